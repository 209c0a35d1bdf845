"""Two or more `dflashgen bench` runs of the same table side by side (no GPU): per problem and M the
dispatched time of the first run (the base) and each other run's change from it in percent, then the
forward totals of every run. For runtime knobs that change no kernel (e.g. DFLASHGEN_L2_PREFETCH),
measured back to back on one machine; runs given with the same label are averaged.

  python tools/bench_ab.py LABEL=DIR_OR_JSON [LABEL=DIR_OR_JSON ...] [--problems SUBSTR ...] [--ms 1 8 16]

e.g. `python tools/bench_ab.py off=call5/pf0-run1 off=call5/pf0-run7 pf4=call5/pf4-run4 pf6=call5/pf6-run5`
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any


def load(path: Path) -> dict[str, Any]:
    return json.loads((path / "bench.json" if path.is_dir() else path).read_text())


def dispatched_us(row: dict[str, Any]) -> float:
    """What the runtime dispatched at this M: the kernel's time, or the baseline's where it falls back."""
    return row["us"] if row.get("path") == "kernel" else row["baseline_us"]


def by_label(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[tuple[str, int], float]]:
    """label -> (problem, M) -> dispatched us, averaged over the label's runs."""
    acc: dict[str, dict[tuple[str, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for label, rep in runs:
        for key, p in rep["problems"].items():
            for b in p["buckets"]:
                acc[label][(key, b["m"])].append(dispatched_us(b))
    return {lab: {k: mean(v) for k, v in rows.items()} for lab, rows in acc.items()}


def totals(runs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[tuple[int, str, int], tuple[float, float]]]:
    """label -> (TP, deployment, M) -> (dispatched ms, roofline fraction), the label's runs averaged."""
    acc: dict[str, dict[tuple[int, str, int], list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for label, rep in runs:
        for t in rep["forward_totals"]:
            acc[label][(t["tp"], t["deployment"], t["m"])].append((t["dispatched_ms"], t["roofline_ms"]))
    out: dict[str, dict[tuple[int, str, int], tuple[float, float]]] = {}
    for lab, rows in acc.items():
        out[lab] = {}
        for k, v in rows.items():
            ms, roof = mean(a for a, _ in v), mean(r for _, r in v)
            out[lab][k] = (ms, roof / ms)
    return out


def report(runs: list[tuple[str, dict[str, Any]]], subs: list[str], ms: list[int] | None) -> list[str]:
    labels = list(dict.fromkeys(lab for lab, _ in runs))
    base, others = labels[0], labels[1:]
    rows = by_label(runs)
    out = [f"| problem | M | {base} us | " + " | ".join(f"{lab} %" for lab in others) + " |",
           "|---|---|---|" + "---|" * len(others)]
    for key, m in sorted(rows[base]):
        if (subs and not any(s in key for s in subs)) or (ms and m not in ms):
            continue
        b = rows[base][(key, m)]
        cells = [f"{(rows[lab][(key, m)] / b - 1) * 100:+.1f}" if (key, m) in rows[lab] else "-" for lab in others]
        out.append(f"| {key} | {m} | {b:.2f} | " + " | ".join(cells) + " |")
    tots = totals(runs)
    out += ["", "| TP | deployment | M | " + " | ".join(f"{lab} ms (fraction)" for lab in labels) + " |",
            "|---|---|---|" + "---|" * len(labels)]
    for tp, dep, m in sorted(tots[base]):
        if ms and m not in ms:
            continue
        cells = [f"{tots[lab][(tp, dep, m)][0]:.2f} ({tots[lab][(tp, dep, m)][1]:.1%})" if (tp, dep, m) in tots[lab]
                 else "-" for lab in labels]
        out.append(f"| {tp} | {dep} | {m} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=bench dir or bench.json (the first label is the base)")
    ap.add_argument("--problems", nargs="*", default=[], help="substrings of problem keys (default: all)")
    ap.add_argument("--ms", nargs="*", type=int)
    args = ap.parse_args()
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"{spec!r}: expected LABEL=PATH")
        runs.append((label, load(Path(path))))
    print("\n".join(report(runs, args.problems, args.ms)))


if __name__ == "__main__":
    main()
