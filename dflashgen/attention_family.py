"""The grouped verification attention kernel family: specs from schedules/attention.yaml, rendered
through templates/verify_attention.cu.j2 (registered in ``render.FAMILY_MODULES`` as "attention").

Head counts come from the models and TP degrees in schedules/targets.yaml (query heads / TP; KV heads
/ TP, at least 1: a KV head is replicated when there are fewer than ranks). Names encode every
parameter: ``dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds2_sp512_le2048s64_le8192s128`` (the
split rule: 64-token splits up to 2048 tokens, 128 up to 8192, else 512; see runtime/split_rule.py).
``wg: 1`` schedules (sm_90 only, built for sm_90a) run the warpgroup-MMA kernel
(templates/include/dflashgen/verify_attention_wgmma.cuh): one warpgroup per CTA over the group's
query rows padded to 64; their names carry ``_wg1`` before the split rule. ``tma: 1`` (with ``wg: 1``,
FP16 KV, 16-token pages) brings K/V in by TMA from one producer warp (``_wg1_tma1``; same arithmetic, so
the same bits as the cp.async twin); the manifest entry says ``tma: 1`` and the runtime passes the K / V
pools' tensor maps after the other parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

import yaml

from . import __version__
from .render import FamilyKernel, _env, load_targets
from .runtime.split_rule import SplitRule

FAMILY = "attention"
KV_DTYPES = ("fp16", "e5m2", "e4m3")
KV_ENUM = {"fp16": "FP16", "e5m2": "E5M2", "e4m3": "E4M3"}
# Shared memory per SM (bytes, CTA reservations included): the occupancy hint of D-split kernels.
SM_SMEM = {70: 98304, 80: 167936, 90: 233472}
MMA = {"m8n8k4": ("AttnSm70", "mma.sync.m8n8k4 / HMMA.884"), "m16n8k16": ("AttnSm80", "mma.sync.m16n8k16 / HMMA.16816")}
WG_MMA = "wgmma.m64nTk16 QK (SS) + m64n256k16 PV (P from registers) / HGMMA"
WG_ROWS = 64  # the wgmma kernel's M: one warpgroup over the KV group's query rows, padded
WG_TILES = (16, 32, 64)  # its tile is the QK wgmma's N


@dataclass(frozen=True)
class AttnSpec:
    arch: int
    hq: int
    hkv: int
    d: int
    qrows: int
    kv: str
    page: int
    tile: int
    stages: int
    split: int
    kvg: int = 1  # token groups of warps per CTA (each a tile of every stage)
    hs: int = 1  # CTAs per (request, KV head, split), each a part of the group's query rows
    ds: int = 1  # warps per (16-row block, token group): QK tokens and PV columns split DS ways
    short: tuple[tuple[int, int], ...] = ()  # split rule tiers (max length, split) below `split`
    wg: int = 0  # 1: sm_90a warpgroup-MMA kernel (verify_attention_wgmma.cuh); kvg 1 / 2 warpgroups; ds = 1
    # 1 (wg only, FP16 KV): K/V by TMA (cp.async.bulk.tensor, 128-byte swizzle) from one extra producer warp,
    # full / empty mbarriers per stage; the runtime passes a tensor map of each pool (kernel parameters)
    tma: int = 0
    default: bool = True  # the schedule the runtime serves (else a benchmark candidate)
    serves: tuple[str, ...] = ()
    # a served wg kernel: the mma.sync kernel next in default_for's list, served instead when
    # DFLASHGEN_ATTN_WG=0 (emitted too); not part of the name
    fallback: str = ""
    # a served wg kernel: its deeper-ring bitwise twin (`deep_for` in the YAML: same tile, token groups
    # and split rule, more stages, so one CTA per SM), which the runtime serves instead when a batch at
    # the block table's capacity would occupy at most one CTA per SM (runtime/attention_kernel.py)
    deep: str = ""

    @property
    def name(self) -> str:
        return (f"dfg_attn_sm{self.arch}_h{self.hq}kv{self.hkv}_d{self.d}_q{self.qrows}_{self.kv}_p{self.page}"
                f"_t{self.tile}_st{self.stages}_g{self.kvg}_hs{self.hs}_ds{self.ds}{'_wg1' if self.wg else ''}"
                f"{'_tma1' if self.tma else ''}_{self.rule.tag}")

    @property
    def target(self) -> str:
        """The compute_/sm_ suffix: 90a for the wgmma kernel (arch-specific features), else the arch."""
        return f"{self.arch}a" if self.wg else str(self.arch)

    @property
    def rule(self) -> SplitRule:
        """A request's split size from its own length (the kernel renders the same rule as constants)."""
        return SplitRule(self.split, self.short)

    @property
    def rows(self) -> int:
        """Query rows per (request, KV head): the merge's and the workspace's row count."""
        return self.hq // self.hkv * self.qrows

    @property
    def cta_rows(self) -> int:
        return self.rows // self.hs

    @property
    def threads(self) -> int:
        if self.wg:
            return 128 * self.kvg + 32 * self.tma  # one warpgroup per token group (+ the TMA producer warp)
        return 32 * (self.cta_rows // 16) * self.kvg * self.ds

    @property
    def min_blocks(self) -> int:
        """`__launch_bounds__` min-blocks hint: D-split kernels ask for the CTAs that shared memory allows,
        so ptxas keeps the (halved) registers to what those CTAs' warps leave; others keep 1."""
        return 1 if self.ds == 1 else max(1, self.ctas_per_sm(SM_SMEM[self.arch]))

    @property
    def smem(self) -> int:
        """Dynamic shared memory in bytes (mirrors VerifyAttention::SMEM, or VerifyAttentionWg::SMEM for
        wg: 1 KB alignment slack, Q of 64 rows, the K/V ring, page ids; the template asserts it)."""
        pages_bytes = (((self.split + self.page - 1) // self.page + 1) * 4 + 15) // 16 * 16
        if self.wg:  # FP8: the ring as stored + 1 (stages 2) or 2 decoded FP16 stages of K/V tiles
            kvb, ncvt = (2, 0) if self.kv == "fp16" else (1, 1 if self.stages == 2 else 2)
            tt = self.tile * self.kvg
            return (1024 + WG_ROWS * self.d * 2 + self.stages * 2 * tt * self.d * kvb
                    + ncvt * 2 * tt * self.d * 2 + pages_bytes
                    + 16 * self.stages * self.tma)  # TMA: full / empty mbarriers per stage
        kv_bytes, tt = (2 if self.kv == "fp16" else 1), self.tile * self.kvg
        teams = self.threads // 32 // self.ds  # S / P / alpha buffers per team of ds warps
        pages = (self.split + self.page - 1) // self.page + 1  # the split's page ids
        return (self.cta_rows * self.d * 2 + self.stages * 2 * tt * self.d * kv_bytes
                + (0 if self.kv == "fp16" else 2 * tt * self.d * 2)
                + teams * 16 * (self.tile + 4) * 4 + teams * 16 * (self.tile + 8) * 2 + teams * 16 * 4
                + (pages * 4 + 15) // 16 * 16)

    def ctas_per_sm(self, smem_per_sm: int = 233472, reserved: int = 1024) -> int:
        """Resident CTAs per SM by shared memory (sm_90: 228 KB per SM, 1 KB reserved per CTA)."""
        return smem_per_sm // (self.smem + reserved)

    def key(self) -> tuple[int, int, int, int, int, str, int]:
        """What the runtime dispatches on (everything but the schedule)."""
        return (self.arch, self.hq, self.hkv, self.d, self.qrows, self.kv, self.page)

    def meta(self) -> dict[str, Any]:
        m = asdict(self)
        m["serves"] = list(self.serves)
        m["short"] = [list(t) for t in self.short]
        m.update(threads=self.threads, smem=self.smem, rows=self.rows, cta_rows=self.cta_rows,
                 min_blocks=self.min_blocks)
        if self.wg:
            m["target"] = self.target  # build.py: compute_90a / sm_90a
        else:
            del m["wg"]  # the mma.sync entries keep their pre-wgmma form
        if not self.tma:
            del m["tma"]  # tma: 1 entries take two tensor-map parameters (runtime/attention_kernel.py)
        if not self.fallback:
            del m["fallback"]
        if not self.deep:
            del m["deep"]
        return m


class AttnScheduleError(ValueError):
    """schedules/attention.yaml asks for an illegal kernel."""


@cache
def load_schedule() -> dict[str, Any]:
    return dict(yaml.safe_load((resources.files("dflashgen.schedules") / "attention.yaml").read_text()))


def target_heads() -> dict[tuple[int, int, int], set[str]]:
    """(query heads, KV heads, head_dim) per rank -> the "model/tpN" targets needing them."""
    from .model import load_model_config

    out: dict[tuple[int, int, int], set[str]] = {}
    for t in load_targets():
        cfg = load_model_config(t.model)
        if cfg.num_attention_heads % t.tp:
            raise AttnScheduleError(f"{t.model}: {cfg.num_attention_heads} query heads do not split over TP{t.tp}")
        hq, hkv = cfg.num_attention_heads // t.tp, max(1, cfg.num_key_value_heads // t.tp)
        out.setdefault((hq, hkv, cfg.head_dim), set()).add(f"{t.model}/tp{t.tp}")
    return out


def check(spec: AttnSpec, smem_limit: int) -> None:
    try:  # first: the name encodes the rule
        rule = spec.rule
    except ValueError as e:
        raise AttnScheduleError(f"sm_{spec.arch} h{spec.hq}kv{spec.hkv} t{spec.tile} g{spec.kvg}: {e}") from None
    if spec.hq % spec.hkv or spec.rows % 16:
        raise AttnScheduleError(f"{spec.name}: query rows per KV group ({spec.rows}) must be a multiple of 16")
    if spec.hs < 1 or spec.rows % (16 * spec.hs):
        raise AttnScheduleError(f"{spec.name}: {spec.hs} row parts of {spec.rows} rows must each be a multiple of 16")
    if spec.d != 256:
        raise AttnScheduleError(f"{spec.name}: the kernel's accumulator layout is written for head_dim 256")
    if spec.wg not in (0, 1):
        raise AttnScheduleError(f"{spec.name}: wg is 0 (mma.sync) or 1 (warpgroup MMA)")
    if spec.wg:
        if spec.arch != 90:
            raise AttnScheduleError(f"{spec.name}: wg: 1 (wgmma) exists on sm_90 only, not sm_{spec.arch}")
        if spec.kvg not in (1, 2) or spec.ds != 1:
            raise AttnScheduleError(f"{spec.name}: the wgmma kernel takes kvg 1 or 2 (warpgroups), no ds")
        if spec.rows > WG_ROWS or spec.rows % 8:
            raise AttnScheduleError(f"{spec.name}: the wgmma kernel takes <= {WG_ROWS} query rows per KV group "
                                    f"(a multiple of 8), not {spec.rows}")
        if spec.tile not in WG_TILES or spec.stages < 2:
            raise AttnScheduleError(f"{spec.name}: the wgmma kernel's tile is one of {WG_TILES}, with >= 2 stages")
    if spec.tma not in (0, 1):
        raise AttnScheduleError(f"{spec.name}: tma is 0 (cp.async) or 1 (TMA producer warp)")
    if spec.tma and (not spec.wg or spec.kv != "fp16" or spec.page != 16):
        raise AttnScheduleError(f"{spec.name}: tma: 1 is a variant of the wgmma kernel (wg: 1) for FP16 KV and "
                                "16-token pages")
    if spec.ds not in (1, 2, 4) or spec.tile % (16 * spec.ds) or (spec.ds > 1 and spec.threads // 32 // spec.ds > 15):
        raise AttnScheduleError(f"{spec.name}: the D split needs tile % (16 x ds) == 0 and <= 15 warp teams")
    sizes = [rule.split, *(sp for _, sp in rule.tiers)]
    if any(sp % (spec.tile * spec.kvg) for sp in sizes) or spec.tile % 16 or spec.page & (spec.page - 1):
        raise AttnScheduleError(f"{spec.name}: every split % (tile x groups), tile % 16 and a power-of-two page "
                                "are required")
    kv_bytes, tt = (2 if spec.kv == "fp16" else 1), spec.tile * spec.kvg
    idle = (spec.cta_rows * spec.d * 2 + spec.stages * 2 * tt * spec.d * kv_bytes  # Q + stages (+ FP8 decode)
            + (0 if spec.kv == "fp16" else 4 * tt * spec.d))
    if ((spec.kvg - 1) * spec.cta_rows // 16 * 128 * 32 + spec.kvg * spec.cta_rows * 2) * 4 > idle:
        raise AttnScheduleError(f"{spec.name}: the token groups' combine buffer exceeds the Q and stage buffers")
    ring = (spec.smem - 1024 - WG_ROWS * spec.d * 2 - ((spec.split + spec.page - 1) // spec.page + 1) * 4
            - 16 * spec.stages * spec.tma)
    if spec.wg and spec.kvg > 1 and ring < 128 * 128 * 4 + WG_ROWS * 2 * 4:
        raise AttnScheduleError(f"{spec.name}: the warpgroups' combine buffer exceeds the ring")
    if spec.smem > smem_limit:
        raise AttnScheduleError(f"{spec.name}: {spec.smem} B shared memory exceeds sm_{spec.arch}'s {smem_limit}")


def _tiers(rules: dict[Any, Any] | None, hkv: int) -> tuple[tuple[int, int], ...]:
    """A variant's split-rule tiers for this KV-head count: ``{kv_heads: [[max_len, split], ...]}``."""
    if not isinstance(rules, dict):
        if rules is None:
            return ()
        raise AttnScheduleError(f"split rule tiers must be a mapping {{kv_heads: [[max_len, split], ...]}}, "
                                f"got {rules!r}")
    try:
        return tuple((int(a), int(b)) for a, b in rules.get(hkv) or ())
    except (TypeError, ValueError):
        raise AttnScheduleError(f"split rule tiers for {hkv} KV heads: want [[max_len, split], ...], "
                                f"got {rules.get(hkv)!r}") from None


def _builds(var: dict[str, Any], kv: str, page: int, extra: bool = False) -> bool:
    """Whether a schedule is emitted for this KV dtype and page: a served mma.sync one for all, a wg
    one (and every benchmark extra) for page 16 and its `kv` dtypes (default FP16)."""
    if not (extra or var.get("wg")):
        return True
    return page == 16 and kv in var.get("kv", ["fp16"])


def specs() -> list[AttnSpec]:
    sch = load_schedule()
    out: dict[str, AttnSpec] = {}
    archs = sorted({t.arch for t in load_targets()})
    for (hq, hkv, d), users in sorted(target_heads().items()):
        split = int(sch["split_tokens"][hkv])
        for arch in archs:
            a = sch["archs"][arch]
            # One served schedule per (arch, KV heads, KV dtype, page): `default_for` overrides `default`
            # per KV-head count with a schedule or a preference list, whose first schedule built for
            # the (dtype, page) serves it (a wg schedule: page 16 and its `kv` dtypes only).
            pref = a.get("default_for", {}).get(hkv, a["default"])
            # The served schedule takes the top-level `short_splits` rule unless it names its own
            # `short`; benchmark extras keep a fixed split unless they name one.
            served = [{"short": sch.get("short_splits"), **v} for v in (pref if isinstance(pref, list) else [pref])]
            for kv in sch["kv_dtypes"]:
                for page in sch["pages"]:
                    usable = [v for v in served if _builds(v, kv, page)]
                    if not usable:
                        raise AttnScheduleError(f"sm_{arch} {hkv} KV heads: no served schedule builds {kv} KV "
                                                f"with {page}-token pages (default_for lists only wg ones?)")
                    base = AttnSpec(arch, hq, hkv, d, int(sch["query_rows"]), kv, int(page), 0, 0, split,
                                    serves=tuple(sorted(users)))

                    def make(var: dict[str, Any], default: bool, base: AttnSpec = base) -> AttnSpec:
                        spec = replace(base, tile=int(var["tile"]), stages=int(var["stages"]),
                                       split=int(var.get("split", {}).get(base.hkv, base.split)),
                                       kvg=int(var.get("kvg", 1)), hs=int(var.get("hs", 1)), ds=int(var.get("ds", 1)),
                                       short=_tiers(var.get("short"), base.hkv), wg=int(var.get("wg", 0)),
                                       tma=int(var.get("tma", 0)), default=default)
                        check(spec, int(sch["archs"][base.arch]["smem_limit"]))
                        return spec

                    pick = make(usable[0], True)
                    # a served wg kernel keeps the list's next mma.sync schedule as its fallback (built too)
                    back = next((v for v in usable[1:] if not v.get("wg")), None) if pick.wg else None
                    if back is not None:
                        fb = make(back, False)
                        out.setdefault(fb.name, fb)
                        pick = replace(pick, fallback=fb.name)
                    deep = a.get("deep_for", {}).get(hkv)
                    if deep is not None and pick.wg:  # (FP8 KV and 4-token pages serve mma.sync: none)
                        twin = make({"short": sch.get("short_splits"), **deep}, False)
                        if bitwise_key(twin) != bitwise_key(pick) or twin.stages <= pick.stages:
                            raise AttnScheduleError(f"{twin.name}: deep_for must be a deeper-ring twin of the served "
                                                    f"{pick.name} (same tile, groups, split rule; more stages)")
                        out.setdefault(twin.name, twin)
                        pick = replace(pick, deep=twin.name)
                    out[pick.name] = pick
                    # benchmark candidates: page 16, FP16 KV unless the variant lists its `kv` dtypes; an
                    # extra equal to the served schedule stays the served one
                    for var in a.get("extra", []):
                        if _builds(var, kv, page, extra=True):
                            spec = make(var, False)
                            out.setdefault(spec.name, spec)
    return [out[n] for n in sorted(out)]


def bitwise_key(spec: AttnSpec) -> tuple[Any, ...]:
    """What a kernel's bits depend on beyond its inputs: schedules equal here give equal outputs (stages,
    row parts, the D split and TMA only move the same arithmetic; the GPU tests check it)."""
    return (spec.arch, spec.hq, spec.hkv, spec.d, spec.qrows, spec.kv, spec.page, spec.tile, spec.kvg,
            spec.split, spec.short, spec.wg)


def render(spec: AttnSpec) -> str:
    mma_struct, mma_name = MMA[load_schedule()["archs"][spec.arch]["mma"]]
    if spec.wg:  # Cfg keeps the mma.sync struct: VerifyAttention<Cfg> supplies the merge kernel
        mma_name, mma_struct = WG_MMA, MMA["m16n8k16"][0]
    return _env().get_template("verify_attention.cu.j2").render(
        version=__version__, name=spec.name, serves=list(spec.serves) or ["(ad hoc)"], arch=spec.target,
        mma=mma_name, mma_struct=mma_struct, wg=spec.wg, tma=spec.tma,
        header="verify_attention_wgmma.cuh" if spec.wg else "verify_attention.cuh",
        attn_struct="VerifyAttentionWg" if spec.wg else "VerifyAttention",
        hq=spec.hq, hkv=spec.hkv, group=spec.hq // spec.hkv, d=spec.d, qrows=spec.qrows,
        kv=spec.kv, kv_enum=KV_ENUM[spec.kv], page=spec.page, tile=spec.tile, stages=spec.stages, split=spec.split,
        kvg=spec.kvg, hs=spec.hs, ds=spec.ds, min_blocks=spec.min_blocks, short=spec.short,
        threads=spec.threads, smem=spec.smem, rows=spec.rows,
    )


def family_kernels() -> list[FamilyKernel]:
    return [FamilyKernel(s.name, s.arch, render(s), s.meta()) for s in specs()]
