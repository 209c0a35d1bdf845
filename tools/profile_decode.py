"""Where a decode round's time goes (torch.profiler, CUDA + CPU): the full-size Qwen3.8-27B-shaped
synthetic target with the replay drafter, as ``dflashgen decode-bench`` runs it, profiled over the
steady-state rounds of one batch of B requests (prefill excluded: one stalling joint prefill of the
B prompts, so no prefill runs beside the profiled rounds).

    python3 tools/profile_decode.py [--batches 1 8] [--layers 64] [--rounds 12] [--trace DIR]
                                    [--joiner [--prefill-sm-carveout N]]

Prints per B: wall ms per round, the kernels by total CUDA time (count per round), and the CPU ops
by total CPU time. --trace writes a Chrome trace per B (gzip). --joiner: one more request waits,
and request 0 stops after its first round, so the joiner's prefill runs on the side stream beside
the profiled rounds (overlapped prefill, opt-in since session 36): what it costs the rounds, and
(--trace) whether their kernels wait behind the prefill's; --prefill-sm-carveout as decode-bench's."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from dflashgen.runtime.decode_bench import (
    NUM_DRAFT,
    BenchConfig,
    _block_drafter,
    _make_drafter,
    _params_for,
    load_target,
    make_prompts,
    replay_continuations,
    write_synthetic,
)
from dflashgen.runtime.spec_decode import SpecDecoder
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from trace_gaps import write_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--joiner", action="store_true", help="profile rounds with a joiner prefilling beside them")
    ap.add_argument("--prefill-sm-carveout", type=int, default=None)
    a = ap.parse_args()
    d = tempfile.mkdtemp()
    t0 = time.perf_counter()
    write_synthetic(d, None, a.layers, None, seed=0, device="cuda")
    target = load_target(d, device="cuda")
    print(f"synthetic target written + loaded in {time.perf_counter() - t0:.1f} s")
    out_len = (a.rounds + 4) * (NUM_DRAFT + 1)  # more than the profiled rounds at full acceptance
    for b in a.batches:
        n_req = b + 1 if a.joiner else b
        cfg = BenchConfig(prompts=n_req, prompt_len=a.prompt_len, output_len=out_len, batches=(b,))
        prompts = make_prompts(n_req, cfg.prompt_len, target.cfg.vocab_size, 0)
        params = _params_for(cfg, n_req)
        # --joiner: request 0 leaves after its first round, request b then prefills beside the rounds
        max_new = [NUM_DRAFT + 1] + [out_len] * (n_req - 1) if a.joiner else out_len
        conts = replay_continuations(target, prompts, out_len + NUM_DRAFT, cfg)
        block = _block_drafter(target, 0)
        max_len = cfg.prompt_len + out_len
        dec = SpecDecoder(target, _make_drafter(cfg, target, block, conts, b, max_len), max_batch=b,
                          max_len=max_len, num_draft=NUM_DRAFT, overlap_prefill=a.joiner,
                          prefill_sm_carveout=a.prefill_sm_carveout)  # without --joiner: all B rows from round 1
        dec.generate(prompts[:b], params[:b], 2 * (NUM_DRAFT + 1))  # warm-up: capture, first-use builds
        rounds = {"n": 0}
        prof_box: dict[str, profile] = {}

        def observer(event: str, rid: int, n: int, rounds=rounds, prof_box=prof_box, dec=dec) -> None:
            # start after the first round (prefill done), stop after a.rounds more
            if event != "tokens" or len(dec.stats.rounds) == rounds["n"]:
                return
            rounds["n"] = len(dec.stats.rounds)
            if rounds["n"] == 1:
                torch.cuda.synchronize()
                p = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                p.__enter__()
                prof_box["p"] = p
                rounds["t"] = time.perf_counter()
            elif rounds["n"] == a.rounds + 1 and "p" in prof_box:
                torch.cuda.synchronize()
                rounds["wall"] = time.perf_counter() - rounds["t"]
                prof_box["p"].__exit__(None, None, None)

        dec.observer = observer
        dec.generate(prompts, params, max_new)
        if "wall" not in rounds:
            print(f"B={b}: fewer than {a.rounds + 1} rounds ran; nothing profiled")
            continue
        prof = prof_box["p"]
        n = a.rounds
        summ = dec.stats.summary()
        print(f"\n===== B={b}: {rounds['wall'] * 1e3 / n:.2f} ms wall per round over {n} rounds "
              f"(accepted length {summ['mean_acceptance_length']:.2f}"
              + (f"; a joiner prefilling beside them, {summ['overlapped_prefills']} overlapped prefill(s)"
                 + (f", SM carveout {a.prefill_sm_carveout}" if a.prefill_sm_carveout else "") if a.joiner else "")
              + ")")
        ka = prof.key_averages()
        kernels = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in kernels) / 1e3 / n
        print(f"GPU kernel time per round: {total:.2f} ms; launches per round: "
              f"{sum(e.count for e in kernels) / n:.0f}")
        print(f"{'ms/round':>9} {'count/round':>11}  kernel")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:45]:
            print(f"{e.self_device_time_total / 1e3 / n:9.3f} {e.count / n:11.1f}  {e.key[:110]}")
        print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
        if a.trace:
            Path(a.trace).mkdir(parents=True, exist_ok=True)
            write_trace(prof, Path(a.trace) / f"decode-B{b}.json.gz")


if __name__ == "__main__":
    main()
