"""Time the gated-delta-rule verify step (the advance, and the step with a folded rollback) at the
Qwen3.8-27B GDN shapes per batch size, and (``--prefill``) one request's prefill of that many positions
(the sequential kernel and the chunk-form pair):
T = 8 positions, 16 key / 48 value heads, dk = dv = 128, FP32 state. CUDA-graph replays of 20 launches,
CUDA events, median of 15 replays; also the bytes of state the step reads and what that costs at
the measured read bandwidth, so `us` can be read against a floor. ``chain_us``: a verify forward's
GDN glue and step as the target runs them (gdn_inputs -> the replaying step -> gdn_gate) over 48
layers of their own state (the states from DRAM, as in a forward), per layer. Run under ncu with
``-k regex:dfg_sm90_gdn --launch-skip 2 --launch-count 1 python3 tools/gdn_bench.py --batches 8``.

    python3 tools/gdn_bench.py [--batches 1 2 4 8] [--prefill 1023 [--prefill-batches 1 4]] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
from dflashgen.runtime.gdn_io import gdn_gate, gdn_inputs
from dflashgen.runtime.gdn_kernel import gdn_advance, gdn_prefill, gdn_prefill_chunked, gdn_step

from dflashgen.gdn_family import COLS
from dflashgen.timing import replay_time

HK, HV, DK, DV, T = 16, 48, 128, 128, 8


def _graph_us(fn, reps: int = 20, samples: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return replay_time(g, calls=reps, replays=1, repeats=samples).us


def time_batch(b: int, dev: torch.device, gen: torch.Generator) -> dict[str, float]:
    """Step and advance time (us) for B requests at the model's GDN shapes."""

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen) * scale

    s0 = rnd(b, HV, DK, DV, scale=0.1)
    q, k, v = rnd(b, T, HK, DK, scale=0.1), rnd(b, T, HK, DK, scale=0.1), rnd(b, T, HV, DV)
    beta = torch.rand(b, T, HV, device=dev, generator=gen)
    log_decay = -torch.rand(b, T, HV, device=dev, generator=gen)
    o, u = torch.empty(b, T, HV, DV, device=dev), torch.empty(b, T, HV, DV, device=dev)
    decay, k_out = torch.empty(b, T, HV, device=dev), torch.empty(b, T, HK, DK, device=dev)
    n = torch.full((b,), 5, dtype=torch.long, device=dev)
    s = s0.clone()[None]  # [L = 1, B, Hv, DK, dv]

    def step() -> None:
        gdn_step(s0, q, k, v, beta, log_decay, o=o, u=u, decay=decay, k_out=k_out)

    def advance() -> None:
        gdn_advance(s, k_out[None], u[None], decay[None], n)

    s1, arrive = s0.clone(), torch.zeros(b, HK, dtype=torch.int32, device=dev)

    def step_replay() -> None:  # a rollback of 5 positions folded into the next step (writes its state)
        gdn_step(s1, q, k, v, beta, log_decay, o=o, u=u, decay=decay, k_out=k_out, replay_n=n, arrive=arrive)

    return {"B": b, "step_us": round(_graph_us(step), 2), "advance_us": round(_graph_us(advance), 2),
            "step_replay_us": round(_graph_us(step_replay), 2), "chain_us": round(time_chain(b, dev, gen), 2),
            "state_MB": round(s0.numel() * 4 / 1e6, 2), "ctas": -(-DV // COLS) * HV * b}


def time_chain(b: int, dev: torch.device, gen: torch.Generator, layers: int = 48, width: int = 4) -> float:
    """Per layer (us): gdn_inputs -> the replaying step -> gdn_gate, as a verify forward runs each GDN
    layer, over ``layers`` layers with their own states (one graph replay = one forward's GDN work)."""
    c = 2 * HK * DK + HV * DV
    cat = torch.randn(b, width - 1 + T, c, device=dev, generator=gen)
    zba = (torch.randn(b, T, HV * DV + 2 * HV, device=dev, generator=gen) * 2).half()
    conv_w = torch.randn(c, width, device=dev, generator=gen) * 0.5
    dt_bias, neg_a = torch.randn(HV, device=dev, generator=gen), -torch.rand(HV, device=dev, generator=gen) * 4
    w = torch.rand(DV, device=dev, generator=gen) + 0.5
    states = torch.randn(layers, b, HV, DK, DV, device=dev, generator=gen) * 0.1
    u = torch.zeros(layers, b, T, HV, DV, device=dev)
    decay = torch.ones(layers, b, T, HV, device=dev)
    k_out = torch.zeros(layers, b, T, HK, DK, device=dev)
    n = torch.full((b,), 5, dtype=torch.long, device=dev)
    arrive = torch.zeros(b, HK, dtype=torch.int32, device=dev)
    dims = (HK, DK, HV, DV)

    def forward() -> None:
        for i in range(layers):
            q, k, v, beta, ld = gdn_inputs(cat, zba, conv_w, dt_bias, neg_a, dims)
            o, _, _ = gdn_step(states[i], q, k, v, beta, ld, u=u[i], decay=decay[i], k_out=k_out[i], replay_n=n,
                               arrive=arrive)
            gdn_gate(o, zba, w, 1e-6)

    return _graph_us(forward, reps=1, samples=9) / layers


def time_prefill(t: int, dev: torch.device, gen: torch.Generator, b: int = 1) -> dict[str, float]:
    """B requests' prefill of t positions each (the state committed in place), per GDN layer (us): the
    sequential kernel and the chunk-form pair (prep + scan)."""
    s = torch.randn(b, HV, DK, DV, device=dev, generator=gen) * 0.1
    q, k = (torch.nn.functional.normalize(torch.randn(b, t, HK, DK, device=dev, generator=gen), dim=-1)
            for _ in range(2))  # L2-normalised, as gdn_inputs makes them
    v = torch.randn(b, t, HV, DV, device=dev, generator=gen)
    beta = torch.rand(b, t, HV, device=dev, generator=gen)
    log_decay = -torch.rand(b, t, HV, device=dev, generator=gen)
    o = torch.empty(b, t, HV, DV, device=dev)
    us = _graph_us(lambda: gdn_prefill(s, q, k, v, beta, log_decay, o=o), reps=5, samples=9)
    ck = _graph_us(lambda: gdn_prefill_chunked(s, q, k, v, beta, log_decay, o=o), reps=5, samples=9)
    return {"T": t, "B": b, "prefill_us": round(us, 1), "us_per_position": round(us / t / b, 3),
            "chunked_us": round(ck, 1), "speedup": round(us / ck, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8], help="step batches (none: skip)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[], help="prefill lengths to time")
    ap.add_argument("--prefill-batches", type=int, nargs="+", default=[1], help="requests per prefill")
    ap.add_argument("--json", default=None)
    ap.add_argument("--chain-only", action="store_true", help="time only the inputs -> step -> gate chain")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    if args.chain_only:
        for b in args.batches:
            print({"B": b, "chain_us": round(time_chain(b, dev, gen), 2)}, flush=True)
        return
    for b in args.batches:
        rows.append(time_batch(b, dev, gen))
        print(rows[-1], flush=True)
    prefill = []
    for t in args.prefill:
        for b in args.prefill_batches:
            prefill.append(time_prefill(t, dev, gen, b))
            print(prefill[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "T": T, "rows": rows, "prefill": prefill}, f, indent=1)


if __name__ == "__main__":
    main()
