"""Which SASS instructions a kernel's warps stall on: summarise the source page of an ncu report
collected with `--section SourceCounters` (warp-state PC sampling), exported as CSV by

  ncu --import R.ncu-rep --page source --print-source sass --csv > R.csv
  python3 tools/ncu_stalls.py R.csv [--top 25]

Prints the instructions with the most stall samples, each with its largest stall reasons, and the
totals per opcode (e.g. whether the L1TEX waits sit on the weight loads, the activation loads or the
scale loads). Columns are found by name, so minor ncu version differences do not matter.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        lines = [ln for ln in f if ln.strip() and not ln.startswith("==")]
    # ncu may print a preamble (kernel name, function) above the table: start at the header row
    start = next((i for i, ln in enumerate(lines[:50]) if "Source" in ln and "Address" in ln), 0)
    rows = [{k: v for k, v in r.items() if k is not None} for r in csv.DictReader(lines[start:])]
    if not rows:
        raise SystemExit(f"{a.csv}: no rows (was the report collected with --section SourceCounters?)")
    cols = list(rows[0])
    total_col = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    src_col = next((c for c in cols if c.strip().lower() == "source"), None)
    addr_col = next((c for c in cols if "Address" in c), None)
    if total_col is None or src_col is None:
        raise SystemExit(f"{a.csv}: no stall-sampling / source columns among {cols[:12]} ...")
    # per-reason sample columns: ncu names them after the stall (e.g. "stall_long_sb" or "Long Scoreboard")
    skip = {total_col, src_col, addr_col}
    # (not the totals again -- "# Samples", the not-issued total -- nor each reason's not-issued half)
    reasons = [c for c in cols if c not in skip and "stall" in c.lower() and "Not-issued" not in c
               and "Not Issued" not in c and any(_num(r[c]) for r in rows[:2000])]
    total = sum(_num(r[total_col]) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples")
    by_op: Counter[str] = Counter()
    for r in rows:
        m = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", r[src_col])
        by_op[m.group(1) if m else "?"] += _num(r[total_col])
    print("samples by opcode: " + "  ".join(f"{op} {100 * s / total:.1f}%" for op, s in by_op.most_common(12)))
    print(f"\n{'share':>6}  {'address':>8}  instruction  (largest reasons)")
    for r in sorted(rows, key=lambda r: -_num(r[total_col]))[: a.top]:
        top = sorted(((_num(r[c]), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c.strip()} {v:.0f}" for v, c in top if v)
        print(f"{100 * _num(r[total_col]) / total:5.1f}%  {r.get(addr_col, '') if addr_col else '':>8}  "
              f"{r[src_col].strip()[:60]}  ({why})")


if __name__ == "__main__":
    main()
