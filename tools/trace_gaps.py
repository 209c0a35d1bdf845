"""Where the GPU waits in a torch.profiler Chrome trace (``export_chrome_trace``, plain or gzip): GPU
busy time (the union of kernels, copies and memsets) against the span from the first to the last, and
the idle gaps grouped by what ended them (the runtime call that launched the next GPU work, and that
work) -- so host-bound stretches of an eager forward or a decode round show by name.

    python3 tools/trace_gaps.py TRACE.json[.gz] [--per N] [--rows 20] [--min-us 3] [--compare OTHER]

``--per N`` divides the totals by N (e.g. the profiled rounds). ``--compare OTHER``: also the GPU
work per kernel name (templates cut) in both traces, by OTHER's total: count, time per N and mean
duration -- e.g. decode rounds alone vs with a prefill beside them, to see which kernels stretch."""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import shutil
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    with (gzip.open(p, "rt") if p.suffix == ".gz" else p.open()) as f:
        return json.load(f)["traceEvents"]


def gpu_gaps(events: list[dict[str, Any]]) -> tuple[float, float, list[tuple[float, float]]]:
    """(span, busy, gaps) in microseconds over the trace's GPU work."""
    iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS)
    if not iv:
        return 0.0, 0.0, []
    busy, gaps = 0.0, []
    lo, hi = iv[0]
    for a, b in iv[1:]:
        if a > hi:
            busy += hi - lo
            gaps.append((hi, a))
            lo, hi = a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    return iv[-1][1] - iv[0][0], busy, gaps


def gap_causes(events: list[dict[str, Any]], gaps: list[tuple[float, float]], min_us: float) -> collections.Counter:
    """Idle microseconds per "runtime call -> next GPU work" that ended each gap of >= min_us."""
    start = {}
    for e in events:
        if e.get("cat") in GPU_CATS:
            start.setdefault(e["ts"], e)
    calls = {e["args"].get("correlation"): e["name"] for e in events
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    out: collections.Counter = collections.Counter()
    for a, b in gaps:
        if b - a < min_us:
            continue
        nxt = start.get(b)
        call = calls.get(nxt["args"].get("correlation"), "?") if nxt else "?"
        out[f"{call} -> {nxt['name'][:60] if nxt else '?'}"] += b - a
    return out


def per_kernel(events: list[dict[str, Any]]) -> dict[str, list[float]]:
    """[count, total us] per GPU work name (C++ template arguments cut)."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in GPU_CATS:
            k = re.sub(r"<.*", "", e["name"])[:70]
            out[k][0] += 1
            out[k][1] += e["dur"]
    return out


def write_trace(prof: Any, path: str | Path) -> None:
    """A torch.profiler's Chrome trace to ``path`` (gzip when it ends in .gz)."""
    p = Path(path)
    if p.suffix != ".gz":
        prof.export_chrome_trace(str(p))
        return
    raw = p.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as f, gzip.open(p, "wb") as g:
        shutil.copyfileobj(f, g)
    raw.unlink()


def print_gaps(events: list[dict[str, Any]], per: float = 1.0, rows: int = 20, min_us: float = 3.0) -> None:
    """GPU span / busy / idle (divided by ``per``) and the ``rows`` largest gap causes."""
    span, busy, gaps = gpu_gaps(events)
    n = per
    n_gaps = sum(1 for g in gaps if g[1] - g[0] >= min_us) / n
    print(f"GPU span {span / 1e3 / n:.3f} ms, busy {busy / 1e3 / n:.3f} ms, idle {(span - busy) / 1e3 / n:.3f} ms "
          f"({n_gaps:.0f} gaps >= {min_us:g} us)" + (f" per {n:g}" if n != 1 else ""))
    for k, v in gap_causes(events, gaps, min_us).most_common(rows):
        print(f"{v / n:10.1f} us  {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--per", type=float, default=1.0, help="divide the totals by this (e.g. rounds)")
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--min-us", type=float, default=3.0)
    ap.add_argument("--compare", default=None, help="a second trace: per-kernel time in both")
    a = ap.parse_args()
    ev = load_events(a.trace)
    print_gaps(ev, a.per, a.rows, a.min_us)
    n = a.per
    if a.compare:
        ka, kb = per_kernel(ev), per_kernel(load_events(a.compare))
        print(f"\n{'GPU work':70s} {'n':>6} {'us/N':>9} {'mean':>7} | {'n':>6} {'us/N':>9} {'mean':>7}  (this | other)")
        for k in sorted(set(ka) | set(kb), key=lambda k: -kb.get(k, [0, 0.0])[1])[:a.rows * 2]:
            both = (ka.get(k, [0, 0.0]), kb.get(k, [0, 0.0]))
            cols = [f"{c:6.0f} {t / n:9.1f} {t / max(c, 1):7.1f}" for c, t in both]
            print(f"{k:70s} {cols[0]} | {cols[1]}")


if __name__ == "__main__":
    main()
