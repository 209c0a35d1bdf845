"""Time one round's draft pass of the static-slot DFlash2 drafter alone (the decode loop's "draft" phase
without the host work around it): the Qwen3.8-27B drafter (5 layers, FP16 weights, the target's
vocabulary for the shared embedding and lm_head, random), every slot's context filled to --ctx
positions, the CUDA graph of batch B replayed; CUDA events, median of 25 replays per B
(dflashgen.timing.replay_time).

    python3 tools/draft_bench.py [--batches 1 2 4 8] [--ctx 1100] [--json PATH] [--ab-unfused]

--ab-unfused: also capture the pass with ``fused_projections=False`` (q / k / v and gate / up one GEMM
each) and time the two graphs alternating, three times per B.
"""

from __future__ import annotations

import argparse
import json

import torch
from dflashgen.runtime.drafter import BlockDrafter, DrafterConfig, StaticDFlashDrafter

from dflashgen.timing import replay_time

VOCAB = 248320


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ctx", type=int, default=1100, help="context positions per slot")
    ap.add_argument("--max-len", type=int, default=1536)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ab-unfused", action="store_true", help="also time the pass with one GEMM per projection")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = DrafterConfig()
    embed = torch.randn(VOCAB, cfg.hidden_size, device=dev, dtype=torch.float16) * 0.02
    lm_head = torch.nn.Linear(cfg.hidden_size, VOCAB, bias=False, device=dev, dtype=torch.float16)
    block = BlockDrafter(cfg, embed, lm_head, dtype=torch.float16, device=dev, act_dtype=torch.float16)
    variants = {"fused": True, **({"unfused": False} if args.ab_unfused else {})}
    statics = {}
    for name, fused in variants.items():
        block.fused_projections = fused  # read while the graphs are captured
        statics[name] = static = StaticDFlashDrafter(block, max(args.batches), args.max_len)
        static.capture()
        for k, v in zip(static.k, static.v, strict=True):  # stand-in context keys / values
            k.normal_(0, 1)
            v.normal_(0, 1)
        static.ctx_len.fill_(args.ctx)
        static.h_base.fill_(args.ctx)
        static.h_keep.zero_()  # the staged round appends nothing countable: every replay sees the same context
    rows = []
    for b in args.batches:
        for rep in range(3 if args.ab_unfused else 1):  # alternating: clocks drift within a call
            for name, static in statics.items():
                graph, _ = static._graphs[b]
                for _ in range(3):
                    graph.replay()
                t = replay_time(graph, replays=1, repeats=25)
                rows.append({"B": b, "variant": name, "run": rep, "draft_ms": round(t.us / 1e3, 3),
                             "noise_ms": round(t.noise_us / 1e3, 3), "ctx": args.ctx})
                print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
