"""Where a WGC tile's time goes (skinny_gemm_pw.cuh): each named kernel rebuilt (nvcc, sm_90a cubin)
against a copy of the kernel headers with tools/wgc_clock_probe.diff applied (the stamps; the shipped
headers carry none), launched once on random weights after a warm-up, and its stamps read back:

- per CTA: SM and globaltimer at start and at the end of warpgroup 0's main loop -> the waves
  (CTAs started per SM), CTA durations, the launch span;
- in two CTAs (the first and the last along y), per K group and consumer warpgroup (its warp 0):
  clock64 at issue start / issued / previous group retired (wgmma.wait_group) / load start /
  weights landed / decoded / activations there; per activation warp: loads issued / slot free /
  stored. Printed as medians over the steady groups (the first and last 4 left out) and as how far
  the warpgroups run apart (group a's issue on warpgroup g minus warpgroup 0's).

  python tools/wgc_clock_probe.py KERNEL [KERNEL ...] [--m 64] [--json out.json]

The probe's stamps cost a few instructions per group (and ptxas may spill a word): relative
intervals, not the served kernel's speed. Not part of the shipped flow.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

# consumer stamps (skinny_gemm_pw.cuh DFG_STAMP k): issue start, issued, previous retired, load start,
# weights landed, decoded, activations there; activation warps: loads issued, slot free, stored
C_STAMPS = ("issue", "issued", "retired", "load", "weights", "decoded", "xfull")
A_STAMPS = ("ldg", "xempty", "stored")


def probe_headers(out: Path) -> Path:
    """A copy of the kernel headers with the probe's stamps patched in."""
    from dflashgen.toolchain import headers_dir

    inc = out / "include"
    shutil.copytree(headers_dir(), inc)
    diff = Path(__file__).with_name("wgc_clock_probe.diff")
    # (git apply outside a repository: paths relative to the headers' folder)
    subprocess.run(["git", "apply", "-p4", str(diff)], cwd=inc / "dflashgen", check=True)
    return inc


def probe_cubin(entry: dict[str, Any], out: Path, inc: Path) -> Path:
    from dflashgen.render import render_kernel
    from dflashgen.toolchain import CXX_FLAGS, include_dirs, system_nvcc
    from dflashgen.tune import spec_of

    src = out / f"{entry['name']}.cu"
    src.write_text(render_kernel(spec_of(entry)))
    cubin = out / f"{entry['name']}.cubin"
    cmd = [str(system_nvcc()), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", *CXX_FLAGS, "-o", str(cubin),
           str(src), *[f"-I{d}" for d in include_dirs(nvcc=True, headers=inc)]]
    subprocess.run(cmd, check=True)
    return cubin


def read_global(module: Any, name: str, shape: tuple[int, ...]) -> Any:
    import numpy as np
    from dflashgen.runtime.driver import check, cu

    ptr, size = check(cu().cuModuleGetGlobal(module.handle, name.encode()), f"cuModuleGetGlobal {name}")
    host = np.zeros(shape, dtype=np.uint64)
    assert host.nbytes == int(size), (host.nbytes, int(size))
    check(cu().cuMemcpyDtoH(host.ctypes.data, ptr, host.nbytes), "cuMemcpyDtoH")
    return host


def clear_global(module: Any, name: str) -> None:
    from dflashgen.runtime.driver import check, cu

    ptr, size = check(cu().cuModuleGetGlobal(module.handle, name.encode()), f"cuModuleGetGlobal {name}")
    check(cu().cuMemsetD8(ptr, 0, int(size)), "cuMemsetD8")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def analyse(entry: dict[str, Any], clk: Any, cta: Any, m: int) -> dict[str, Any]:
    from dflashgen.tune import spec_of

    spec = spec_of(entry)
    grid = spec.grid(m)
    n_cta = grid[0] * grid[1] * grid[2]
    starts = [int(cta[i][0]) for i in range(n_cta)]
    ends = [int(cta[i][1]) for i in range(n_cta)]
    sms = [int(cta[i][2]) for i in range(n_cta)]
    t0 = min(starts)
    per_sm: dict[int, int] = {}
    for s in sms:
        per_sm[s] = per_sm.get(s, 0) + 1
    res: dict[str, Any] = {
        "kernel": entry["name"], "m": m, "grid": grid, "ctas": n_cta,
        "span_us": (max(ends) - t0) / 1e3,
        "cta_us_median": med([(e - s) / 1e3 for s, e in zip(starts, ends, strict=True)]),
        "sms_used": len(per_sm), "ctas_per_sm_max": max(per_sm.values()),
        "last_cta_start_us": (max(starts) - t0) / 1e3,
    }
    groups = (spec.layout.k // spec.kplan.k_group) // (grid[2] if spec.ctas_k > 1 else 1)
    wgs = spec.tile.warps_n // 4
    steady = range(4, min(groups, 128) - 4)
    for sel in (0, 1):
        c = clk[sel]
        rows: dict[str, Any] = {}
        for g in range(wgs):
            st = c[g]
            iv = {
                "period": [st[a + 1][0] - st[a][0] for a in steady if a + 1 < groups],
                "issue": [st[a][1] - st[a][0] for a in steady],
                "wait_retire": [st[a][2] - st[a][1] for a in steady],
                # load(a + 1) runs right after group a's retire wait: its pieces, attributed to a + 1
                "wait_weights": [st[a][4] - st[a][3] for a in steady],
                "decode": [st[a][5] - st[a][4] for a in steady],
                "wait_xfull": [st[a][6] - st[a][5] for a in steady],
                "skew_vs_wg0": [int(st[a][0]) - int(c[0][a][0]) for a in steady],
            }
            rows[f"wg{g}"] = {k: med([float(x) for x in v]) for k, v in iv.items()}
        for p in range(spec.tile.producer):
            st = c[4 + p]
            mine = [a for a in steady if a % spec.tile.producer == p]
            iv = {"wait_xempty": [st[a][1] - st[a][0] for a in mine], "store": [st[a][2] - st[a][1] for a in mine],
                  "period": [st[a + spec.tile.producer][0] - st[a][0] for a in mine if a + spec.tile.producer < groups]}
            rows[f"act{p}"] = {k: med([float(x) for x in v]) for k, v in iv.items()}
        res[f"cta{'_first' if sel == 0 else '_last'}"] = rows
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from dflashgen.runtime import GemmKernel

    from dflashgen.verify import random_packed
    man = json.loads((Path(__file__).resolve().parents[1] / "generated" / "manifest.json").read_text())
    entries = {e["name"]: e for e in man["kernels"]}
    dev = torch.device("cuda", 0)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        inc = probe_headers(Path(tmp))
        for name in args.kernels:
            e = entries[name]
            n, k, silu = e["n"], e["k"], e["epilogue"] == "silu"
            gen = torch.Generator(device=dev).manual_seed(0)
            _, packed = random_packed(e["arch"], e["format"], n, k, silu, dev, gen)
            x = torch.randn((args.m, k), device=dev, dtype=torch.float16, generator=gen)
            kern = GemmKernel(e, probe_cubin(e, Path(tmp), inc), max_m=args.m, device=dev)
            for _ in range(3):
                kern(x, packed)
            torch.cuda.synchronize()
            clear_global(kern.module, "dfg_probe")
            clear_global(kern.module, "dfg_probe_cta")
            kern(x, packed)
            torch.cuda.synchronize()
            clk = read_global(kern.module, "dfg_probe", (2, 8, 128, 8))
            cta = read_global(kern.module, "dfg_probe_cta", (2048, 4))
            r = analyse(e, clk, cta, args.m)
            out.append(r)
            print(json.dumps(r, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
