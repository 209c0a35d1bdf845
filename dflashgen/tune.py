"""`dflashgen tune`: race the generated kernels against the baselines per projection and M bucket
on the GPU at hand, admit only verified measured winners, and write tuning/<gpu>.json.

Per problem (arch, format, epilogue, N, K):
1. prune candidates with a cost model (bytes incl. re-reads when rows < M, MMA work, waves);
2. verify every survivor (rel L2 <= 1e-3, bitwise batch invariance vs M = 1 and 8-row slices);
3. time survivors and baselines (cuBLAS FP16 on pre-dequantized weights, cuBLAS FP8 via
   torch._scaled_mm where the GPU has FP8, and the dequantize+matmul fallback) with rotated
   weights in CUDA graphs (dflashgen.timing);
4. choose the K plan once per problem jointly over all buckets (the sum of best times), then per
   bucket the fastest tile of that plan; admit it only if it beats the best baseline by more than
   the measured noise, otherwise record the fallback and why.
Results are journaled after every problem, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .prepack import Layout, PackedWeight, prepack
from .schedule import KernelSpec, KPlan, Tile, model_us
from .timing import Timing, copies_for, graph_time, read_bandwidth
from .verify import random_packed

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
SERVABLE_PEERS = ("cublas_fp16", "fallback")
# L2 prefetch depths (K groups per weight stream, runtime/kernels.py) raced per served sm_90 bucket
# against the runtime's default; a depth is recorded only where it beats the default beyond noise
PREFETCH_DEPTHS = (0, 1, 2, 4, 6)
SMS = {70: 80, 80: 108, 90: 132}  # reference parts (V100, A100, H100/H200)


@dataclass
class Problem:
    arch: int
    fmt: str
    silu: bool
    n: int
    k: int
    serves: list[str] = field(default_factory=list)
    count: int = 0  # instances per forward (for weighted totals)

    @property
    def key(self) -> str:
        return f"sm{self.arch}/{self.fmt}/{'silu' if self.silu else 'store'}/n{self.n}/k{self.k}"

    @property
    def weight_bytes(self) -> int:
        per = 0.5 + 1 / 16 if self.fmt == "nvfp4" else 1.0
        return int(self.n * self.k * per)


def spec_of(entry: dict[str, Any]) -> KernelSpec:
    """The schedule's KernelSpec behind a manifest entry (missing knobs at their defaults)."""
    kp, t = entry["kplan"], entry["tile"]
    lay = Layout(entry["arch"], entry["format"], entry["n"], entry["k"])
    # knobs a manifest entry leaves out (it drops those at their off value) take the Tile's defaults;
    # the earliest entries also left out warps_n and stages
    tile = Tile(**{"warps_n": 2, "stages": 3, **{f.name: t[f.name] for f in fields(Tile) if f.name in t}})
    threads = entry.get("threads", 32 * tile.warps_n * kp.get("warps_k", 1))
    plan = KPlan(split_k=kp.get("split_k", 1), warps_k=kp.get("warps_k", threads // (32 * tile.warps_n)),
                 k_group=kp.get("k_group", lay.k_group), wgmma=kp.get("wgmma", 0))
    return KernelSpec(entry["arch"], entry["format"], entry["n"], entry["k"], entry.get("epilogue") == "silu",
                      plan, tile)


def model_time_us(entry: dict[str, Any], m: int, bw_gbs: float, sms: int = 0) -> float:
    """The schedule's cost model (dflashgen.schedule.model_us: bytes, MMA work, bytes in flight,
    issue on the busiest SM, ramp, split-K reduce tail) for a manifest entry."""
    return model_us(spec_of(entry), m, bw_gbs, sms or SMS.get(entry["arch"], 100))


def prune(entries: list[dict[str, Any]], m: int, bw_gbs: float, keep: float = 1.6,
          keep_x_smem: float = 1.8) -> list[dict[str, Any]]:
    """Candidates within `keep` x the cost model's best, per K plan: the tuner chooses the plan
    jointly over all buckets, so every plan keeps its own leaders at every M. Within a plan the
    x_smem tiles are ranked among themselves (within `keep_x_smem` of their best): only they carry
    the model's L1TEX / L2 traffic terms, which are calibrated on one ncu point, so they neither
    crowd out the register-path tiles nor get dropped against those tiles' leaner model. Serial
    tiles (one CTA walks all K workers: few warps, modelled latency-bound) likewise among themselves, and
    the producer tiles among themselves (the model does not see their producer warp), those with
    wgmma consumers apart again."""
    by_plan: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for e in entries:
        t = e["tile"]  # groups: register path 0, x_smem 1, serial 2, producer 4, wgmma producer 8
        group = (int(t.get("x_smem", 0)) + int(t.get("serial", 0)) + 2 * min(1, int(t.get("producer", 0)))
                 + 4 * int(t.get("wgc", 0)))
        by_plan[(json.dumps(e["kplan"], sort_keys=True), group)].append(e)
    out = []
    for plan in sorted(by_plan):
        # ties (rows that all cover M) go to the smallest tile: least padded work
        scored = sorted(by_plan[plan], key=lambda e: (model_time_us(e, m, bw_gbs), e["tile"]["rows"], e["name"]))
        best = model_time_us(scored[0], m, bw_gbs)
        factor = max(keep, keep_x_smem) if plan[1] else keep
        out += [e for e in scored if model_time_us(e, m, bw_gbs) <= factor * best]
    return sorted(out, key=lambda e: (model_time_us(e, m, bw_gbs), e["tile"]["rows"], e["name"]))


def problems_regex(probs: list[Problem]) -> str:
    """Kernel-name regex for every candidate of these problems (``sm90/fp8_channel/store/n5120/k1536``
    -> ``dfg_sm90_fp8_store_n5120_k1536_...``): what a run over them builds and loads."""
    keys = "|".join(re.escape(f"{p.fmt.replace('fp8_channel', 'fp8')}_{'silu' if p.silu else 'store'}_n{p.n}_k{p.k}_")
                    for p in probs)
    return f"^dfg_sm{probs[0].arch}_({keys})" if probs else "^$"


def problems_for(targets: list[Any], arch: int) -> list[Problem]:
    from .render import problems

    out: dict[str, Problem] = {}
    seen = set()
    for t in targets:
        if (t.model, t.tp, t.deployment.name) in seen:  # one target per arch lists the same projections
            continue
        seen.add((t.model, t.tp, t.deployment.name))
        for proj, fmt, silu in problems(t.model, t.tp, t.deployment):
            p = Problem(arch, fmt, silu, proj.n, proj.k)
            p = out.setdefault(p.key, p)
            p.serves.append(f"{t.model}/tp{t.tp}/{proj.name}" + ("+silu" if silu else ""))
            p.count += proj.count
    return [out[k] for k in sorted(out)]


def selected(problems: list[Problem], only: str | None) -> list[Problem]:
    """The problems whose key (``sm90/nvfp4/store/n5120/k1536``) matches the regex ``only`` (all: None)."""
    return [p for p in problems if not only or re.search(only, p.key)]


@dataclass
class Baselines:
    """Peers on the same problem, same M, same run."""

    fp16: dict[int, Timing] = field(default_factory=dict)
    fp8: dict[int, Timing] = field(default_factory=dict)
    fallback: dict[int, Timing] = field(default_factory=dict)


def _weights(p: Problem, device: torch.device, seed: int) -> tuple[Any, PackedWeight]:
    return random_packed(p.arch, p.fmt, p.n, p.k, p.silu, device, torch.Generator(device=device).manual_seed(seed))


def rotated_copies(packed: PackedWeight, copies: int) -> list[PackedWeight]:
    """``packed`` and copies - 1 clones of its streams: the same codes in distinct buffers, so a chain
    that rotates through them reads every call's weights from DRAM."""
    return [packed] + [PackedWeight(packed.layout, packed.weights.clone(),
                                    None if packed.scales is None else packed.scales.clone(), packed.col_scale)
                       for _ in range(copies - 1)]


def time_kernel(kern: Any, packed: PackedWeight, x: torch.Tensor, copies: int,
                prefetch: int | None = None) -> Timing:
    ws = rotated_copies(packed, copies)
    out = torch.empty((x.shape[0], kern.n_out), dtype=torch.float16, device=x.device)
    return graph_time(lambda i: kern(x, ws[i], out, prefetch=prefetch), copies)


def pick_prefetch(default: Timing, default_depth: int, by_depth: dict[int, Timing]) -> tuple[int | None, str]:
    """Pure choice (testable without a GPU): the fastest raced depth if it beats the default rule's
    time beyond the combined noise, else None (the table then leaves the default in place)."""
    depth = min(sorted(by_depth), key=lambda k: by_depth[k].us, default=None)
    if depth is None or depth == default_depth or not by_depth[depth].beats(default):
        return None, f"L2 prefetch: the default ({default_depth} groups, {default.us:.2f} us) kept"
    return depth, (f"L2 prefetch {depth} groups {by_depth[depth].us:.2f} us beats the default "
                   f"({default_depth} groups) {default.us:.2f} us")


def race_prefetch(buckets: list[dict[str, Any]], kernels: dict[str, Any], timings: dict[str, dict[int, Timing]],
                  packed: PackedWeight, k: int, copies: int, device: torch.device) -> None:
    """Per bucket served by an sm_90 kernel, time it at PREFETCH_DEPTHS and record a depth that beats
    the default (``prefetch_groups``, ``us`` at it, every depth's time in ``prefetch_us``)."""
    for b in buckets:
        kern = kernels.get(b.get("kernel") or "")
        if b.get("path") != "kernel" or kern is None or kern.arch < 90 or kern.prefetch_from_env:
            continue
        m, default = b["m"], timings[b["kernel"]][b["m"]]
        default_depth = kern.prefetch_for(m)
        x = torch.randn(m, k, device=device, dtype=torch.float16)
        by_depth = {d: time_kernel(kern, packed, x, copies, prefetch=d) for d in PREFETCH_DEPTHS if d != default_depth}
        b["prefetch_us"] = {str(d): round(t.us, 3) for d, t in sorted({**by_depth, default_depth: default}.items())}
        depth, why = pick_prefetch(default, default_depth, by_depth)
        if depth is not None:
            b.update(prefetch_groups=depth, us=by_depth[depth].us)
        b["why"] = f"{b['why']}; {why}"


def time_baselines(p: Problem, w: Any, ms: tuple[int, ...], device: torch.device, fp8_ok: bool) -> Baselines:
    from dflashgen.runtime.library import fallback_gemm

    b = Baselines()
    w16 = w.dequantize().to(torch.float16)
    copies = copies_for(w16.numel() * 2, device)
    w16s = [w16] + [w16.clone() for _ in range(copies - 1)]
    for m in ms:
        x = torch.randn(m, p.k, device=device, dtype=torch.float16)
        o = torch.empty(m, p.n, device=device, dtype=torch.float16)
        b.fp16[m] = graph_time(lambda i, x=x, o=o, ws=w16s: torch.matmul(x, ws[i].t(), out=o), copies)
    w16s.clear()
    if fp8_ok:
        w8 = w16.to(torch.float8_e4m3fn)
        c8 = copies_for(w8.numel(), device)
        w8s = [w8] + [w8.clone() for _ in range(c8 - 1)]
        sb = torch.ones(1, p.n, device=device)
        for m in ms:
            mp = max(16, (m + 15) // 16 * 16)  # _scaled_mm wants M a multiple of 16
            x8 = torch.randn(mp, p.k, device=device).to(torch.float8_e4m3fn)
            sa = torch.ones(mp, 1, device=device)
            try:
                b.fp8[m] = graph_time(lambda i, x8=x8, sa=sa, ws=w8s: torch._scaled_mm(
                    x8, ws[i].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), c8)
            except (RuntimeError, TypeError):
                break
        w8s.clear()
    packed = prepack(w, Layout(p.arch, p.fmt, p.n, p.k, p.silu))
    for m in ms:
        x = torch.randn(m, p.k, device=device, dtype=torch.float16)
        b.fallback[m] = graph_time(lambda i, x=x: fallback_gemm(x, packed), 1, replays=3, repeats=3)
    return b


def choose(ms: tuple[int, ...], timings: dict[str, dict[int, Timing]], plans: dict[str, str],
           peers: dict[int, dict[str, Timing]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Pure selection (testable without a GPU): one K plan for all buckets, chosen by the sum of
    per-bucket best times (batch invariance forbids switching plans with M; sums within their noise
    are decided by the time relative to each bucket's best), then per bucket the fastest tile of
    that plan, admitted only if it beats the best peer by more than the noise."""
    by_plan: dict[str, list[str]] = defaultdict(list)
    for name in timings:
        by_plan[plans[name]].append(name)

    def plan_times(names: list[str]) -> dict[int, Timing]:
        # a bucket the runtime serves from a peer anyway costs the peer's time, whatever the plan
        out = {}
        for m in ms:
            servable = [t for k, t in peers[m].items() if k in SERVABLE_PEERS] or [Timing(1e9, 0.0)]
            out[m] = min([timings[n][m] for n in names if m in timings[n]] + [min(servable, key=lambda t: t.us)],
                         key=lambda t: t.us)
        return out

    costs = {k: plan_times(by_plan[k]) for k in sorted(by_plan)}
    total = {k: sum(t.us for t in c.values()) for k, c in costs.items()}
    noise = {k: sum(t.noise_us for t in c.values()) for k, c in costs.items()}
    plan = min(total, key=lambda k: total[k]) if total else None
    if plan is not None:
        # Plans whose sums differ by less than their noise are a tie (their sums flip between runs, the
        # large-M buckets weighing most): take the one fastest relative to each bucket's best instead.
        tied = [k for k in total if total[k] - total[plan] <= noise[k] + noise[plan]]
        best = {m: min(c[m].us for c in costs.values()) for m in ms}
        plan = min(tied, key=lambda k: (sum(costs[k][m].us / best[m] for m in ms), total[k]))
    buckets = []
    for m in ms:
        pm = peers[m]
        # Admission is against the peers the runtime can actually serve instead: cuBLAS FP16 on
        # (cached) dequantized weights and dequantize+matmul. cuBLAS FP8 is reported, not used to
        # admit: it needs FP8 activations, which breaks the 1e-3 accuracy contract.
        servable = {k: v for k, v in pm.items() if k in SERVABLE_PEERS} or pm
        best_peer = min(servable, key=lambda k: servable[k].us)
        names = [n for n in (by_plan[plan] if plan else []) if m in timings[n]]
        row: dict[str, Any] = {"m": m, "baseline": best_peer, "baseline_us": pm[best_peer].us,
                               "noise_us": pm[best_peer].noise_us, "peers_us": {k: v.us for k, v in pm.items()}}
        if names:
            best = min(names, key=lambda n: (timings[n][m].us, n))
            t = timings[best][m]
            row.update(candidate=best, candidate_us=t.us, candidate_noise_us=t.noise_us)
            if t.beats(pm[best_peer]):
                gain = pm[best_peer].us - t.us
                row.update(path="kernel", kernel=best, us=t.us,
                           why=f"beats {best_peer} by {gain:.2f} us (noise {t.noise_us + pm[best_peer].noise_us:.2f})")
            else:
                row.update(path="fallback", kernel=None, us=None,
                           why=f"best kernel {t.us:.2f} us does not beat {best_peer} {pm[best_peer].us:.2f} us")
        else:
            row.update(path="fallback", kernel=None, us=None, why="no verified candidate")
        buckets.append(row)
    return plan, buckets


def tune_problem(p: Problem, entries: list[dict[str, Any]], images: dict[str, tuple[Path, str]],
                 device: torch.device, bw_gbs: float, ms: tuple[int, ...] = BUCKETS,
                 fp8_ok: bool = True, prefetch: dict[int, int] | None = None) -> dict[str, Any]:
    """Measure one problem; return its table entry plus the raw measurements. ``prefetch``: M ->
    the L2 prefetch depth to time every candidate at (``dflashgen bench``: the table's tuned depths);
    None: candidates run at the default rule, then each served sm_90 bucket races PREFETCH_DEPTHS."""
    from dflashgen.runtime import GemmKernel

    from .verify import verify_problem

    # Verification first: a candidate that is wrong or not batch-invariant never gets timed.
    survivors = {e["name"] for m in ms for e in prune(entries, m, bw_gbs)}
    cand = [e for e in entries if e["name"] in survivors]
    reports = verify_problem(cand, images, tuple(sorted(set(ms) | {1, 8, 17})), device)
    ok = {r.name for r in reports if r.ok}
    w, packed = _weights(p, device, seed=1)
    copies = copies_for(packed.stream_bytes, device)
    kernels = {e["name"]: GemmKernel(e, images[e["name"]][0], max_m=max(ms), device=device)
               for e in cand if e["name"] in ok}
    timings: dict[str, dict[int, Timing]] = defaultdict(dict)
    for m in ms:
        x = torch.randn(m, p.k, device=device, dtype=torch.float16)
        for e in prune([e for e in cand if e["name"] in ok], m, bw_gbs):
            timings[e["name"]][m] = time_kernel(kernels[e["name"]], packed, x, copies,
                                                prefetch=None if prefetch is None else prefetch.get(m))
    base = time_baselines(p, w, ms, device, fp8_ok)
    plans = {n: json.dumps(next(e for e in cand if e["name"] == n)["kplan"], sort_keys=True) for n in timings}
    peers = {m: {k: v for k, v in (("cublas_fp16", base.fp16.get(m)), ("cublas_fp8", base.fp8.get(m)),
                                   ("fallback", base.fallback.get(m))) if v is not None} for m in ms}
    plan, buckets = choose(ms, timings, plans, peers)
    if prefetch is None:
        race_prefetch(buckets, kernels, timings, packed, p.k, copies, device)
    else:
        for b in buckets:  # what was timed: the table's depth where it names one
            if b.get("path") == "kernel" and b["m"] in prefetch:
                b["prefetch_groups"] = prefetch[b["m"]]
    return {
        "kplan": json.loads(plan) if plan else None, "buckets": buckets, "serves": p.serves, "count": p.count,
        "weight_bytes": p.weight_bytes, "verified": sorted(ok), "rejected": sorted({r.name for r in reports} - ok),
        "read_gbs": bw_gbs,
        # every timed candidate (the race behind the choice: losing K plans, e.g. wgmma, included)
        "timings_us": {n: {str(m): round(t.us, 3) for m, t in sorted(ts.items())} for n, ts in sorted(timings.items())},
    }


def problem_kernels_hash(entries: list[dict[str, Any]]) -> str:
    """Identity of one problem's candidate set: its manifest entries and the GEMM sources they are
    built from (the per-problem form of the table fingerprint's kernel_library hash)."""
    from dflashgen.runtime.library import library_hash

    return library_hash(sorted(entries, key=lambda e: e["name"]))


def read_measurements(path: Path) -> dict[str, Any]:
    """A journal or measurements report (JSON, or gzipped JSON as kept under bench/)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def load_journal(path: Path, fp: dict[str, Any], hashes: dict[str, str]) -> dict[str, Any]:
    """Problems already measured that need no new measurement: same kind of machine (the fingerprint
    but its kernel_library) and the same candidate set (``hashes``: problem key -> its current
    problem_kernels_hash). An interrupted run's journal, or an earlier run's measurements report passed
    as the journal: a re-tune after a schedule change then times only the problems whose kernels changed."""
    if not path.exists():
        return {}
    try:
        j = read_measurements(path)
    except (ValueError, OSError):
        return {}  # a journal cut mid-write: start over rather than trust it
    machine = {k: v for k, v in fp.items() if k != "kernel_library"}
    if {k: v for k, v in j.get("fingerprint", {}).items() if k != "kernel_library"} != machine:
        return {}
    return {k: v for k, v in j.get("problems", {}).items() if k in hashes and v.get("kernels") == hashes[k]}


def save_journal(path: Path, fp: dict[str, Any], done: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"fingerprint": fp, "problems": done}, indent=1))
    tmp.replace(path)


def run(targets_path: Path | None = None, out: Path | None = None, journal: Path | None = None,
        only: str | None = None, ms: tuple[int, ...] = BUCKETS, progress: bool = True,
        carry: Path | None = None) -> Path:
    """Tune the targets' problems (``only``: those whose keys match) on this GPU and write the table.
    ``carry``: an earlier run's measurements report whose problems, measured on this kind of machine
    with the same candidate kernels, are kept as measured (a re-tune after a schedule change then
    times only the problems whose kernels changed); the table holds them and the newly timed ones."""
    from tqdm import tqdm

    from dflashgen.runtime.library import default_table_path, machine_fingerprint
    from dflashgen.runtime.table import TuningTable

    from .render import load_targets
    from .verify import manifest_problems, native_kernels

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    fp = machine_fingerprint(device)
    arch = fp["arch"]
    out = out or default_table_path(device)
    journal = journal or out.with_suffix(".journal.json")
    every = problems_for(load_targets(targets_path), arch)
    probs = selected(every, only)
    every_entry = manifest_problems(arch)
    hashes = {key: problem_kernels_hash(entries) for key, entries in every_entry.items()}
    carried = {k: v for k, v in (load_journal(carry, fp, hashes) if carry else {}).items()
               if k in {p.key for p in every}}
    if carry:
        print(f"{len(carried)} problems carried from {carry} (this kind of machine, unchanged kernels)")
    done = {**carried, **load_journal(journal, fp, hashes)}
    todo = [p for p in probs if p.key not in done]
    bw = read_bandwidth(device)
    t0 = time.time()
    # build (if missing) and load only the kernels left to measure: the cost model's survivors at
    # some bucket of the problems left (tune_problem prunes the same way, so the rest is never timed)
    names = sorted({e["name"] for p in todo for m in ms for e in prune(every_entry[p.key], m, bw)})
    images, entries_by_key = native_kernels(arch, "^(" + "|".join(names) + ")$") if names else ({}, {})
    t_build = time.time() - t0
    if names:
        print(f"{len(names)} candidate kernels of {len(todo)} problems ready in {t_build:.0f} s")
    fp8_ok = arch >= 89
    for p in tqdm(probs, desc="tune", unit="problem", disable=not progress):
        if p.key in done:
            continue
        done[p.key] = {**tune_problem(p, entries_by_key[p.key], images, device, bw, ms, fp8_ok),
                       "kernels": hashes[p.key]}
        save_journal(journal, fp, done)
        torch.cuda.empty_cache()
    table = TuningTable({"schema": 1, "tuned": True, "fingerprint": fp,
                         "note": f"dflashgen tune on {fp['gpu']}: {len(done) - len(carried)} problems in "
                                 f"{time.time() - t0:.0f} s ({t_build:.0f} s of it building "
                                 f"{len(names)} kernels); read bandwidth {bw:.0f} GB/s"
                                 + (f"; {len(carried)} carried from {carry.name}" if carried else ""),
                         "problems": {k: {"kplan": v["kplan"], "buckets": v["buckets"]} for k, v in done.items()}},
                        str(out))
    table.save(out)
    report = out.with_suffix(".measurements.json")
    report.write_text(json.dumps({"fingerprint": fp, "read_gbs": bw, "problems": done}, indent=1, sort_keys=True))
    return out


def heuristic_table(arch: int, targets_path: Path | None = None, bw_gbs: float = 800.0) -> dict[str, Any]:
    """An untuned table for a GPU we cannot measure here (the V100): per problem and bucket the
    candidate the cost model ranks first. Its fingerprint names only the arch, so it serves any
    GPU of that arch until its owner runs `dflashgen tune`, which replaces it."""
    from dflashgen.runtime.library import kernel_library_hash

    from . import __version__
    from .render import load_manifest, load_targets

    entries: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in load_manifest()["kernels"]:
        if e["arch"] == arch:
            entries[f"sm{arch}/{e['format']}/{e['epilogue']}/n{e['n']}/k{e['k']}"].append(e)
    problems: dict[str, Any] = {}
    for p in problems_for(load_targets(targets_path), arch):
        cands = entries.get(p.key)
        if not cands:
            continue
        # one K plan for every bucket (batch invariance): the one the cost model sums lowest
        by_plan: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for e in cands:
            by_plan[json.dumps(e["kplan"], sort_keys=True)].append(e)

        def cost(es: list[dict[str, Any]]) -> float:
            return sum(min(model_time_us(e, m, bw_gbs) for e in es) for m in BUCKETS)

        plan = min(sorted(by_plan), key=lambda k: cost(by_plan[k]))
        buckets = []
        for m in BUCKETS:
            best = prune(by_plan[plan], m, bw_gbs)[0]
            buckets.append({"m": m, "path": "kernel", "kernel": best["name"], "us": None,
                            "why": f"untuned: cost model {model_time_us(best, m, bw_gbs):.1f} us at {bw_gbs:.0f} GB/s"})
        problems[p.key] = {"kplan": json.loads(plan), "buckets": buckets}
    return {"schema": 1, "tuned": False, "problems": problems,
            "note": f"heuristic sm_{arch} table from the cost model, not measured: replace it by running "
                    "`dflashgen tune` on the GPU",
            "fingerprint": {"gpu": None, "arch": arch, "sms": None, "driver": None, "cuda": None, "torch": None,
                            "dflashgen": __version__, "kernel_library": kernel_library_hash()}}

