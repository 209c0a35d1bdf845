"""Why a projection runs slower inside a decode round than in `dflashgen bench` (session 40).

In a B1 / B2 round (torch.profiler, `tools/profile_decode.py`) the served NVFP4 kernels took 15-30%
longer per call than the bench's figure for the same kernel and M. Candidates: the working set (the
bench rotates two copies of one weight; a forward streams ~15 GB of distinct weights: TLB reach),
sustained clocks / power, or the sequence of different kernels. This times the TP1 projection
sequence of one 64-layer forward (the table's kernels, layer pattern 3 GDN + 1 attention) as one
CUDA graph in three forms and prints them beside the bench-style per-problem sum:

- ``distinct``: every layer its own weights (the real working set),
- ``reuse``: every GDN layer the same weights, every attention layer the same (a ~0.4 GB set),
- ``bench``: each problem alone, rotating two copies (what `dflashgen bench` times) x its count,

with the SM clock and power sampled by nvidia-smi while each replays. The shapes come from the
model's projections at a TP degree and deployment (default TP1 NVFP4): at TP4 the kernels are small
and a chain shows how much of their launch and ramp the back-to-back (PDL) launches hide.

    python3 tools/chain_probe.py --ms 8 16 [--tp 4] [--deployment fp8] [--layers 64] [--out chain.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from dflashgen.runtime.library import KernelLibrary

from dflashgen.timing import copies_for, graph_time, replay_time
from dflashgen.verify import random_packed

Spec = tuple[str, int, int, bool]  # (name, n, k, silu)


def layer_specs(model: str, tp: int, deployment: str) -> tuple[str, list[Spec], list[Spec]]:
    """The weight format and the projections of a GDN layer and of an attention layer, in forward
    order (the layer's own projections, then the MLP's gate_up with its SiLU epilogue and down)."""
    from dflashgen.deployment import load_deployment
    from dflashgen.render import problems

    # the model runs gate_up with its SiLU epilogue: its plain twin (a problem of its own) is left out
    projs = [(p, fmt, silu) for p, fmt, silu in problems(model, tp, load_deployment(deployment))
             if silu or p.name != "gate_up_proj"]
    spec: dict[str, list[Spec]] = {p.layer_type: [] for p, _, _ in projs}
    for p, _, silu in projs:
        spec[p.layer_type].append((p.name + ("+silu" if silu else ""), p.n, p.k, silu))
    fmts = {fmt for _, fmt, _ in projs}
    if len(fmts) != 1:
        raise SystemExit(f"deployment {deployment!r} mixes weight formats {sorted(fmts)}: one format per chain")
    return fmts.pop(), spec["linear_attention"] + spec["mlp"], spec["full_attention"] + spec["mlp"]


class Clocks:
    """nvidia-smi sampling in the background: mean SM clock (MHz) and power (W) of a window."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, text=True)

    def close(self) -> list[str]:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=5)
        return out.splitlines()


def sustained(graph: torch.cuda.CUDAGraph, seconds: float = 1.5) -> list[float]:
    """Per-replay times (ms) of back-to-back replays for about ``seconds``."""
    times = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--model", default="qwen3.8-27b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--deployment", default="nvfp4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    lib = KernelLibrary(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    kinds = ["attn" if (i + 1) % 4 == 0 else "gdn" for i in range(args.layers)]
    fmt, GDN, ATTN = layer_specs(args.model, args.tp, args.deployment)

    def make(spec: Spec) -> Any:
        _, n, k, silu = spec
        return random_packed(lib.arch, fmt, n, k, silu, dev, gen)[1]

    distinct = [[make(s) for s in (ATTN if kind == "attn" else GDN)] for kind in kinds]
    shared = {"gdn": distinct[0], "attn": distinct[kinds.index("attn")]}
    gb = sum(w.stream_bytes for layer in distinct for w in layer) / 1e9
    print(f"{args.model} TP{args.tp} {args.deployment}: {args.layers} layers, {gb:.1f} GB of distinct packed weights")
    report: dict[str, Any] = {"model": args.model, "tp": args.tp, "deployment": args.deployment,
                              "layers": args.layers, "weights_gb": gb, "ms": {}}
    clocks = Clocks()
    windows: list[tuple[str, float, float]] = []
    for m in args.ms:
        xs = {k: torch.randn(m, k, device=dev, dtype=torch.float16) for _, _, k, _ in GDN + ATTN}
        outs = {n: torch.empty(m, n // 2 if silu else n, device=dev, dtype=torch.float16)
                for _, n, _, silu in GDN + ATTN}
        row: dict[str, Any] = {}
        for form in ("distinct", "reuse"):
            def forward(form: str = form, xs: dict = xs, outs: dict = outs) -> None:
                for i, kind in enumerate(kinds):
                    specs = ATTN if kind == "attn" else GDN
                    ws = distinct[i] if form == "distinct" else shared[kind]
                    for (_, n, k, _), w in zip(specs, ws, strict=True):
                        lib.gemm(xs[k], w, outs[n])
            forward()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                forward()
            g.replay()
            torch.cuda.synchronize()
            t0 = time.time()
            per = sustained(g)
            windows.append((f"m{m}-{form}", t0, time.time()))
            row[form] = {"median_ms": statistics.median(per), "min_ms": min(per), "replays": len(per)}
            print(f"M={m} {form}: median {statistics.median(per):.3f} ms, min {min(per):.3f} ({len(per)} replays)")
            del g
        # bench-style: each problem alone, rotating >= 3x L2 of copies, x its count per forward
        total = 0.0
        per_problem = {}
        for spec in {s for s in GDN + ATTN}:
            name, n, k, silu = spec
            w0 = make(spec)
            copies = copies_for(w0.stream_bytes, dev)
            ws = [w0] + [make(spec) for _ in range(copies - 1)]
            t = graph_time(lambda i, ws=ws, n=n, k=k, xs=xs, outs=outs: lib.gemm(xs[k], ws[i], outs[n]), copies)
            count = sum(1 for kind in kinds for s in (ATTN if kind == "attn" else GDN) if s == spec)
            per_problem[name] = {
                "us": round(t.us, 2), "count": count, "kernel": lib.choose(w0, m).kernel}
            total += count * t.us / 1e3
        # the same per-problem kernels inside the distinct chain: one graph per problem kind over
        # every layer's own weights (the chain without the other kinds between)
        for spec in {s for s in GDN + ATTN}:
            name, n, k, silu = spec
            layer_ws = [w for i, kind in enumerate(kinds)
                        for s, w in zip(ATTN if kind == "attn" else GDN, distinct[i], strict=True) if s == spec]
            g = torch.cuda.CUDAGraph()
            lib.gemm(xs[k], layer_ws[0], outs[n])
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for w in layer_ws:
                    lib.gemm(xs[k], w, outs[n])
            t = replay_time(g, len(layer_ws))
            per_problem[name]["distinct_us"] = round(t.us, 2)
            del g
        row["bench_sum_ms"] = total
        row["per_problem"] = per_problem
        print(f"M={m} bench-style sum: {total:.3f} ms")
        for name, v in sorted(per_problem.items()):
            print(f"   {name:16s} x{v['count']:3d} bench {v['us']:7.2f} us, one kind over distinct weights "
                  f"{v['distinct_us']:7.2f} us  {v['kernel']}")
        report["ms"][str(m)] = row
        torch.cuda.empty_cache()
    lines = clocks.close()
    # mean SM clock / power inside each timed window
    samples = []
    for ln in lines:
        parts = [p.strip() for p in ln.split(",")]
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            samples.append((ts, float(parts[1]), float(parts[2]), float(parts[3])))
        except (ValueError, IndexError):
            continue
    report["clocks"] = {}
    for name, t0, t1 in windows:
        inside = [s for s in samples if t0 - 1 <= s[0] <= t1]
        if inside:
            report["clocks"][name] = {"sm_mhz": statistics.mean(s[1] for s in inside),
                                      "min_sm_mhz": min(s[1] for s in inside),
                                      "power_w": statistics.mean(s[3] for s in inside), "samples": len(inside)}
            c = report["clocks"][name]
            print(f"{name}: SM {c['sm_mhz']:.0f} MHz (min {c['min_sm_mhz']:.0f}), {c['power_w']:.0f} W")
    report["smi"] = lines[-400:]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
