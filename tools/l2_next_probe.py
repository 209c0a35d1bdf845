"""Probe: does prefetching the NEXT projection's weights into L2 while this one runs hide the
per-launch ramp of the small (TP4) GEMMs?

Per problem and M, the table's served kernel is timed as `dflashgen bench` does (a CUDA graph over
weight copies rotated through >= 3x L2), in three chains:
  base   gemm(copy i)
  empty  l2pf(nothing) ; gemm(copy i)            -- the cost of the extra launch alone
  next   l2pf(copy i+1, first F of it) ; gemm(copy i)   -- copy i+1 streams into L2 under gemm(i)
`l2pf` is a one-wave kernel of bulk L2 prefetches (cp.async.bulk.prefetch.L2, fire and forget), so
`next` - `empty` is what an in-kernel prefetch of the successor's weights could buy. Not part of the
shipped flow; its numbers decide whether the GEMM signature takes a successor pointer.

  python tools/l2_next_probe.py [problem-regex] [--ms 1 8 16] [--frac 1.0 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

PF_SRC = r"""
extern "C" __global__ void dfg_l2_next_prefetch(const char* a, unsigned long long a_bytes, const char* b,
                                                unsigned long long b_bytes, unsigned chunk) {
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x * chunk;
  const unsigned long long t = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * chunk;
  for (unsigned long long i = t; i < a_bytes; i += step) {
    const unsigned n = (unsigned)(a_bytes - i < chunk ? a_bytes - i : chunk) & ~15u;
    if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a + i), "r"(n) : "memory");
  }
  for (unsigned long long i = t; i < b_bytes; i += step) {
    const unsigned n = (unsigned)(b_bytes - i < chunk ? b_bytes - i : chunk) & ~15u;
    if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(b + i), "r"(n) : "memory");
  }
}
"""


def time_chains(kern: Any, x: Any, y: Any, ws: list[Any], pfg: int | None, fracs: list[float],
                l2pf: Callable[[Any, float], None]) -> dict[str, float]:
    """Per-call us of the three chains (module docstring) over the rotated copies ``ws``."""
    from dflashgen.timing import graph_time

    n = len(ws)
    row = {"base": graph_time(lambda i: kern(x, ws[i], y, prefetch=pfg), n).us,
           "empty": graph_time(lambda i: (l2pf(None, 0.0), kern(x, ws[i], y, prefetch=pfg)), n).us}
    for f in fracs:
        row[f"next{f:g}"] = graph_time(
            lambda i, f=f: (l2pf(ws[(i + 1) % n], f), kern(x, ws[i], y, prefetch=pfg)), n).us
    return row


def main() -> None:
    import ctypes

    import torch
    from dflashgen.runtime import GemmKernel
    from dflashgen.runtime.driver import Module, current_stream, ensure_context
    from dflashgen.runtime.library import default_table_path
    from dflashgen.runtime.table import TuningTable

    from dflashgen.prepack import PackedWeight
    from dflashgen.render import load_targets
    from dflashgen.timing import copies_for
    from dflashgen.tune import _weights, problems_for, rotated_copies, selected
    from dflashgen.verify import native_kernels

    ap = argparse.ArgumentParser()
    ap.add_argument("only", nargs="?", default=None)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--frac", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    ensure_context(0)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "pf.cu", Path(tmp) / "pf.cubin"
        src.write_text(PF_SRC)
        subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-o", str(cubin), str(src)], check=True)
        mod = Module(cubin.read_bytes(), "l2pf")
    pf = mod.function("dfg_l2_next_prefetch")
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def l2pf(w: PackedWeight | None, frac: float) -> None:
        a = w.weights if w is not None else None
        s = w.scales if w is not None else None
        ab = int(a.numel() * frac) if a is not None else 0
        sb = int(s.numel() * frac) if s is not None else 0
        pf.launch((sms, 1, 1), (32, 1, 1),
                  [ctypes.c_void_p(a.data_ptr() if a is not None else 0), ctypes.c_uint64(ab),
                   ctypes.c_void_p(s.data_ptr() if s is not None else 0), ctypes.c_uint64(sb),
                   ctypes.c_uint32(16384)], current_stream(0))

    table = TuningTable.load(default_table_path(device))
    probs = selected(problems_for(load_targets(None), 90), args.only)
    out = []
    for p in probs:
        buckets = {b["m"]: b for b in table.problems().get(p.key, {}).get("buckets", []) if b.get("kernel")}
        names = {buckets[m]["kernel"] for m in args.ms if m in buckets}
        if not names:
            continue
        images, by_key = native_kernels(90, "^(" + "|".join(sorted(names)) + ")$")
        entries = {e["name"]: e for e in by_key[p.key]}
        _, packed = _weights(p, device, seed=1)
        copies = copies_for(packed.stream_bytes, device)
        ws = rotated_copies(packed, copies)
        for m in args.ms:
            if m not in buckets:
                continue
            b = buckets[m]
            kern = GemmKernel(entries[b["kernel"]], images[b["kernel"]][0], max_m=64, device=device)
            pfg = b.get("prefetch_groups")
            x = torch.randn(m, p.k, device=device, dtype=torch.float16)
            y = torch.empty((m, kern.n_out), dtype=torch.float16, device=device)
            row = {"problem": p.key, "m": m, "kernel": b["kernel"], "mb": packed.stream_bytes / 1e6,
                   "copies": copies, "table_us": b.get("us")}
            row.update(time_chains(kern, x, y, ws, pfg, args.frac, l2pf))
            out.append(row)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
