"""Schedule experiments: render ad hoc tile/K-plan variants, build them, and (on a GPU) time them
against each other with the same honest timing as `tune`. Not part of the shipped kernel set.

  python tools/sweep.py build   # here: render + compile variants into the build cache
  python tools/sweep.py run     # on the GPU: verify + time every variant, print a table
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from dflashgen.render import render_kernel, sha256
from dflashgen.schedule import KernelSpec, KPlan, Tile, illegal_reason

SHAPES = {  # name: (format, N, K)
    "gate_up_tp1_fp4": ("nvfp4", 34816, 5120),
    "down_tp1_fp4": ("nvfp4", 5120, 17408),
    "o_tp4_fp4": ("nvfp4", 5120, 1536),
    "gate_up_tp1_fp8": ("fp8_channel", 34816, 5120),
}
MANIFEST = Path(".build/sweep-manifest.json")


def variants() -> list[KernelSpec]:
    out = []
    for name, (fmt, n, k) in SHAPES.items():
        kg = 64 if fmt == "nvfp4" else 32
        grid = [(wk, st, 2, nt, 8) for wk, st, nt in itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2))]
        grid += [(wk, 4, 2, nt, rows) for wk, nt, rows in itertools.product((1, 4), (2, 4), (16, 32))]
        for wk, st, wn, nt, rows in grid:
            spec = KernelSpec(90, fmt, n, k, False, KPlan(1, wk, kg), Tile(rows, nt, wn, st), (name,))
            if illegal_reason(spec) is None:
                out.append(spec)
    return out


def build_variants() -> None:
    from dflashgen.build import build

    entries = []
    for s in variants():
        src = render_kernel(s)
        entries.append({**s.to_dict(), "file": f"sm_90/{s.name}.cu", "source": src, "source_sha256": sha256(src)})
    MANIFEST.write_text(json.dumps({"kernels": entries}))
    res = build([90], manifest={"kernels": entries}, build_dir=Path(".build/build"), jobs=2)
    print(f"{len(res.artifacts)} variants built")


def run_variants() -> None:
    import torch
    from dflashgen.runtime import GemmKernel

    from dflashgen.prepack import Layout, prepack
    from dflashgen.timing import copies_for, read_bandwidth
    from dflashgen.tune import time_kernel
    from dflashgen.verify import random_fp8, random_nvfp4
    from dflashgen.weights import reference_gemm, rel_l2

    entries = json.loads(MANIFEST.read_text())["kernels"]
    rec = json.loads(Path(".build/build/sm_90/record.json").read_text())["kernels"]
    dev = torch.device("cuda")
    bw = read_bandwidth(dev)
    print(f"read bandwidth {bw:.0f} GB/s")
    by_shape: dict[str, list[dict]] = {}
    for e in entries:
        by_shape.setdefault(e["serves"][0], []).append(e)
    rows = []
    for shape, es in by_shape.items():
        fmt, n, k = SHAPES[shape]
        gen = torch.Generator(device=dev).manual_seed(0)
        w = random_nvfp4(n, k, (n,), dev, gen) if fmt == "nvfp4" else random_fp8(n, k, dev, gen)
        packed = prepack(w, Layout(90, fmt, n, k))
        nbytes = packed.stream_bytes
        copies = copies_for(nbytes, dev)
        for m in (8, 16, 32, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            ref = reference_gemm(x, w)
            for e in es:
                kern = GemmKernel(e, Path(".build/build") / rec[e["name"]]["cubin"], 64, dev)
                err = rel_l2(kern(x, packed), ref)
                t = time_kernel(kern, packed, x, copies)
                gbs = nbytes / (t.us * 1e3)
                rows.append((shape, m, e["kplan"]["warps_k"], e["tile"]["stages"], e["tile"]["warps_n"],
                             e["tile"]["warp_nt"], e["tile"]["rows"], t.us, gbs / bw, err))
    rows.sort(key=lambda r: (r[0], r[1], r[7]))
    print(f"{'shape':<18}{'M':>4}{'wk':>4}{'st':>4}{'wn':>4}{'nt':>4}{'rows':>5}{'us':>9}{'frac':>7}{'relL2':>9}")
    best: dict[tuple, tuple] = {}
    for r in rows:
        best.setdefault((r[0], r[1]), r)
    for r in rows:
        if r is best[(r[0], r[1])] or r[8] > 0.6:
            print(f"{r[0]:<18}{r[1]:>4}{r[2]:>4}{r[3]:>4}{r[4]:>4}{r[5]:>4}{r[6]:>5}{r[7]:>9.2f}{r[8]:>7.0%}{r[9]:>9.1e}")
    Path(sys.argv[2] if len(sys.argv) > 2 else "sweep.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    build_variants() if sys.argv[1] == "build" else run_variants()
