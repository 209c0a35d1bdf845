"""Where a prefill's time goes (torch.profiler, CUDA + CPU): a few layers of the Qwen3.8-27B-shaped
synthetic target, one 1023-token prompt (eager prefill is host-bound when CPU time >> CUDA time).
``--gdn chunked`` profiles the GDN layers on the generated chunk-form kernels, ``--gdn torch`` in the
torch chunk (matrix) form, instead of the sequential prefill kernel (``DFLASHGEN_GDN_PREFILL``), for
before / after.
    python3 tools/profile_prefill.py [--layers 4] [--tokens 1023] [--gdn sequential|chunked|torch]"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from dflashgen.runtime.decode_bench import load_target, write_synthetic
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1023)
    ap.add_argument("--gdn", choices=("sequential", "chunked", "torch"), default="sequential",
                    help="GDN prefill: the sequential prefill kernel (default), the chunk-form kernels or the "
                         "torch chunk form")
    a = ap.parse_args()
    os.environ["DFLASHGEN_GDN_PREFILL"] = a.gdn
    d = tempfile.mkdtemp()
    write_synthetic(d, None, a.layers, None, seed=0, device="cuda")
    target = load_target(d, device="cuda")
    toks = torch.randint(0, target.cfg.vocab_size, (1, a.tokens), device="cuda")
    n_new = torch.tensor([a.tokens], device="cuda")
    for _ in range(2):  # warm-up: first-use builds, dequantized caches, cuBLAS heuristics
        target(toks, target.new_state(1, a.tokens), num_new=n_new, logits=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    target(toks, target.new_state(1, a.tokens), num_new=n_new, logits=False)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    print(f"prefill of {a.tokens} tokens, {a.layers} layers, GDN {a.gdn}: {ms:.1f} ms wall")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        target(toks, target.new_state(1, a.tokens), num_new=n_new, logits=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
