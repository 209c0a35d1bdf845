"""`dflashgen attn-bench`: the grouped verification attention kernels against their baselines, measured
in one run on the GPU at hand.

Per head layout (Qwen3.8-27B at TP1: 24 query / 4 KV heads; per TP4 rank: 6 / 1), context length
(1K, 4K, 16K, 32K cached tokens + 8 verify rows) and batch (1, 2, 4, 8), FP16 KV in 16-token pages:
- ours: the default schedule the runtime serves (and each benchmark-only schedule variant);
- per-request: our kernel launched once per request (what a per-request loop costs);
- SDPA flash / efficient: ``torch.nn.functional.scaled_dot_product_attention`` forced onto each
  backend, on an equivalent contiguous KV ``[B, Hkv, ctx + 8, D]`` (GQA without expansion, lower-right
  causal mask when the backend takes it; otherwise unmasked, which reads the same bytes).
Every variant is timed as a CUDA graph over enough KV copies that the working set is >= 3x L2, with
CUDA events, median of repeats (``timing.graph_time``). The KV-read roofline is the KV bytes over the
read bandwidth measured in the same run. JSON + Markdown in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HEADS = {"tp1": (24, 4), "tp4": (6, 1)}
CONTEXTS = (1024, 4096, 16384, 32768)
BATCHES = (1, 2, 4, 8)
NQ, D, PAGE = 8, 256, 16


def _sdpa_fn(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Callable[[], None], str]:
    """A callable running SDPA on one backend, and how it masks; raises if the backend refuses."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    be = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    masks: list[tuple[Any, str]] = [(causal_lower_right(q.shape[2], k.shape[2]), "causal"), (None, "unmasked")]
    last: Exception | None = None
    for mask, label in masks:
        def call(mask: Any = mask) -> None:
            with sdpa_kernel(be):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        try:
            call()
            torch.cuda.synchronize()
            return call, label
        except Exception as e:  # this backend does not take this combination: try the next
            last = e
    raise RuntimeError(f"SDPA {backend}: {last}")


def _point(hq: int, hkv: int, ctx: int, nb: int, variants: list[dict[str, Any]], bw: float,
           capacity: int = 0) -> dict[str, Any]:
    from .runtime.attention_kernel import paged_verify_attention, serving_entry
    from .timing import copies_for, graph_time

    def timed(step: Callable[[int], None]) -> float:
        return graph_time(step, copies, replays=5, repeats=5).us

    dev = torch.device("cuda")
    n = ctx + NQ
    blocks = -(-n // PAGE)
    kv_bytes = nb * hkv * n * D * 2 * 2
    copies = copies_for(kv_bytes, dev)
    g = torch.Generator(device=dev).manual_seed(ctx + nb)
    nblk = copies * nb * blocks
    k_pool = torch.randn(nblk, PAGE, hkv, D, device=dev, generator=g).half()
    v_pool = torch.randn(nblk, PAGE, hkv, D, device=dev, generator=g).half()
    perm = torch.randperm(nblk, device=dev, generator=g).to(torch.int32)
    tables = [perm[c * nb * blocks:(c + 1) * nb * blocks].view(nb, blocks).contiguous() for c in range(copies)]
    # Our kernels size their grid for the table's capacity (splits past a request's own count exit):
    # `capacity` > the context widens the tables (spare entries: a valid id, never read), as in serving,
    # where the table holds the longest context. SDPA and the per-request loop are unaffected.
    wide = -(-capacity // PAGE) - blocks
    wtables = [torch.cat([t, t[:, :1].expand(nb, wide)], 1).contiguous() for t in tables] if wide > 0 else tables
    lengths = torch.full((nb,), n, dtype=torch.int32, device=dev)
    q = torch.randn(nb, NQ, hq, D, device=dev, generator=g).half()
    out = torch.empty(nb, NQ, hq, D, dtype=torch.float32, device=dev)
    row: dict[str, Any] = {"ctx": ctx, "B": nb, "kv_bytes": kv_bytes, "roofline_us": kv_bytes / bw * 1e6,
                           "capacity": max(capacity, blocks * PAGE)}

    def ours(name: str | None) -> Callable[[int], None]:
        return lambda i: paged_verify_attention(q, k_pool, v_pool, wtables[i], lengths, out=out, kernel=name,
                                                validate=False)

    for v in variants:
        row.setdefault("schedules", {})[v["name"]] = timed(ours(v["name"]))
    default = next(v for v in variants if v["default"])
    # what the runtime serves: the default schedule, or its deep twin where this batch at this table
    # width keeps one CTA per SM (runtime/attention_kernel.py serving_entry; the same bits either way)
    served = serving_entry(default, nb, wtables[0].shape[1] * PAGE, dev.index or torch.cuda.current_device())
    row["ours_kernel"] = served["name"]
    row["ours_us"] = row["schedules"][served["name"]] if served["name"] in row["schedules"] else timed(ours(None))
    outs = [out[b:b + 1] for b in range(nb)]

    def per_request(i: int) -> None:
        for b in range(nb):
            paged_verify_attention(q[b:b + 1], k_pool, v_pool, tables[i][b:b + 1], lengths[b:b + 1], out=outs[b],
                                   validate=False)

    row["per_request_us"] = timed(per_request)
    # The same bytes as contiguous [B, Hkv, n, D] per copy (the SDPA layout).
    ks = [k_pool[t.long()].view(nb, blocks * PAGE, hkv, D)[:, :n].transpose(1, 2).contiguous() for t in tables]
    vs = [v_pool[t.long()].view(nb, blocks * PAGE, hkv, D)[:, :n].transpose(1, 2).contiguous() for t in tables]
    qs = q.transpose(1, 2).contiguous()
    for be in ("flash", "efficient"):
        try:
            fns = [_sdpa_fn(be, qs, ks[c], vs[c]) for c in range(copies)]
            row[f"sdpa_{be}_us"] = timed(lambda i, fns=fns: fns[i][0]())
            row[f"sdpa_{be}_mask"] = fns[0][1]
        except Exception as e:
            row[f"sdpa_{be}_us"], row[f"sdpa_{be}_error"] = None, str(e).splitlines()[0][:200]
    base = {k: row[k] for k in ("per_request_us", "sdpa_flash_us", "sdpa_efficient_us") if row.get(k)}
    row["best_baseline"] = min(base, key=base.__getitem__)
    row["speedup_vs_best"] = base[row["best_baseline"]] / row["ours_us"]
    row["roofline_frac"] = row["roofline_us"] / row["ours_us"]
    row["best_schedule_frac"] = row["roofline_us"] / min(row["schedules"].values())
    return row


def run(out_dir: Path, contexts: tuple[int, ...] = CONTEXTS, batches: tuple[int, ...] = BATCHES,
        heads: tuple[str, ...] = tuple(HEADS), capacity: int = 0, only: str | None = None) -> dict[str, Any]:
    """``only``: a regex on kernel names; the race keeps the matching candidates (the default always runs)."""
    from .runtime.attention_kernel import attention_entries, kernel_arch
    from .timing import read_bandwidth

    t0 = time.time()
    dev = torch.device("cuda")
    arch = kernel_arch(dev)
    bw = read_bandwidth(dev) * 1e9
    rep: dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev), "kernel_arch": arch, "read_GBps": bw / 1e9,
                           "torch": torch.__version__, "nq": NQ, "head_dim": D, "page": PAGE, "kv": "fp16",
                           "capacity": capacity, "only": only, "rows": []}
    for tag in heads:
        hq, hkv = HEADS[tag]
        variants = sorted((e for e in attention_entries()
                           if (e["arch"], e["hq"], e["hkv"], e["kv"], e["page"]) == (arch, hq, hkv, "fp16", PAGE)
                           and (e["default"] or not only or re.search(only, e["name"]))),
                          key=lambda e: (not e["default"], e["name"]))
        for ctx in contexts:
            for nb in batches:
                row = _point(hq, hkv, ctx, nb, variants, bw, capacity)
                row.update(heads=tag, hq=hq, hkv=hkv, default=variants[0]["name"])
                rep["rows"].append(row)
                print(f"attn-bench {tag} ctx {ctx:>5} B {nb}: ours {row['ours_us']:8.1f} us "
                      f"({100 * row['roofline_frac']:4.1f}% roofline), best baseline {row['best_baseline']} "
                      f"x{row['speedup_vs_best']:.2f}", flush=True)
                torch.cuda.empty_cache()
    rep["seconds"] = time.time() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attn-bench.json").write_text(json.dumps(rep, indent=1, sort_keys=True))
    (out_dir / "attn-bench.md").write_text(markdown(rep))
    return rep


def _us(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def race_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per head layout, each schedule over every measured (ctx, B): geometric-mean time relative to the
    served default, worst point, points where it is the fastest schedule, points slower than the best
    baseline, and its mean KV-roofline fraction at 16K. What promoting it to `default_for` would give."""
    out = ["Schedule race (time / default's time: geomean, worst; wins; points slower than the best "
           "baseline; mean % roofline at 16K):", "",
           "| heads | schedule | geomean | worst | wins | slower than baseline | % roofline 16K |",
           "|---|---|---|---|---|---|---|"]
    for tag in sorted({r["heads"] for r in rows}):
        rs = [r for r in rows if r["heads"] == tag]
        names = sorted({n for r in rs for n in r["schedules"]})
        stats = []
        for n in names:
            pts = [r for r in rs if r["schedules"].get(n)]
            if not pts:
                continue
            ratios = [r["schedules"][n] / r["ours_us"] for r in pts]
            base = [min(v for k in ("per_request_us", "sdpa_flash_us", "sdpa_efficient_us") if (v := r.get(k)))
                    for r in pts]
            wins = sum(1 for r in pts if r["schedules"][n] == min(r["schedules"].values()))
            slow = sum(1 for r, b in zip(pts, base, strict=True) if r["schedules"][n] > b)
            r16 = [r["roofline_us"] / r["schedules"][n] for r in pts if r["ctx"] == 16384]
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            stats.append((geo, n, max(ratios), wins, slow, len(pts), sum(r16) / len(r16) if r16 else math.nan))
        for geo, n, worst, wins, slow, npts, f16 in sorted(stats):
            out.append(f"| {tag} | `{n}` | {geo:.2f} | {worst:.2f} | {wins}/{npts} | {slow}/{npts} "
                       f"| {100 * f16:.0f}% |")
    return out


def rule_table(rows: list[dict[str, Any]]) -> list[str]:
    """The served schedule's split rule per (heads, ctx, B): its time vs its fixed-split twin's (the same
    schedule without the ``_le<len>s<split>`` tiers, raced as a candidate), and the best baseline."""
    out = ["Split rule effect (served schedule vs the same schedule at its fixed split):", "",
           "| heads | ctx | B | with rule us | fixed split us | ratio | best baseline us |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        twin = re.sub(r"(_le\d+s\d+)+$", "", r["default"])
        if twin == r["default"] or twin not in r["schedules"]:
            continue
        base = min((v for k in ("per_request_us", "sdpa_flash_us", "sdpa_efficient_us") if (v := r.get(k))),
                   default=None)
        mine = r["schedules"][r["default"]]
        out.append(f"| {r['heads']} | {r['ctx']} | {r['B']} | {_us(mine)} | {_us(r['schedules'][twin])} "
                   f"| {mine / r['schedules'][twin]:.2f} | {_us(base)} |")
    return out if len(out) > 4 else []


def markdown(rep: dict[str, Any]) -> str:
    lines = [f"# Grouped verification attention on {rep['gpu']} (sm_{rep['kernel_arch']} kernels)", "",
             f"FP16 KV, page {rep['page']}, {rep['nq']} verify rows, head_dim {rep['head_dim']}; "
             f"measured read bandwidth {rep['read_GBps']:.0f} GB/s; CUDA graphs, medians; "
             f"{rep['seconds']:.0f} s." + (f" Our kernels' block tables hold {rep['capacity']} tokens (grid sized "
                                           f"for that capacity)." if rep.get("capacity") else ""), "",
             "`ours` is what the runtime serves: the default schedule, or (`deep`) its deeper-ring twin where "
             "the batch at the table's width keeps one CTA per SM (the same bits).", "",
             "| heads | ctx | B | ours us | served | % KV roofline | best schedule % | per-request us | SDPA flash us "
             "| SDPA efficient us | best baseline | ours vs best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        served = "default" if r.get("ours_kernel", r["default"]) == r["default"] else "deep"
        lines.append(f"| {r['heads']} ({r['hq']}/{r['hkv']}) | {r['ctx']} | {r['B']} | {_us(r['ours_us'])} | {served} "
                     f"| {100 * r['roofline_frac']:.0f}% | {100 * r['best_schedule_frac']:.0f}% "
                     f"| {_us(r['per_request_us'])} | {_us(r.get('sdpa_flash_us'))} "
                     f"| {_us(r.get('sdpa_efficient_us'))} | {r['best_baseline']} | x{r['speedup_vs_best']:.2f} |")
    lines += ["", "Schedules (us per call):", ""]
    names = sorted({n for r in rep["rows"] for n in r["schedules"]})
    for n in names:
        vals = [f"{r['heads']}/{r['ctx']}/B{r['B']}: {_us(r['schedules'][n])}" for r in rep["rows"]
                if n in r["schedules"]]
        lines.append(f"- `{n}`: " + ", ".join(vals))
    lines += ["", *race_table(rep["rows"])]
    if rule := rule_table(rep["rows"]):
        lines += ["", *rule]
    masks = {r.get("sdpa_flash_mask") for r in rep["rows"]} | {r.get("sdpa_efficient_mask") for r in rep["rows"]}
    errs = {r.get(k) for r in rep["rows"] for k in ("sdpa_flash_error", "sdpa_efficient_error") if r.get(k)}
    lines += ["", f"SDPA masks used: {sorted(m for m in masks if m)}; errors: {sorted(errs) or 'none'}", ""]
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("attn-bench", help="verify attention kernels vs SDPA and per-request launches (GPU)")
    p.add_argument("--out", default="bench/attention")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--heads", nargs="+", choices=sorted(HEADS), default=list(HEADS))
    p.add_argument("--capacity", type=int, default=0,
                   help="block-table capacity in tokens for our kernels (default: the context, rounded to pages); "
                        "larger = the serving case, where the grid covers the longest context")
    p.add_argument("--only", default=None,
                   help="regex on kernel names: race only the matching candidates (and the served default), "
                        "e.g. '_wg1_' for the sm_90a warpgroup-MMA kernels")

    def main(args: argparse.Namespace) -> int:
        rep = run(Path(args.out), tuple(args.contexts), tuple(args.batches), tuple(args.heads), args.capacity,
                  args.only)
        print((Path(args.out) / "attn-bench.md").read_text())
        print(f"wrote {args.out}/attn-bench.json, attn-bench.md ({rep['seconds']:.0f} s)")
        return 0

    p.set_defaults(fn=main)
