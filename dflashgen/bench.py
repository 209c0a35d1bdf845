"""`dflashgen bench`: re-measure what the tuning table dispatches, against cuBLAS FP16, cuBLAS FP8
and the read roofline measured in the same run; write JSON, a Markdown table and a PNG plot.

The weighted total over one 64-layer forward uses each projection's count per forward.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from .tune import problems_for, problems_regex, selected, tune_problem

REPORT_MS = (1, 8, 16, 32, 64)


def run(table_path: Path | None, out_dir: Path, targets_path: Path | None = None, ms: tuple[int, ...] = REPORT_MS,
        race_all: bool = False, only: str | None = None) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from dflashgen.runtime.library import default_table_path, machine_fingerprint
    from dflashgen.runtime.table import TuningTable

    from .render import load_targets
    from .timing import read_bandwidth, tensor_tflops
    from .verify import manifest_problems, native_kernels

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    fp = machine_fingerprint(device)
    arch = fp["arch"]
    table = None
    if not race_all:
        table = TuningTable.load(table_path or default_table_path(device))
        table.check_matches(fp)
    targets = load_targets(targets_path)
    probs = selected(problems_for(targets, arch), only)
    # build (if missing) and load only what runs: the table's kernels (a problem it serves from a peer
    # alone: one candidate, which the peers are timed beside), or every candidate with race_all
    names = problems_regex(probs)
    if table is not None:
        man = manifest_problems(arch)
        want: set[str] = set()
        for p in probs:
            want |= {b["kernel"] for b in table.problems().get(p.key, {}).get("buckets", [])
                     if b.get("kernel")} or {man[p.key][0]["name"]}
        names = f"^({'|'.join(sorted(map(re.escape, want)))})$"
    images, by_key = native_kernels(arch, names)
    bw = read_bandwidth(device)
    results: dict[str, Any] = {}
    failed: dict[str, str] = {}  # problem -> the error that stopped its measurement
    t0 = time.time()
    for p in tqdm(probs, desc="bench", unit="problem"):
        entries = by_key[p.key]
        prefetch: dict[int, int] = {}  # the table's tuned L2 prefetch depths, timed as served
        if table is not None:
            buckets = table.problems().get(p.key, {}).get("buckets", [])
            chosen = {b.get("kernel") for b in buckets}
            entries = [e for e in entries if e["name"] in chosen] or entries[:1]
            prefetch = {b["m"]: b["prefetch_groups"] for b in buckets if b.get("prefetch_groups") is not None}
        try:
            results[p.key] = tune_problem(p, entries, images, device, bw, ms, fp8_ok=arch >= 89, prefetch=prefetch)
        except Exception as e:  # one problem's failure is reported with the rest, not a lost report
            failed[p.key] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        torch.cuda.empty_cache()
    tflops = tensor_tflops(device)  # after the kernels: its 384 MB of operands are gone before they run
    report = {"fingerprint": fp, "read_gbs": bw, "tensor_tflops": tflops, "ms": list(ms),
              "seconds": time.time() - t0, "table": str(table.source) if table else None, "problems": results,
              "failed": failed,
              "forward_totals": forward_totals(results, targets, arch, ms, tflops)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    (out_dir / "bench.md").write_text(markdown(report))
    plot(report, out_dir / "bench.png")
    return report


def _ours(row: dict[str, Any]) -> float | None:
    return row.get("us") or row.get("candidate_us")


def forward_totals(results: dict[str, Any], targets: list[Any], arch: int, ms: tuple[int, ...],
                   tensor_tflops: float | None = None) -> list[dict[str, Any]]:
    """Per (TP, deployment, M): sum over the projections of one forward of count x time. With the
    measured FP16 tensor rate: ``mma_floor_ms`` (2 M N K at that rate) and ``floor_ms``, per
    projection the larger of its read and MMA floors -- what no kernel that reads the weights once
    and multiplies in FP16 can beat (at M = 64 the MMA floor passes the read floor)."""
    from .render import problems

    out = []
    seen = set()
    for t in targets:
        if (t.tp, t.deployment.name) in seen:
            continue
        seen.add((t.tp, t.deployment.name))
        for m in ms:
            tot: dict[str, float] = defaultdict(float)
            for proj, fmt, silu in problems(t.model, t.tp, t.deployment):
                if silu:
                    continue
                key = f"sm{arch}/{fmt}/store/n{proj.n}/k{proj.k}"
                row = next((b for b in results.get(key, {}).get("buckets", []) if b["m"] == m), None)
                if row is None:
                    continue
                ours = _ours(row) or row["baseline_us"]
                dispatched = row["us"] if row.get("path") == "kernel" else row["baseline_us"]
                bytes_ = results[key]["weight_bytes"]
                tot["ours_ms"] += proj.count * ours / 1e3
                tot["dispatched_ms"] += proj.count * dispatched / 1e3
                read_ms = bytes_ / (results[key]["read_gbs"] * 1e3) / 1e3
                tot["roofline_ms"] += proj.count * read_ms
                if tensor_tflops:
                    mma_ms = 2 * m * proj.n * proj.k / (tensor_tflops * 1e9)
                    tot["mma_floor_ms"] += proj.count * mma_ms
                    tot["floor_ms"] += proj.count * max(read_ms, mma_ms)
                for peer, us in row["peers_us"].items():
                    tot[f"{peer}_ms"] += proj.count * us / 1e3
            if tot:
                tot_r = {k: round(v, 3) for k, v in tot.items()}
                frac = tot["roofline_ms"] / tot["ours_ms"] if tot["ours_ms"] else 0.0
                row = {"tp": t.tp, "deployment": t.deployment.name, "m": m, **tot_r,
                       "roofline_fraction": round(frac, 3)}
                if tot.get("floor_ms") and tot["dispatched_ms"]:
                    row["floor_fraction"] = round(tot["floor_ms"] / tot["dispatched_ms"], 3)
                out.append(row)
    return out


def markdown(report: dict[str, Any]) -> str:
    fp = report["fingerprint"]
    tf = report.get("tensor_tflops")
    floors = tf is not None and all("floor_ms" in t for t in report["forward_totals"])
    lines = [f"# dflashgen bench on {fp['gpu']} (sm_{fp['arch']}, {fp['sms']} SMs)", "",
             f"Measured read bandwidth: {report['read_gbs']:.0f} GB/s"
             + (f"; measured FP16 tensor rate (cuBLAS, 8192^3): {tf:.0f} TFLOP/s" if tf else "") + ". Times are "
             "medians of CUDA-graph replays with weights rotated through >= 3x L2; fraction = achieved weight-read "
             "GB/s over measured read bandwidth."
             + (" MMA floor = 2 M N K at the measured tensor rate; floor = per projection the larger of the read "
                "and MMA floors, and floor fraction = floor / dispatched." if floors else ""),
             *(["", f"**INCOMPLETE**: {len(report['failed'])} problem(s) failed to measure (listed at the end); "
                "the forward totals leave them out."] if report.get("failed") else []),
             "", "## One 64-layer forward (sum of count x time over the projection mix)", "",
             "| TP | deployment | M | dflashgen ms | dispatched ms | cuBLAS FP16 ms | cuBLAS FP8 ms | roofline ms "
             "| roofline fraction |" + (" MMA floor ms | floor fraction |" if floors else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if floors else "")]
    for t in report["forward_totals"]:
        lines.append(f"| {t['tp']} | {t['deployment']} | {t['m']} | {t['ours_ms']:.2f} | {t['dispatched_ms']:.2f} | "
                     f"{t.get('cublas_fp16_ms', float('nan')):.2f} | {t.get('cublas_fp8_ms', float('nan')):.2f} | "
                     f"{t['roofline_ms']:.2f} | {t['roofline_fraction']:.0%} |"
                     + (f" {t['mma_floor_ms']:.2f} | {t['floor_fraction']:.0%} |" if floors else ""))
    lines += ["", "## Per projection", "",
              "| problem | serves | M | ours us | GB/s | fraction | vs FP16 | vs FP8 | dispatched |",
              "|---|---|---|---|---|---|---|---|---|"]
    for key, r in sorted(report["problems"].items()):
        for b in r["buckets"]:
            ours = _ours(b)
            if ours is None:
                continue
            gbs = r["weight_bytes"] / (ours * 1e3)
            p = b["peers_us"]
            vs16 = f"{p['cublas_fp16'] / ours:.2f}x" if "cublas_fp16" in p else "-"
            vs8 = f"{p['cublas_fp8'] / ours:.2f}x" if "cublas_fp8" in p else "-"
            serves = ", ".join(s.split("/", 1)[1] for s in r["serves"][:3])
            lines.append(f"| {key} | {serves} | {b['m']} | {ours:.2f} | {gbs:.0f} | {gbs / r['read_gbs']:.0%} | "
                         f"{vs16} | {vs8} | {b['path']} |")
    if report.get("failed"):
        lines += ["", "## Failed problems", "", *(f"- `{k}`: {v}" for k, v in sorted(report["failed"].items()))]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    probs = sorted(report["problems"].items())
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for ax, fmt in zip(axes, ("nvfp4", "fp8_channel"), strict=True):
        for key, r in probs:
            if f"/{fmt}/" not in key:
                continue
            pts = [(b["m"], r["weight_bytes"] / (_ours(b) * 1e3) / r["read_gbs"]) for b in r["buckets"] if _ours(b)]
            if pts:
                label = key.split("/", 1)[1] + " (" + r["serves"][0].split("/")[-1] + ")"
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_title(f"{fmt}: fraction of measured read bandwidth")
        ax.set_xlabel("M (rows)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("roofline fraction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

