"""Speculative decoding with continuous batching over :class:`~dflashgen.runtime.target.TargetModel`.

One round (DFlash2 "q7": ``D = 7`` drafts, ``D + 1 = 8`` verify positions per request):

1. the drafter proposes ``D`` tokens per active request (:class:`Drafter`);
2. the target runs ``[pending token, d_1 .. d_D]`` with ``state.checkpoint(D + 1)`` armed;
3. :func:`~dflashgen.runtime.sampling.verify` accepts ``a`` drafts and adds one recovered/bonus token;
4. the ``a + 1`` tokens are appended (cut at EOS / max tokens) and ``state.rollback`` keeps ``a + 1``
   of the ``D + 1`` positions.

State convention (the invariant every step keeps): a request's history is ``prompt + generated``;
its last token is *pending* -- emitted (or the last prompt token) but not yet fed to the target --
and ``state.lengths[slot] == len(history) - 1``. Prefill therefore feeds ``prompt[:-1]`` (nothing
for a 1-token prompt) and the first verify round scores ``prompt[-1]`` followed by the drafts: the
logits of that round's position ``j`` predict the token after ``history + d_1..d_j``, so the target
needs no separate "first token" sample. After a round, the kept positions are the pending token and
the ``a`` accepted drafts; the newly sampled token becomes the pending one.

Drafters conditioned on the target (DFlash: ``needs_taps = True``, ``taps``, ``observe``, ``release``;
see :class:`TapDrafter`): prefill and verify run the target with ``taps=drafter.taps``; after prefill
and after every rollback the decoder calls ``drafter.observe(rid, start, hidden)`` with the tapped
hidden states (concatenated in ``taps`` order) of the positions just committed to the target state,
and ``drafter.release(rid)`` when a request finishes. Observing is timed as ``draft``.

Capacity: a request may hold ``max_len`` tokens (prompt + generated). The verify forward writes
``D + 1`` positions past ``len(history) - 1``, so the state is allocated with ``max_len + D``
positions (the overshoot is rolled back). A round runs slots ``[0, b)`` with ``b`` = the highest active
slot + 1 (admission fills the lowest free slot); empty slots below it ride along as padding (their
length stays 0 through the rollback); finished slots are ``reset`` and reused by queued requests.

CUDA graphs (default on a CUDA target without TP): the verify forward and the rollback replay graphs
captured per batch size (:class:`~.graphs.DecodeGraphs`), as does a static-slot drafter's draft pass;
``graphs=False`` runs the same steps eagerly, bitwise-identical. Sampling: the generated compact
rejection kernel on CUDA (``sampler="compact"``, :mod:`~.rejection`), the dense torch path on CPU or
with ``sampler="dense"``; both consume the same uniforms and give the same tokens.

Pipelined rounds (``pipeline``, default on for a CUDA target with a drafter that has ``prelaunch``):
the host reads a round's outcome only after queueing everything that follows from it on the device --
the rollback to ``base + kept`` (kept counts computed on the device), the drafter's staging of the
kept positions and the next round's draft pass, whose pending tokens are each row's last emitted
token -- so the GPU drafts while the host appends tokens, checks stops and prepares the next verify.
A round after which a request may reach its token limit while others wait is not prelaunched (its
slot would be refilled, and a joiner needs a draft of its own), and an EOS that admits a joiner
anyway discards the prelaunched pass. The draft pass may then run at a larger batch than needed
(rows of requests that just stopped ride along); greedy outputs are unchanged.

Synthetic acceptance (benchmark only): a drafter with ``synthetic_acceptance = True`` (the
:class:`ReplayDrafter` option) supplies ``accept_decisions(contexts) -> [B, D] bool`` each round, and
verification uses them instead of the sampled rows' accept test (``verify(..., accept_override=)``);
all other work (target forward, full-vocab probabilities, recovered/bonus sampling, rollback) is the
real path. ``Stats.synthetic_acceptance`` / the summary say so.

Tensor parallelism (a target built with a :class:`~.parallel.TPContext`): every rank runs this same
loop in lockstep -- same prompts, same arguments, same call order -- and each round two small
broadcasts from the group's first rank make the ranks agree by construction: the draft tokens (before
the target forward, which every rank must run on the same tokens) and the verify outcome (accepted
counts + emitted tokens, ``B x (D + 2)`` integers). All control flow after it -- EOS / max-token
stops, slot release, rollback lengths, admissions -- is a function of broadcast values and of the
identical per-request bookkeeping, so every rank takes the same branch and issues the same
collectives (no hang). Why broadcast rather than trust identical inputs: the gathered logits are
identical on every rank, but a drafter conditioned on the target (``TapDrafter``) sees each rank's own
hidden states, which the all-reduce does not promise to be bitwise equal across ranks for every NCCL
algorithm / device, and any sampling-kernel difference would otherwise silently fork the ranks' token
streams and deadlock the next collective. The cost is one tiny collective each, per round.
"""

from __future__ import annotations

import contextlib
import logging
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .graphs import DecodeGraphs
from .host import to_device
from .parallel import broadcast_from_first
from .sampling import SamplingParams, Uniforms, VerifyResult, verify
from .target import DecodeState, TargetModel, drain

__all__ = [
    "Drafter",
    "NgramDrafter",
    "ReplayDrafter",
    "RequestContext",
    "RoundStats",
    "SpecDecoder",
    "Stats",
    "TapDrafter",
    "plain_greedy",
]

Tensor = torch.Tensor
DraftOutput = Tensor | tuple[Tensor, Tensor | None]
PHASES = ("draft", "target", "sample", "host", "prefill")  # prefill: queuing overlapped prefill layers
MAX_GRAPH_BATCH = 8  # CUDA graphs are captured for B = 1..8
log = logging.getLogger("dflashgen")


# --------------------------------------------------------------------------- drafters


@dataclass(frozen=True)
class RequestContext:
    """What a drafter sees of one active request. ``tokens`` = prompt + generated (the last entry is
    the pending token the next verify round starts from); ``rid`` = index in ``generate``'s prompts."""

    rid: int
    tokens: Sequence[int]
    prompt_len: int
    params: SamplingParams

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@runtime_checkable
class Drafter(Protocol):
    """``propose(contexts)`` -> draft tokens ``[B, D]`` (long), optionally with draft probabilities
    ``[B, D, V]`` as ``(tokens, probs)``; without probabilities verification treats drafts as one-hot."""

    num_draft: int
    label: str

    def propose(self, contexts: Sequence[RequestContext]) -> DraftOutput: ...


@runtime_checkable
class TapDrafter(Drafter, Protocol):
    """A drafter fed the target's hidden states after layers ``taps`` (``needs_taps = True``).

    ``observe(rid, start, hidden)``: request ``rid``'s committed positions ``start .. start + n`` have
    target hidden states ``hidden [n, len(taps) * H]``; anything the drafter holds past ``start`` is
    stale (rolled back). ``release(rid)``: the request finished."""

    needs_taps: bool
    taps: Sequence[int]

    def observe(self, rid: int, start: int, hidden: Tensor) -> None: ...

    def release(self, rid: int) -> None: ...


def _tap_drafter(drafter: Drafter) -> TapDrafter | None:
    return drafter if getattr(drafter, "needs_taps", False) else None  # type: ignore[return-value]


def _fuse(hidden: dict[int, Tensor], taps: Sequence[int]) -> Tensor:
    return torch.cat([hidden[i] for i in taps], dim=-1)  # [B, T, len(taps) * H], DFlash's order


class NgramDrafter:
    """Prompt lookup (no weights): match the last ``n`` (then ``n - 1`` .. 1) tokens at their latest
    earlier occurrence in the history and copy what followed it; pad with the last token if none."""

    def __init__(self, n: int = 3, num_draft: int = 7) -> None:
        if n < 1 or num_draft < 1:
            raise ValueError(f"n and num_draft must be >= 1, got n={n}, num_draft={num_draft}")
        self.n, self.num_draft = n, num_draft
        self.label = f"ngram (prompt lookup, n<={n})"

    def draft_one(self, tokens: Sequence[int]) -> list[int]:
        h, d = list(tokens), self.num_draft
        for k in range(min(self.n, len(h) - 1), 0, -1):
            pat = h[-k:]
            for s in range(len(h) - k - 1, -1, -1):  # latest earlier occurrence first
                if h[s:s + k] == pat:
                    ext = h[:]  # LZ-style copy: the copied span may run into the proposals themselves
                    for i in range(d):
                        ext.append(ext[s + k + i])
                    return ext[len(h):]
        return [h[-1]] * d

    def propose(self, contexts: Sequence[RequestContext]) -> Tensor:
        return torch.tensor([self.draft_one(c.tokens) for c in contexts], dtype=torch.long).view(-1, self.num_draft)


class ReplayDrafter:
    """Benchmark stand-in for a trained drafter: proposes the known target continuation token with
    probability ``acceptance`` per position, else a different token (so greedy verification accepts
    a leading run with P(run >= i) = acceptance**i). Outputs must carry ``label``: the acceptance is
    synthetic, not a property of any drafter model.

    ``continuations[rid]``: the target's generated tokens for request ``rid`` (e.g. from
    :func:`plain_greedy`). Randomness depends only on (seed, rid, position): batch-composition free.
    ``cost_model``: called once per round with the contexts (e.g. a block-drafter-shaped forward of
    ``D + 1`` positions per request; :func:`~dflashgen.runtime.drafter.block_drafter_cost` runs a real
    DFlash2 block drafter) so that measured draft time is a real cost; None = free drafts.

    ``synthetic_acceptance`` (BENCHMARK ONLY): under sampled verification a random target accepts a
    replayed greedy token with its own probability p(x), so the design rate is not realised. With
    this flag the drafter declares ``synthetic_acceptance = True`` and :class:`SpecDecoder` asks
    :meth:`accept_decisions` for the accept/reject decision of every sampled row and draft position
    (the same seeded coins that chose "right" tokens, so P(accept) = ``acceptance`` i.i.d.); the
    target forward, ``target_probs`` over the full vocab, the recovered/bonus sampling and the
    rollback run as in the real path, so their cost is real, but the emitted tokens no longer follow
    the target distribution. Greedy rows are verified as usual (unchanged).
    """

    def __init__(self, continuations: Sequence[Sequence[int]], acceptance: float, num_draft: int = 7,
                 seed: int = 0, cost_model: Callable[[Sequence[RequestContext]], Any] | None = None,
                 *, synthetic_acceptance: bool = False) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        self.continuations = [list(c) for c in continuations]
        self.acceptance, self.num_draft, self.seed, self.cost_model = acceptance, num_draft, seed, cost_model
        self._coins: dict[int, tuple[tuple[int, int], list[bool]]] = {}  # rid -> ((seed, generated), coins)
        self.synthetic_acceptance = bool(synthetic_acceptance)
        if getattr(cost_model, "needs_taps", False):
            # A drafter as the cost model (e.g. StaticDFlashDrafter): it sees the real target taps through
            # this drafter's hooks and runs its real forward every round; its drafts are discarded.
            self.needs_taps, self.taps = True, cost_model.taps  # type: ignore[union-attr]
            for hook in ("observe", "release", "assign", "observe_round", "capture", "prelaunch", "cancel"):
                if hasattr(cost_model, hook):
                    setattr(self, hook, getattr(cost_model, hook))
            if hasattr(cost_model, "propose"):
                self.cost_model = cost_model.propose  # type: ignore[union-attr]
        self.label = f"replay (synthetic acceptance p={acceptance:g})"
        if self.synthetic_acceptance:
            self.label += " [SYNTHETIC accept/reject decisions under sampled verification]"

    def coins(self, ctx: RequestContext) -> list[bool]:
        """Per draft position: "right" (accepted) with probability ``acceptance``; a function of
        (seed, rid, tokens generated so far) only, so batch composition cannot change it. The last
        round's coins are kept per request (``propose`` and ``accept_decisions`` both need them)."""
        key = (self.seed, ctx.generated)
        hit = self._coins.get(ctx.rid)
        if hit is not None and hit[0] == key:
            return hit[1]
        rng = random.Random(f"{self.seed}:{ctx.rid}:{ctx.generated}")
        out = [rng.random() < self.acceptance for _ in range(self.num_draft)]
        self._coins[ctx.rid] = (key, out)
        return out

    def draft_one(self, ctx: RequestContext) -> list[int]:
        cont, g = self.continuations[ctx.rid], ctx.generated
        out: list[int] = []
        for i, right in enumerate(self.coins(ctx)):
            true = cont[g + i] if g + i < len(cont) else ctx.tokens[-1]
            # Never id -1 or >= V: any other in-range id is "wrong" under greedy verification.
            out.append(true if right else (true - 1 if true > 0 else 1))
        return out

    def propose(self, contexts: Sequence[RequestContext]) -> Tensor:
        if self.cost_model is not None:
            self.cost_model(contexts)
        return torch.tensor([self.draft_one(c) for c in contexts], dtype=torch.long).view(-1, self.num_draft)

    def accept_decisions(self, contexts: Sequence[RequestContext]) -> Tensor:
        """``[B, D]`` bool: the synthetic accept decisions (``synthetic_acceptance`` mode only)."""
        return torch.tensor([self.coins(c) for c in contexts], dtype=torch.bool).view(-1, self.num_draft)


# --------------------------------------------------------------------------- stats


@dataclass
class RoundStats:
    batch: int  # active requests
    accepted: list[int]  # accepted drafts per active request (0..D, before EOS / max-token cuts)
    emitted: int  # tokens appended to outputs (after cuts)
    ms: dict[str, float]  # phase -> milliseconds
    rids: list[int] = field(default_factory=list)  # request of each ``accepted`` entry
    prelaunched: bool = False  # its draft pass was queued during the previous round (``pipeline``)


@dataclass
class Stats:
    """Per-round records of one ``generate`` call. Times: ``time.perf_counter`` on CPU; CUDA events
    (synchronised once per round) for the device phases on CUDA, so medians are device time."""

    label: str = ""
    num_draft: int = 0
    synthetic_acceptance: bool = False  # sampled rows' accept/reject decided by the drafter (benchmark only)
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)  # prefills the requests in flight waited for
    # prefills run beside the rounds (overlap_prefill): device time from first layer queued to done
    overlapped_prefill_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        acc = [a for r in self.rounds for a in r.accepted]
        emitted = sum(r.emitted for r in self.rounds)
        out: dict[str, Any] = {
            "drafter": self.label,
            "num_draft": self.num_draft,
            "synthetic_acceptance": self.synthetic_acceptance,
            "rounds": len(self.rounds),
            "tokens": emitted,
            "mean_accepted_drafts": statistics.fmean(acc) if acc else 0.0,
            # DFlash's "acceptance length": tokens per request-round incl. the recovered/bonus token.
            "mean_acceptance_length": statistics.fmean(acc) + 1 if acc else 0.0,
            "mean_batch": statistics.fmean(r.batch for r in self.rounds) if self.rounds else 0.0,
            "prelaunched_rounds": sum(r.prelaunched for r in self.rounds),
            "prefill_ms_total": sum(self.prefill_ms),
            "overlapped_prefill_ms_total": sum(self.overlapped_prefill_ms),
            "overlapped_prefills": len(self.overlapped_prefill_ms),
            "wall_s": self.wall_s,
            "tokens_per_s": emitted / self.wall_s if self.wall_s > 0 else 0.0,
        }
        for p in PHASES:
            v = [r.ms[p] for r in self.rounds if p in r.ms]
            out[f"median_{p}_ms"] = statistics.median(v) if v else 0.0
        return out


class _Timer:
    """Phase timer: CUDA events on a CUDA device (read after one synchronize per round), else
    perf_counter. ``host`` and ``prefill`` (queuing an overlapped prefill's layers) are always
    wall-clock (Python work). ``last``: the event that ended the last device phase (None on CPU)."""

    HOST = ("host", "prefill")

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.ms: dict[str, float] = {}
        self._events: list[tuple[str, Any, Any]] = []
        self.last: Any = None

    def start(self, phase: str) -> Any:
        if self.cuda and phase not in self.HOST:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, phase: str, t0: Any) -> None:
        if isinstance(t0, float):
            self.ms[phase] = self.ms.get(phase, 0.0) + (time.perf_counter() - t0) * 1e3
        else:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((phase, t0, ev))
            self.last = ev

    def flush(self) -> dict[str, float]:
        if self._events:
            for _, _, b in self._events:  # these events only: a prelaunched draft may still be running
                b.synchronize()
            for phase, a, b in self._events:
                self.ms[phase] = self.ms.get(phase, 0.0) + a.elapsed_time(b)
        ms, self.ms, self._events = self.ms, {}, []
        return ms


class _HostCopy:
    """A device tensor's copy into pinned host memory, queued now and waited for by ``wait`` (which
    returns it as ``(column 0, columns 1..)``): work queued in between runs before the host blocks."""

    def __init__(self, t: Tensor) -> None:
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def wait(self) -> tuple[Tensor, Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host[:, 0], self.host[:, 1:]


# --------------------------------------------------------------------------- overlapped prefill


@dataclass
class _Loading:
    """A joining request's prefill queued layer by layer beside the rounds (``overlap_prefill``)."""

    joins: list[int]  # the slots it fills
    reqs: list[_Request]
    steps: Generator[int, None, Callable[[], None]] | None  # the target forward; None once all is queued
    finish: Callable[[], None] | None = None  # copies into the slots (the round stream)
    start: Any = None  # CUDA events on the side stream around its device work (None on CPU)
    done: Any = None


@contextlib.contextmanager
def _sm_carveout(n: int | None) -> Iterator[None]:
    """cuBLAS calls made inside target at most (SMs - n) SMs (torch's experimental SM carveout, read
    per call on the host), so a prefill layer's long GEMM CTAs leave n SMs free for the rounds'
    kernels on the other stream; the previous setting is restored. n None: no change."""
    if n is None:
        yield
        return
    prev = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(n)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(prev)


class _Overlap:
    """Overlapped prefill: the rounds run on a high-priority stream, queued prefills on a low-priority
    side stream (so the GPU serves a round's kernels first and fills the gaps with prefill work); on
    CPU no streams, the layers just interleave with the rounds. ``retired``: activated prefills whose
    scratch state the round stream may still be copying (dropped after the round's sync)."""

    def __init__(self, device: torch.device, per_round: int | None, sm_carveout: int | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.per_round = per_round if per_round is not None or self.cuda else 4
        self.sm_carveout = sm_carveout  # SMs the prefill's cuBLAS GEMMs leave to the rounds (None: none)
        # lower number = higher priority; out-of-range values map to the device's extremes
        self.rounds = torch.cuda.Stream(device, priority=-8) if self.cuda else None
        self.side = torch.cuda.Stream(device, priority=0) if self.cuda else None
        self.queue: deque[_Loading] = deque()
        self.retired: list[_Loading] = []

    def reserved(self) -> set[int]:
        return {s for job in self.queue for s in job.joins}

    def add(self, joins: list[int], reqs: list[_Request], steps: Generator[int, None, Callable[[], None]]) -> None:
        self.queue.append(_Loading(joins, reqs, steps))

    def _queue_layer(self, job: _Loading) -> None:
        assert job.steps is not None
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            if self.cuda and job.start is None:
                job.start = torch.cuda.Event(enable_timing=True)
                job.start.record()
            try:
                with _sm_carveout(self.sm_carveout):
                    next(job.steps)
            except StopIteration as fin:
                job.finish, job.steps = fin.value, None
                if self.cuda:
                    job.done = torch.cuda.Event(enable_timing=True)
                    job.done.record()

    def pump(self, round_done: Any) -> None:
        """Queue prefill layers in admission order: ``per_round`` of them, or (None) at least one and
        more while the round's device work (``round_done``, an event) is still running."""
        n = 0
        for job in self.queue:
            while job.steps is not None:
                if n and (n >= self.per_round if self.per_round is not None
                          else round_done is None or round_done.query()):
                    return
                self._queue_layer(job)
                n += 1

    def ready(self, block: bool) -> list[_Loading]:
        """Queued prefills whose device work is done, in admission order, with the current (round)
        stream ordered after them. ``block`` (no request in flight): queue what is left and wait."""
        out: list[_Loading] = []
        while self.queue:
            job = self.queue[0]
            while block and job.steps is not None:
                self._queue_layer(job)
            if job.steps is not None or (self.cuda and not block and not job.done.query()):
                break
            if self.cuda:
                if block:
                    job.done.synchronize()
                torch.cuda.current_stream().wait_event(job.done)
            out.append(self.queue.popleft())
        return out


# --------------------------------------------------------------------------- decoder


@dataclass
class _Request:
    rid: int
    tokens: list[int]  # prompt + generated; tokens[-1] is pending (not yet in the target state)
    prompt_len: int
    params: SamplingParams
    max_new: int
    rounds: int = 0  # verify rounds so far: the per-request step of seeded uniforms

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class SpecDecoder:
    """Continuous-batching speculative decoder: up to ``max_batch`` requests in flight, the rest queue.

    ``max_len``: tokens per request (prompt + generated). ``state``: an existing state to decode in
    (needs ``batch >= max_batch`` and ``max_len + num_draft`` positions); default: a new one.
    """

    def __init__(self, target: TargetModel, drafter: Drafter, max_batch: int, max_len: int, num_draft: int = 7,
                 *, state: DecodeState | None = None, graphs: bool | None = None,
                 sampler: str | None = None, join_group: int = 1, overlap_prefill: bool | None = None,
                 prefill_layers_per_round: int | None = None, prefill_sm_carveout: int | None = None,
                 pipeline: bool | None = None) -> None:
        """graphs: run the verify forward and the rollback as CUDA graphs captured per batch size
        1..max_batch (default: on a CUDA target without tensor parallelism); False runs the same
        steps eagerly (bitwise-identical). sampler: "compact" (the generated fused rejection-sampling
        kernel, default on CUDA), "dense" (the torch reference) or None for the default.
        join_group: admission policy while requests are in flight. Waiting requests join once at
        least ``min(join_group, waiting)`` slots are free (all free slots are filled then, in one
        joint prefill); an empty batch always admits. 1 (default) admits each request as soon as a
        slot frees. Every prefill stalls the requests in flight, and a joint prefill of k prompts
        costs far less than k single ones, so a larger group trades a few rounds of idle slots for
        fewer stalls.
        overlap_prefill: while requests are in flight, a joining request's prefill is queued on a
        low-priority side stream, layer by layer between rounds, and the request enters the batch at
        the first round after its prefill completed; the requests in flight keep decoding instead of
        waiting (the rounds run on a high-priority stream, so the GPU serves them first and fills the
        gaps with prefill work). The same operations in the same order, so the same bits. Default
        (None): off, the joiners' prefill stalls the batch -- on the H200 the two hold whole SMs in turn
        rather than sharing them, and stalling decoded as fast or faster (session 36, three alternating
        runs on one machine: B4 865 vs 839 tok/s median, B8 1246 vs 1239) with a shorter TTFT at B4.
        Not with tensor parallelism. On CPU (True) the layers interleave with the rounds without
        concurrency, which exercises the same bookkeeping.
        prefill_layers_per_round: with overlap, layers queued per round; None: on CUDA, as many as the
        round's target forward leaves host time for (at least one), on CPU 4.
        prefill_sm_carveout: with overlap, the overlapped prefill's cuBLAS GEMMs target all but this
        many SMs (torch's experimental cuBLAS SM carveout), so the rounds' kernels find free SMs
        instead of waiting behind long GEMM CTAs; None (default): no carveout. Scheduling only: the
        same operations, but cuBLAS may pick another kernel for the smaller SM count, so prefill bits
        can differ from an uncarved prefill (not from one another: the choice is per shape).
        pipeline: launch the next round's draft pass before the host reads a round's outcome (the
        pending tokens and the staged context are on the device already), so the GPU drafts while
        the host does the round's bookkeeping and prepares the next one instead of idling. Needs a
        drafter with ``prelaunch`` / ``cancel`` (:class:`~.drafter.StaticDFlashDrafter`, or the replay
        drafter over one) and no overlapped prefill. Skipped for a round after which a request may
        reach its token limit while others wait (a join would need a fresh draft), and discarded if
        a request joins anyway (EOS). Greedy outputs are unchanged; the draft pass may run at a
        larger batch size than its requests need (rows of requests that just stopped ride along),
        so a drafter whose rows are not batch-invariant can propose other tokens. Default (None):
        on for a CUDA target whose drafter supports it."""
        if max_batch < 1 or max_len < 2 or num_draft < 1:
            raise ValueError(f"need max_batch >= 1, max_len >= 2, num_draft >= 1; got {max_batch}, {max_len}, "
                             f"{num_draft}")
        if isinstance(join_group, bool) or not isinstance(join_group, int) or not 1 <= join_group <= max_batch:
            raise ValueError(f"join_group must be an integer in 1..max_batch={max_batch}, got {join_group!r}")
        self.join_group = join_group
        if prefill_layers_per_round is not None and (isinstance(prefill_layers_per_round, bool) or not isinstance(
                prefill_layers_per_round, int) or prefill_layers_per_round < 1):
            raise ValueError(f"prefill_layers_per_round must be an integer >= 1, got {prefill_layers_per_round!r}")
        if getattr(drafter, "num_draft", num_draft) != num_draft:
            raise ValueError(f"drafter proposes {drafter.num_draft} tokens, the decoder verifies {num_draft}")
        need = max_len + num_draft  # verify overshoot, rolled back (module docstring)
        if state is None:
            state = target.new_state(max_batch, need)
        if max_batch > state.batch:
            raise ValueError(f"max_batch={max_batch} exceeds the decode state's capacity of {state.batch} requests")
        if state.max_len < need:
            raise ValueError(f"the decode state holds {state.max_len} positions; max_len={max_len} with "
                             f"num_draft={num_draft} needs {need}")
        self.target, self.drafter, self.state = target, drafter, state
        self.tp_group = getattr(target, "tp_group", None)  # lockstep broadcasts (module docstring)
        self.tap_drafter = _tap_drafter(drafter)
        # Benchmark-only verifier override, used only when the drafter declares it (ReplayDrafter).
        self.synthetic_acceptance = bool(getattr(drafter, "synthetic_acceptance", False))
        self.max_batch, self.max_len, self.num_draft = max_batch, max_len, num_draft
        cuda = target.device.type == "cuda"
        if graphs is None:
            graphs = cuda and self.tp_group is None  # NCCL collectives inside a capture: not attempted
        if graphs and max_batch > MAX_GRAPH_BATCH:
            raise ValueError(f"max_batch={max_batch} is above the captured maximum of {MAX_GRAPH_BATCH} "
                             "(CUDA graphs are captured for B = 1..8; pass graphs=False for more)")
        taps = self.tap_drafter.taps if self.tap_drafter else None
        self.steps = DecodeGraphs(target, state, num_draft + 1, max_batch, taps, capture=bool(graphs))
        if sampler is None:
            sampler = "compact" if cuda else "dense"
        if sampler not in ("compact", "dense"):
            raise ValueError(f"sampler must be 'compact' or 'dense', got {sampler!r}")
        self.sampler = sampler
        overlap_prefill = bool(overlap_prefill)  # None: the default, stalling (docstring)
        if overlap_prefill and self.tp_group is not None:
            raise ValueError("overlap_prefill needs a target without tensor parallelism (its collectives "
                             "would run on two streams)")
        if prefill_sm_carveout is not None and (isinstance(prefill_sm_carveout, bool) or not isinstance(
                prefill_sm_carveout, int) or prefill_sm_carveout < 1):
            raise ValueError(f"prefill_sm_carveout must be an integer >= 1 (SMs), got {prefill_sm_carveout!r}")
        if prefill_sm_carveout is not None and not overlap_prefill:
            raise ValueError("prefill_sm_carveout applies to overlapped prefill (overlap_prefill=True)")
        if prefill_sm_carveout is not None and not hasattr(torch._C, "_set_sm_carveout_experimental"):
            raise ValueError(f"prefill_sm_carveout needs torch's cuBLAS SM carveout (torch {torch.__version__} "
                             "has no torch._C._set_sm_carveout_experimental)")
        self.overlap = (_Overlap(target.device, prefill_layers_per_round, prefill_sm_carveout)
                        if overlap_prefill else None)
        can_pipeline = hasattr(drafter, "prelaunch") and hasattr(drafter, "cancel")
        if pipeline and not can_pipeline:
            raise ValueError(f"pipeline needs a drafter with prelaunch / cancel (a static-slot DFlash drafter); "
                             f"{type(drafter).__name__} has none")
        if pipeline and overlap_prefill:
            raise ValueError("pipeline and overlap_prefill exclude each other (an overlapped prefill's layers "
                             "are queued between rounds)")
        self.pipeline = bool(can_pipeline and not overlap_prefill and cuda) if pipeline is None else pipeline
        self.stats = Stats(getattr(drafter, "label", type(drafter).__name__), num_draft, self.synthetic_acceptance)
        self.errors: dict[int, str] = {}  # request index -> reason, from the last generate(strict=False)
        self.slot_log: list[tuple[int, int]] = []  # (request, slot) in admission order
        # Optional observer (event, request, tokens generated so far): "admit" before a request's
        # prefill, "tokens" after a round appends to it. For per-request timestamps (TTFT / TPOT).
        self.observer: Callable[[str, int, int], None] | None = None

    # ------------------------------------------------------------------ validation

    def _validate(self, prompts: Sequence[Sequence[int]], params: Any, max_new_tokens: Any,
                  ) -> tuple[list[_Request | None], dict[int, str]]:
        n = len(prompts)
        if isinstance(params, SamplingParams | dict):
            params = [params] * n
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * n
        if len(params) != n or len(max_new_tokens) != n:
            raise ValueError(f"{n} prompts but {len(params)} params and {len(max_new_tokens)} max_new_tokens")
        vocab = self.target.cfg.vocab_size
        reqs: list[_Request | None] = []
        errors: dict[int, str] = {}
        for i, (prompt, sp, m) in enumerate(zip(prompts, params, max_new_tokens, strict=True)):
            try:
                if isinstance(sp, dict):
                    sp = SamplingParams(**sp)  # its __post_init__ names the bad field
                elif not isinstance(sp, SamplingParams):
                    raise ValueError(f"params must be a SamplingParams, got {type(sp).__name__}")
                if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                    raise ValueError(f"max_new_tokens must be an integer >= 1, got {m!r}")
                toks = [int(t) for t in prompt]
                if not toks:
                    raise ValueError("empty prompt")
                if len(toks) > self.max_len - m:
                    raise ValueError(f"prompt of {len(toks)} tokens is longer than max_len - max_new_tokens = "
                                     f"{self.max_len} - {m}")
                if not all(0 <= t < vocab for t in toks):
                    raise ValueError(f"prompt token ids must be in [0, {vocab})")
                reqs.append(_Request(i, toks, len(toks), sp, m))
            except (ValueError, TypeError) as e:
                errors[i] = f"request {i}: {e}"
                reqs.append(None)
        return reqs, errors

    # ------------------------------------------------------------------ generate

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams | dict] | SamplingParams,
                 max_new_tokens: Sequence[int] | int, eos: int | None = None, seed: int = 0,
                 *, strict: bool = True) -> list[list[int]]:
        """Generated tokens per request (EOS included when hit). Invalid requests: ``strict`` raises a
        ValueError naming each before any work; ``strict=False`` skips them (empty output, reason
        in ``self.errors``) and decodes the rest. Stats of the call are in ``self.stats``."""
        with self._round_stream():
            return self._generate(prompts, params, max_new_tokens, eos, seed, strict)

    @contextlib.contextmanager
    def _round_stream(self) -> Iterator[None]:
        """With overlapped prefill on CUDA: the rounds on the high-priority stream (ordered after the
        caller's stream, and the caller's after them on the way out, prefills included)."""
        ov = self.overlap
        if ov is None or ov.side is None:
            yield
            return
        caller = torch.cuda.current_stream(self.target.device)
        ov.rounds.wait_stream(caller)
        try:
            with torch.cuda.stream(ov.rounds):
                yield
        finally:
            ov.queue.clear()  # a failed call leaves nothing queued for the next
            caller.wait_stream(ov.rounds)
            caller.wait_stream(ov.side)
            ov.rounds.synchronize()  # the retired prefills' buffers are read until here
            ov.retired.clear()

    def _generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams | dict] | SamplingParams,
                  max_new_tokens: Sequence[int] | int, eos: int | None, seed: int, strict: bool) -> list[list[int]]:
        reqs, errors = self._validate(prompts, params, max_new_tokens)
        if errors and strict:
            raise ValueError("; ".join(errors.values()))
        self.errors = errors
        self.stats = Stats(self.stats.label, self.num_draft, self.synthetic_acceptance)
        self.slot_log = []
        gen = torch.Generator().manual_seed(seed)  # unseeded requests' uniforms
        st, dev, d = self.state, self.target.device, self.num_draft
        for s in range(st.batch):
            st.reset(s)  # a previous (possibly failed) call may have left requests behind
        self.steps.capture()  # once, while the state is empty (no-op for eager steps)
        if hasattr(self.drafter, "capture"):
            self.drafter.capture()  # a static-slot drafter's graphs, likewise
        queue = deque(r for r in reqs if r is not None)
        slots: list[_Request | None] = [None] * st.batch
        out: dict[int, list[int]] = {}
        t_start = time.perf_counter()
        greedy_pad = SamplingParams(temperature=0.0)
        ov = self.overlap
        if self.pipeline:
            self.drafter.cancel()  # type: ignore[attr-defined]  # a failed call may have left one
        prelaunched, carried = False, None
        while queue or any(r is not None for r in slots) or (ov is not None and ov.queue):
            joins = []
            loading = ov.reserved() if ov is not None else set()
            free = sum(slots[s] is None and s not in loading for s in range(self.max_batch))
            admit = bool(queue) and (free == self.max_batch or free >= min(self.join_group, len(queue)))
            for s in range(self.max_batch):
                if admit and slots[s] is None and s not in loading and queue:
                    slots[s] = queue.popleft()
                    st.reset(s)
                    joins.append(s)
                    self.slot_log.append((slots[s].rid, s))  # type: ignore[union-attr]
                    if self.tap_drafter is not None and hasattr(self.tap_drafter, "assign"):
                        self.tap_drafter.assign(slots[s].rid, s)  # type: ignore[union-attr]
                    if self.observer is not None:
                        self.observer("admit", slots[s].rid, 0)  # type: ignore[union-attr]
            if joins:
                if ov is None:
                    self._prefill(slots, joins)
                else:  # the requests in flight keep decoding; into an empty batch the first joins now
                    groups = self._prefill_groups(joins)
                    if not any(slots[s] is not None for s in range(st.batch) if s not in joins):
                        # the first request alone (a joint group split: its rows round as they would
                        # in any batch only on a batch-invariant target, which prefills alone anyway)
                        self._prefill(slots, [groups[0][0]])
                        groups = [g for g in (groups[0][1:], *groups[1:]) if g]
                    self._begin_prefill(slots, groups)
            if ov is not None and ov.queue:
                for job in ov.ready(block=not any(r is not None for r in slots)):
                    self._activate(slots, job)
                if not any(r is not None for r in slots):
                    continue

            if prelaunched and joins:  # its slots are not this round's: the joiners need their draft
                self.drafter.cancel()  # type: ignore[attr-defined]
            pre_used, prelaunched = prelaunched and not joins, False
            timer, carried = carried if carried is not None else _Timer(dev), None
            t0 = timer.start("host")
            active = [s for s in range(st.batch) if slots[s] is not None]
            ctx = [RequestContext(r.rid, tuple(r.tokens), r.prompt_len, r.params)
                   for r in (slots[s] for s in active) if r is not None]
            timer.stop("host", t0)

            t0 = timer.start("draft")
            drafts, q = _split_draft(self.drafter.propose(ctx))
            timer.stop("draft", t0)

            t0 = timer.start("host")
            if drafts.shape != (len(active), d):
                raise ValueError(f"drafter returned {tuple(drafts.shape)}, expected {(len(active), d)}")
            # Slots [0, b) run: the smallest captured batch holding every active slot (admission fills
            # the lowest free slots, so b is the active count except while requests drain).
            b = active[-1] + 1
            idx = torch.tensor(active, dtype=torch.long)
            if drafts.is_cuda and dev.type == "cuda":  # a device drafter's tokens stay there: no host round
                draft_all = drafts.to(dev, torch.long)  # trip, so the GPU never waits for this round's prep
                if active != list(range(b)):
                    draft_all = torch.zeros(b, d, dtype=torch.long, device=dev).index_copy_(
                        0, to_device(idx, dev), draft_all)
            else:
                draft_all = torch.zeros(b, d, dtype=torch.long)
                draft_all[idx] = drafts.to("cpu", torch.long)
            pending = torch.zeros(b, 1, dtype=torch.long)
            base = torch.zeros(b, dtype=torch.long)
            row_params, steps = [greedy_pad] * b, [0] * b
            for s in range(b):
                r = slots[s]
                if r is not None:
                    pending[s, 0], base[s] = r.tokens[-1], len(r.tokens) - 1
                    row_params[s], steps[s] = r.params, r.rounds
            u = Uniforms.for_requests(row_params, d, steps, gen, dev)  # one draw for the whole batch
            q_all = None
            if q is not None:  # empty slots: zero q is valid and ignored (they are greedy)
                q_all = torch.zeros(b, d, q.shape[-1], dtype=q.dtype, device=dev)
                q_all[to_device(idx, dev)] = q.to(dev)
            live = torch.tensor([slots[s] is not None for s in range(b)])
            live_dev, base_dev = to_device(live, dev), to_device(base, dev)
            forced = None
            if self.synthetic_acceptance:  # benchmark only: the drafter decides sampled rows' accepts
                forced = torch.zeros(b, d, dtype=torch.bool)
                forced[idx] = self.drafter.accept_decisions(ctx).to("cpu", torch.bool)  # type: ignore[attr-defined]
                forced = to_device(forced, dev)
            # TP: every rank feeds rank 0's drafts to the target (no-op without a process group).
            draft_dev = broadcast_from_first(to_device(draft_all, dev), self.tp_group)
            tokens = torch.cat([to_device(pending, dev), draft_dev], dim=1)
            timer.stop("host", t0)

            t0 = timer.start("target")
            logits, hidden = self.steps.verify(b, tokens)
            timer.stop("target", t0)
            if ov is not None and ov.queue:  # queue prefill layers while the target forward runs
                t0 = timer.start("prefill")
                ov.pump(timer.last)
                timer.stop("prefill", t0)

            t0 = timer.start("sample")
            res = self._verify(draft_dev, logits, row_params, u, q_all, forced)
            # TP: rank 0's verify outcome decides on every rank (module docstring).
            outcome = broadcast_from_first(torch.cat([res.accepted[:, None], res.tokens], dim=1), self.tp_group)
            # Keep the pending token + the accepted drafts; the new token becomes pending. Computed on
            # the device, so the rollback (and the drafter's staging) are queued before the host waits.
            keep_dev = torch.where(live_dev, 1 + outcome[:, 0], 0)
            self.steps.rollback(b, base_dev + keep_dev)
            timer.stop("sample", t0)

            fused = None
            if self.tap_drafter is not None:  # the kept positions: pending token + accepted drafts
                t0 = timer.start("draft")
                fused = _fuse(hidden, self.tap_drafter.taps)
                if hasattr(self.tap_drafter, "observe_round"):  # static slots: one staged copy
                    self.tap_drafter.observe_round(fused, base_dev, keep_dev)
                    fused = None
                timer.stop("draft", t0)
            outcome_host = _HostCopy(outcome)
            if self._may_prelaunch(slots, active, queue):
                # the next round's draft pass runs while the host reads this outcome and does the
                # round's bookkeeping (its time is the next round's draft phase)
                carried = _Timer(dev)
                t0 = carried.start("draft")
                self.drafter.prelaunch(outcome[:, 1:].gather(1, outcome[:, :1])[:, 0])  # type: ignore[attr-defined]
                carried.stop("draft", t0)
                prelaunched = True
            accepted_t, tokens_t = outcome_host.wait()
            if ov is not None:
                ov.retired.clear()  # the round stream is past their copies (synchronised just above)
            if fused is not None:  # a per-request tap drafter: observes on the host's schedule
                t0 = timer.start("draft")
                keep_l = torch.where(live, 1 + accepted_t, 0).tolist()
                for s in active:
                    r = slots[s]
                    assert r is not None
                    self.tap_drafter.observe(r.rid, int(base[s]), fused[s, :keep_l[s]])  # type: ignore[union-attr]
                timer.stop("draft", t0)

            t0 = timer.start("host")
            acc_l, tok_l = accepted_t.tolist(), tokens_t.tolist()
            accepted, rids, emitted = [], [], 0
            for s in active:
                r = slots[s]
                assert r is not None
                r.rounds += 1
                accepted.append(acc_l[s])
                rids.append(r.rid)
                for t in tok_l[s][:acc_l[s] + 1]:
                    r.tokens.append(t)
                    emitted += 1
                    if t == eos or len(r.generated) >= r.max_new:
                        break
                if self.observer is not None:
                    self.observer("tokens", r.rid, len(r.generated))
                if r.generated[-1:] == [eos] or len(r.generated) >= r.max_new:
                    out[r.rid] = r.generated
                    if self.tap_drafter is not None:
                        self.tap_drafter.release(r.rid)
                    slots[s] = None
                    st.reset(s)  # frees the slot; the next admission reuses it
            timer.stop("host", t0)
            self.stats.rounds.append(RoundStats(len(active), accepted, emitted, timer.flush(), rids, pre_used))
        if prelaunched:  # a request stopped early (EOS): nothing follows the last prelaunch
            self.drafter.cancel()  # type: ignore[attr-defined]
        self.stats.wall_s = time.perf_counter() - t_start
        return [out.get(i, []) for i in range(len(prompts))]

    def _may_prelaunch(self, slots: list[_Request | None], active: list[int], queue: deque) -> bool:
        """Whether to prelaunch the next round's draft pass (``pipeline``): not if a request may reach
        its token limit in this round while others wait (its slot would be refilled, and a joiner
        needs a draft of its own), nor if every request may (nothing may follow)."""
        if not self.pipeline:
            return False
        reqs = [r for r in (slots[s] for s in active) if r is not None]
        ending = [len(r.tokens) - r.prompt_len + self.num_draft + 1 >= r.max_new for r in reqs]
        return not all(ending) and not (queue and any(ending))

    def _verify(self, drafts: Tensor, logits: Tensor, params: list[SamplingParams], u: Uniforms,
                q: Tensor | None, forced: Tensor | None) -> VerifyResult:
        """Rejection sampling of one round: the generated compact kernel (``sampler="compact"``) or
        the dense torch reference; both consume the same uniforms and agree on every decision."""
        if self.sampler == "compact":
            from .driver import DriverError
            from .images import KernelImageError
            from .rejection import compact_verify

            try:
                return compact_verify(drafts, logits, params, u, q, accept_override=forced)
            except (KernelImageError, DriverError) as e:  # no loadable image: the reference serves
                log.warning("dflashgen: compact rejection kernel unavailable (%s); using the dense path", e)
                self.sampler = "dense"
        return verify(drafts, logits, params, u, q, accept_override=forced)

    def _prefill(self, slots: list[_Request | None], joins: list[int]) -> None:
        """Prefill the joining requests now (the requests in flight, if any, wait). A batch-invariant
        target (``target.batch_invariant``) prefills each request alone, unpadded: the prefill's
        chunk-form GDN and conv round per (batch, length) shape, and :func:`plain_greedy` prefills at
        B=1, so this is what makes a request's tokens independent of who joins with it."""
        if len(groups := self._prefill_groups(joins)) > 1:
            for g in groups:
                self._prefill(slots, g)
            return
        timer = _Timer(self.target.device)
        t0 = timer.start("prefill_gpu")
        drain(self._prefill_steps([slots[s] for s in joins], joins))()  # type: ignore[arg-type]
        timer.stop("prefill_gpu", t0)
        self.stats.prefill_ms.append(timer.flush()["prefill_gpu"])

    def _prefill_groups(self, joins: list[int]) -> list[list[int]]:
        """The joint prefills of ``joins``: one, or one per request for a batch-invariant target."""
        return [[s] for s in joins] if getattr(self.target, "batch_invariant", False) else [joins]

    def _begin_prefill(self, slots: list[_Request | None], groups: list[list[int]]) -> None:
        """Queue joint prefills beside the rounds (``overlap_prefill``): their slots stay out of the
        batch until :meth:`_activate`."""
        assert self.overlap is not None
        for g in groups:
            reqs = [slots[s] for s in g]
            self.overlap.add(g, reqs, self._prefill_steps(reqs, g))  # type: ignore[arg-type]
            for s in g:
                slots[s] = None

    def _activate(self, slots: list[_Request | None], job: _Loading) -> None:
        """A queued prefill whose device work is done (the round stream waits for it): copy its
        caches into the slots (on the round stream), and its requests join the next round."""
        assert job.finish is not None
        job.finish()
        for s, r in zip(job.joins, job.reqs, strict=True):
            slots[s] = r
        if job.start is not None:
            self.stats.overlapped_prefill_ms.append(job.start.elapsed_time(job.done))
        else:
            self.stats.overlapped_prefill_ms.append(0.0)
        assert self.overlap is not None
        self.overlap.retired.append(job)

    def _prefill_steps(self, reqs: list[_Request], joins: list[int]) -> Generator[int, None, Callable[[], None]]:
        """Feed ``prompt[:-1]`` of ``reqs`` (right-padded, ``num_new``) into a scratch state, one
        target layer per ``next()``; returns ``finish``, which copies the caches into the slots
        ``joins`` and shows the drafter the prompt's taps. The in-flight requests are untouched and
        need no headroom for the prompt chunk. Lengths are known on the host, so the forward runs
        unchecked (no host sync, which would wait for whatever the prefill's stream has queued)."""
        lens = [len(r.tokens) - 1 for r in reqs]
        t = max(lens)
        td = self.tap_drafter
        if t == 0:  # all 1-token prompts: the pending token is the whole prompt
            def clear() -> None:
                for r in reqs:  # an empty context (also clears any stale one under the same rid)
                    if td is not None:
                        td.observe(r.rid, 0, torch.empty(0, 0, device=self.target.device))
            return clear
        dev = self.target.device
        pad = torch.zeros(len(reqs), t, dtype=torch.long)
        for j, r in enumerate(reqs):
            pad[j, :lens[j]] = torch.tensor(r.tokens[:-1])
        tmp = self.target.new_state(len(reqs), t)
        n_new = torch.tensor(lens, device=dev)
        taps = td.taps if td is not None else None
        _, hidden = yield from self.target.forward_steps(pad.to(dev), tmp, num_new=n_new, taps=taps or (),
                                                         check=False, logits=False)
        fused = _fuse(hidden, td.taps) if td is not None else None

        def finish() -> None:
            if td is not None and fused is not None:
                for j, r in enumerate(reqs):
                    td.observe(r.rid, 0, fused[j, :lens[j]])  # prefill taps count as prefill time
            for j, s in enumerate(joins):
                _copy_request(self.state, s, tmp, j, lens[j])
        return finish


def _copy_request(dst: DecodeState, slot: int, src: DecodeState, j: int, n: int) -> None:
    """Request j of ``src`` (its first n positions: KV, GDN recurrent and conv state) into ``slot`` of ``dst``."""
    for i in dst.k:
        dst.k[i][slot, :n] = src.k[i][j, :n]
        dst.v[i][slot, :n] = src.v[i][j, :n]
    for i in dst.ssm:
        dst.ssm[i][slot] = src.ssm[i][j]
        dst.conv[i][slot] = src.conv[i][j]
    dst.lengths[slot] = n


def _split_draft(out: DraftOutput) -> tuple[Tensor, Tensor | None]:
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


@torch.no_grad()
def plain_greedy(target: TargetModel, prompt: Sequence[int], n: int) -> list[int]:
    """Non-speculative greedy decoding, one token per forward: the equivalence oracle.

    Prefills ``prompt[:-1]`` and then steps the last prompt token alone, exactly as
    :class:`SpecDecoder` does (its first verify round starts at the last prompt token): the prompt's
    last position then goes through the same one-token GDN step as every decoded token instead of
    the prefill's (chunk-form, per-length) arithmetic, so a batch-invariant target gives
    byte-identical tokens on both paths. The prefill also runs in a scratch state of exactly
    ``len(prompt) - 1`` positions, as the decoder's does: the prefill's reference attention reduces over
    the cache length, whose GEMM shape would otherwise differ."""
    if not prompt or n < 1:
        raise ValueError("need a non-empty prompt and n >= 1")
    dev = target.device
    st = target.new_state(1, len(prompt) + n)
    if len(prompt) > 1:
        tmp = target.new_state(1, len(prompt) - 1)
        target(torch.tensor([list(prompt[:-1])], device=dev), tmp, logits=False)
        _copy_request(st, 0, tmp, 0, len(prompt) - 1)
    out = [int(target(torch.tensor([[prompt[-1]]], device=dev), st)[0, -1].argmax())]
    while len(out) < n:
        out.append(int(target(torch.tensor([[out[-1]]], device=dev), st)[0, -1].argmax()))
    return out
