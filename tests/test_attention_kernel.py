"""Grouped verification attention kernels on the CPU: the rendered family, its sm_70 (and one sm_90)
compile, exact FP8 decoding, the fragment-layout coverage, a float emulation of the kernel's split /
tile / merge order against the reference, and the input errors. GPU runs: test_gpu_attention.py."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from dflashgen.runtime.attention import PagedKVCache, verify_attention, verify_attention_reference
from dflashgen.runtime.attention_kernel import (
    AttentionInputError,
    check_inputs,
    dense_verify_attention,
    paged_verify_attention,
    select_kernel,
    validate_contents,
)

from dflashgen import attention_family as af
from dflashgen.build import build

TARGET_HEADS = [(24, 4), (6, 1)]  # Qwen3.8-27B at TP1 and per TP4 rank


def test_family_covers_every_target_once() -> None:
    specs = af.specs()
    defaults: dict[tuple, af.AttnSpec] = {}
    for s in specs:
        if s.default:
            assert s.key() not in defaults, f"two default schedules for {s.key()}"
            defaults[s.key()] = s
        for part in (f"sm{s.arch}", f"h{s.hq}kv{s.hkv}", f"d{s.d}", f"q{s.qrows}", s.kv, f"p{s.page}",
                     f"t{s.tile}", f"st{s.stages}", f"g{s.kvg}", f"hs{s.hs}", f"ds{s.ds}",
                     f"sp{s.split}", *(f"le{a}s{b}" for a, b in s.short), *(["wg1"] if s.wg else []),
                     *(["tma1"] if s.tma else [])):
            assert f"_{part}_" in s.name + "_"
        assert s.name.endswith(s.rule.tag)
    want = {(a, hq, hkv, 256, 8, kv, p) for a in (70, 80, 90) for hq, hkv in TARGET_HEADS
            for kv in ("fp16", "e5m2", "e4m3") for p in (4, 16)}
    assert set(defaults) == want
    assert all("qwen3.8-27b/tp" in u for s in specs for u in s.serves)
    assert len(specs) <= 100, "keep the family's build small"
    # Every served schedule carries the YAML's split rule; the race has the same schedules without it.
    rules = af.load_schedule()["short_splits"]
    for s in defaults.values():
        assert [list(t) for t in s.short] == rules[s.hkv] and s.rule(1032) < s.split
    fixed = {(s.hkv, s.tile, s.kvg, s.ds, s.split) for s in specs if not s.short and s.arch == 90}
    assert all((s.hkv, s.tile, s.kvg, s.ds, s.split) in fixed for s in defaults.values() if s.arch == 90)
    # The runtime picks exactly the default, and only by name otherwise.
    for hq, hkv in TARGET_HEADS:
        e = select_kernel(90, hq, hkv, 256, "fp16", 16)
        spec = defaults[(90, hq, hkv, 256, 8, "fp16", 16)]
        assert e["default"] and e["family"] == "attention" and e["name"] == spec.name and e["smem"] == spec.smem


def test_render_is_deterministic_and_marked_generated() -> None:
    s = af.specs()[0]
    a, b = af.render(s), af.render(s)
    assert a == b and "DO NOT EDIT" in a and f"{s.name}_merge" in a and f"SMEM == {s.smem}" in a


def test_split_rule_renders_into_the_kernel() -> None:
    """The rule is constants in the kernel source (its identity), tiers in order, the long split last."""
    spec = af.AttnSpec(90, 24, 4, 256, 8, "fp16", 16, tile=32, stages=2, split=512, ds=2,
                       short=((2048, 64), (8192, 128)))
    assert spec.name.endswith("_ds2_sp512_le2048s64_le8192s128")
    src = af.render(spec)
    body = src[src.index("split_for(int len)"):src.index("MIN_SPLIT")]
    assert body.index("len <= 2048) return 64") < body.index("len <= 8192) return 128") < body.index("return SPLIT")
    assert "MIN_SPLIT = 64;" in src
    # The distinct split sizes (the kernel loads a split's page ids under each before the length arrives).
    sizes = src[src.index("size_at(int i)"):src.index("};", src.index("size_at(int i)"))]
    assert "NSIZES = 3;" in src and sizes.index("return 64") < sizes.index("return 128") < sizes.index("return SPLIT")
    plain = af.render(af.AttnSpec(90, 24, 4, 256, 8, "fp16", 16, tile=32, stages=2, split=512, ds=2))
    assert "if (len" not in plain and "MIN_SPLIT = 512;" in plain and "NSIZES = 1;" in plain
    same = af.render(af.AttnSpec(90, 24, 4, 256, 8, "fp16", 16, tile=32, stages=2, split=512, ds=2,
                                 short=((2048, 64), (4096, 64))))
    assert "NSIZES = 2;" in same  # tiers with one split size: loaded once
    assert spec.meta()["short"] == [[2048, 64], [8192, 128]]


@pytest.mark.parametrize("tiers,match", [({4: [[2048, 48]]}, "every split"), ({4: [[2048, 512]]}, "bad split rule"),
                                         ({4: [[8192, 64], [2048, 128]]}, "bad split rule"),
                                         ({4: [[2048]]}, "max_len, split"), ([[2048, 64]], "mapping")])
def test_bad_split_rules_in_the_schedule(monkeypatch, tiers, match) -> None:
    """A bad `short_splits` (or a variant's `short`) in schedules/attention.yaml fails generation clearly."""
    sch = {**af.load_schedule(), "short_splits": tiers}
    monkeypatch.setattr(af, "load_schedule", lambda: sch)
    with pytest.raises(af.AttnScheduleError, match=match):
        af.specs()


@pytest.mark.parametrize("change,match", [({"tile": 48}, "tile"), ({"d": 128}, "head_dim 256"),
                                          ({"hq": 5}, "multiple of 16"), ({"stages": 9}, "shared memory"),
                                          ({"hs": 2}, "row parts"), ({"tile": 16, "kvg": 8}, "combine buffer"),
                                          ({"tile": 16, "ds": 2}, "D split"),
                                          # the warpgroup-MMA kernel (wg: 1)
                                          ({"wg": 1, "arch": 80}, "sm_90 only"), ({"wg": 2}, "wg is 0"),
                                          ({"wg": 1, "kv": "e4m3", "tile": 64, "stages": 4}, "shared memory"),
                                          ({"wg": 1, "ds": 2}, "kvg 1 or 2"),
                                          ({"wg": 1, "kvg": 4}, "kvg 1 or 2"),
                                          ({"wg": 1, "kvg": 2, "tile": 16, "stages": 2, "split": 512},
                                           "combine buffer exceeds the ring"),
                                          ({"wg": 1, "hq": 12}, "<= 64 query rows"),
                                          ({"wg": 1, "tile": 128, "split": 512}, "tile is one of"),
                                          ({"wg": 1, "stages": 1}, ">= 2 stages"),
                                          ({"wg": 1, "hs": 2}, "row parts"),  # 24 rows: the merge's 16-row parts
                                          ({"wg": 1, "tile": 64, "stages": 4}, "shared memory"),
                                          # its TMA variant (tma: 1): wg, FP16 KV, 16-token pages only
                                          ({"tma": 1}, "variant of the wgmma kernel"),
                                          ({"wg": 1, "tma": 1, "kv": "e4m3"}, "FP16 KV"),
                                          ({"wg": 1, "tma": 1, "page": 4}, "16-token pages"),
                                          ({"wg": 1, "tma": 2}, "tma is 0"),
                                          ({"wg": 1, "tma": 1, "tile": 64, "stages": 4}, "shared memory")])
def test_schedule_rejects_illegal_kernels(change, match) -> None:
    base = dict(arch=90, hq=6, hkv=1, d=256, qrows=8, kv="fp16", page=16, tile=32, stages=2, split=256)
    with pytest.raises(af.AttnScheduleError, match=match):
        af.check(af.AttnSpec(**{**base, **change}), 232448)


@pytest.mark.parametrize("arch,needles", [(70, ["mma.sync.aligned.m8n8k4"]),
                                          (90, ["mma.sync.aligned.m16n8k16", "ldmatrix", "cp.async"])])
def test_kernel_compiles_without_spills(arch, needles) -> None:
    name = select_kernel(arch, 6, 1, 256, "e4m3", 4)["name"]
    res = build([arch], only=f"^{name}$", progress=False)
    r = res.resources()[name]
    assert r["registers"] > 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0
    ptx = res.artifacts[name].ptx.read_text()
    assert all(n in ptx for n in needles) and f"{name}_merge" in ptx


def _wg_spec(**kw) -> af.AttnSpec:
    base = dict(arch=90, hq=24, hkv=4, d=256, qrows=8, kv="fp16", page=16, tile=32, stages=2, split=512, wg=1)
    return af.AttnSpec(**{**base, **kw})


def test_wgmma_specs_render_and_name() -> None:
    """wg: 1 schedules: `_wg1` in the name (before the split rule), one warpgroup, the sm_90a target in
    the manifest entry (build.py compiles compute_90a / sm_90a), the wgmma header and struct rendered;
    mma.sync entries keep their form. Page 16, sm_90 only; served (default_for, session 6) for FP16 KV
    at both head layouts, FP8 KV adds its decode buffers to the shared memory."""
    spec = _wg_spec(short=((2048, 64), (8192, 128)))
    assert spec.name == "dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds1_wg1_sp512_le2048s64_le8192s128"
    assert spec.threads == 128 and spec.min_blocks == 1 and spec.target == "90a"
    assert spec.smem == 1024 + 64 * 256 * 2 + 2 * 2 * 32 * 256 * 2 + 144  # slack, Q, ring, 33 page ids
    meta = spec.meta()
    assert meta["target"] == "90a" and meta["wg"] == 1 and meta["rows"] == 48
    src = af.render(spec)
    assert "#include <dflashgen/verify_attention_wgmma.cuh>" in src and "VerifyAttentionWg<Cfg>" in src
    assert "__launch_bounds__(128, 1)" in src and "__align__(1024)" in src and "sm_90a" in src
    assert f"SMEM == {spec.smem}" in src and "wgmma=1" in src
    plain = _wg_spec(wg=0, ds=2)
    assert "wg" not in plain.meta() and "target" not in plain.meta() and "_wg" not in plain.name
    assert "VerifyAttentionWg" not in af.render(plain) and "__align__(128)" in af.render(plain)
    wgs = [s for s in af.specs() if s.wg]
    rules = af.load_schedule()["short_splits"]
    assert wgs and all(s.arch == 90 and s.page == 16
                       and s.default == (s.kv == "fp16" and [list(t) for t in s.short] == rules[s.hkv]) for s in wgs
                       if (s.tile, s.stages, s.kvg, s.split) in ((32, 2, 1, 512), (32, 2, 1, 128)) and not s.tma)
    assert {s.hkv for s in wgs if s.default} == {hkv for _, hkv in TARGET_HEADS}
    assert {s.kv for s in wgs} == {"fp16", "e5m2", "e4m3"}
    ring = 1024 + 64 * 256 * 2 + 4 * 2 * 32 * 256 + 144  # FP8, 4 stages: the ring as stored (1 byte)
    assert _wg_spec(kv="e4m3", stages=4).smem == ring + 2 * 2 * 32 * 256 * 2  # + 2 decoded K/V pairs
    assert _wg_spec(kv="e5m2").smem == 1024 + 64 * 256 * 2 + 2 * 2 * 32 * 256 + 144 + 2 * 32 * 256 * 2
    assert {(s.hq, s.hkv) for s in wgs} == set(TARGET_HEADS)
    # at least one candidate with each served split rule (a servable twin of the default's rule)
    for hq, hkv in TARGET_HEADS:
        served = select_kernel(90, hq, hkv, 256, "fp16", 16)
        assert any(s.hkv == hkv and [list(t) for t in s.short] == served["short"] and s.split == served["split"]
                   for s in wgs)


@pytest.mark.parametrize("tile,stages,kv,kvg", [(32, 2, "fp16", 1), (32, 4, "fp16", 1), (32, 4, "e4m3", 1),
                                                 (16, 4, "fp16", 2)])  # in-order / overlapped loops, 2 WGs
def test_wgmma_kernel_compiles_for_sm90a(tile, stages, kv, kvg) -> None:
    """A wg kernel through the build (compute_90a PTX, sm_90a cubin): wgmma for QK (m64nTk16) and PV
    (m64n256k16), no spills, no ptxas wgmma serialization warnings (C7513 / C7514)."""
    name = next(s.name for s in af.specs() if s.wg and s.hkv == 1 and (s.tile, s.stages, s.kv, s.kvg)
                == (tile, stages, kv, kvg) and s.short)
    res = build([90], only=f"^{name}$", progress=False)
    art = res.artifacts[name]
    r = res.resources()[name]
    assert 0 < r["registers"] <= 255 and r["spill_stores"] == 0 and r["spill_loads"] == 0
    ptx = art.ptx.read_text()
    assert ".target sm_90a" in ptx and f"{name}_merge" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{tile}k16.f32.f16.f16" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in ptx and "fence.proxy.async" in ptx
    log = art.log.read_text()
    assert "serializ" not in log.lower() and "C751" not in log


def test_tma_specs_render_and_name() -> None:
    """tma: 1 (the wg kernel with K/V by TMA from a producer warp): `_tma1` after `_wg1` in the name,
    128 x kvg + 32 threads, 16 B of mbarriers per stage, `tma: 1` in the manifest entry (the runtime's
    cue to pass the tensor maps), the kernel taking two __grid_constant__ maps; every tma candidate has a
    cp.async twin (same tile, token groups, split rule: the same arithmetic) for the GPU's bitwise test."""
    spec = _wg_spec(tma=1, stages=4, short=((2048, 64), (8192, 128)))
    assert spec.name == "dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st4_g1_hs1_ds1_wg1_tma1_sp512_le2048s64_le8192s128"
    assert spec.threads == 160 and spec.target == "90a"
    assert spec.smem == _wg_spec(stages=4).smem + 4 * 16  # full / empty mbarriers per stage
    meta = spec.meta()
    assert meta["tma"] == 1 and meta["wg"] == 1 and meta["threads"] == 160 and meta["target"] == "90a"
    assert "tma" not in _wg_spec().meta() and "tma" not in _wg_spec(wg=0).meta()
    src = af.render(spec)
    assert "VerifyAttentionWg<Cfg, true>" in src and "Attn::NTHREADS == 160" in src and "tma=1" in src
    assert "const __grid_constant__ dflashgen::wgattn::TmaMap kmap" in src and "smem, &kmap, &vmap);" in src
    assert "__launch_bounds__(160, 1)" in src
    plain = af.render(_wg_spec(stages=4))
    assert "TmaMap" not in plain and "VerifyAttentionWg<Cfg>" in plain and "Attn::THREADS == 128" in plain
    specs = af.specs()
    tmas = [s for s in specs if s.tma]
    assert tmas and all(s.wg and not s.default and s.kv == "fp16" and s.page == 16 for s in tmas)
    assert {s.hkv for s in tmas} == {hkv for _, hkv in TARGET_HEADS}
    for t in tmas:
        assert any(s.wg and not s.tma and (s.hq, s.hkv, s.tile, s.kvg, s.split, s.short, s.kv, s.page)
                   == (t.hq, t.hkv, t.tile, t.kvg, t.split, t.short, t.kv, t.page) for s in specs), t.name
    rules = af.load_schedule()["short_splits"]
    assert all([list(x) for x in t.short] == rules[t.hkv] for t in tmas)  # the served split rule


def test_tma_kernel_compiles_for_sm90a() -> None:
    """A tma kernel (the overlapped loop, t32 st3) through the build: the consumers issue no cp.async,
    the producer's 4-d tensor copies complete on mbarriers; no spills, no wgmma serialization."""
    name = next(s.name for s in af.specs() if s.tma and s.hkv == 1 and (s.tile, s.stages) == (32, 3))
    res = build([90], only=f"^{name}$", progress=False)
    art = res.artifacts[name]
    r = res.resources()[name]
    assert 0 < r["registers"] <= 255 and r["spill_stores"] == 0 and r["spill_loads"] == 0
    ptx = art.ptx.read_text()
    main = ptx[ptx.index(f".entry {name}("):]
    main = main[: main.index(".entry", 10)] if ".entry" in main[10:] else main
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes" in main
    assert "mbarrier.try_wait.parity" in main and "mbarrier.arrive.expect_tx" in main
    assert "cp.async.cg" not in main and "cp.async.wait_group" not in main
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in main and ".param .align 64 .b8" in main
    log = art.log.read_text()
    assert "serializ" not in log.lower() and "C751" not in log


def test_wgmma_fragment_dataflow() -> None:
    """The S accumulator (wgmma D layout: per warp the m16n8 C layout of every 8-column block) repacked
    as P's A fragments exactly as the kernel does (block n -> k-step n / 2, registers 2 (n & 1) + j)
    holds P[row, k] where the PTX A layout wants it: row g + 8 (i & 1), k 2 t + 8 (i >> 1) + h."""
    t_ = 64
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for n in range(t_ // 8):
            for e in range(4):
                row, col = _sm80_acc(lane, n, e)  # the S element this thread holds
                ks, i, h = n >> 1, 2 * (n & 1) + (e >> 1), e & 1  # where the kernel packs it
                assert (row, col) == (g + 8 * (i & 1), 16 * ks + 2 * t + 8 * (i >> 1) + h)


def test_wgmma_layout_matches_cute(tmp_path) -> None:
    """The wg kernel's swizzled tiles, k-step starts and descriptor fields == CuTe's canonical GMMA
    layouts and make_gmma_desc (tests/wgmma_attention_layout.cpp, compiled for the host with g++); the
    tma: 1 kernel's SWIZZLE_128B boxes land every chunk where the cp.async copies put it."""
    import shutil
    import subprocess
    from pathlib import Path

    from dflashgen.toolchain import include_dirs

    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.skip("no host C++ compiler")
    dirs = [str(d) for d in include_dirs()]
    try:
        import nvidia.cuda_nvcc  # crt/host_defines.h, which cuda_runtime_api.h includes

        dirs += [str(Path(p) / "include") for p in nvidia.cuda_nvcc.__path__]
    except ImportError:
        pass
    dirs += ["/usr/local/cuda/include"]
    exe = tmp_path / "layout"
    cpp = Path(__file__).with_name("wgmma_attention_layout.cpp")
    res = subprocess.run([cxx, "-std=c++17", "-O0", *(f"-I{d}" for d in dirs), str(cpp), "-o", str(exe)],
                         capture_output=True, text=True)
    if res.returncode and "No such file or directory" in res.stderr:
        pytest.skip(f"headers for a host build of CuTe missing: {res.stderr.splitlines()[-1][:200]}")
    assert res.returncode == 0, res.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and "OK: 0 mismatches" in run.stdout, run.stdout[-3000:]


def test_work_placement_knobs_compile_on_sm70(tmp_path) -> None:
    """Row parts, the D split (named team barriers) and token groups together on the m8n8k4 path (no
    committed sm_70 kernel uses them): NVRTC 12 -> compute_70 PTX -> ptxas, no spills."""
    import subprocess

    from dflashgen.toolchain import nvrtc_compile, parse_ptxas_log, plan_for

    spec = af.AttnSpec(70, 24, 4, 256, 8, "fp16", 16, tile=32, stages=1, split=512, kvg=2, hs=3, ds=2)
    af.check(spec, 98304)
    src, ptx = tmp_path / f"{spec.name}.cu", tmp_path / f"{spec.name}.ptx"
    src.write_text(af.render(spec))
    nvrtc_compile(src, ptx, 70)
    text = ptx.read_text()
    assert "mma.sync.aligned.m8n8k4" in text and "bar.sync 1, 64" in text
    log = subprocess.run([plan_for(70).ptxas, "-v", "-arch=sm_70", str(ptx), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    r = parse_ptxas_log(log)[spec.name]
    assert r["registers"] > 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0


def test_fp8_decoders_are_exact() -> None:
    """The kernel's bit tricks: E5M2 byte << 8 is the FP16; E4M3 -> FP16 of value * 2^-8."""
    b = torch.arange(256, dtype=torch.int32)
    e5 = b.to(torch.uint8).view(torch.float8_e5m2).float()
    fin = torch.isfinite(e5)
    got5 = (b << 8).to(torch.int16).view(torch.float16).float()
    assert torch.equal(got5[fin], e5[fin])
    e4 = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    fin = ~torch.isnan(e4)
    got4 = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(torch.int16).view(torch.float16).float() * 256
    assert torch.equal(got4[fin], e4[fin])


def _sm80_tile(frag: torch.Tensor) -> torch.Tensor:
    """The 16 x (8 * n) accumulator tile held as m16n8 fragments frag[lane, n, e]."""
    out = torch.zeros(16, 8 * frag.shape[1])
    for ln in range(32):
        for n in range(frag.shape[1]):
            for e in range(4):
                out[_sm80_acc(ln, n, e)] = frag[ln, n, e]
    return out


def _sm80_acc(lane: int, n: int, e: int) -> tuple[int, int]:
    return lane // 4 + 8 * (e >> 1), 8 * n + 2 * (lane % 4) + (e & 1)


def _sm70_acc(lane: int, n: int, e: int) -> tuple[int, int]:
    i, qp = (lane & 3) + 4 * (lane >> 4), (lane >> 2) & 3
    row = (i & 1) + 2 * ((e >> 1) & 1) + 4 * (i >> 2)
    col = 2 * ((i >> 1) & 1) + (e & 1) + 4 * (e >> 2)
    return 8 * (qp & 1) + row, 8 * ((qp >> 1) + 2 * n) + col


@pytest.mark.parametrize("acc,ntiles,elems", [(_sm80_acc, 32, 4), (_sm70_acc, 16, 8)])
def test_accumulator_layouts_cover_the_warp_tile_once(acc, ntiles, elems) -> None:
    """Every (row, column) of a warp's 16 x 256 output (and 16 x T scores, the same formulas with
    fewer N tiles) is held by exactly one (lane, tile, element): mirrors acc_row / acc_col."""
    seen = [acc(lane, n, e) for lane in range(32) for n in range(ntiles) for e in range(elems)]
    assert sorted(seen) == [(r, c) for r in range(16) for c in range(256)]


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _combine(parts: list, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum, O) of several token ranges combined in order with the kernel's -inf guard."""
    mx = torch.stack([p[0] for p in parts]).amax(0)
    base = _finite_or_zero(mx)
    den, num = torch.zeros(len(mx)), torch.zeros(len(mx), d)
    for m_s, l_s, o_s in parts:
        w = torch.exp2(m_s - base)
        den, num = den + l_s * w, num + o_s * w[:, None]
    return mx, den, num


def _emulate(q: torch.Tensor, cache: PagedKVCache, reqs: list[int], spec: af.AttnSpec) -> torch.Tensor:
    """The kernel's arithmetic in float32 torch: FP16 Q, FP16-decoded K/V, scores in log2 units,
    splits of spec.split tokens in tiles of spec.tile, online softmax with the kernel's -inf guards,
    FP16 P, and the ascending-order merge. Checks the index math (causal limits, padded rows, split
    and tile boundaries, scale folding) that the GPU then executes."""
    nb, nq, hq, d = q.shape
    group = hq // cache.num_kv_heads
    out = torch.empty(nb, nq, hq, d)
    qk = 1 / math.sqrt(d) * 1.4426950408889634 * float(cache.k_scale)
    for b, r in enumerate(reqs):
        n = cache.length(r)
        split = spec.rule(n)  # the request's own length picks its split size
        pos = torch.arange(n)
        blocks = cache.block_tables[r, pos // cache.block_size].long()
        k16 = cache.k_pool[blocks, pos % cache.block_size].to(torch.float16).float()  # exact for FP8
        v16 = cache.v_pool[blocks, pos % cache.block_size].to(torch.float16).float()
        for kh in range(cache.num_kv_heads):
            rows = torch.zeros(group * spec.qrows, d)
            i = torch.arange(group * spec.qrows) % spec.qrows
            for h in range(group):
                rows[h * spec.qrows:h * spec.qrows + nq] = q[b, :, kh * group + h].half().float()
            limit = torch.where(i < nq, n - nq + i, n - 1)
            parts = []
            for lo in range(0, n, split):
                groups = []
                for grp in range(spec.kvg):  # group g: tile g of every stage of kvg tiles
                    m = torch.full((len(rows),), -math.inf)
                    ssum, o = torch.zeros(len(rows)), torch.zeros(len(rows), d)
                    for t0 in range(lo + grp * spec.tile, min(lo + split, n), spec.tile * spec.kvg):
                        t1 = min(t0 + spec.tile, n)
                        s = rows @ k16[t0:t1, kh].T * qk
                        s = s.masked_fill(torch.arange(t0, t1)[None, :] > limit[:, None], -math.inf)
                        m_new = torch.maximum(m, s.amax(1))
                        base = _finite_or_zero(m_new)
                        alpha, p = torch.exp2(m - base), torch.exp2(s - base[:, None])
                        ssum = ssum * alpha + p.sum(1)
                        o = o * alpha[:, None] + p.half().float() @ v16[t0:t1, kh]
                        m = m_new
                    groups.append((m, ssum, o))
                parts.append(_combine(groups, d))
            m_s, den, num = _combine(parts, d)
            res = num * (float(cache.v_scale) / den)[:, None]
            for h in range(group):
                out[b, :, kh * group + h] = res[h * spec.qrows:h * spec.qrows + nq]
    return out


@pytest.mark.parametrize("dtype,kvg,tile,short", [(torch.float16, 1, 32, False), (torch.float8_e5m2, 1, 32, False),
                                                  (torch.float8_e4m3fn, 1, 32, False), (torch.float16, 2, 32, False),
                                                  (torch.float16, 2, 16, False), (torch.float16, 1, 32, True),
                                                  (torch.float16, 2, 16, True)])
@pytest.mark.parametrize("nq", [8, 3])
def test_kernel_algorithm_matches_reference(dtype, kvg, tile, short, nq) -> None:
    """With `short`, lengths 63 and 64 + nq - 1 fall in a tier of one-stage splits and 200 in the long
    split: both sides of the threshold in one batch."""
    tt = tile * kvg
    spec = af.AttnSpec(90, 6, 1, 256, 8, "fp16", 4, tile=tile, stages=2, split=(4 if short else 2) * tt, kvg=kvg,
                       short=((64 + nq - 1, tt),) if short else ())
    scales = {"k_scale": 0.05, "v_scale": 0.02} if dtype != torch.float16 else {}
    cache = PagedKVCache(128, 4, 1, 256, max_requests=4, max_blocks_per_request=64, dtype=dtype, **scales)
    g = torch.Generator().manual_seed(0)
    lengths = [nq, 63, 64 + nq - 1, 200]  # a split holding only the last rows' tokens, tile tails
    for r, n in enumerate(lengths):
        cache.append(r, torch.randn(n, 1, 256, generator=g) * 2, torch.randn(n, 1, 256, generator=g))
    q = torch.randn(len(lengths), nq, 6, 256, generator=g).half()
    ref = verify_attention_reference(q, cache, list(range(len(lengths))))
    got = _emulate(q, cache, list(range(len(lengths))), spec)
    vmax = max(float(cache.gather(r)[1].abs().max()) for r in range(len(lengths)))
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-3 * vmax)


def _inputs(**over):
    t = dict(q=torch.zeros(2, 8, 6, 256, dtype=torch.float16), k_pool=torch.zeros(10, 16, 1, 256, dtype=torch.float16),
             v_pool=torch.zeros(10, 16, 1, 256, dtype=torch.float16),
             block_tables=torch.zeros(2, 4, dtype=torch.int32), lengths=torch.full((2,), 8, dtype=torch.int32))
    t.update(over)
    return t


@pytest.mark.parametrize("over,match", [
    ({"q": torch.zeros(2, 8, 5, 256, dtype=torch.float16), "k_pool": torch.zeros(10, 16, 2, 256, dtype=torch.float16),
      "v_pool": torch.zeros(10, 16, 2, 256, dtype=torch.float16)}, "not a multiple of KV heads"),
    ({"q": torch.zeros(2, 8, 6, 128, dtype=torch.float16)}, "head_dim"),
    ({"q": torch.zeros(8, 6, 256)}, r"\[B, nq, Hq, D\]"),
    ({"k_pool": torch.zeros(10, 16, 1, 256)}, "float16 / float8"),
    ({"v_pool": torch.zeros(10, 16, 1, 256, dtype=torch.float8_e5m2)}, "differ"),
    ({"k_pool": torch.zeros(10, 16, 256, 1, dtype=torch.float16).transpose(2, 3)}, "contiguous"),
    ({"block_tables": torch.zeros(2, 4, dtype=torch.int64)}, "int32"),
    ({"block_tables": torch.zeros(2, 8, dtype=torch.int32)[:, :4]}, "block_tables must be contiguous"),
    ({"lengths": torch.zeros(3, dtype=torch.int32)}, "lengths"),
])
def test_structural_errors(over, match) -> None:
    with pytest.raises(AttentionInputError, match=match):
        check_inputs(**_inputs(**over))


def test_content_and_kernel_errors() -> None:
    table = torch.tensor([[0, 1, 2, 3], [4, 10, -1, -1]], dtype=torch.int32)
    with pytest.raises(AttentionInputError, match="request 1: page table entry 1 = 10 out of range"):
        validate_contents(table, torch.tensor([64, 20], dtype=torch.int32), 8, 16, 10)
    with pytest.raises(AttentionInputError, match="exceeds the block table's capacity 64"):
        validate_contents(table, torch.tensor([65, 8], dtype=torch.int32), 8, 16, 10)
    with pytest.raises(AttentionInputError, match="shorter than the 8 query rows"):
        validate_contents(table, torch.tensor([7, 8], dtype=torch.int32), 8, 16, 10)
    validate_contents(table, torch.tensor([64, 16], dtype=torch.int32), 8, 16, 10)  # unused -1 entries are fine
    with pytest.raises(AttentionInputError, match="no sm_90 attention kernel for 12 query / 1 KV heads"):
        select_kernel(90, 12, 1, 256, "fp16", 16)
    with pytest.raises(AttentionInputError, match="page 8"):
        select_kernel(70, 6, 1, 256, "fp16", 8)
    with pytest.raises(AttentionInputError, match="CUDA tensors"):
        paged_verify_attention(**_inputs())


def test_cpu_dispatch_is_the_reference() -> None:
    cache = PagedKVCache(16, 4, 1, 256, max_requests=2, max_blocks_per_request=8, dtype=torch.float8_e4m3fn,
                         k_scale=0.1)
    g = torch.Generator().manual_seed(1)
    for r, n in enumerate((9, 20)):
        cache.append(r, torch.randn(n, 1, 256, generator=g), torch.randn(n, 1, 256, generator=g))
    q = torch.randn(2, 8, 6, 256, generator=g)
    assert torch.equal(verify_attention(q, cache, [0, 1]), verify_attention_reference(q, cache, [0, 1]))
    with pytest.raises(AttentionInputError, match="CUDA tensors"):
        verify_attention(q, cache, [0, 1], backend="kernel")
    kc = torch.zeros(2, 32, 1, 256, dtype=torch.float16)
    assert dense_verify_attention(q, kc, kc, torch.tensor([9, 20])) is None  # CPU: the caller's reference


# --- fragment data flow: the header's shared-memory addressing driven through models of ldmatrix and
# the MMA fragment layouts (PTX ISA for m16n8k16; CuTe's SM70 TN / TT layouts for m8n8k4) ----------

def _swz(row: int, chunk: int, chunks: int) -> int:
    return row * chunks + (chunk ^ (row & 7))


def _store_tile(x: torch.Tensor) -> torch.Tensor:
    """A [rows, D] tile as the kernel lays it out: 16-byte chunks swizzled per row (flat halves)."""
    rows, d = x.shape
    flat = torch.zeros(rows * d)
    for r in range(rows):
        for c in range(d // 8):
            flat[8 * _swz(r, c, d // 8):8 * _swz(r, c, d // 8) + 8] = x[r, 8 * c:8 * c + 8]
    return flat


def _ldsm(flat: torch.Tensor, addrs: list[int], trans: bool = False) -> list[list[tuple[float, float]]]:
    """ldmatrix.x4: lane 8m + r gives row r of matrix m (8 halves at addrs[lane]); returns per lane
    the four 32-bit registers as (lo, hi) pairs."""
    mats = [torch.stack([flat[addrs[8 * m + r]:addrs[8 * m + r] + 8] for r in range(8)]) for m in range(4)]
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        regs = []
        for m in mats:
            mm = m.T if trans else m
            regs.append((float(mm[g, 2 * t]), float(mm[g, 2 * t + 1])))
        out.append(regs)
    return out


def _mma16816(a: list, b: list, c: torch.Tensor) -> None:
    """c [32 lanes, 4] += A (16x16) B (16x8) with A, B rebuilt from the lanes' fragments."""
    A, B = torch.zeros(16, 16), torch.zeros(16, 8)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col], A[row, col + 1] = a[lane][reg]
        for reg, k in enumerate([2 * t, 2 * t + 8]):
            B[k, g], B[k + 1, g] = b[lane][reg]
    C = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane] += torch.tensor([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])


def test_sm80_fragment_dataflow() -> None:
    """AttnSm80::qk / pv addressing (transliterated) computes Q K^T and P V exactly."""
    t_, d, r0 = 32, 64, 16  # D reduced to 64 to keep it quick: the formulas do not depend on D
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randint(-3, 4, s, generator=g).float() for s in ((48, d), (t_, d), (t_, d)))
    sq, sk, sv = _store_tile(q), _store_tile(k), _store_tile(v)
    ch = d // 8
    s = torch.zeros(32, t_ // 8, 4)
    for kk in range(d // 16):
        a = _ldsm(sq, [8 * _swz(r0 + (ln & 7) + 8 * ((ln >> 3) & 1), 2 * kk + (ln >> 4), ch) for ln in range(32)])
        for j in range(t_ // 16):
            b = _ldsm(sk, [8 * _swz(16 * j + (ln & 7) + 8 * (ln >> 4), 2 * kk + ((ln >> 3) & 1), ch)
                           for ln in range(32)])
            _mma16816(a, [x[0:2] for x in b], s[:, 2 * j])
            _mma16816(a, [x[2:4] for x in b], s[:, 2 * j + 1])
    assert torch.equal(_sm80_tile(s), q[r0:r0 + 16] @ k.T)
    p_ld = t_ + 8
    p = torch.randint(-3, 4, (16, t_), generator=g).float()
    sp = torch.zeros(16 * p_ld)
    for r in range(16):
        sp[r * p_ld:r * p_ld + t_] = p[r]
    o = torch.zeros(32, d // 8, 4)
    for ks in range(t_ // 16):
        a = _ldsm(sp, [((ln & 7) + 8 * ((ln >> 3) & 1)) * p_ld + 16 * ks + 8 * (ln >> 4) for ln in range(32)])
        for j in range(d // 16):
            b = _ldsm(sv, [8 * _swz(16 * ks + (ln & 7) + 8 * ((ln >> 3) & 1), 2 * j + (ln >> 4), ch)
                           for ln in range(32)], trans=True)
            _mma16816(a, [x[0:2] for x in b], o[:, 2 * j])
            _mma16816(a, [x[2:4] for x in b], o[:, 2 * j + 1])
    assert torch.equal(_sm80_tile(o), p @ v)


def test_sm70_fragment_dataflow() -> None:
    """AttnSm70::qk / pv addressing with m8n8k4 per quad-pair (CuTe: TN A row i / B column i, 4 K;
    TT B row k = i % 4, columns 4 (i / 4) ..; SM70_8x8_32b accumulators) computes Q K^T and P V."""
    t_, d, r0 = 32, 64, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randint(-3, 4, s, generator=g).float() for s in ((48, d), (t_, d), (t_, d)))
    sq, sk, sv = _store_tile(q), _store_tile(k), _store_tile(v)
    ch = d // 8

    def ld4(flat: torch.Tensor, row: int, e: int) -> torch.Tensor:
        base = 8 * _swz(row, e >> 3, ch) + (e & 7)
        return flat[base:base + 4]

    def lanes(qp: int) -> list[tuple[int, int]]:  # (lane, logical thread i) of quad-pair qp
        return [(4 * qp + (i & 3) + 16 * (i >> 2), i) for i in range(8)]

    def crow(i: int, e: int) -> int:
        return (i & 1) + 2 * ((e >> 1) & 1) + 4 * (i >> 2)

    def ccol(i: int, e: int) -> int:
        return 2 * ((i >> 1) & 1) + (e & 1) + 4 * (e >> 2)

    s = torch.zeros(16, t_)
    for qp in range(4):
        rb, tb0 = qp & 1, qp >> 1
        for j in range(t_ // 16):
            acc = torch.zeros(8, 8)  # the QP's 8x8 block, via its fragments
            for kd in range(d // 4):
                A, B = torch.zeros(8, 4), torch.zeros(4, 8)
                for _, i in lanes(qp):
                    A[i] = ld4(sq, r0 + 8 * rb + i, 4 * kd)
                    B[:, i] = ld4(sk, 8 * (tb0 + 2 * j) + i, 4 * kd)
                acc += A @ B
            for _, i in lanes(qp):
                for e in range(8):
                    s[8 * rb + crow(i, e), 8 * (tb0 + 2 * j) + ccol(i, e)] = acc[crow(i, e), ccol(i, e)]
    assert torch.equal(s, q[r0:r0 + 16] @ k.T)
    p = torch.randint(-3, 4, (16, t_), generator=g).float()
    o = torch.zeros(16, d)
    for qp in range(4):
        rb, db0 = qp & 1, qp >> 1
        for n in range(d // 16):
            acc = torch.zeros(8, 8)
            for kt in range(t_ // 4):
                A, B = torch.zeros(8, 4), torch.zeros(4, 8)
                for _, i in lanes(qp):
                    A[i] = p[8 * rb + i, 4 * kt:4 * kt + 4]
                    col = 8 * (db0 + 2 * n) + 4 * (i >> 2)
                    B[i % 4, 4 * (i // 4):4 * (i // 4) + 4] = ld4(sv, 4 * kt + (i & 3), col)
                acc += A @ B
            for ln, i in lanes(qp):
                for e in range(8):
                    row, col = _sm70_acc(ln, n, e)
                    assert (row, col) == (8 * rb + crow(i, e), 8 * (db0 + 2 * n) + ccol(i, e))
                    o[row, col] = acc[crow(i, e), ccol(i, e)]
    assert torch.equal(o, p @ v)


def test_bench_markdown_renders_a_report() -> None:
    from dflashgen.attn_bench import markdown

    row = {"heads": "tp4", "hq": 6, "hkv": 1, "ctx": 1024, "B": 2, "ours_us": 10.0, "roofline_frac": 0.5,
           "best_schedule_frac": 0.6, "per_request_us": 12.0, "sdpa_flash_us": 11.0, "sdpa_flash_mask": "causal",
           "sdpa_efficient_us": None, "sdpa_efficient_error": "no GQA", "best_baseline": "sdpa_flash_us",
           "speedup_vs_best": 1.1, "schedules": {"dfg_attn_x": 10.0, "dfg_attn_y": 12.5}, "default": "dfg_attn_x"}
    row16 = {**row, "ctx": 16384, "roofline_us": 5.0}
    md = markdown({"gpu": "H200", "kernel_arch": 90, "page": 16, "nq": 8, "head_dim": 256, "read_GBps": 4300.0,
                   "seconds": 30.0, "rows": [row, row16]})
    assert "| tp4 (6/1) | 1024 | 2 | 10.0 | default | 50% | 60% | 12.0 | 11.0 | n/a | sdpa_flash_us | x1.10 |" in md
    deep = markdown({"gpu": "H200", "kernel_arch": 90, "page": 16, "nq": 8, "head_dim": 256, "read_GBps": 4300.0,
                     "seconds": 30.0, "rows": [{**row, "ours_kernel": "dfg_attn_y"}]})
    assert "| tp4 (6/1) | 1024 | 2 | 10.0 | deep | 50% |" in deep  # the runtime served the deep twin here
    assert "no GQA" in md and "`dfg_attn_x`" in md
    # The race summary: y is 1.25x the default at both points, slower than SDPA flash (11 us) at both.
    assert "| tp4 | `dfg_attn_x` | 1.00 | 1.00 | 2/2 | 0/2 | 50% |" in md
    assert "| tp4 | `dfg_attn_y` | 1.25 | 1.25 | 0/2 | 2/2 | 40% |" in md
    assert "Split rule effect" not in md  # the default has no rule: no twin to compare with
    ruled = {**row, "default": "dfg_attn_x_sp128_le2048s32", "schedules": {"dfg_attn_x_sp128_le2048s32": 10.0,
                                                                          "dfg_attn_x_sp128": 20.0}}
    md = markdown({"gpu": "H200", "kernel_arch": 90, "page": 16, "nq": 8, "head_dim": 256, "read_GBps": 4300.0,
                   "seconds": 30.0, "rows": [ruled]})
    assert "| tp4 | 1024 | 2 | 10.0 | 20.0 | 0.50 | 11.0 |" in md


class _Recorder:
    """Stands in for a loaded kernel's two functions: records each launch."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.pdls: list[bool] = []
        self.pdl = True  # as _Launcher sets it for a sm_90 build
        self.main, self.merge = self._fn("main"), self._fn("merge")

    def _fn(self, which: str):
        rec = self

        class Fn:
            def launch(self, grid, block, args, stream, shared=0, pdl=False) -> None:
                rec.calls.append((which, grid, block, [getattr(a, "value", a) for a in args], shared))
                rec.pdls.append(pdl)

        return Fn()


def _stub_launches(monkeypatch, ak) -> _Recorder:
    """attention_kernel's launches on the CPU: a sm_90 arch, stream 0, launches recorded by the result."""
    rec = _Recorder()
    monkeypatch.setattr(ak, "_require_cuda", lambda q: None)
    monkeypatch.setattr(ak, "kernel_arch", lambda dev, arch=None: 90)
    monkeypatch.setattr(ak, "_stream", lambda dev: (0, 0))
    monkeypatch.setattr(ak, "_launcher", lambda entry, idx: rec)
    monkeypatch.setattr(ak, "_err_flag", lambda idx: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(ak, "_sm_count", lambda idx: 1)  # a one-SM GPU: the served schedule, never its deep twin
    return rec


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_launch_arguments(monkeypatch, dtype) -> None:
    """The host side of a launch with the driver stubbed: grid, block, shared memory, strides of an
    interleaved pool, the folded softmax / FP8 scales, and the capacity the kernels check against."""
    import dflashgen.runtime.attention_kernel as ak

    rec = _stub_launches(monkeypatch, ak)
    kv = torch.zeros(10, 2, 16, 1, 256, dtype=dtype)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]], dtype=torch.int32)
    out = ak.paged_verify_attention(torch.zeros(2, 8, 6, 256), kv[:, 0], kv[:, 1], tables,
                                    torch.tensor([64, 20], dtype=torch.int32), k_scale=0.5, v_scale=0.25)
    assert out.shape == (2, 8, 6, 256) and out.dtype == torch.float32
    e = select_kernel(90, 6, 1, 256, ak.KV_TAG[dtype], 16)
    (w1, grid, block, a, smem), (w2, mgrid, mblock, m, _) = rec.calls
    assert rec.pdls == [True, True]  # both functions with programmatic serialization (the launcher's flag)
    splits = ak.entry_rule(e).max_splits(64)  # the rule's most splits up to the table's 64 tokens
    assert splits == max(ak.entry_rule(e).splits(n) for n in range(1, 65))
    # (row parts x KV heads, requests, splits): the split index varies slowest (working CTAs first)
    assert (w1, grid, block, smem) == ("main", (1, 2, splits), (e["threads"], 1, 1), e["smem"])
    assert (w2, mgrid, mblock) == ("merge", (48, 1, 2), (64, 1, 1))
    assert a[3] - a[2] == 16 * 256 * kv.element_size() and a[4] == 2 * 16 * 256  # V half, block stride
    unit = 256 if dtype != torch.float16 else 1  # E4M3 decodes to value * 2^-8
    assert a[9] == pytest.approx(0.5 * unit / 16 * 1.4426950408889634) and a[12] == splits
    assert m[4] == 64 and m[5] == splits and m[6] == pytest.approx(0.25 * unit)


class _FakeTmaDriver:
    """cuda.bindings.driver with cuTensorMapEncodeTiled recorded: each map's 128 bytes are 16 words
    of its call number (so a copy can be told from another), the real enums otherwise."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self._real = driver
        self.calls: list[tuple] = []
        self._maps: list = []

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def cuTensorMapEncodeTiled(self, *args):  # noqa: N802 (the driver's name)
        import ctypes

        self.calls.append(args)
        buf = (ctypes.c_uint64 * 16)(*([len(self.calls)] * 16))
        self._maps.append(buf)

        class Map:
            def getPtr(self) -> int:  # noqa: N802
                return ctypes.addressof(buf)

        return (self._real.CUresult.CUDA_SUCCESS, Map())


def test_tma_launch_passes_the_pools_tensor_maps(monkeypatch) -> None:
    """A tma: 1 kernel gets the K and V pools' tensor maps after the other parameters (none for the
    others): 4-d (D, Hkv, page, blocks) FP16 maps with the pools' byte strides (an interleaved pool's
    block stride), a box of one 64-column atom x one head x one page, 128-byte swizzle, zero fill;
    built once per pool (cached by address, shape, strides, dtype) and copied into the launch."""
    import ctypes

    import dflashgen.runtime.attention_kernel as ak
    import dflashgen.runtime.driver as drv

    fake = _FakeTmaDriver()
    monkeypatch.setattr(drv, "cu", lambda: fake)
    monkeypatch.setattr(ak, "_TMAPS", {})
    rec = _stub_launches(monkeypatch, ak)
    kv = torch.zeros(10, 2, 16, 1, 256, dtype=torch.float16)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]], dtype=torch.int32)
    name = next(s.name for s in af.specs() if s.tma and s.hkv == 1 and s.stages == 3)

    def launch(kernel):
        rec.calls.clear()
        ak.paged_verify_attention(torch.zeros(2, 8, 6, 256), kv[:, 0], kv[:, 1], tables,
                                  torch.tensor([64, 20], dtype=torch.int32), kernel=kernel)
        return rec.calls[0]

    _, _, block, args, smem = launch(name)
    e = select_kernel(90, 6, 1, 256, "fp16", 16, name)
    assert e["tma"] == 1 and block == (160, 1, 1) and smem == e["smem"] and len(args) == 16
    kmap, vmap = args[14:]
    assert isinstance(kmap, drv.TensorMapArg) and isinstance(vmap, drv.TensorMapArg)
    assert list(kmap.opaque) == [1] * 16 and list(vmap.opaque) == [2] * 16  # the maps' bytes, in order
    assert len(fake.calls) == 2
    for call, pool in zip(fake.calls, (kv[:, 0], kv[:, 1]), strict=True):
        dtype, rank, addr, dims, strides, box, estr, inter, swz, l2, oob = call
        assert dtype == fake.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16 and rank == 4
        assert addr == pool.data_ptr()
        assert [int(x) for x in dims] == [256, 1, 16, 10]  # D, Hkv, page, blocks (innermost first)
        assert [int(x) for x in strides] == [512, 512, 2 * 16 * 256 * 2]  # bytes; the interleaved block stride
        assert [int(x) for x in box] == [64, 1, 16, 1] and [int(x) for x in estr] == [1] * 4
        assert swz == fake.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
        assert inter == fake.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
        assert oob == fake.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE  # zeros outside
    # cached: the same pools encode nothing new; the kernel's parameters are the cached bytes
    args2 = launch(name)[3]
    assert len(fake.calls) == 2 and list(args2[14].opaque) == [1] * 16
    # the cp.async twin (same rule) takes no maps
    twin = next(s.name for s in af.specs() if s.wg and not s.tma and s.hkv == 1 and s.short and s.kv == "fp16"
                and s.stages == 2 and s.tile == 32 and s.kvg == 1 and s.split == e["split"]
                and [list(t) for t in s.short] == e["short"])
    assert len(launch(twin)[3]) == 14 and len(fake.calls) == 2
    # a new pool (another address) gets its own maps
    kv = torch.zeros(12, 2, 16, 1, 256, dtype=torch.float16)
    launch(name)
    assert len(fake.calls) == 4 and [int(x) for x in fake.calls[2][3]] == [256, 1, 16, 12]
    assert ctypes.sizeof(drv.TensorMapArg) == 128
    with pytest.raises(AttentionInputError, match="FP16"):
        ak.pool_tensor_map(torch.zeros(4, 16, 1, 256, dtype=torch.float8_e4m3fn))


def test_dense_cache_chunks_prefill_into_verify_blocks(monkeypatch) -> None:
    import dflashgen.runtime.attention_kernel as ak

    seen = []

    def fake(q, kp, vp, table, lens, **kw):
        seen.append((tuple(q.shape), tuple(kp.shape), table[1, :2].tolist(), lens.tolist()))
        return torch.zeros(q.shape)

    monkeypatch.setattr(ak, "kernel_supported", lambda *a: True)
    monkeypatch.setattr(ak, "paged_verify_attention", fake)
    kc = torch.zeros(2, 64, 4, 256, dtype=torch.float16)
    out = ak.dense_verify_attention(torch.zeros(2, 20, 24, 256), kc, kc, torch.tensor([20, 50]))
    assert out is not None and out.shape == (2, 20, 24, 256)
    # [B, max_len] viewed as 16-token pages, request b owning pages 4b..4b+3; 8-row chunks of the 20
    # queries end at positions length - 12, length - 4 and length.
    assert seen == [((2, 8, 24, 256), (8, 16, 4, 256), [4, 5], [8, 38]),
                    ((2, 8, 24, 256), (8, 16, 4, 256), [4, 5], [16, 46]),
                    ((2, 4, 24, 256), (8, 16, 4, 256), [4, 5], [20, 50])]


def test_served_schedule_preference_list(monkeypatch) -> None:
    """default_for may list schedules in preference order: each (KV dtype, page) is served by the first
    one built for it. The sm_90 wgmma schedule serves FP16 KV with 16-token pages; FP8 KV and 4-token
    pages fall through to the mma.sync schedule; a list with nothing for a (dtype, page) is an error."""
    sch = af.load_schedule()
    served = {(s.hkv, s.kv, s.page): s for s in af.specs() if s.default and s.arch == 90}
    assert {k[0] for k in served} == {hkv for _, hkv in TARGET_HEADS}
    for (_, kv, page), s in served.items():
        assert bool(s.wg) == (kv == "fp16" and page == 16), s.name
        assert s.short  # every served schedule carries the split rule
    assert served[(4, "fp16", 4)].ds == 2 and served[(1, "fp16", 4)].ds == 1  # the mma.sync fallbacks
    only_wg = copy.deepcopy(sch)
    only_wg["archs"][90]["default_for"] = {4: [{"tile": 32, "stages": 2, "wg": 1}], 1: {"tile": 32, "stages": 2}}
    monkeypatch.setattr(af, "load_schedule", lambda: only_wg)
    with pytest.raises(af.AttnScheduleError, match="no served schedule builds fp16 KV with 4-token pages"):
        af.specs()


def test_wgmma_default_can_be_switched_off(monkeypatch) -> None:
    """DFLASHGEN_ATTN_WG=0 serves a default wgmma kernel's mma.sync fallback (built, same split rule);
    schedules without a wgmma default are unaffected."""
    for hq, hkv in TARGET_HEADS:
        monkeypatch.delenv("DFLASHGEN_ATTN_WG", raising=False)
        wg = select_kernel(90, hq, hkv, 256, "fp16", 16)
        fp8 = select_kernel(90, hq, hkv, 256, "e4m3", 16)
        assert wg.get("wg") == 1 and wg["fallback"] and "fallback" not in fp8
        monkeypatch.setenv("DFLASHGEN_ATTN_WG", "0")
        mma = select_kernel(90, hq, hkv, 256, "fp16", 16)
        assert mma["name"] == wg["fallback"] and not mma.get("wg") and not mma["default"]
        assert (mma["split"], mma["short"]) == (wg["split"], wg["short"])  # same split boundaries
        assert select_kernel(90, hq, hkv, 256, "e4m3", 16) == fp8


def test_wgmma_kernel_takes_row_parts() -> None:
    """hs: 3 row parts of the wgmma kernel (16 of the 48 rows per CTA, padded to the wgmma M): legal,
    raced as an extra beside its hs = 1 twin (the same tile, stages, token groups and split: the GPU
    test of work-placement twins then holds it bitwise to that twin), never served by default."""
    af.check(_wg_spec(hs=3), 232448)
    af.check(_wg_spec(hq=6, hkv=1, split=256, hs=3), 232448)
    specs = af.specs()
    for hq, hkv in TARGET_HEADS:
        hs3 = [s for s in specs if s.wg and s.hs == 3 and (s.hq, s.hkv) == (hq, hkv)]
        assert hs3 and not any(s.default for s in hs3)
        for s in hs3:
            twin = [t for t in specs if t.wg and t.hs == 1 and (t.hq, t.hkv, t.tile, t.stages, t.kvg, t.split, t.short)
                    == (s.hq, s.hkv, s.tile, s.stages, s.kvg, s.split, s.short)]
            assert twin and "_hs3_" in s.name and s.smem == twin[0].smem


def test_pdl_launch_only_for_sm90_builds(monkeypatch) -> None:
    """Programmatic serialization only for builds that execute griddepcontrol.wait (sm_90): the
    compute_70 PTX served on any GPU has no wait, so it must launch plainly; DFLASHGEN_PDL=0 turns it off."""
    import dflashgen.runtime.attention_kernel as ak

    monkeypatch.delenv("DFLASHGEN_PDL", raising=False)
    assert ak.pdl_launch({"arch": 90}) and not ak.pdl_launch({"arch": 80}) and not ak.pdl_launch({"arch": 70})
    monkeypatch.setenv("DFLASHGEN_PDL", "0")
    assert not ak.pdl_launch({"arch": 90})


def test_attention_kernels_wait_before_touching_memory() -> None:
    """Every rendered attention kernel (main and merge) waits for its predecessor before anything
    else: the runtime launches sm_90 builds with programmatic serialization, and a kernel that read
    or wrote before the wait would race the previous kernel in the stream."""
    src = (Path(__file__).resolve().parents[1] / "templates" / "verify_attention.cu.j2").read_text()
    bodies = src.split("extern \"C\" __global__")[1:]
    assert len(bodies) == 2
    for body in bodies:
        code = body[body.index("{") + 1:]
        first_use = min(code.index(x) for x in ("Attn::run", "Attn::merge") if x in code)
        assert "dflashgen::pdl_wait();" in code[:first_use]



def test_deep_twin_serves_batches_that_fit_one_cta_per_sm(monkeypatch) -> None:
    """A served wg schedule names its deep twin (deep_for: more stages, the same bitwise key), and the
    launcher serves the twin exactly when B x KV heads x splits at the table's capacity fit one CTA per
    SM: decided from the host-side shapes only (a CUDA graph captures one kernel), the served schedule
    for larger batches or longer tables, for explicit kernels, and under DFLASHGEN_ATTN_DEEP=0."""
    import dflashgen.runtime.attention_kernel as ak

    served = {s.name: s for s in af.specs() if s.default and s.deep}
    assert {(s.hkv, s.kv, s.page) for s in served.values()} == {(hkv, "fp16", 16) for _, hkv in TARGET_HEADS}
    by_name = {s.name: s for s in af.specs()}
    for s in served.values():
        twin = by_name[s.deep]
        assert af.bitwise_key(twin) == af.bitwise_key(s) and twin.stages > s.stages and not twin.default
    rec = _stub_launches(monkeypatch, ak)
    monkeypatch.setattr(ak, "_sm_count", lambda idx: 132)
    e = select_kernel(90, 24, 4, 256, "fp16", 16)
    rule = ak.entry_rule(e)

    def launched(nb: int, cap: int, **kw) -> str:
        kv = torch.zeros(nb * cap // 16, 2, 16, 4, 256, dtype=torch.float16)
        tables = torch.arange(nb * cap // 16, dtype=torch.int32).view(nb, cap // 16)
        rec.calls.clear()
        ak.paged_verify_attention(torch.zeros(nb, 8, 24, 256), kv[:, 0], kv[:, 1], tables,
                                  torch.full((nb,), cap, dtype=torch.int32), **kw)
        (_, _, block, _, smem), _ = rec.calls
        return next(n for n, x in ((n, x) for n, x in by_name.items() if x.key() == by_name[e["name"]].key())
                    if x.smem == smem and x.threads == block[0] and n in (e["name"], e["deep"]))

    assert 4 * rule.splits(16384) <= 132 < 8 * rule.splits(16384)
    assert launched(1, 16384) == e["deep"]  # 128 CTAs: one per SM
    assert launched(2, 16384) == e["name"]  # 256: two per SM on the served ring
    assert launched(1, 32768) == e["name"]
    assert launched(1, 16384, kernel=e["name"]) == e["name"]
    monkeypatch.setenv("DFLASHGEN_ATTN_DEEP", "0")
    assert launched(1, 16384) == e["name"]
