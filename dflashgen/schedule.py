"""Tile schedules: the declarative space in schedules/sm_XX.yaml expanded into legal kernel specs.

Two levels, so batch invariance holds by construction:
- ``KPlan`` (split_k, warps_k, k_group) fixes how K is cut and in which order partial sums meet. It
  is a function of (arch, format, N, K) only.
- ``Tile`` (rows, warp_nt, warps_n, stages, x_ahead, x_smem, min_blocks) is what the tuner may change per
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
    k_plan: dict[str, Any]
    tiles: dict[str, list[int]]
    limits: dict[str, int]
    max_m: int
    wgmma: dict[str, Any] = field(default_factory=dict)  # sm_90 only: the wgmma K plans' space


@cache
def load_space(arch: int) -> ArchSpace:
    path = resources.files("dflashgen.schedules") / f"sm_{arch}.yaml"
    if not path.is_file():
        raise ScheduleError(f"no schedule space for sm_{arch} (expected schedules/sm_{arch}.yaml)")
    raw: dict[str, Any] = yaml.safe_load(path.read_text())
    try:
        space = ArchSpace(
            arch=int(raw["arch"]), mma=str(raw["mma"]), sms=int(raw["sms"]), k_plan=dict(raw["k_plan"]),
            # x_smem_tiles: a list of [rows, warp_nt, warps_n, stages(, max threads)]; every other knob ints
            # (a list entry may end in format tags, e.g. register_tiles' `fp8`: kept as strings)
            tiles={k: [tuple(x if isinstance(x, str) else int(x) for x in v) if isinstance(v, list) else int(v)
                       for v in vs]
                   for k, vs in raw["tiles"].items()}, limits=dict(raw["limits"]),
            max_m=int(raw["max_m"]), wgmma=dict(raw.get("wgmma") or {}),
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
    warps_k: int  # K workers per CTA: warps (mma.sync) or warpgroups of 4 warps (wgmma)
    k_group: int
    # 1: sm_90a warpgroup MMA (wgmma.m64nNk16, A from the decoded registers, B from shared memory)
    # instead of mma.sync. Part of the K plan: wgmma need not round like mma.sync, so a problem's
    # M buckets never mix the two (the tuner picks one plan per problem).
    wgmma: int = 0


@dataclass(frozen=True)
class Tile:
    rows: int
    warp_nt: int
    warps_n: int
    stages: int
    min_blocks: int = 1  # __launch_bounds__ min blocks per SM: caps registers at 64K / (threads * it)
    x_ahead: int = 1  # d > 0: activations fetched d groups ahead (d + 1 buffers); 0: at their group's top
    x_smem: int = 0  # 1: the CTA stages each K stage's activations in shared memory once (cp.async)
    # 1: each of the plan's split_k x warps_k K workers is a CTA of its own (warps_n warps, one
    # activation ring), reduced through the split-K workspace in the plan's order: the same bits as
    # the plan's in-CTA tiles, with few warps per CTA (names `_ws1`; skinny_gemm.cuh WSPLIT)
    wsplit: int = 0
    # 1: register-path tile whose weight ring (stages groups per warp) sits in shared memory, filled
    # with cp.async (names `_wa1`; skinny_gemm.cuh W_ASYNC): the same words, decode and MMAs
    w_async: int = 0
    # 1: register-path tile whose lanes prefetch into L2, at each unrolled trip's top, the weight and
    # scale words the next trip's ring refills load (names `_pf1`; skinny_gemm.cuh L2_AHEAD): the
    # same loads, decode and MMAs, so the same bits
    l2_ahead: int = 0
    # 1: x_smem tile whose one CTA walks ALL of its K plan's workers' ranges with one pipeline, folding
    # each worker's sums into running sums in shared memory in the plan's order (names `_sw1`;
    # skinny_gemm.cuh SERIAL): the plan's bits, no partials, grid z = 1
    serial: int = 0
    # p > 0: a serial tile whose copies all come from p extra producer warps, `stages` K groups ahead, into
    # a shared-memory ring the warps_n consumer warps read (names `_pw<p>`; skinny_gemm_pw.cuh): the
    # consumers only wait on mbarriers, decode and issue MMAs
    producer: int = 0
    # 1: a producer tile whose consumers are warpgroups issuing wgmma (A: the decoded fragments, B: the
    # stage's activations in the wgmma layout; names `_wc1`; sm_90a) in the mma.sync plan's K order
    wgc: int = 0
    # a wgc tile's activation ring depth (names `_xr<d>`): its weights have a ring of their own,
    # `stages` groups deep, filled by one more warp, so weight bytes in flight do not cost activation
    # stages (8 KB each at 64 rows)
    x_ring: int = 0
    # a wgc tile's weight-ring warps (names `_ww<n>` when > 1; 0: one), each copying warps_n / n of the
    # warp tiles' words per K group: one warp for three warpgroups' tiles left their consumers waiting
    w_warps: int = 0
    # 1: a wgc tile of a split-K plan with one CTA per split (grid z = split_k; names `_zs1`), each
    # walking its split's workers; the splits meet through FP32 partials, summed by the last CTA in
    # split order (the plan's bits) -- split_k times the CTAs of the tile that walks every split
    z_split: int = 0
    # 1: a wgc tile without weight warps whose consumer warps copy their own tile's words into the
    # weight ring (cp.async, waited per thread: no full / empty barriers; names `_wsf1`)
    w_self: int = 0
    # P > 0: a w_self tile of a one-split plan on P CTAs (grid y; the space's SM count; names `_ps<P>`):
    # CTA c walks column block c whole, then one K worker of a column block past P (the blocks a grid of
    # one CTA per block runs as a second, mostly empty wave), whose workers' sums meet through FP32
    # partials in worker order (the plan's fold: its bits). For N tilings of P + 1 .. P + P / workers blocks
    persist: int = 0
    # 1: a w_self wgc tile (not persist) whose consumers take K groups in pairs (names `_pr1`): both
    # groups' waits first, then their two decodes in one basic block (independent chains the scheduler
    # can interleave), then their wgmmas as one batch, retired one pair later -- the same MMAs into the
    # same accumulators in the same order, so the plan's bits; two more A fragment buffers
    pair: int = 0


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
    def workers_per_cta(self) -> int:
        """K workers per CTA at once: the plan's warps_k, or 1 for a wsplit or serial tile."""
        return 1 if self.tile.wsplit or self.tile.serial else self.kplan.warps_k

    @property
    def ctas_k(self) -> int:
        """CTAs along K (grid z, partial slots): split_k, times warps_k for a wsplit tile; 1 for a
        serial tile (one CTA walks every worker); a persist tile's partial slots: its K workers."""
        if self.tile.persist:
            return self.kplan.split_k * self.kplan.warps_k
        if self.tile.serial:
            return self.kplan.split_k if self.tile.z_split else 1
        return self.kplan.split_k * (self.kplan.warps_k if self.tile.wsplit else 1)

    @property
    def launch_min_blocks(self) -> int:
        """The __launch_bounds__ min-blocks argument written (0: none). Without one ptxas picks its
        own register target, which spilled 512-thread CTAs and NVFP4 r32 serial tiles; an explicit 1
        lets it take up to 255 registers."""
        if self.tile.min_blocks > 1:
            return self.tile.min_blocks
        return 1 if self.threads >= 512 or self.tile.serial else 0

    @property
    def threads(self) -> int:
        # wgmma: plus one producer warp that stages the activations (skinny_gemm.cuh produce_wgmma)
        # (a producer tile: plus its producer warps; wgc: plus the weight-ring warps, skinny_gemm_pw.cuh)
        return (32 * self.tile.warps_n * self.workers_per_cta + 32 * self.kplan.wgmma + 32 * self.tile.producer
                + 32 * (0 if self.tile.w_self else max(1, self.tile.w_warps)) * self.tile.wgc)

    @property
    def target(self) -> str:
        """The ptxas target: sm_90a for wgmma kernels (arch-specific features), else sm_<arch>."""
        return f"{self.arch}a" if self.kplan.wgmma or self.tile.wgc else str(self.arch)

    @property
    def epilogue(self) -> str:
        return "silu" if self.silu else "store"

    @property
    def name(self) -> str:
        # Every parameter that changes the code is in the name (CUTLASS-style).
        kp, t = self.kplan, self.tile
        return (f"dfg_sm{self.arch}_{FORMAT_TAG[self.fmt]}_{self.epilogue}_n{self.n}_k{self.k}"
                f"_sk{kp.split_k}_wk{kp.warps_k}_kg{kp.k_group}{'_wg1' if kp.wgmma else ''}"
                f"_r{t.rows}_nt{t.warp_nt}_wn{t.warps_n}_st{t.stages}_xa{t.x_ahead}_xs{t.x_smem}"
                f"{'_ws1' if t.wsplit else ''}{'_wa1' if t.w_async else ''}{'_pf1' if t.l2_ahead else ''}"
                f"{'_sw1' if t.serial else ''}{f'_pw{t.producer}' if t.producer else ''}{'_wc1' if t.wgc else ''}"
                f"{f'_xr{t.x_ring}' if t.wgc else ''}{f'_ww{t.w_warps}' if t.w_warps > 1 else ''}"
                f"{'_zs1' if t.z_split else ''}{'_wsf1' if t.w_self else ''}{f'_ps{t.persist}' if t.persist else ''}"
                f"{'_pr1' if t.pair else ''}_mb{t.min_blocks}")

    @property
    def problem_key(self) -> str:
        """Kernels with the same key are interchangeable (same layout and same K plan)."""
        return f"sm{self.arch}/{self.fmt}/{self.epilogue}/n{self.n}/k{self.k}"

    def grid(self, m: int) -> tuple[int, int, int]:
        if self.tile.persist:  # P CTAs, the rest column blocks' K workers spread over them (grid z 1)
            return (math.ceil(m / self.tile.rows), self.tile.persist, 1)
        tiles = self.layout.n_pad // self.layout.tile_rows
        per_cta = self.tile.warp_nt * self.tile.warps_n
        return (math.ceil(m / self.tile.rows), math.ceil(tiles / per_cta), self.ctas_k)

    def workspace_floats(self, m: int) -> int:
        return self.ctas_k * m * self.layout.n_pad if self.ctas_k > 1 else 0

    @property
    def x_stages(self) -> int:
        """Activation ring depth of an x_smem tile (skinny_gemm.cuh XST): wgmma stages + 1; mma.sync
        3, so the copies run two groups ahead whatever the depth of the weight ring (stages)."""
        return self.tile.stages + 1 if self.kplan.wgmma else 3

    @property
    def smem_dynamic(self) -> bool:
        """Shared memory beyond the static 48 KB: declared dynamic, opted in at load, passed at launch."""
        return bool(self.tile.producer) or self.smem_bytes() > load_space(self.arch).limits["smem_bytes"]

    def smem_bytes(self) -> int:
        nacc = 4 if self.fam == "sm80" else 8
        acc = self.tile.warp_nt * self.tile.rows // 8 * nacc
        # serial: each lane's running sums (and the finished splits' with split-K)
        fold = self.tile.warps_n * acc * 32 * 4 * (2 if self.kplan.split_k > 1 else 1) if self.tile.serial else 0
        if self.tile.producer:  # skinny_gemm_pw.cuh SMEM: the ring's stages, the running sums, mbarriers
            tiles = self.tile.warps_n * self.tile.warp_nt
            w_stage = tiles * 512 + (tiles * 64 if self.fmt == "nvfp4" else 0)
            x_stage = self.tile.rows * self.kplan.k_group * 2
            if self.tile.wgc:  # a weight ring of `stages`, an activation ring of x_ring groups; the running
                # sums in registers without split-K or with one CTA per split
                fold = fold if self.kplan.split_k > 1 and not self.tile.z_split else 0
                return self.tile.stages * w_stage + self.tile.x_ring * x_stage + fold + 16 * (self.tile.stages
                                                                                               + self.tile.x_ring)
            return self.tile.stages * (w_stage + x_stage) + fold + 16 * self.tile.stages
        red = (self.workers_per_cta - 1) * self.tile.warps_n * acc * 32 * 4 if self.workers_per_cta > 1 else 4
        # x_smem: a ring of x_stages groups of activations per K worker, overlaid with `red`
        ring = self.x_stages * self.workers_per_cta * self.tile.rows * self.kplan.k_group * 2
        # w_async: per warp and stage 16 weight bytes and a 4-byte scale word per lane (beside the
        # activation ring of an x_smem tile)
        wring = self.threads // 32 * self.tile.stages * self.tile.warp_nt * 32 * (16 + 4) if self.tile.w_async else 0
        return max(red, ring + wring + fold) if self.tile.x_smem else max(red, wring)

    def reg_estimate(self) -> int:
        """Rough live registers per thread; only used to keep hopeless tiles out."""
        nacc = 4 if self.fam == "sm80" else 8
        acc = self.tile.warp_nt * self.tile.rows // 8 * nacc
        a_frag = 16 if self.fmt == "nvfp4" else 8  # decoded A registers per warp tile and group
        x_frag = (self.kplan.k_group // (32 if self.fam == "sm80" else 8)) * 4  # per 8 rows, per group
        # the weight ring: 4 + 1 registers per stage and warp tile (w_async: in shared memory)
        pipeline = (1 if self.tile.w_async else self.tile.stages) * self.tile.warp_nt * 5
        n8 = self.tile.rows // 8
        if self.tile.wgc:  # two (pair: four) A fragment buffers, the stage descriptors, barrier and fold addresses
            return acc + (4 if self.tile.pair else 2) * a_frag + 40
        if self.kplan.wgmma:  # A fragments (x2: generous), descriptors; no activation registers
            chunks = -(-self.tile.rows * self.kplan.k_group // 8 // 128)
            return acc + 2 * a_frag + pipeline + 3 * chunks + 40
        # activations: current group + the one being fetched, or just the current one
        xbuf = self.tile.x_ahead + 1
        if self.tile.x_smem:  # one LDS.128 per 8 rows in flight, copier offsets and ring indices
            # wsplit with split-K: a second accumulator set while combining the workers (after the loop)
            combine = acc if self.tile.wsplit and self.kplan.split_k > 1 else 0
            return acc + self.tile.warp_nt * a_frag + 4 * n8 + pipeline + 8 + 32 + combine
        return acc + self.tile.warp_nt * a_frag + xbuf * x_frag * n8 + pipeline + n8 * 3 + 32

    def to_dict(self) -> dict[str, Any]:
        kplan = asdict(self.kplan)
        if not self.kplan.wgmma:
            del kplan["wgmma"]  # mma.sync entries keep their pre-wgmma form
        tile = asdict(self.tile)
        # Optional tile fields are written only when set, so the entries of tiles that predate a field
        # keep their form (and the library hash its value) when the field is added.
        for f in ("wsplit", "w_async", "l2_ahead", "serial", "producer", "wgc", "x_ring", "w_warps", "z_split",
                  "w_self", "persist", "pair"):
            if not tile[f]:
                del tile[f]
        d = {
            "name": self.name, "arch": self.arch, "format": self.fmt, "epilogue": self.epilogue,
            "n": self.n, "k": self.k, "n_pad": self.layout.n_pad, "n_out": self.n_out,
            "kplan": kplan, "tile": tile, "threads": self.threads,
            "smem_bytes": self.smem_bytes(), "launch_min_blocks": self.launch_min_blocks,
            "serves": list(self.serves),
        }
        if self.tile.wsplit or self.tile.serial:
            d["ctas_k"] = self.ctas_k  # grid z and partial slots (the runtime's split count)
        if self.tile.persist:
            d["grid_y"], d["grid_z"] = self.tile.persist, 1  # (ctas_k: the partial slots, not grid z)
        if self.smem_dynamic:
            d["smem_dynamic"] = True
        if self.kplan.wgmma or self.tile.wgc:
            d["target"] = self.target
        return d


def k_plan(arch: int, fmt: str, n: int, k: int) -> KPlan:
    """The one K plan for (arch, format, N, K): enough warps along K to fill the GPU, preferring
    warps of one CTA (reduced in shared memory) over CTA splits (FP32 partials through L2, summed
    in the same launch by the last of the split warps holding each output)."""
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
    # Split across CTAs only when the CTA's warps fall well short: a split costs the partials' round
    # trip through L2 plus a serial tail (the last warp of a tile sums them) and, on mid-size N
    # (5120: 320 tiles), pushes the grid just past one wave (sk2 = 320 CTAs of 512 threads for 264
    # slots), while warps_k alone already gives half the wanted warps.
    if warps_k >= space.k_plan.get("split_if_below", 0.0) * want:
        return KPlan(split_k=1, warps_k=warps_k, k_group=lay.k_group)
    while (warps_k * split_k < want and split_k * 2 <= space.k_plan["max_split_k"]
           and groups // (warps_k * split_k * 2) >= min_groups):
        split_k *= 2
    return KPlan(split_k=split_k, warps_k=warps_k, k_group=lay.k_group)


def k_plans(arch: int, fmt: str, n: int, k: int) -> list[KPlan]:
    """Every K plan the tuner may choose from for (arch, format, N, K): the derived one first, then
    split-K alternatives (`k_plan.alt_split_k`, warps_k of the derived plan or half of it) that the
    cost model predicts within `alt_slack` of the derived plan's best at M = 8 or 16 (it cannot
    rank them finer than that: the tuner measures), at most `max_alt_plans` of them, best first;
    then the wgmma plans (sm_90, `wgmma_plans`). A function of (arch, format, N, K) only -- never
    of M -- so whichever plan the tuner picks (once per problem, jointly over all M buckets) is
    shared by every tile."""
    return _mma_sync_plans(arch, fmt, n, k) + wgmma_plans(arch, fmt, n, k)


def wgmma_plans(arch: int, fmt: str, n: int, k: int) -> list[KPlan]:
    """The wgmma K plan (sm_90 spaces with a `wgmma` section; N >= `wgmma.min_n`): for each
    warpgroup count in `wgmma.warps_k`, the smallest power-of-two split_k that gives >=
    `wgmma.min_ctas` CTAs per row block (a CTA is N / 64 weight rows) while every worker keeps
    `min_groups_per_worker` groups; of those, the one the cost model puts fastest at M = max_m
    (the bucket wgmma is for), fewer warpgroups on ties. At most one per problem, to keep the
    kernel count down. A function of (arch, format, N, K) only, like every K plan."""
    space = load_space(arch)
    wg = space.wgmma
    if not wg or n < wg.get("min_n", 0):
        return []
    lay = Layout(arch, fmt, n, k)
    groups = k // lay.k_group
    ctas = math.ceil(lay.n_pad // lay.tile_rows / 4)
    min_groups = space.k_plan["min_groups_per_worker"]
    best: tuple[float, int, KPlan] | None = None
    for wk in wg["warps_k"]:
        if groups // wk < min_groups:
            continue
        sk = 1
        while (ctas * sk < wg["min_ctas"] and sk * 2 <= wg["max_split_k"]
               and groups // (wk * sk * 2) >= min_groups):
            sk *= 2
        plan = KPlan(split_k=sk, warps_k=wk, k_group=lay.k_group, wgmma=1)
        tiles = _wgmma_tiles(arch, fmt, n, k, False, plan, ())
        if not tiles:
            continue
        us = min(model_us(t, space.max_m) for t in tiles)
        if best is None or (us, wk) < best[:2]:
            best = (us, wk, plan)
    return [best[2]] if best else []


def _mma_sync_plans(arch: int, fmt: str, n: int, k: int) -> list[KPlan]:
    space = load_space(arch)
    base = k_plan(arch, fmt, n, k)
    lay = Layout(arch, fmt, n, k)
    groups = k // lay.k_group
    kp = space.k_plan
    alts: list[tuple[float, KPlan]] = []
    best_base = {m: _best_us(arch, fmt, n, k, base, m) for m in (8, 16)}
    if lay.n_pad // lay.tile_rows * kp["max_split_k"] < space.sms:
        return [base]  # too small to fill the GPU whatever the split
    # An evenly loaded derived plan still races fewer CTA splits when it splits K: the warps it
    # wants per SM are the cost model's, and each split adds a partials round trip and shortens
    # every warp's K range (H200: FP8 n4120's evenly loaded sk4 plan never raced its sk2 alternative,
    # 7.4 against 10.3 us at M = 1 once it did; session 44).
    fewer_only = _imbalance(arch, fmt, n, k, base) < kp.get("alt_if_imbalance", 1.0)
    for sk in kp.get("alt_split_k", []):
        for wk in sorted({base.warps_k, max(1, base.warps_k // 2)}):
            plan = KPlan(split_k=sk, warps_k=wk, k_group=lay.k_group)
            if (plan == base or sk > kp["max_split_k"] or groups // (sk * wk) < kp["min_groups_per_worker"]
                    or (fewer_only and sk >= base.split_k)):
                continue
            ratio = min(_best_us(arch, fmt, n, k, plan, m) / best_base[m] for m in (8, 16))
            if ratio <= 1.0 + kp.get("alt_slack", 0.0):
                alts.append((ratio, plan))
    alts.sort(key=lambda a: (a[0], a[1].split_k, a[1].warps_k))
    plans = [base] + [p for _, p in alts[: kp.get("max_alt_plans", 0)]]
    # An unsplit plan whose warps hold few K groups each also races half the warps along K: the ring's
    # prologue is most of such a warp's work, and the half-size CTAs take the deep stages and fit more
    # per SM (H200, session 45: FP8 k1536, 6 groups per warp at warps_k 8, M = 16 4.87 -> 4.18 us at
    # warps_k 4; NVFP4 n8704 + SiLU, 10 groups, M = 8 11.19 -> 8.61 us; FP8 k4352's 17 lost 2%)
    half = KPlan(split_k=1, warps_k=base.warps_k // 2, k_group=lay.k_group)
    if (base.split_k == 1 and groups // base.warps_k < kp.get("halve_warps_k_below", 0)
            and half.warps_k >= 1 and half not in plans):
        plans.append(half)
    return plans


def _imbalance(arch: int, fmt: str, n: int, k: int, plan: KPlan) -> float:
    """Busiest SM's CTAs over the average, for the cost model's best register-path tile of the plan
    at M = 8 (1.0: every SM equally loaded; 132 / 80 for 80 CTAs on 132 SMs)."""
    sms = load_space(arch).sms
    tiles = [s for s in _plan_tiles(arch, fmt, n, k, False, plan, ()) if s.tile.rows == 8 and not s.tile.x_smem
             and _base_stages(s)]
    best = min(tiles, key=lambda s: model_us(s, 8))
    ctas = math.prod(best.grid(8))
    return math.ceil(ctas / sms) * sms / ctas


def _best_us(arch: int, fmt: str, n: int, k: int, plan: KPlan, m: int) -> float:
    """The cost model's best time at M over the plan's register-path tiles of at most 16 rows (the
    alternatives are for the SM fill at small M, where x_smem tiles are not what decides it)."""
    times = [model_us(s, m) for s in _plan_tiles(arch, fmt, n, k, False, plan, ())
             if s.tile.rows <= 16 and not s.tile.x_smem and _base_stages(s)]
    return min(times, default=math.inf)


def _base_stages(spec: KernelSpec) -> bool:
    """A register-path tile at the space's base stages and x_ahead: the K plans are derived from those
    alone, so the extra deep_stages / far_x_ahead candidates race within the plans and never change
    which plans exist."""
    tiles = load_space(spec.arch).tiles
    return (spec.tile.stages in tiles["stages"] and spec.tile.x_ahead in tiles["x_ahead"]
            and not spec.tile.w_async and not spec.tile.l2_ahead)


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
    # the prepack pads PAD_GROUPS groups for the register rings' read-ahead past K; a producer ring copies
    # exactly the groups there are
    max_stages = 32 if t.producer else PAD_GROUPS
    if not 1 <= t.stages <= max_stages:
        return f"stages={t.stages} outside 1..{max_stages} (the prepack pads {PAD_GROUPS} groups)"
    if bool(t.wgc) != (t.x_ring >= 2):
        return "x_ring (>= 2) is the activation ring of a wgc tile, and only of one"
    if t.wgc and t.producer and t.x_ring % t.producer:
        # each activation warp then owns x_ring / producer slots and waits on them in order; a slot
        # shared by two warps could be waited on two phases ahead, which an mbarrier parity cannot tell
        return f"x_ring={t.x_ring} not a multiple of the {t.producer} activation warps"
    if t.w_self and (not t.wgc or t.w_warps or t.l2_ahead):
        return "w_self: a wgc tile whose consumers copy their own weights (no weight warps, no L2 prefetch)"
    if t.z_split and (not t.wgc or spec.kplan.split_k < 2):
        return "z_split: a wgc tile of a split-K plan (one CTA per split)"
    if t.persist:
        workers = spec.kplan.split_k * spec.kplan.warps_k
        blocks = -(-tiles // (t.warps_n * t.warp_nt))
        if not (t.w_self and not t.z_split and spec.kplan.split_k == 1 and workers >= 2 and groups % workers == 0):
            return "persist: a w_self wgc tile of a one-split plan of >= 2 K workers dividing its K groups"
        if not 0 < blocks - t.persist <= t.persist // workers:
            return (f"persist={t.persist}: {blocks} column blocks leave no rest, or more rest K workers than "
                    "CTAs (one rest item per CTA)")
    if t.pair and (not t.w_self or t.persist or t.x_ring < 8):
        # (two groups in flight and two being decoded: a shallower activation ring would have the
        # consumers wait on slots they have just released)
        return "pair: a w_self wgc tile (not persist) with an activation ring of >= 8 slots"
    if t.w_warps and (not t.wgc or t.warps_n % t.w_warps):
        return f"w_warps={t.w_warps}: the weight warps of a wgc tile, dividing its warps_n={t.warps_n} tiles"
    if t.rows % 8 or t.rows > space.max_m:
        return f"rows={t.rows} must be a multiple of 8 and <= max_m={space.max_m}"
    if tiles % t.warp_nt:
        return f"{tiles} warp tiles not divisible by warp_nt={t.warp_nt}"
    if groups < spec.kplan.split_k * spec.kplan.warps_k:
        return f"{groups} K groups for {spec.kplan.split_k * spec.kplan.warps_k} K workers"
    if spec.kplan.wgmma:
        wg = space.wgmma
        if not wg:
            return f"wgmma K plans only where the schedule space has a wgmma section (sm_90), not sm_{spec.arch}"
        if not (t.warps_n == 4 and t.warp_nt == 1 and t.x_smem and not t.x_ahead):
            return "wgmma tiles are one warpgroup per K worker (warps_n=4, warp_nt=1) with x_smem=1, x_ahead=0"
        if t.rows not in (8, 16, 32, 64):
            return f"wgmma rows={t.rows}: the instruction's N must be 8, 16, 32 or 64 here"
        if t.stages < 2:
            return "wgmma needs >= 2 stages (a ring of stages + 1 >= 3 activation stages)"
        if spec.kplan.warps_k not in wg["warps_k"]:
            return f"wgmma warps_k={spec.kplan.warps_k} not in {wg['warps_k']}"
        if t.wsplit:
            return "wsplit tiles are mma.sync tiles"
    elif t.x_smem:
        if spec.fam != "sm80":
            return "x_smem needs the m16n8k16 trait (its lanes read 16 B of one batch row per sub-block)"
        shape = (t.rows, t.warp_nt, t.warps_n, t.stages)
        key = _shape_list(t)
        listed = [s for s in space.tiles.get(key, [])
                  if s[:4] == shape and (not t.wgc or (*s[4:6], *(list(s[6:9]) + [0, 0, 0])[:3])
                                         == (t.producer, t.x_ring, t.l2_ahead, t.w_warps, t.w_self))]
        if t.wgc:
            listed = [s[:4] for s in listed]  # producer warps, activation ring, L2 prefetch: not thread caps
        if t.x_ahead or not listed:
            return (f"x_smem only with x_ahead=0 and (rows, warp_nt, warps_n, stages) {shape} in the "
                    f"space's {key} {[s[:4] for s in space.tiles.get(key, [])]}")
        if t.wsplit and spec.kplan.warps_k < 2:
            return "wsplit splits a plan's warps_k >= 2 workers into CTAs; this plan has one per split"
        if key == "x_smem_capped_tiles":
            pass  # its 5th field is the occupancy it is capped for (checked below), not a thread cap
        elif len(listed[0]) > 4 and spec.threads > listed[0][4]:
            return (f"x_smem tile {shape} with {spec.threads} threads: its registers fit >= 2 CTAs per SM "
                    f"only up to {listed[0][4]} threads")
        if len(listed[0]) > 5 and spec.threads < listed[0][5]:
            return f"x_smem tile {shape} with {spec.threads} threads: listed for >= {listed[0][5]} threads only"
        if not t.wgc and spec.threads > space.limits.get("x_smem_max_threads", 512):  # wgc: no B fragments
            return (f"x_smem with {spec.threads} threads: (512, 1) launch bounds cap registers at 128 "
                    f"and FP8 tiles spill (nvcc 13); at most {space.limits.get('x_smem_max_threads')}")
    elif not t.x_ahead and (t.rows < space.limits["x_ahead_off_from_rows"] or t.warp_nt > 1):
        return (f"x_ahead=0 only for warp_nt=1 tiles from rows={space.limits['x_ahead_off_from_rows']} "
                "(the others have the registers or are register-bound on weights)")
    elif t.x_ahead > 1 and (t.x_ahead not in space.tiles.get("far_x_ahead", [])
                            or t.rows not in space.tiles.get("far_rows", []) or t.stages not in space.tiles["stages"]):
        return (f"x_ahead={t.x_ahead}: activations more than one group ahead only as the space's far_x_ahead "
                f"{space.tiles.get('far_x_ahead', [])} for tiles of {space.tiles.get('far_rows', [])} rows at the "
                f"base stages {space.tiles['stages']} (with a deeper ring FP8 r16 nt2 spilled)")
    if t.w_async:
        xs_listed = [list(x) for x in space.tiles.get("w_async_x_smem_tiles", [])]
        if t.wsplit or spec.kplan.wgmma or spec.fam != "sm80":
            return "w_async (the weight ring in shared memory, cp.async: sm_80+) is for in-CTA mma.sync tiles"
        if t.x_smem and not t.serial and [t.rows, t.warp_nt, t.warps_n, t.stages] not in xs_listed:
            return f"w_async x_smem tiles only from the space's w_async_x_smem_tiles {xs_listed}"
        if not t.x_smem and (t.stages not in space.tiles.get("w_async_stages", [])
                             or t.rows > max(space.tiles.get("w_async_max_rows", [0]))):
            return (f"w_async register-path tiles of <= {space.tiles.get('w_async_max_rows', [0])} rows at the "
                    f"space's w_async_stages {space.tiles.get('w_async_stages', [])}")
    if t.l2_ahead and not t.wgc and (t.x_smem or t.w_async or t.wsplit or spec.kplan.wgmma or t.x_ahead != 1
                       or 1 not in space.tiles.get("l2_ahead", [])
                       or t.rows > max(space.tiles.get("l2_ahead_max_rows", [0]))):
        return (f"l2_ahead only for register-path mma.sync tiles at x_ahead=1 of <= "
                f"{space.tiles.get('l2_ahead_max_rows', [0])} rows, where the space lists l2_ahead "
                f"({space.tiles.get('l2_ahead', [])})")
    if t.serial and (not t.x_smem or t.wsplit or spec.kplan.wgmma
                     or spec.kplan.split_k * spec.kplan.warps_k < 2):
        return "serial tiles are mma.sync x_smem tiles of plans with >= 2 K workers (one CTA walks them all)"
    if t.producer and (not t.serial or t.w_async or spec.arch < 90):
        return "producer tiles are serial x_smem tiles without w_async, on sm_90 (mbarrier waits)"
    if t.wgc and (not t.producer or t.warp_nt != 1 or t.warps_n % 4 or t.rows not in (16, 32, 64)):
        return "wgc tiles are producer tiles of whole warpgroups (warps_n % 4 == 0, warp_nt 1), rows 16 / 32 / 64"
    if t.producer > 1 and not t.wgc:
        return "mma.sync producer tiles have one producer warp"
    if t.min_blocks < 1:
        return f"min_blocks={t.min_blocks} < 1"
    # wgc tiles: up to three consumer warpgroups + 4 activation warps + a weight warp per warpgroup =
    # 608 threads (their registers, not a thread cap, bound them: 65536 / 608 = 107 per thread)
    max_threads = space.limits.get("wgc_max_threads", 512) if t.wgc else space.limits["max_threads"]
    if spec.threads > max_threads:
        return f"{spec.threads} threads > {max_threads}"
    # an mma.sync x_smem ring may take dynamic shared memory up to the opt-in limit (dyn_smem_bytes)
    dyn = t.x_smem and not spec.kplan.wgmma
    smem_limit = max(space.limits["smem_bytes"], space.limits.get("dyn_smem_bytes", 0) if dyn else 0)
    if spec.smem_bytes() > smem_limit:
        return f"{spec.smem_bytes()} B shared memory > {smem_limit}"
    # __launch_bounds__(threads) caps registers at 64K / threads: a tile needing more spills
    budget = min(space.limits["reg_budget"], 65536 // spec.threads)
    if spec.reg_estimate() > budget:
        return f"~{spec.reg_estimate()} registers > budget {budget} ({spec.threads} threads)"
    if t.min_blocks > 1 and t.x_smem:
        # x_smem_capped_tiles: a deliberate cap (ptxas may spill a few bytes; the race decides), for the
        # listed occupancy only
        warps = [s[4] for s in space.tiles.get("x_smem_capped_tiles", [])
                 if s[:4] == (t.rows, t.warp_nt, t.warps_n, t.stages)]
        if not warps or t.min_blocks * spec.threads > 32 * warps[0]:
            return (f"capped x_smem tile {(t.rows, t.warp_nt, t.warps_n, t.stages)} at {t.min_blocks} blocks of "
                    f"{spec.threads} threads: above the space's x_smem_capped_tiles occupancy {warps}")
    elif t.min_blocks > 1 and _reg_need(spec, space) > 65536 // (spec.threads * t.min_blocks):
        return f"~{_reg_need(spec, space)} registers do not fit {t.min_blocks} blocks of {spec.threads} threads"
    if not t.x_smem and t.warps_n not in space.tiles["warps_n"]:
        return f"warps_n={t.warps_n} only for x_smem tiles"
    if t.wsplit and not t.x_smem:
        return "wsplit tiles are x_smem tiles (one activation ring per CTA)"
    return None


def _shape_list(t: Tile) -> str:
    """The space's list an x_smem tile's shape must be in: wsplit_tiles, serial_tiles (w_async:
    w_async_serial_tiles) or x_smem_tiles."""
    if t.serial:
        if t.wgc:
            return "wgmma_producer_tiles"
        return "producer_tiles" if t.producer else "w_async_serial_tiles" if t.w_async else "serial_tiles"
    if t.wsplit:
        return "wsplit_tiles"
    return "x_smem_capped_tiles" if t.min_blocks > 1 else "x_smem_tiles"


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
    if spec.tile.x_smem:
        return 1  # any min-blocks cap (even 96 for a tile that needs 72) made nvcc 13 spill these
    if want > 1 and _reg_need(spec, space) <= 65536 // (spec.threads * want):
        return want
    if spec.threads < 512 and (spec.tile.warps_n < max(space.tiles["warps_n"])
                               or spec.kplan != k_plan(spec.arch, spec.fmt, spec.n, spec.k)):
        # New tiles (half-size CTAs, split-K alternatives): left without a hint nvcc 13 aimed some
        # below their need (sm_90 split-K r16 spilled at 80 registers) and a hint of 1 lets it take
        # up to 255: cap them at the full (generous) estimate instead.
        return max(1, 65536 // (spec.threads * -(-spec.reg_estimate() // 8) * 8))
    return 1


def candidates(arch: int, fmt: str, n: int, k: int, silu: bool = False,
               serves: tuple[str, ...] = ()) -> list[KernelSpec]:
    """Every legal kernel of the space for one problem (all its K plans), in a deterministic order."""
    out: list[KernelSpec] = []
    plans = _mma_sync_plans(arch, fmt, n, k)
    alt_rows = load_space(arch).k_plan.get("alt_max_rows", 64)
    for i, plan in enumerate(plans):
        # alternatives are for the small-M buckets (SM fill), register-path tiles only (rows=8 still
        # serves any M), plus the serial tiles: the plan is chosen jointly over all M buckets, and
        # serial tiles are the ones that take M = 32-64 in the plan's own order
        out += [c for c in _plan_tiles(arch, fmt, n, k, silu, plan, serves)
                if i == 0 or (c.tile.rows <= alt_rows and not c.tile.x_smem) or c.tile.serial]
    for plan in wgmma_plans(arch, fmt, n, k):
        out += _wgmma_tiles(arch, fmt, n, k, silu, plan, serves)
    return out


def _wgmma_tiles(arch: int, fmt: str, n: int, k: int, silu: bool, kp: KPlan,
                 serves: tuple[str, ...]) -> list[KernelSpec]:
    """A wgmma plan's tiles: one warpgroup (4 warps x 16 weight rows) per K worker, the CTA's
    batch rows as the instruction's N, activations always through shared memory."""
    wg = load_space(arch).wgmma
    out = []
    for rows in wg["rows"]:
        for stages in wg["stages"]:
            c = KernelSpec(arch, fmt, n, k, silu, kp, Tile(rows, 1, 4, stages, min_blocks=1, x_ahead=0, x_smem=1),
                           serves)
            if illegal_reason(c) is None and c not in out:
                out.append(c)
    return out


def _plan_tiles(arch: int, fmt: str, n: int, k: int, silu: bool, kp: KPlan,
                serves: tuple[str, ...]) -> list[KernelSpec]:
    space = load_space(arch)
    out: list[KernelSpec] = []
    # x_smem tiles hold no activations in registers (always x_ahead=0); their shapes are the
    # space's x_smem_tiles list, every other tile the product of the knobs
    xs_shapes = space.tiles.get("x_smem_tiles", []) if 1 in space.tiles.get("x_smem", [0]) else []
    for rows in space.tiles["rows"]:
        # warp_nt values only the x_smem list names (e.g. 4) get x_smem tiles only
        for warp_nt in sorted(set(space.tiles["warp_nt"]) | {s[1] for s in xs_shapes}):
            for warps_n in sorted(set(space.tiles["warps_n"]) | {s[2] for s in xs_shapes}):
                # register-path tiles of <= deep_max_rows rows also race the deeper weight rings
                stages_rp = space.tiles["stages"] + (space.tiles.get("deep_stages", [])
                                                     if rows <= max(space.tiles.get("deep_max_rows", [0])) else [])
                # and activations further ahead (far_x_ahead) for those of far_rows rows
                x_ahead_rp = space.tiles["x_ahead"] + (space.tiles.get("far_x_ahead", [])
                                                       if rows in space.tiles.get("far_rows", []) else [])
                # (stages, x_ahead, x_smem, w_async, l2_ahead)
                act = ([(st, xa, 0, 0, 0) for st, xa in itertools.product(stages_rp, x_ahead_rp)]
                       if warp_nt in space.tiles["warp_nt"] else [])
                # and, at x_ahead 1, their L2 prefetch one trip ahead (l2_ahead) for <= l2_ahead_max_rows rows
                if rows <= max(space.tiles.get("l2_ahead_max_rows", [0])):
                    act += [(st, 1, 0, 0, 1) for st, xa, *_ in act if xa == 1 and 1 in space.tiles.get("l2_ahead", [])]
                xs_stages = sorted({s[3] for s in xs_shapes if s[:3] == (rows, warp_nt, warps_n)})
                act += [(st, 0, 1, 0, 0) for st in xs_stages]
                wa_xs = [list(x) for x in space.tiles.get("w_async_x_smem_tiles", [])]
                # and the listed ones with the weight ring in shared memory too
                act += [(st, 0, 1, 1, 0) for st in xs_stages if [rows, warp_nt, warps_n, st] in wa_xs]
                # and the weight ring in shared memory (w_async) for those of <= w_async_max_rows rows
                if warp_nt in space.tiles["warp_nt"] and rows <= max(space.tiles.get("w_async_max_rows", [0])):
                    act += [(st, xa, 0, 1, 0) for st, xa in itertools.product(space.tiles.get("w_async_stages", []),
                                                                              space.tiles["x_ahead"])]
                for stages, xa, xs, wa, pf in act:
                    tile = Tile(rows, warp_nt, warps_n, stages, x_ahead=xa, x_smem=xs, w_async=wa, l2_ahead=pf)
                    spec = KernelSpec(arch, fmt, n, k, silu, kp, tile, serves)
                    deep = not xs and spec.tile.stages not in space.tiles["stages"]
                    if (deep or wa or xa > 1) and spec.threads > max(space.tiles.get("deep_max_threads", [0])):
                        continue  # a deeper ring at 512 threads (128-register cap) spilled (FP8 r16 nt2)
                    for occ in space.tiles["occupancy"]:
                        # an l2_ahead tile keeps its twin's launch bounds (an A/B of the prefetch alone)
                        mb = min_blocks(replace(spec, tile=replace(spec.tile, l2_ahead=0)), occ)
                        if pf and 65536 // (spec.threads * mb) < spec.reg_estimate() + L2_AHEAD_REGS:
                            continue  # no room for the prefetch's registers under the twin's cap
                        c = replace(spec, tile=replace(spec.tile, min_blocks=mb))
                        if illegal_reason(c) is None and c not in out and _fills_better(c):
                            out.append(c)
    # listed register-path shapes beyond the knobs' product (register_tiles), within their thread bounds
    # and, where the entry names formats (trailing tags: `fp8`, `nvfp4`), for those formats only
    for rows, warp_nt, warps_n, stages, xa, max_thr, min_thr, *only in space.tiles.get("register_tiles", []):
        if only and FORMAT_TAG[fmt] not in only:
            continue
        c = KernelSpec(arch, fmt, n, k, silu, kp, Tile(rows, warp_nt, warps_n, stages, x_ahead=xa), serves)
        c = replace(c, tile=replace(c.tile, min_blocks=_occupancy_blocks(c)))
        if min_thr <= c.threads <= max_thr and illegal_reason(c) is None and c not in out:
            out.append(c)
    # capped shapes: a listed shape capped for the fewest CTAs per SM that put its whole grid at M = rows
    # in one wave, where that is 2 .. the listed warps per SM (x_smem_capped_tiles: [rows, warp_nt,
    # warps_n, stages, warps]; register_capped_tiles: [rows, warp_nt, warps_n, stages, x_ahead, warps(,
    # format tags)], register-path tiles)
    capped = [(Tile(r, nt, wn, st, x_ahead=0, x_smem=1), w)
              for r, nt, wn, st, w in space.tiles.get("x_smem_capped_tiles", [])]
    capped += [(Tile(r, nt, wn, st, x_ahead=xa), w)
               for r, nt, wn, st, xa, w, *only in space.tiles.get("register_capped_tiles", [])
               if not only or FORMAT_TAG[fmt] in only]
    for tile, warps in capped:
        c = KernelSpec(arch, fmt, n, k, silu, kp, tile, serves)
        rows = tile.rows
        mb = -(-math.prod(c.grid(rows)) // space.sms)
        # no wave to save, or one the tile reaches without this cap (x_smem tiles carry no hint: their
        # registers decide; register-path tiles carry their own occupancy hint)
        reached = (_reg_need(c, space) <= 65536 // (c.threads * mb) if tile.x_smem else mb <= _occupancy_blocks(c))
        if not 2 <= mb <= warps * 32 // c.threads or reached:
            continue
        c = replace(c, tile=replace(c.tile, min_blocks=mb))
        if illegal_reason(c) is None and c not in out:
            out.append(c)
    # wsplit shapes (the plan's K workers as CTAs of their own): x_smem tiles from their own list
    for rows, warp_nt, warps_n, stages, *_ in space.tiles.get("wsplit_tiles", []):
        c = KernelSpec(arch, fmt, n, k, silu, kp,
                       Tile(rows, warp_nt, warps_n, stages, x_ahead=0, x_smem=1, wsplit=1), serves)
        if illegal_reason(c) is None and c not in out:
            out.append(c)
    # serial shapes (one CTA walks all of the plan's K workers): x_smem tiles from their own list
    # (and with their weight ring in shared memory, deeper: w_async_serial_tiles)
    # (and fed by a producer warp: producer_tiles, stages = its ring's K groups)
    # (and with wgmma consumer warpgroups: wgmma_producer_tiles, [rows, 1, warps_n, weight stages, activation
    # producer warps, activation stages(, 1: the weight warp's L2 prefetch ahead of its ring)])
    for key, wa, pw in (("serial_tiles", 0, 0), ("w_async_serial_tiles", 1, 0), ("producer_tiles", 0, 1),
                        ("wgmma_producer_tiles", 0, 1)):
        for rows, warp_nt, warps_n, stages, *extra in space.tiles.get(key, []):
            wgc = int(key == "wgmma_producer_tiles")
            tile = Tile(rows, warp_nt, warps_n, stages, x_ahead=0, x_smem=1, serial=1, w_async=wa,
                        producer=extra[0] if wgc else pw, wgc=wgc, x_ring=extra[1] if wgc else 0,
                        l2_ahead=extra[2] if wgc and len(extra) > 2 else 0,
                        w_warps=extra[3] if wgc and len(extra) > 3 else 0,
                        w_self=extra[4] if wgc and len(extra) > 4 else 0,
                        pair=extra[5] if wgc and len(extra) > 5 else 0)
            c = KernelSpec(arch, fmt, n, k, silu, kp, tile, serves)
            # (wgc_z_split: each wgc shape of a split-K plan also with one CTA per split, `_zs1`)
            zs = wgc and 1 in space.tiles.get("wgc_z_split", [])
            twins = [c, replace(c, tile=replace(tile, z_split=1))] if zs else [c]
            # (wgc_persist: each w_self shape of a one-split plan also on one CTA per SM, `_ps<sms>`, where
            # its column blocks overflow the SMs by at most SMs / workers)
            if wgc and tile.w_self and 1 in space.tiles.get("wgc_persist", []):
                twins.append(replace(c, tile=replace(tile, persist=space.sms)))
            out.extend(t for t in twins if illegal_reason(t) is None and t not in out)
    return out


def _fills_better(spec: KernelSpec) -> bool:
    """Narrow CTAs (warps_n below the space's widest) exist to put work on more SMs: keep one only
    where the cost model says it beats the same tile at the widest warps_n at M = rows."""
    space = load_space(spec.arch)
    widest = max(space.tiles["warps_n"])
    if spec.tile.warps_n >= widest or spec.tile.x_smem:
        return True  # x_smem shapes come from an explicit list: that list is their filter
    if spec.tile.rows > space.limits.get("narrow_max_rows", 64) or spec.tile.warp_nt > 1:
        return False  # large row tiles get their CTAs from row blocks; nt > 1 undoes the narrowing
    wide = replace(spec, tile=replace(spec.tile, warps_n=widest))
    wide = replace(wide, tile=replace(wide.tile, min_blocks=_occupancy_blocks(wide)))
    if illegal_reason(wide) is not None:
        return True
    return model_us(spec, spec.tile.rows) < 0.95 * model_us(wide, spec.tile.rows)


def _occupancy_blocks(spec: KernelSpec) -> int:
    return max(min_blocks(spec, occ) for occ in load_space(spec.arch).tiles["occupancy"])


# ---------------------------------------------------------------------------------------------
# Cost model (shared by the generator's plan/tile rules, the tuner's pruning and the untuned
# heuristic tables): the slowest of DRAM bytes, MMA work, latency (bytes in flight per resident
# warp) and issue on the busiest SM (the SM that got the most CTAs), plus a ramp and, for split-K,
# the reduce (REDUCE_US: set when it was a second launch; since session 5 it is the last warp's
# serial tail in the same launch, to be measured on the H200 before changing it, which would
# change which plans and tiles are generated). Calibrated on the H200
# (bench/h200-2026-11-29-s3 ncu): NVFP4 r8 kernels on 80 of 132 SMs issue ~2.2 instructions per
# cycle per SM, i.e. they are issue-bound per SM, so how evenly CTAs land on SMs decides their
# speed; FP8 is bound by bytes in flight.
# ---------------------------------------------------------------------------------------------
L2_REREAD = 0.3  # a re-read of a weight tile by another row block mostly hits L2
MMA_TFLOPS = {70: 100.0, 80: 250.0, 90: 600.0}  # mma.sync FP16 (H200 measured 643 TFLOP/s)
WGMMA_TFLOPS = 1000.0  # wgmma FP16, FP32 accumulation (~1.6x the mma.sync measured; dense peak ~990)
SM_GIPS = {70: 2.2 * 1.4, 80: 2.2 * 1.4, 90: 2.2 * 1.78}  # sustained G instructions/s per SM
LATENCY_US = 1.0  # DRAM round trip under load: bytes in flight per warp are its stages
READ_GBS = {70: 800.0, 80: 1800.0, 90: 4260.0}  # reference read bandwidth
RAMP_US, REDUCE_US = 2.0, 2.0
# room an l2_ahead tile needs under its twin's register cap beyond the twin's estimate. Calibrated on
# nvcc 13 builds of all of them: FP8 r16 nt2 st3 (estimate 116) spilled 8 bytes at a 128 cap (so > 12),
# NVFP4 r16 nt1 st4 (estimate 114) fit it exactly at 128 (so <= 14)
L2_AHEAD_REGS = 13
# x_smem tiles (m16n8k16, sm_80 / sm_90) also pay for traffic the other terms do not see:
# L1TEX / shared-memory bytes on the busiest SM (weight loads, LDS.128 B fragments, the cp.async
# fills) at 128 B per clock, and L2 -> SM bytes (each row block re-reads the weights; every N tile
# of CTAs stages all M activation rows). Calibrated on the session-4 ncu of the NVFP4 gate_up x_smem
# r32 nt1 wn2 tile at M = 64 (96 us: L1/TEX 77%, L2 72.5% of peak, ~913 MB from L2; modelled 96).
# Register-path tiles keep the model the generator's tile and plan rules were tuned with.
L1_BYTES_PER_US = {80: 128 * 1.41e3, 90: 128 * 1.78e3}
L1_EFF = 0.85
L2_GBS = {80: 5000.0, 90: 11000.0}
X_SMEM_INSTR = (16.0, 9.0)  # x_smem copies, barrier and wait per warp and group (NVFP4, FP8), sm_90 SASS


def _instr_per_group(spec: KernelSpec) -> float:
    """SASS instructions per (warp tile, K group) of the main loop (bench/NOTES.md counts, sm_90);
    sm_70/sm_80 decode in software (about twice as many)."""
    nvfp4 = spec.fmt == "nvfp4"
    if spec.kplan.wgmma:
        # decode as mma.sync, plus barrier and wgmma issue per group; per 8 rows only the producer
        # warp's 4-byte cp.async copies (rows x KG x 2 bytes per group) spread over the warp tiles
        # -- an estimate, not yet calibrated on the H200
        base, per8 = (64.0 + 12.0, 3.0) if nvfp4 else (14.0 + 12.0, 1.5)
        return base + per8 * (spec.tile.rows // 8 - 1)
    base, per8 = (64.0, 6.0) if nvfp4 else (14.0, 3.4)
    if spec.arch < 89:
        base *= 1.9 if nvfp4 else 4.0
    # x_smem: copies, barrier and wait per warp (shared by its warp_nt tiles); sm_90 SASS per tile-group
    # (gate_up N34816): NVFP4 r16 / r32 / r64 nt2 72-74 / 85-89 / 109-120, nt1 80-84 / 95-104
    xs = X_SMEM_INSTR[0 if nvfp4 else 1] / spec.tile.warp_nt if spec.tile.x_smem else 0.0
    return base + per8 * (spec.tile.rows // 8 - 1) + xs


def resident_ctas(spec: KernelSpec) -> int:
    """CTAs per SM: the min-blocks hint where the kernel is capped for it, else by threads and the
    estimated registers."""
    if spec.tile.min_blocks > 1:
        return spec.tile.min_blocks
    regs = max(32, _reg_need(spec, load_space(spec.arch)))
    return max(1, min(32, 2048 // spec.threads, 65536 // (spec.threads * regs)))


def model_us(spec: KernelSpec, m: int, bw_gbs: float = 0.0, sms: int = 0) -> float:
    sms = sms or load_space(spec.arch).sms
    bw = bw_gbs or READ_GBS.get(spec.arch, 1000.0)
    lay = spec.layout
    per_byte = 0.5625 if spec.fmt == "nvfp4" else 1.0
    wbytes = spec.n * spec.k * per_byte
    gx, gy, gz = spec.grid(m)
    t_mem = (1 + L2_REREAD * (gx - 1)) * wbytes / (bw * 1e3)
    tflops = WGMMA_TFLOPS if spec.kplan.wgmma else MMA_TFLOPS.get(spec.arch, 100.0)
    t_mma = 2 * gx * spec.tile.rows * lay.n_pad * spec.k / (tflops * 1e6)
    ctas = gx * gy * gz
    warps = spec.threads // 32
    res = resident_ctas(spec)
    # latency: a warp keeps `stages` loads per warp tile in flight, so a CTA alone takes its bytes
    # over (warps x stages x load / latency); the busiest SM runs its CTAs `res` at a time
    per_load = 576 if spec.fmt == "nvfp4" else 512  # bytes per warp tile and group (NVFP4: + scales)
    tile_groups = spec.tile.warp_nt * spec.tile.warps_n * (spec.k // lay.k_group) // gz
    cta_us = tile_groups * per_load / (warps * spec.tile.stages * spec.tile.warp_nt * per_load) * LATENCY_US
    t_lat = math.ceil(math.ceil(ctas / sms) / res) * cta_us
    # issue on the busiest SM: it runs ceil(ctas / sms) CTAs, each of warp tiles x its K groups
    t_issue = math.ceil(ctas / sms) * tile_groups * _instr_per_group(spec) / (SM_GIPS.get(spec.arch, 3.0) * 1e3)
    t_l1 = t_l2 = 0.0
    if spec.tile.x_smem and spec.fam == "sm80" and not spec.kplan.wgmma:
        groups = spec.k // lay.k_group // gz  # K groups of one CTA (all its K workers)
        wn, nt, n8 = spec.tile.warps_n, spec.tile.warp_nt, spec.tile.rows // 8
        x_frag = wn * n8 * (lay.k_group // 32) * 512  # B fragments: 16 B per lane per 8 rows and 32 K
        fill = min(spec.tile.rows, m) * lay.k_group * 2
        cta_bytes = groups * (wn * nt * per_load + x_frag + fill)
        t_l1 = math.ceil(ctas / sms) * cta_bytes / (L1_BYTES_PER_US.get(spec.arch, 128 * 1.4e3) * L1_EFF)
        t_l2 = (gx * wbytes + gy * m * spec.k * 2) / (L2_GBS.get(spec.arch, 5000.0) * 1e3)
    t = max(t_mem, t_mma, t_lat, t_issue, t_l1, t_l2) + RAMP_US
    return t + (REDUCE_US if gz > 1 else 0.0)
