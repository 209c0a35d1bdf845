"""Tile schedules: the declarative space in schedules/sm_XX.yaml expanded into legal kernel specs.

Two levels, so batch invariance holds by construction:
- ``KPlan`` (split_k, warps_k, k_group) fixes how K is cut and in which order partial sums meet. It
  is a function of (arch, format, N, K) only.
- ``Tile`` (rows, warp_nt, warps_n, stages, x_ahead, min_blocks) is what the tuner may change per
  M: rows per CTA, N tiling, activation prefetch and the occupancy hint, none of which touches the
  reduction.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from importlib import resources
from typing import Any

import yaml

from .prepack import PAD_GROUPS, Layout, family

FORMAT_TAG = {"nvfp4": "nvfp4", "fp8_channel": "fp8"}


class ScheduleError(ValueError):
    """A schedule file is invalid or a requested kernel is illegal."""


@dataclass(frozen=True)
class ArchSpace:
    arch: int
    mma: str
    sms: int
    k_plan: dict[str, int]
    tiles: dict[str, list[int]]
    limits: dict[str, int]
    max_m: int


@cache
def load_space(arch: int) -> ArchSpace:
    path = resources.files("dflashgen.schedules") / f"sm_{arch}.yaml"
    if not path.is_file():
        raise ScheduleError(f"no schedule space for sm_{arch} (expected schedules/sm_{arch}.yaml)")
    raw: dict[str, Any] = yaml.safe_load(path.read_text())
    try:
        space = ArchSpace(
            arch=int(raw["arch"]), mma=str(raw["mma"]), sms=int(raw["sms"]), k_plan=dict(raw["k_plan"]),
            tiles={k: [int(v) for v in vs] for k, vs in raw["tiles"].items()}, limits=dict(raw["limits"]),
            max_m=int(raw["max_m"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ScheduleError(f"schedules/sm_{arch}.yaml: missing or bad field: {e}") from e
    if space.arch != arch:
        raise ScheduleError(f"schedules/sm_{arch}.yaml says arch {space.arch}")
    for knob in ("rows", "warp_nt", "warps_n", "stages", "x_ahead", "occupancy"):
        if not space.tiles.get(knob):
            raise ScheduleError(f"schedules/sm_{arch}.yaml: tiles.{knob} is empty")
    return space


@dataclass(frozen=True)
class KPlan:
    split_k: int
    warps_k: int
    k_group: int


@dataclass(frozen=True)
class Tile:
    rows: int
    warp_nt: int
    warps_n: int
    stages: int
    min_blocks: int = 1  # __launch_bounds__ min blocks per SM: caps registers at 64K / (threads * it)
    x_ahead: int = 1  # 1: activations fetched one group ahead (two buffers); 0: at their group's top


@dataclass(frozen=True)
class KernelSpec:
    """One generated kernel: everything its name, source and launch depend on."""

    arch: int
    fmt: str  # "nvfp4" | "fp8_channel"
    n: int
    k: int
    silu: bool
    kplan: KPlan
    tile: Tile
    serves: tuple[str, ...] = field(default=(), compare=False)

    @property
    def layout(self) -> Layout:
        return Layout(self.arch, self.fmt, self.n, self.k, self.silu)

    @property
    def fam(self) -> str:
        return family(self.arch)

    @property
    def n_out(self) -> int:
        return self.n // 2 if self.silu else self.n

    @property
    def threads(self) -> int:
        return 32 * self.tile.warps_n * self.kplan.warps_k

    @property
    def epilogue(self) -> str:
        return "silu" if self.silu else "store"

    @property
    def name(self) -> str:
        # Every parameter that changes the code is in the name (CUTLASS-style).
        kp, t = self.kplan, self.tile
        return (f"dfg_sm{self.arch}_{FORMAT_TAG[self.fmt]}_{self.epilogue}_n{self.n}_k{self.k}"
                f"_sk{kp.split_k}_wk{kp.warps_k}_kg{kp.k_group}"
                f"_r{t.rows}_nt{t.warp_nt}_wn{t.warps_n}_st{t.stages}_xa{t.x_ahead}_mb{t.min_blocks}")

    @property
    def problem_key(self) -> str:
        """Kernels with the same key are interchangeable (same layout and same K plan)."""
        return f"sm{self.arch}/{self.fmt}/{self.epilogue}/n{self.n}/k{self.k}"

    def grid(self, m: int) -> tuple[int, int, int]:
        tiles = self.layout.n_pad // self.layout.tile_rows
        per_cta = self.tile.warp_nt * self.tile.warps_n
        return (math.ceil(m / self.tile.rows), math.ceil(tiles / per_cta), self.kplan.split_k)

    def workspace_floats(self, m: int) -> int:
        return self.kplan.split_k * m * self.layout.n_pad if self.kplan.split_k > 1 else 0

    def smem_bytes(self) -> int:
        nacc = 4 if self.fam == "sm80" else 8
        acc = self.tile.warp_nt * self.tile.rows // 8 * nacc
        return max(1, self.kplan.warps_k - 1) * self.tile.warps_n * acc * 32 * 4

    def reg_estimate(self) -> int:
        """Rough live registers per thread; only used to keep hopeless tiles out."""
        nacc = 4 if self.fam == "sm80" else 8
        acc = self.tile.warp_nt * self.tile.rows // 8 * nacc
        a_frag = 16 if self.fmt == "nvfp4" else 8  # decoded A registers per warp tile and group
        x_frag = (self.kplan.k_group // (32 if self.fam == "sm80" else 8)) * 4  # per 8 rows, per group
        pipeline = self.tile.stages * self.tile.warp_nt * 5
        n8 = self.tile.rows // 8
        # activations: current group + the one being fetched, or just the current one
        xbuf = 2 if self.tile.x_ahead else 1
        return acc + self.tile.warp_nt * a_frag + xbuf * x_frag * n8 + pipeline + n8 * 3 + 32

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "arch": self.arch, "format": self.fmt, "epilogue": self.epilogue,
            "n": self.n, "k": self.k, "n_pad": self.layout.n_pad, "n_out": self.n_out,
            "kplan": asdict(self.kplan), "tile": asdict(self.tile), "threads": self.threads,
            "smem_bytes": self.smem_bytes(), "serves": list(self.serves),
        }


def k_plan(arch: int, fmt: str, n: int, k: int) -> KPlan:
    """The one K plan for (arch, format, N, K): enough warps along K to fill the GPU, preferring
    warps of one CTA (reduced in shared memory) over CTA splits (an extra reduce kernel)."""
    space = load_space(arch)
    lay = Layout(arch, fmt, n, k)
    lay.check()
    groups = k // lay.k_group
    tiles = lay.n_pad // lay.tile_rows
    min_groups = space.k_plan["min_groups_per_worker"]
    want = math.ceil(space.sms * space.k_plan["target_warps_per_sm"] / tiles)
    warps_k = min(1 << max(0, math.ceil(math.log2(want))), space.k_plan["max_warps_k"])
    while warps_k > 1 and groups // warps_k < min_groups:
        warps_k //= 2
    split_k = 1
    # Split across CTAs only when the CTA's warps fall well short: a split costs a reduce launch and,
    # on mid-size N (5120: 320 tiles), pushes the grid just past one wave (sk2 = 320 CTAs of 512
    # threads for 264 slots), while warps_k alone already gives half the wanted warps.
    if warps_k >= space.k_plan.get("split_if_below", 0.0) * want:
        return KPlan(split_k=1, warps_k=warps_k, k_group=lay.k_group)
    while (warps_k * split_k < want and split_k * 2 <= space.k_plan["max_split_k"]
           and groups // (warps_k * split_k * 2) >= min_groups):
        split_k *= 2
    return KPlan(split_k=split_k, warps_k=warps_k, k_group=lay.k_group)


def illegal_reason(spec: KernelSpec) -> str | None:
    """Static legality: the reason a spec must never be emitted, or None."""
    space = load_space(spec.arch)
    lay = spec.layout
    try:
        lay.check()
    except ValueError as e:
        return str(e)
    tiles = lay.n_pad // lay.tile_rows
    groups = spec.k // lay.k_group
    t = spec.tile
    if not 1 <= t.stages <= PAD_GROUPS:
        return f"stages={t.stages} outside 1..{PAD_GROUPS} (the prepack pads {PAD_GROUPS} groups)"
    if t.rows % 8 or t.rows > space.max_m:
        return f"rows={t.rows} must be a multiple of 8 and <= max_m={space.max_m}"
    if tiles % t.warp_nt:
        return f"{tiles} warp tiles not divisible by warp_nt={t.warp_nt}"
    if groups < spec.kplan.split_k * spec.kplan.warps_k:
        return f"{groups} K groups for {spec.kplan.split_k * spec.kplan.warps_k} K workers"
    if not t.x_ahead and (t.rows < space.limits["x_ahead_off_from_rows"] or t.warp_nt > 1):
        return (f"x_ahead=0 only for warp_nt=1 tiles from rows={space.limits['x_ahead_off_from_rows']} "
                "(the others have the registers or are register-bound on weights)")
    if t.min_blocks < 1:
        return f"min_blocks={t.min_blocks} < 1"
    if spec.threads > space.limits["max_threads"]:
        return f"{spec.threads} threads > {space.limits['max_threads']}"
    if spec.smem_bytes() > space.limits["smem_bytes"]:
        return f"{spec.smem_bytes()} B shared memory > {space.limits['smem_bytes']}"
    # __launch_bounds__(threads) caps registers at 64K / threads: a tile needing more spills
    budget = min(space.limits["reg_budget"], 65536 // spec.threads)
    if spec.reg_estimate() > budget:
        return f"~{spec.reg_estimate()} registers > budget {budget} ({spec.threads} threads)"
    if t.min_blocks > 1 and _reg_need(spec, space) > 65536 // (spec.threads * t.min_blocks):
        return f"~{_reg_need(spec, space)} registers do not fit {t.min_blocks} blocks of {spec.threads} threads"
    return None


def _reg_need(spec: KernelSpec, space: ArchSpace) -> int:
    """Registers the tile really needs: the (deliberately generous) estimate less its measured
    over-count, rounded up to the allocation unit of 8."""
    return -(-(spec.reg_estimate() - space.limits["reg_slack"]) // 8) * 8


def min_blocks(spec: KernelSpec, occupancy: int) -> int:
    """The __launch_bounds__ min-blocks hint for a target of `occupancy` resident warps per SM:
    the blocks that make up that many warps when the tile's registers fit them, else 1 (no cap
    beyond the thread count; ptxas then keeps whatever it needs, spill-free)."""
    space = load_space(spec.arch)
    want = max(1, occupancy * 32 // spec.threads)
    if want > 1 and _reg_need(spec, space) <= 65536 // (spec.threads * want):
        return want
    return 1


def candidates(arch: int, fmt: str, n: int, k: int, silu: bool = False,
               serves: tuple[str, ...] = ()) -> list[KernelSpec]:
    """Every legal kernel of the space for one problem, in a deterministic order."""
    space = load_space(arch)
    kp = k_plan(arch, fmt, n, k)
    out = []
    for rows in space.tiles["rows"]:
        for warp_nt in space.tiles["warp_nt"]:
            for warps_n in space.tiles["warps_n"]:
                for stages, xa in itertools.product(space.tiles["stages"], space.tiles["x_ahead"]):
                    tile = Tile(rows, warp_nt, warps_n, stages, x_ahead=xa)
                    spec = KernelSpec(arch, fmt, n, k, silu, kp, tile, serves)
                    for occ in space.tiles["occupancy"]:
                        t = replace(spec.tile, min_blocks=min_blocks(spec, occ))
                        c = replace(spec, tile=t)
                        if illegal_reason(c) is None and c not in out:
                            out.append(c)
    return out
