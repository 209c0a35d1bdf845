"""What a tuning run measured, grouped (no GPU): `dflashgen tune` keeps every timed candidate per
problem and M (`tune-measurements.json.gz`, beside the table); this prints, per problem and M, the
served path, the best kernel of each group and the cuBLAS peers, as a Markdown table. With --vs, the
same from a second file (another session's run) beside it, group by group.

  python tools/tune_report.py MEAS.json.gz [--problems SUBSTR ...] [--ms 32 64] [--by plan|tile|family]
                              [--vs OTHER.json.gz]

Groups: `plan` the K plan (sk_wk_kg, the bits a kernel must reproduce), `tile` the plan and the tile's
kind (mma.sync, a wgmma plan's kernel, or wgmma-consumer with its `_zs` / `_wsf` / `_ww` / `_wn`
fields), `family` the tile's kind alone.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path
from typing import Any

_PLAN = re.compile(r"_(sk\d+_wk\d+_kg\d+)_")
_WGC_FIELDS = re.compile(r"_(wn\d+|ww\d+|zs\d+|wsf\d+)(?=_)")


def load(path: Path) -> dict[str, Any]:
    """The measurements file's problems (gzip or plain JSON)."""
    raw = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return json.loads(raw)["problems"]


def short(name: str) -> str:
    """A kernel name without its problem prefix (dfg_sm90_<fmt>_<epi>_n<N>_k<K>_)."""
    return re.sub(r"^dfg_sm\d+_[a-z0-9]+_[a-z]+_n\d+_k\d+_", "", name)


def family(name: str) -> str:
    """mma.sync, wgmma (a wgmma K plan's kernel, `_wg1_`), or wgc with the fields that shape a
    wgmma-consumer tile (e.g. wgc_wn12_wsf1)."""
    if "_wc1_" not in name:
        return "wgmma" if "_wg1_" in name else "mma.sync"
    return "_".join(["wgc", *_WGC_FIELDS.findall(name)])


def group_of(name: str, by: str) -> str:
    plan = m.group(1) if (m := _PLAN.search(name)) else "?"
    return {"plan": plan, "tile": f"{plan} {family(name)}", "family": family(name)}[by]


def best_by_group(problem: dict[str, Any], m: int, by: str) -> dict[str, tuple[float, str]]:
    """group -> (best us at M, its kernel) over every candidate timed at M."""
    out: dict[str, tuple[float, str]] = {}
    for name, times in problem.get("timings_us", {}).items():
        us = times.get(str(m))
        if us is None:
            continue
        g = group_of(name, by)
        if g not in out or us < out[g][0]:
            out[g] = (us, name)
    return out


def rows(problems: dict[str, Any], subs: list[str], ms: list[int] | None, by: str,
         other: dict[str, Any] | None) -> list[str]:
    head = "| problem | M | served | us | cuBLAS FP16 | group | best us | kernel |" + (" other us |" if other else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key in sorted(problems):
        if subs and not any(s in key for s in subs):
            continue
        p = problems[key]
        for b in p.get("buckets", []):
            m = b["m"]
            if ms and m not in ms:
                continue
            served = short(b["kernel"]) if b.get("kernel") else b.get("path", "?")
            us = b.get("us") or b.get("baseline_us")
            groups = best_by_group(p, m, by)
            theirs = best_by_group(other[key], m, by) if other and key in other else {}
            for i, (g, (gus, gname)) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
                lead = (f"| {key} | {m} | {served} | {us:.1f} | {b.get('baseline_us') or 0:.1f} " if i == 0
                        else "| | | | | ")
                o = f" {theirs[g][0]:.1f} |" if g in theirs else " - |"
                lines.append(f"{lead}| {g} | {gus:.1f} | {short(gname)} |" + (o if other else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measurements", type=Path)
    ap.add_argument("--problems", nargs="*", default=[], help="substrings of problem keys (default: all)")
    ap.add_argument("--ms", nargs="*", type=int, default=None)
    ap.add_argument("--by", choices=("plan", "tile", "family"), default="tile")
    ap.add_argument("--vs", type=Path, default=None, help="a second measurements file, beside the first")
    a = ap.parse_args()
    other = load(a.vs) if a.vs else None
    print("\n".join(rows(load(a.measurements), a.problems, a.ms, a.by, other)))


if __name__ == "__main__":
    main()
