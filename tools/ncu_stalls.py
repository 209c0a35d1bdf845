"""Which SASS instructions a kernel's warps stall on: summarise the source page of an ncu report
collected with `--section SourceCounters` (warp-state PC sampling), exported as CSV by

  ncu --import R.ncu-rep --page source --print-source sass --csv > R.csv
  python3 tools/ncu_stalls.py R.csv [--top 25]

Prints the instructions with the most stall samples, each with its largest stall reasons, and the
totals per opcode (e.g. whether the L1TEX waits sit on the weight loads, the activation loads or the
scale loads); then every mbarrier try-wait with its execution count: ptxas puts a wait's first try
inline and its retry loop out of line past the kernel's last EXIT, so a retry line's count over its
inline twin's is how often that wait timed out and went round again (a warp that waits long retries
often and spends issue slots doing it; session 18 found the WGC consumers retrying ~25 times per
weight wait). Columns are found by name, so minor ncu version differences do not matter.
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
    _mbarrier_waits(rows, src_col, next((c for c in cols if c.strip() == "Instructions Executed"), None))


def _mbarrier_waits(rows: list[dict[str, str]], src_col: str, exec_col: str | None) -> None:
    """Each mbarrier try-wait's executions, the out-of-line retries marked, and the retries' share of
    all executed instructions (a retry is the try-wait and its branch back)."""
    if exec_col is None:
        return
    last_exit = max((i for i, r in enumerate(rows) if "EXIT" in r[src_col]), default=len(rows))
    waits = [(i, r) for i, r in enumerate(rows) if "TRYWAIT" in r[src_col] and _num(r[exec_col])]
    if not waits:
        return
    executed = sum(_num(r[exec_col]) for r in rows) or 1.0
    retries = sum(_num(r[exec_col]) for i, r in waits if i > last_exit)
    print(f"\nmbarrier try-waits (executions; 'retry': the out-of-line loop): retries are "
          f"{100 * 2 * retries / executed:.1f}% of executed instructions")
    for i, r in waits:
        kind = "retry " if i > last_exit else "inline"
        print(f"  {kind} {_num(r[exec_col]):>10.0f}  {r[src_col].strip()[:70]}")


if __name__ == "__main__":
    main()
