"""The bench's 64-layer forward totals from a tuning table's own measurements (no GPU): the tuner
times the chosen kernel and the peers (cuBLAS FP16 / FP8) per problem and M with the bench's method
(CUDA graphs, weights rotated through >= 3x L2, medians), so its table holds what `dflashgen bench`
would re-measure. The read bandwidth (and, for the MMA floor, the tensor rate) must come from a
measurement on that GPU, given here.

  python tools/table_totals.py TABLE --read-gbs 4266 [--tflops 769]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflashgen.bench import forward_totals
from dflashgen.render import load_targets
from dflashgen.tune import problems_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table", type=Path)
    ap.add_argument("--read-gbs", type=float, required=True)
    ap.add_argument("--tflops", type=float, default=None)
    a = ap.parse_args()
    table = json.loads(a.table.read_text())
    arch = table["fingerprint"]["arch"]
    targets = load_targets(None)
    results = {}
    for p in problems_for(targets, arch):
        if p.key in table["problems"]:
            results[p.key] = {**table["problems"][p.key], "weight_bytes": p.weight_bytes, "read_gbs": a.read_gbs}
    ms = (1, 8, 16, 32, 64)
    print("| TP | deployment | M | dispatched ms | cuBLAS FP16 ms | cuBLAS FP8 ms | roofline ms | fraction |"
          + (" MMA floor ms | floor fraction |" if a.tflops else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if a.tflops else ""))
    for t in forward_totals(results, targets, arch, ms, a.tflops):
        frac = t["roofline_ms"] / t["dispatched_ms"]
        print(f"| {t['tp']} | {t['deployment']} | {t['m']} | {t['dispatched_ms']:.2f} | "
              f"{t.get('cublas_fp16_ms', 0):.2f} | {t.get('cublas_fp8_ms', 0):.2f} | "
              f"{t['roofline_ms']:.2f} | {frac:.0%} |"
              + (f" {t['mma_floor_ms']:.2f} | {t['floor_fraction']:.0%} |" if a.tflops else ""))


if __name__ == "__main__":
    main()
