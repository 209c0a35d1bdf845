"""Where a prefill's time goes (torch.profiler, CUDA + CPU): a few layers of the Qwen3.8-27B-shaped
synthetic target, one 1023-token prompt (eager prefill is host-bound when CPU time >> CUDA time).
``--gdn chunked`` profiles the GDN layers on the generated chunk-form kernels, ``--gdn torch`` in the
torch chunk (matrix) form, instead of the sequential prefill kernel (``DFLASHGEN_GDN_PREFILL``), for
before / after.
    python3 tools/profile_prefill.py [--layers 4] [--tokens 1023] [--gdn sequential|chunked|torch]
                                      [--rows 18] [--shapes] [--trace FILE.json.gz]

--trace writes the profiled forward's Chrome trace and prints where the GPU waited in it
(tools/trace_gaps.py): with all 64 layers, what an eager prefill loses to the host beyond its CUDA time."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from dflashgen.runtime.decode_bench import load_target, write_synthetic
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from trace_gaps import load_events, print_gaps, write_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1023)
    ap.add_argument("--rows", type=int, default=18, help="rows of the CUDA-time table (default 18)")
    ap.add_argument("--shapes", action="store_true", help="also a table of ops grouped by input shapes")
    ap.add_argument("--gdn", choices=("sequential", "chunked", "torch"), default="sequential",
                    help="GDN prefill: the sequential prefill kernel (default), the chunk-form kernels or the "
                         "torch chunk form")
    ap.add_argument("--trace", default=None, help="write the Chrome trace here (gzip) and summarise its GPU gaps")
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
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=a.shapes) as prof:
        target(toks, target.new_state(1, a.tokens), num_new=n_new, logits=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=60))
    if a.shapes:  # which aten op (and shapes) each glue kernel belongs to
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=a.rows,
                                                                  max_name_column_width=40, max_shapes_column_width=90))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    if a.trace:
        write_trace(prof, a.trace)
        print_gaps(load_events(a.trace), rows=15)


if __name__ == "__main__":
    main()
