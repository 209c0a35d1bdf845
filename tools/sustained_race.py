"""Do the tuner's winners hold under a decode's sustained load? (session 40)

`dflashgen tune` times each candidate in short bursts (a graph of two weight copies, 10 replays,
a sync, 7 samples: under a millisecond of work per sample). A decode round keeps the GPU busy for
~10 ms at a time; there the H200 sits at its 700 W cap and its SM clock drops (1.4-1.9 GHz under
`tools/chain_probe.py`), and the NVFP4 kernels are issue-bound. This races, per TP1 problem and M,
the table's winner and its closest rivals of the same K plan (from a tune's measurements file)
in both forms, alternating candidates in each round:

- ``burst``: exactly the tuner's timing (``dflashgen.tune.time_kernel``),
- ``sustained``: a graph of the kernel over ``--copies`` distinct weights, replayed for >= 40 ms per
  sample after a 0.3 s warm-up of the same graph (the clock and power state a forward sees).

    python3 tools/sustained_race.py --measurements M.json.gz --ms 8 16 [--top 5] [--only nvfp4/] [--out F]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from dflashgen.runtime.library import KernelLibrary

from dflashgen.tune import time_kernel
from dflashgen.verify import random_packed


def sustained_us(kern: Any, ws: list[Any], x: torch.Tensor, out: torch.Tensor, warm_s: float = 0.3,
                 sample_ms: float = 40.0, samples: int = 5) -> float:
    for w in ws[:2]:
        kern(x, w, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            kern(x, w, out)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    e1.synchronize()
    per_replay_ms = max(e0.elapsed_time(e1), 1e-3)
    reps = max(1, int(sample_ms / per_replay_ms))
    t_end = time.time() + warm_s
    while time.time() < t_end:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    out_us = []
    for _ in range(samples):
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        e1.synchronize()
        out_us.append(e0.elapsed_time(e1) * 1e3 / (reps * len(ws)))
    return statistics.median(out_us)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measurements", required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--only", default="nvfp4/")
    ap.add_argument("--copies", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    lib = KernelLibrary(dev)
    path = Path(args.measurements)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    meas = json.loads(raw)
    table = lib.table.problems() if lib.table else {}
    gen = torch.Generator(device=dev).manual_seed(0)
    report: dict[str, Any] = {}
    for key, prob in sorted(meas["problems"].items()):
        if not re.search(args.only, key) or key not in table or "tp1/" not in " ".join(prob.get("serves", [])):
            continue
        plan = table[key]["kplan"]
        _, fmt, epi, n_s, k_s = key.split("/")
        n, k, silu = int(n_s[1:]), int(k_s[1:]), epi == "silu"
        ws = [random_packed(lib.arch, fmt, n, k, silu, dev, gen)[1] for _ in range(args.copies)]
        for m in args.ms:
            served = next(b for b in table[key]["buckets"] if b["m"] == m)
            if served.get("path") != "kernel":
                continue
            timed = [(t[str(m)], name) for name, t in prob["timings_us"].items() if str(m) in t
                     and lib.entries().get(name, {}).get("kplan") == plan]
            names = [nm for _, nm in sorted(timed)[: args.top]]
            if served["kernel"] not in names:
                names.insert(0, served["kernel"])
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            res: dict[str, dict[str, list[float]]] = {nm: {"burst": [], "sustained": []} for nm in names}
            for r in range(args.rounds):
                for nm in names if r % 2 == 0 else names[::-1]:
                    kern = lib.kernel(nm)
                    out = torch.empty(m, kern.n_out, device=dev, dtype=torch.float16)
                    res[nm]["burst"].append(time_kernel(kern, ws[0], x, 2).us)
                    res[nm]["sustained"].append(sustained_us(kern, ws, x, out))
            rows = {nm: {"burst_us": round(statistics.median(v["burst"]), 2),
                         "sustained_us": round(statistics.median(v["sustained"]), 2),
                         "tune_us": prob["timings_us"][nm][str(m)], "served": nm == served["kernel"]}
                    for nm, v in res.items()}
            report[f"{key}@{m}"] = rows
            print(f"== {key} M={m}")
            for nm, v in sorted(rows.items(), key=lambda kv: kv[1]["sustained_us"]):
                print(f"  {'*' if v['served'] else ' '} burst {v['burst_us']:7.2f}  sustained {v['sustained_us']:7.2f}"
                      f"  (tune {v['tune_us']:7.2f})  {nm}")
        del ws
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
