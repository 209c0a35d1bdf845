"""What the dequantize + cuBLAS path (a prefill's projections) costs when the library keeps no FP16
copies (``dequant_cache=0``): per Qwen3.8-27B projection and weight format, the generated dequantize
kernel (GB/s moved: packed bytes read + FP16 bytes written), torch's dequantize_packed (the path
before the kernel), and cuBLAS FP16 at M prefill rows on a kept copy; totals over one forward
(counts per the model's projection mix). Timing: CUDA graphs, CUDA events, medians (dflashgen.timing).

    python3 tools/dequant_bench.py [--tp 1] [--m 1023] [--out DIR]"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from dflashgen.runtime.dequant_kernel import dequantize, dequantize_packed

from dflashgen.model import Projection, derive_projections, load_model_config
from dflashgen.timing import copies_for, graph_time, read_bandwidth
from dflashgen.verify import random_packed


def _eager_us(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median of a few eager calls (torch's multi-kernel path), CUDA events."""
    fn()
    ts = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def _measure(proj: Projection, fmt: str, arch: int, m: int, dev: torch.device) -> dict[str, Any]:
    silu = proj.name == "gate_up_proj"
    _, p = random_packed(arch, fmt, proj.n, proj.k, silu, dev, torch.Generator(device=dev).manual_seed(0))
    moved = p.stream_bytes + 2 * proj.n * proj.k
    packs = [p] + [type(p)(p.layout, p.weights.clone(), None if p.scales is None else p.scales.clone(),
                           p.col_scale.clone()) for _ in range(copies_for(moved, dev) - 1)]
    outs = [torch.empty(proj.n, proj.k, dtype=torch.float16, device=dev) for _ in packs]
    kern = graph_time(lambda i: dequantize(packs[i], out=outs[i]), len(packs))
    want = dequantize_packed(p).to(torch.float16)
    assert torch.equal(outs[0], want), f"{proj.name} {fmt}: kernel != torch"
    torch_us = _eager_us(lambda: outs[0].copy_(dequantize_packed(p)))
    x = torch.randn(m, proj.k, device=dev, dtype=torch.float16)
    gemm = graph_time(lambda i: x @ want.t(), 1, replays=3, repeats=5)
    return {"projection": proj.name, "format": fmt, "n": proj.n, "k": proj.k, "count": proj.count,
            "bytes_moved": moved, "kernel_us": kern.us, "kernel_noise_us": kern.noise_us,
            "kernel_gbs": moved / kern.us / 1e3, "torch_us": torch_us, "gemm_us": gemm.us,
            "overhead": kern.us / gemm.us}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--m", type=int, default=1023, help="prefill rows of the cuBLAS GEMM")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    gbs = read_bandwidth(dev)
    arch = 10 * torch.cuda.get_device_capability(dev)[0] + torch.cuda.get_device_capability(dev)[1]
    rows, totals = [], {}
    for proj in derive_projections(load_model_config(None), a.tp):
        if proj.name == "lm_head":  # FP16 in the checkpoints: nothing to dequantize
            continue
        for fmt in ("nvfp4", "fp8_channel"):
            row = _measure(proj, fmt, arch, a.m, dev)
            rows.append(row)
            t = totals.setdefault(fmt, {"kernel_ms": 0.0, "torch_ms": 0.0, "gemm_ms": 0.0})
            for key in ("kernel", "torch", "gemm"):
                t[f"{key}_ms"] += proj.count * row[f"{key}_us"] / 1e3
            torch.cuda.empty_cache()
            print(f"{proj.name:14s} {fmt:11s} n{proj.n} k{proj.k}: kernel {row['kernel_us']:8.1f} us "
                  f"({row['kernel_gbs']:.0f} GB/s), torch {row['torch_us']:8.1f} us, GEMM M={a.m} "
                  f"{row['gemm_us']:8.1f} us (+{100 * row['overhead']:.0f}%)", flush=True)
    report = {"gpu": torch.cuda.get_device_name(dev), "read_gbs": gbs, "tp": a.tp, "m": a.m, "rows": rows,
              "forward_totals": totals}
    md = [f"# Dequantize + cuBLAS without kept copies on {report['gpu']} (TP{a.tp}, M = {a.m})", "",
          f"Measured read bandwidth {gbs:.0f} GB/s. Kernel GB/s counts packed bytes read + FP16 bytes written.", "",
          "| projection | format | N | K | dequantize kernel us | GB/s | torch dequantize us | cuBLAS FP16 GEMM us "
          "| kernel / GEMM |", "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['projection']} | {r['format']} | {r['n']} | {r['k']} | {r['kernel_us']:.1f} | {r['kernel_gbs']:.0f} "
           f"| {r['torch_us']:.1f} | {r['gemm_us']:.1f} | {100 * r['overhead']:.1f}% |" for r in rows]
    md += ["", "One forward (count x time): " + "; ".join(
        f"{fmt}: dequantize {t['kernel_ms']:.2f} ms (torch's {t['torch_ms']:.1f} ms) on {t['gemm_ms']:.2f} ms of "
        f"GEMMs (+{100 * t['kernel_ms'] / t['gemm_ms']:.0f}%)" for fmt, t in totals.items()), ""]
    print("\n".join(md))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dequant_bench.json").write_text(json.dumps(report, indent=1))
        (out / "dequant_bench.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
