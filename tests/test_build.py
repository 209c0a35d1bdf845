"""Toolchain and build: every committed sm_70 kernel compiles with NVRTC + ptxas 12.9 (pip wheels)
with zero spills; rebuilds do no work; concurrent builds are safe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflashgen.build import build, cache_root
from dflashgen.render import all_entries, load_manifest
from dflashgen.toolchain import parse_ptxas_log, plan_for

SMALL = "dfg_sm70_nvfp4_store_n4120_k5120_.*_r8_"  # the fused GDN TP4 shard: one small kernel


def test_sm70_uses_the_pip_cuda12_toolchain() -> None:
    plan = plan_for(70)
    assert plan.frontend == "nvrtc" and "12." in plan.version


@pytest.mark.slow
def test_every_committed_sm70_kernel_compiles_without_spills() -> None:
    res = build([70], progress=False)
    rows = res.resources()
    committed = [k for k in all_entries(load_manifest()) if k["arch"] == 70]  # GEMMs + kernel families
    assert len(rows) == len(committed) >= 50
    spills = {n: r for n, r in rows.items() if r["spill_stores"] or r["spill_loads"]}
    assert not spills, f"kernels spill: {sorted(spills)[:5]}"
    record = json.loads((res.build_dir / "sm_70" / "record.json").read_text())
    assert all(record["kernels"][n]["resources"]["registers"] > 0 for n in rows)
    gemms = {k["name"] for k in load_manifest()["kernels"]}
    for a in res.artifacts.values():
        assert a.name not in gemms or "mma.sync.aligned.m8n8k4" in a.ptx.read_text()
    again = build([70], progress=False)
    assert again.steps == 0, "a rebuild with nothing changed must do no work"


def test_concurrent_builds_share_one_cache(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from dflashgen.build import build; "
            f"r = build([70], only={SMALL!r}, build_dir=Path(sys.argv[1]), progress=False); "
            "print(len(r.artifacts))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert int(out.strip().splitlines()[-1]) >= 1
    res = build([70], only=SMALL, build_dir=tmp_path, progress=False)
    assert res.steps == 0
    assert not list(tmp_path.rglob("*.tmp")), "no partial outputs left behind"


def test_prebuilt_kernels_are_used_without_a_toolchain(tmp_path: Path, monkeypatch) -> None:
    build([70], only=SMALL, build_dir=tmp_path, progress=False)
    import dflashgen.build as b
    from dflashgen.toolchain import ToolchainError

    def no_toolchain(arch: int, prefer: str = "auto"):
        raise ToolchainError("no CUDA 12 here")

    monkeypatch.setattr(b, "plan_for", no_toolchain)
    res = b.build([70], only=SMALL, build_dir=tmp_path, progress=False)
    assert res.toolchains == {70: "prebuilt"} and res.artifacts
    (tmp_path / "sm_70" / "record.json").write_text("{not json")
    with pytest.raises(ToolchainError, match="corrupt build record"):
        b.build([70], only=SMALL, build_dir=tmp_path, progress=False)


def test_parse_ptxas_log() -> None:
    log = """ptxas info    : Compiling entry function 'k1' for 'sm_70'
ptxas info    : Function properties for k1
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]
"""
    assert parse_ptxas_log(log) == {"k1": {"registers": 96, "spill_stores": 4, "spill_loads": 4, "smem": 4096}}


def test_cache_root_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DFLASHGEN_CACHE", str(tmp_path))
    assert cache_root() == tmp_path


def test_x_smem_kernel_compiles_without_spills_on_sm90(tmp_path: Path) -> None:
    from dflashgen.toolchain import nvcc_supports

    if not nvcc_supports(90):
        pytest.skip("no system nvcc for sm_90")
    # warp_nt = 2 tiles (two weight tiles per B fragment) with a 2-deep weight ring: registers for
    # >= 2 CTAs per SM (the space's x_smem_tiles list says how many)
    names = {"dfg_sm90_nvfp4_store_n34816_k5120_sk1_wk2_kg64_r64_nt1_wn4_st3_xa0_xs1_mb1": 255,
             "dfg_sm90_nvfp4_store_n34816_k5120_sk1_wk2_kg64_r32_nt2_wn4_st2_xa0_xs1_mb1": 128,
             "dfg_sm90_fp8_silu_n34816_k5120_sk1_wk2_kg32_r64_nt2_wn2_st2_xa0_xs1_mb1": 168}
    res = build([90], only="^(" + "|".join(names) + ")$", build_dir=tmp_path, progress=False)
    rec = json.loads((tmp_path / "sm_90" / "record.json").read_text())["kernels"]
    for name, max_regs in names.items():
        r = rec[name]["resources"]
        assert name in res.artifacts and r["spill_stores"] == 0 and r["spill_loads"] == 0
        assert r["registers"] <= max_regs, (name, r)


def test_wgmma_kernels_compile_for_sm90a_without_spills(tmp_path: Path) -> None:
    """The wgmma K plan's kernels (HGMMA, sm_90a): built for the arch-specific target, no spills, and
    no ptxas wgmma-serialization warnings (C75xx: ptxas inserted waits between the wgmmas)."""
    from dflashgen.toolchain import nvcc_supports

    if not nvcc_supports(90):
        pytest.skip("no system nvcc for sm_90")
    names = ["dfg_sm90_nvfp4_store_n34816_k5120_sk1_wk1_kg64_wg1_r64_nt1_wn4_st3_xa0_xs1_mb1",
             "dfg_sm90_fp8_silu_n34816_k5120_sk1_wk2_kg32_wg1_r8_nt1_wn4_st3_xa0_xs1_mb1"]
    res = build([90], only="^(" + "|".join(names) + ")$", build_dir=tmp_path, progress=False)
    rec = json.loads((tmp_path / "sm_90" / "record.json").read_text())["kernels"]
    for name in names:
        r = rec[name]["resources"]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0
        art = res.artifacts[name]
        log = art.log.read_text()
        assert "for 'sm_90a'" in log and "C75" not in log, log
        assert ".target sm_90a" in art.ptx.read_text()


def test_wgmma_kernel_compiles_with_the_pip_toolchain(tmp_path: Path) -> None:
    """NVRTC 12.9 + ptxas 12.9 from the wheels (machines without a system nvcc) take the sm_90a target."""
    name = "dfg_sm90_fp8_store_n14336_k5120_sk1_wk2_kg32_wg1_r8_nt1_wn4_st3_xa0_xs1_mb1"
    res = build([90], only=f"^{name}$", build_dir=tmp_path, progress=False, prefer="nvrtc")
    art = res.artifacts[name]
    log = art.log.read_text()
    assert "for 'sm_90a'" in log and "C75" not in log and " 0 bytes spill stores" in log, log


def test_only_pattern_matching_nothing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--only 'no-such-kernel' matches no kernel for sm_70"):
        build([70], only="no-such-kernel", build_dir=tmp_path)
    assert not (tmp_path / "sm_70").exists()  # nothing half-written


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_carry_build_keeps_the_record_and_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/carry_build.py trims a build folder to the record and the files it lists for current
    kernels (losing the record once left the H200 unable to load any sm_70 PTX)."""
    mod = _tool("carry_build")
    b = tmp_path / "build"
    for d in ("sm_70/aa", "sm_70/old", "sm_90/x", "src"):
        (b / d).mkdir(parents=True)
    for f in ("sm_70/aa/k.ptx", "sm_70/aa/k.cubin", "sm_70/aa/k.ptxas.txt", "sm_70/aa/junk", "sm_70/old/o.ptx",
              "sm_90/x/y.cubin", "src/k.cu"):
        (b / f).write_text("x")
    k = {"source_sha256": "s1", "ptx": "sm_70/aa/k.ptx", "cubin": "sm_70/aa/k.cubin", "log": "sm_70/aa/k.ptxas.txt"}
    gone = {"source_sha256": "s0", "ptx": "sm_70/old/o.ptx", "cubin": "sm_70/old/o.ptx", "log": "sm_70/old/o.ptx"}
    rec = {"toolchain": "t", "kernels": {"k": k, "gone": gone}}
    (b / "sm_70/record.json").write_text(json.dumps(rec))
    monkeypatch.setattr(mod, "_entries", lambda arch: [{"name": "k", "source_sha256": "s1"}])
    mod.main(str(tmp_path))
    assert not b.exists()  # packed for the device tool's carry limit; tools/gpu_env.sh unpacks it
    import tarfile

    with tarfile.open(tmp_path / "build.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    (tmp_path / "build.tar.gz").unlink()
    left = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert left == ["sm_70/aa/k.cubin", "sm_70/aa/k.ptx", "sm_70/aa/k.ptxas.txt", "sm_70/record.json"]
    assert set(json.loads((b / "sm_70/record.json").read_text())["kernels"]) == {"k"}
    monkeypatch.setattr(mod, "_entries", lambda arch: [{"name": "k", "source_sha256": "s2"}])
    with pytest.raises(SystemExit, match="missing or stale"):
        mod.main(str(tmp_path))


def test_the_compiler_gets_the_headers_the_fingerprint_hashed(tmp_path: Path) -> None:
    """build.ninja hands the compile step the header folder the build hashed (--headers), so a
    kernel's content-keyed artifacts never come from other headers, e.g. when the editable install is
    re-pointed to another checkout while a build runs."""
    from dflashgen.build import _ninja_header
    from dflashgen.render import headers_dir
    from dflashgen.toolchain import include_dirs

    rules = "\n".join(_ninja_header())
    assert rules.count(f"--headers {headers_dir()}") == 2  # the NVRTC and the nvcc rule
    assert include_dirs(headers=tmp_path)[0] == tmp_path and include_dirs()[0] == headers_dir()


def test_ncu_stalls_ranks_sass_lines_by_stall_samples(tmp_path: Path, monkeypatch, capsys) -> None:
    """tools/ncu_stalls.py (NCU_SOURCE=1 on the GPU): finds its columns by name in an ncu source-page
    CSV, ranks the SASS lines by stall samples with their largest reasons, and sums them per opcode."""
    csv = tmp_path / "r.csv"
    csv.write_text(
        '==PROF== a line ncu prints first\n'
        '"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"stall_long_sb","stall_wait"\n'
        '"00a0","LDG.E.NA.128.CONSTANT R4, desc[UR6][R2.64]","10","9","0","10"\n'
        '"00b0","HMMA.16816.F32 R8, R4, R12, R8","1,200","100","20","1,180"\n'
        '"00c0","@!P0 F2FP.F16.E4M3.UNPACK_B R20, R4","300","280","290","10"\n')
    monkeypatch.setattr(sys, "argv", ["ncu_stalls.py", str(csv), "--top", "2"])
    _tool("ncu_stalls").main()
    out = capsys.readouterr().out
    assert "3 SASS lines, 1510 stall samples" in out
    assert out.index("HMMA 79.5%") < out.index("F2FP 19.9%") < out.index("LDG 0.7%")
    top = out.splitlines()[-2:]  # --top 2: HMMA first, with its largest reason first
    assert "HMMA" in top[0] and "stall_wait 1180" in top[0] and "F2FP" in top[1] and "LDG" not in out.split("\n\n")[-1]


def test_ncu_stalls_counts_mbarrier_retries(tmp_path: Path, monkeypatch, capsys) -> None:
    """tools/ncu_stalls.py: each mbarrier try-wait with its executions, the out-of-line retry loops
    (past the last EXIT) marked, and the retries' share of all executed instructions."""
    csv = tmp_path / "r.csv"
    csv.write_text(
        '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
        '"0010","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+0x19000], R2","5","100"\n'
        '"0020","@!P0 BRA 0x0040","1","100"\n'
        '"0030","EXIT","0","10"\n'
        '"0040","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+0x19000], R2","0","2,500"\n'
        '"0050","@!P0 BRA 0x0040","0","2,500"\n'
        '"0060","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+0x19040], R2","0","0"\n')
    monkeypatch.setattr(sys, "argv", ["ncu_stalls.py", str(csv)])
    _tool("ncu_stalls").main()
    waits = capsys.readouterr().out.split("mbarrier try-waits")[1].splitlines()
    assert "retries are 96.0% of executed instructions" in waits[0]  # 2 x 2500 of 5210
    assert waits[1].split()[:2] == ["inline", "100"] and waits[2].split()[:2] == ["retry", "2500"]
    assert len(waits) == 3  # a try-wait never executed is not listed


def test_build_command_names_spilling_kernels_and_fails_only_with_no_spills(monkeypatch, capsys) -> None:
    """`dflashgen build` lists spilling kernels; only `--no-spills` turns them into exit 1 (the main
    job times spilling sm_90 candidates like any other rather than stopping)."""
    import argparse

    import dflashgen.build as b
    from dflashgen import cli

    rows = {"k_clean": {"registers": 90, "spill_stores": 0, "spill_loads": 0, "smem": 0},
            "k_spill": {"registers": 96, "spill_stores": 120, "spill_loads": 112, "smem": 0}}

    class Fake:
        toolchains: dict = {}
        build_dir = Path("/nonexistent")
        steps = 0

        def resources(self) -> dict:
            return rows

    monkeypatch.setattr(b, "build", lambda *a, **k: Fake())
    ns = dict(arch=[90], only=None, jobs=None, toolchain="auto", verbose=False, quiet=True)
    assert cli._build(argparse.Namespace(no_spills=False, **ns)) == 0
    out = capsys.readouterr().out
    assert "kernels with spills: 1" in out and "k_spill 120/112" in out and "k_clean" not in out
    assert cli._build(argparse.Namespace(no_spills=True, **ns)) == 1
    rows["k_spill"].update(spill_stores=0, spill_loads=0)
    assert cli._build(argparse.Namespace(no_spills=True, **ns)) == 0


def test_tune_report_groups_every_timed_candidate(tmp_path: Path, monkeypatch, capsys) -> None:
    """tools/tune_report.py: per problem and M the served kernel, then the best of each group (K plan
    and tile kind) fastest first, and with --vs the other run's best of the same group."""
    import gzip

    p = "sm90/nvfp4/store/n5120/k6144"
    pre = "dfg_sm90_nvfp4_store_n5120_k6144_"
    k_zs = pre + "sk3_wk4_kg64_r64_nt1_wn8_st8_xa0_xs1_sw1_pw4_wc1_xr8_zs1_wsf1_mb1"
    k_mma = pre + "sk3_wk4_kg64_r16_nt2_wn2_st3_xa2_xs0_mb1"
    k_mma2 = pre + "sk3_wk4_kg64_r8_nt2_wn2_st3_xa1_xs0_mb2"
    k_wg = pre + "sk1_wk1_kg64_wg1_r16_nt1_wn4_st3_xa0_xs1_mb1"
    buckets = [{"m": 64, "kernel": k_zs, "us": 18.3, "baseline_us": 24.1, "path": "kernel"},
               {"m": 8, "kernel": k_mma2, "us": 8.0, "baseline_us": 16.0, "path": "kernel"}]
    timings = {k_zs: {"64": 18.3}, k_mma: {"64": 28.2, "8": 8.4}, k_mma2: {"64": 30.0, "8": 8.0}, k_wg: {"64": 40.0}}
    run = {"problems": {p: {"buckets": buckets, "timings_us": timings}}}
    old = {"problems": {p: {"buckets": [], "timings_us": {k_mma: {"64": 29.0}}}}}
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json"
    a.write_bytes(gzip.compress(json.dumps(run).encode()))
    b.write_text(json.dumps(old))
    monkeypatch.setattr(sys, "argv", ["tune_report.py", str(a), "--ms", "64", "--vs", str(b)])
    _tool("tune_report").main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 3  # header, rule, three groups at M = 64 (M = 8 left out)
    assert lines[2].startswith(f"| {p} | 64 | sk3_wk4_kg64_r64")
    assert "| 18.3 | 24.1 | sk3_wk4_kg64 wgc_wn8_zs1_wsf1 |" in lines[2]
    assert "| sk3_wk4_kg64 mma.sync | 28.2 | sk3_wk4_kg64_r16" in lines[3] and lines[3].endswith(" 29.0 |")
    assert "| sk1_wk1_kg64 wgmma | 40.0 |" in lines[4] and lines[4].endswith(" - |")


def test_bench_ab_compares_runs_by_label(tmp_path: Path, monkeypatch, capsys) -> None:
    """tools/bench_ab.py: per problem and M the base label's dispatched time (the baseline's where it
    falls back) and each other label's change in percent, same-label runs averaged; then the forward
    totals of every label."""
    p = "sm90/fp8_channel/store/n14336/k5120"

    def run(us8: float, us64: float, ms8: float) -> dict:
        return {"problems": {p: {"buckets": [
                    {"m": 8, "us": us8, "baseline_us": 40.0, "path": "kernel"},
                    {"m": 64, "us": 99.0, "baseline_us": us64, "path": "fallback"}]}},
                "forward_totals": [{"tp": 1, "deployment": "fp8", "m": 8, "dispatched_ms": ms8, "roofline_ms": 5.0}]}

    paths = []
    for i, r in enumerate((run(20.0, 30.0, 6.0), run(22.0, 30.0, 6.5), run(19.8, 31.5, 5.0))):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    monkeypatch.setattr(sys, "argv", ["bench_ab.py", f"off={paths[0]}", f"off={paths[1]}", f"pf={paths[2]}"])
    _tool("bench_ab").main()
    out = capsys.readouterr().out
    assert f"| {p} | 8 | 21.00 | -5.7 |" in out  # (20 + 22) / 2 -> 19.8
    assert f"| {p} | 64 | 30.00 | +5.0 |" in out  # the fallback's (baseline) time
    assert "| 1 | fp8 | 8 | 6.25 (80.0%) | 5.00 (100.0%) |" in out


def test_wgc_clock_probe_patches_the_headers_and_reads_its_stamps(tmp_path: Path) -> None:
    """tools/wgc_clock_probe.py: its stamps patch cleanly into a copy of the shipped kernel headers
    (the diff must follow skinny_gemm_pw.cuh), a served WGC tile compiles against that copy for
    compute_90a with the stamp buffers in it, and the analysis turns stamps of known spacing into
    those intervals (medians over the steady groups) and the CTAs' waves."""
    import numpy as np

    from dflashgen.render import render_kernel
    from dflashgen.toolchain import headers_dir, nvrtc_compile
    from dflashgen.tune import spec_of

    probe = _tool("wgc_clock_probe")
    inc = probe.probe_headers(tmp_path)
    patched = (inc / "dflashgen" / "skinny_gemm_pw.cuh").read_text()
    assert patched.count("DFG_STAMP(") >= 10 and "DFG_STAMP" not in (headers_dir() / "dflashgen" /
                                                                       "skinny_gemm_pw.cuh").read_text()
    man = json.loads((Path(__file__).parent.parent / "generated" / "manifest.json").read_text())
    name = "dfg_sm90_nvfp4_silu_n34816_k5120_sk1_wk2_kg64_r64_nt1_wn12_st8_xa0_xs1_sw1_pw4_wc1_xr8_wsf1_mb1"
    entry = next(e for e in man["kernels"] if e["name"] == name)
    cu = tmp_path / f"{name}.cu"
    cu.write_text(render_kernel(spec_of(entry)))
    nvrtc_compile(cu, tmp_path / "probe.ptx", "90a", headers=inc)
    ptx = (tmp_path / "probe.ptx").read_text()
    assert "dfg_probe_cta" in ptx and "%globaltimer" in ptx and "wgmma.mma_async" in ptx
    # stamps: group a of warpgroup g starts at 1000 a + 7 g; the steps 0..6 at fixed offsets
    offs = (0, 90, 140, 150, 165, 565, 645)
    clk = np.zeros((2, 8, 128, 8), dtype=np.uint64)
    for a in range(128):
        for g in range(3):
            clk[:, g, a, :7] = [1000 * a + 7 * g + o for o in offs]
        for p in range(4):
            clk[:, 4 + p, a, :3] = [1000 * a + 1, 1000 * a + 2001, 1000 * a + 2601]
    cta = np.zeros((2048, 4), dtype=np.uint64)
    n = 182  # the tile's CTAs at M = 64: two per SM on 50 SMs, the second wave starting at 40 us
    for i in range(n):
        cta[i] = (40_000 * (i >= 132), 40_000 * (i >= 132) + 39_000, i % 132, 0)
    r = probe.analyse(entry, clk, cta, 64)
    assert (r["ctas"], r["sms_used"], r["ctas_per_sm_max"]) == (182, 132, 2) and r["span_us"] == 79.0
    wg1 = r["cta_first"]["wg1"]
    assert (wg1["period"], wg1["issue"], wg1["wait_retire"], wg1["decode"], wg1["wait_xfull"], wg1["skew_vs_wg0"]) \
        == (1000, 90, 50, 400, 80, 7)
    assert r["cta_last"]["act2"] == {"wait_xempty": 2000, "store": 600, "period": 4000}


def test_trace_gaps_attributes_gpu_idle_to_the_launch_that_ended_it(tmp_path: Path, monkeypatch, capsys) -> None:
    """tools/trace_gaps.py: GPU busy is the union of overlapping kernels / copies; each idle gap is
    charged to the runtime call (by correlation id) whose GPU work ended it; --per divides."""
    import gzip
    import json

    def gpu(name: str, ts: float, dur: float, corr: int, cat: str = "kernel") -> dict:
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def call(name: str, corr: int) -> dict:
        return {"cat": "cuda_runtime", "name": name, "ts": 0.0, "dur": 1.0, "args": {"correlation": corr}}

    events = [gpu("k1<float>", 0, 10, 1), gpu("k2", 5, 10, 2),  # overlap: busy 0..15
              gpu("Memcpy HtoD", 40, 5, 3, "gpu_memcpy"),  # gap 15..40 (25 us), ended by the copy
              gpu("k1<float>", 47, 3, 4),  # gap 45..47 (2 us: under --min-us 3)
              gpu("k3", 60, 10, 5),  # gap 50..60 (10 us)
              call("cudaLaunchKernel", 1), call("cudaLaunchKernel", 2), call("cudaMemcpyAsync", 3),
              call("cudaLaunchKernel", 4), call("cudaGraphLaunch", 5), {"cat": "cpu_op", "name": "aten::mm", "ts": 1}]
    class Prof:  # what write_trace needs of a torch.profiler.profile
        def export_chrome_trace(self, p: str) -> None:
            Path(p).write_text(json.dumps({"traceEvents": events}))

    tg = _tool("trace_gaps")
    path = tmp_path / "t.json.gz"
    tg.write_trace(Prof(), path)
    assert gzip.decompress(path.read_bytes()) and not (tmp_path / "t.json").exists()  # gzip; the raw export gone
    span, busy, gaps = tg.gpu_gaps(tg.load_events(path))
    assert (span, busy, gaps) == (70, 33, [(15, 40), (45, 47), (50, 60)])
    causes = tg.gap_causes(tg.load_events(path), gaps, 3.0)
    assert causes == {"cudaMemcpyAsync -> Memcpy HtoD": 25, "cudaGraphLaunch -> k3": 10}
    monkeypatch.setattr(sys, "argv", ["trace_gaps.py", str(path), "--per", "2", "--compare", str(path)])
    tg.main()
    out = capsys.readouterr().out
    assert out.startswith("GPU span 0.035 ms, busy 0.01") and "(1 gaps >= 3 us) per 2" in out  # 70 / 33 us over 2
    assert "12.5 us  cudaMemcpyAsync -> Memcpy HtoD" in out
    k1 = next(line for line in out.splitlines() if line.startswith("k1 "))
    assert k1.split() == ["k1", "2", "6.5", "6.5", "|", "2", "6.5", "6.5"]  # 2 calls, 13 us / 2, mean 6.5


def test_artifacts_for_skips_an_arch_the_filter_does_not_name(tmp_path: Path, monkeypatch) -> None:
    """A GPU test filter naming sm_70 kernels only still runs on an sm_90 machine (session 42 lost a
    GPU test run to build() refusing the filter for the arch it named nothing of)."""
    from dflashgen.verify import artifacts_for

    monkeypatch.setenv("DFLASHGEN_CACHE", str(tmp_path))
    arts = artifacts_for([70, 90], 90, SMALL)
    assert arts and all(e["arch"] == 70 and kind == "ptx" and p.exists() for e, p, kind in arts.values())
    assert artifacts_for([70, 90], 90, "^no_such_kernel$") == {}


def test_chain_probe_layers_follow_the_model_at_any_tp_and_deployment() -> None:
    """tools/chain_probe.py's layers come from the model's projections: a GDN and an attention layer
    each run their own projections, then gate_up with SiLU and down, in forward order."""
    cp = _tool("chain_probe")
    fmt, gdn, attn = cp.layer_specs("qwen3.8-27b", 4, "fp8")
    assert fmt == "fp8_channel"
    assert [s[0] for s in gdn] == ["in_proj_qkvzba", "out_proj", "gate_up_proj+silu", "down_proj"]
    assert [s[0] for s in attn] == ["qkv_proj", "o_proj", "gate_up_proj+silu", "down_proj"]
    assert gdn[0][1:] == (4120, 5120, False) and attn[2][1:] == (8704, 5120, True)
    fmt1, gdn1, _ = cp.layer_specs("qwen3.8-27b", 1, "nvfp4")
    assert fmt1 == "nvfp4" and gdn1[3][1:] == (5120, 17408, False)


def test_kernels_sharing_a_translation_unit_get_the_ptx_of_a_lone_compile(tmp_path: Path) -> None:
    """Missing GEMM kernels compile as shared units (one header parse), then split per kernel: each
    kernel's module must be what compiling it alone gives, so sharing a unit changes no kernel."""
    from dflashgen.render import generated_dir
    from dflashgen.toolchain import nvrtc_compile

    pattern = "^dfg_sm70_fp8_store_n5120_k1536_"
    res = build([70], only=pattern, build_dir=tmp_path, progress=False, jobs=1)
    assert len(res.artifacts) >= 2
    units = list((tmp_path / "sm_70" / "units").glob("*.ptx"))
    assert len(units) == 1 and all(n in units[0].read_text() for n in res.artifacts)
    entries = {e["name"]: e for e in load_manifest()["kernels"]}
    for name, art in sorted(res.artifacts.items())[:2]:
        lone = tmp_path / f"{name}.ptx"
        nvrtc_compile(generated_dir() / entries[name]["file"], lone, "70")
        # the kernel itself identical; module scope differs only in unused declarations (the unit's
        # other kernels' constants and demoted-shared comments) and its internal-name hash
        mine, alone = art.ptx.read_text(), lone.read_text()
        assert mine.count(".entry ") == 1
        assert mine[mine.index(".visible .entry"):].rstrip() == alone[alone.index(".visible .entry"):].rstrip()
        assert mine[:mine.index("\n.address_size")] == alone[:alone.index("\n.address_size")]
    assert res.resources()  # each cubin's ptxas report names its kernel


def test_split_ptx_keeps_module_scope_text_and_renumbers_labels() -> None:
    from dflashgen.toolchain import split_ptx

    ptx = (".version 8.8\n.target sm_70\n.address_size 64\n.global .align 4 .b8 tab[16];\n"
           ".func (.param .b32 r) helper(.param .b32 a)\n{\n\tret;\n}\n"
           "\t// .globl\tk0\n.visible .entry k0(\n\t.param .u64 k0_param_0\n)\n{\n$L__BB1_1:\n\tret;\n}\n"
           "\t// .globl\tk1\n.visible .entry k1(\n\t.param .u64 k1_param_0\n)\n{\n"
           "\t.local .align 8 .b8 \t__local_depot2[8];\n$L__BB2_3:\n\tbra $L__BB2_3;\n}\n")
    mods = split_ptx(ptx)
    assert sorted(mods) == ["k0", "k1"]
    for name, other in (("k0", "k1"), ("k1", "k0")):
        m = mods[name]
        assert m.startswith(".version 8.8\n") and "tab[16]" in m and "helper(" in m
        assert f".entry {name}(" in m and f".entry {other}(" not in m
    assert "$L__BB0_1:" in mods["k0"] and "bra $L__BB0_3;" in mods["k1"] and "__local_depot0[8]" in mods["k1"]
