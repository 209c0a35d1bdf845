"""wgmma vs mma.sync on the GPU: every manifest kernel of the chosen sm_90 problems (all their K
plans), verified first (rel L2 <= 1e-3, bitwise batch invariance per K plan, as `dflashgen verify`),
then timed with the tuner's method (CUDA graphs, weights rotated through >= 3x L2), with cuBLAS
FP16 on the dequantized weight as the reference peer. Prints, per problem and M, the best kernel of
each K plan and its fraction of the read roofline. Not part of the shipped flow (`dflashgen tune`
chooses plans); this shows the per-plan numbers tune does not keep.

  python tools/wgmma_race.py [problem-substring ...] [--ms 8 16 32 64] [--json out.json] [--only REGEX]

--only keeps, of each problem's kernels, those whose names match REGEX and those the committed table
serves (built: the same set), the served ones first (each K plan's bitwise anchor is its first kernel).
Each problem substring runs in a process of its own under --timeout seconds (default 150), so a kernel
that hangs (session 16: an mbarrier ring misconfigured) costs its problem, reported as HANG, not the race.

A problem substring matches keys like sm90/nvfp4/store/n34816/k5120 (default: NVFP4 and FP8
gate_up, store and fused SiLU, at TP1).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT = ["nvfp4/store/n34816/k5120", "nvfp4/silu/n34816/k5120", "fp8_channel/store/n34816/k5120"]


def served_kernels(problem: str) -> set[str]:
    """The kernels the committed H200 table serves for the problems whose keys contain `problem`."""
    table = json.loads((Path(__file__).resolve().parents[1] / "tuning" / "nvidia-h200.json").read_text())
    return {b["kernel"] for key, p in table["problems"].items() if problem in key
            for b in p.get("buckets", []) if b.get("kernel")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("problems", nargs="*", default=DEFAULT)
    ap.add_argument("--ms", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", default=None, help="kernel-name regex (and the table's kernels): race just those")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per problem substring (own process)")
    ap.add_argument("--inline", action="store_true", help="race in this process (what each child does)")
    args = ap.parse_args()
    if args.inline:
        out = race(args)
    else:
        out = []
        for prob in args.problems:
            with tempfile.TemporaryDirectory() as tmp:
                child = Path(tmp) / "race.json"
                cmd = [sys.executable, __file__, prob, "--ms", *map(str, args.ms), "--json", str(child), "--inline"]
                try:
                    subprocess.run(cmd + (["--only", args.only] if args.only else []), timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    print(f"HANG {prob}: no result within {args.timeout:.0f} s (killed)", flush=True)
                out += json.loads(child.read_text()) if child.exists() else []
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


def race(args: argparse.Namespace) -> list[dict]:
    import torch

    from dflashgen.timing import copies_for, read_bandwidth
    from dflashgen.tune import Problem, _weights, time_baselines, time_kernel
    from dflashgen.verify import native_kernels, verify_problem

    dev = torch.device("cuda")
    # build and load only these problems' kernels (with --only: those it names and the table's)
    probs = "|".join(re.escape(p.replace("fp8_channel", "fp8").replace("/", "_")) for p in args.problems)
    served = set().union(*(served_kernels(p) for p in args.problems))
    names = f"(?=.*({args.only}|{'|'.join(sorted(served)) or '$^'}))" if args.only else ""
    images, groups = native_kernels(90, f"^(?=.*({probs})){names}")
    bw = read_bandwidth(dev)
    print(f"read bandwidth {bw:.0f} GB/s")
    out = []
    for key in sorted(k for k in groups if any(p in k for p in args.problems)):
        entries = groups[key]
        if args.only:  # the table's kernels first: each K plan's bitwise anchor is its first kernel
            entries = sorted(entries, key=lambda e: e["name"] not in served)
        e0 = entries[0]
        p = Problem(90, e0["format"], e0["epilogue"] == "silu", e0["n"], e0["k"])
        reps = {r.name: r for r in verify_problem(entries, images, tuple(sorted(set(args.ms) | {1, 3, 17, 33})), dev)}
        bad = [r for r in reps.values() if not r.ok]
        for r in bad:
            print(f"  FAIL {r.name}: {r.failures[:3]}")
        w, packed = _weights(p, dev, seed=1)
        nbytes = packed.stream_bytes
        copies = copies_for(nbytes, dev)
        from dflashgen.runtime import GemmKernel

        base = time_baselines(p, w, tuple(args.ms), dev, fp8_ok=False)
        for m in args.ms:
            x = torch.randn(m, p.k, device=dev, dtype=torch.float16)
            best: dict[str, tuple[float, str]] = {}
            for e in entries:
                if not reps[e["name"]].ok:
                    continue
                kern = GemmKernel(e, images[e["name"]][0], max_m=max(args.ms), device=dev)
                t = time_kernel(kern, packed, x, copies)
                # per K plan and MMA kind (wgmma K plans, mma.sync-plan tiles with wgmma consumers `_wc1`)
                wg = bool(e["kplan"].get("wgmma")) or "_wc1" in e["name"]
                plan = json.dumps({**e["kplan"], "wgmma": int(wg)}, sort_keys=True)
                out.append({"problem": key, "m": m, "kernel": e["name"], "kplan": e["kplan"], "us": t.us,
                            "noise_us": t.noise_us})
                if plan not in best or t.us < best[plan][0]:
                    best[plan] = (t.us, e["name"])
            fp16 = base.fp16.get(m)
            print(f"{key} M={m}: cuBLAS FP16 {fp16.us if fp16 else float('nan'):.2f} us")
            for plan, (us, name) in sorted(best.items(), key=lambda kv: kv[1][0]):
                tag = "wgmma" if json.loads(plan).get("wgmma") else "mma.sync"
                print(f"  {tag:<9}{us:9.2f} us {nbytes / (us * 1e3) / bw:6.0%}  {name}")
    return out


if __name__ == "__main__":
    main()
