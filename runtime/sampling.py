"""Speculative-decoding verification (rejection sampling): the dense torch reference.

One round for a uniform decode batch: request ``b`` proposes ``D`` draft tokens, the target scores
``D + 1`` positions, and ``verify`` returns how many drafts are accepted plus one recovered (first
rejection) or bonus (all accepted) token. The procedure reproduces the target distribution exactly.

Exactness: verification runs on integer weights ``w = floor(exp(x - max) * 2^32)`` of the kept set
(:func:`target_weights`, p = w / sum(w)); sums and prefix sums are exact in int64 whatever their
order, and every comparison with a uniform is one float64 expression, so a fused kernel computing
the same float32 ``exp`` reproduces every accept decision and every sampled token bit for bit.

Randomness is an input, never drawn inside: ``Uniforms.accept[b, i]`` decides draft ``i`` and
``Uniforms.sample[b, n]`` draws the token emitted at position ``n = accepted[b]`` (later uniforms
are unused). Categoricals are sampled by ``sample_categorical`` (inverse CDF over token ids in
ascending order, exact on integer weights).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .host import tensor_on, to_device

__all__ = ["FIXED_SCALE", "SamplingParams", "Uniforms", "VerifyResult", "sample_categorical", "target_probs",
           "target_weights", "verify"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling: ``temperature`` 0 = greedy, ``top_k`` 0 = off, ``top_p`` 1 = off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s <= _MASK64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class Uniforms:
    """All randomness of one round: ``accept`` [B, D] and ``sample`` [B, D+1], float32 in [0, 1)."""

    accept: torch.Tensor
    sample: torch.Tensor

    @classmethod
    def draw(
        cls,
        batch: int,
        num_drafts: int,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> Uniforms:
        """``accept`` then ``sample`` from ``generator`` (on its own device), moved to ``device``."""
        if batch < 0 or num_drafts < 0:
            raise ValueError(f"batch and num_drafts must be >= 0, got {batch}, {num_drafts}")
        gen_dev = generator.device if generator is not None else torch.device("cpu")
        accept = torch.rand((batch, num_drafts), generator=generator, device=gen_dev, dtype=torch.float32)
        sample = torch.rand((batch, num_drafts + 1), generator=generator, device=gen_dev, dtype=torch.float32)
        dev = gen_dev if device is None else device
        return cls(to_device(accept, dev), to_device(sample, dev))

    @classmethod
    def for_requests(
        cls,
        params: Sequence[SamplingParams],
        num_drafts: int,
        step: int | Sequence[int],
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> Uniforms:
        """Like ``draw``, but a request with ``seed`` gets uniforms that depend only on (seed, step),
        so its tokens do not depend on which other requests share the batch. ``step``: one for all
        requests, or each request's own (the decode loop's per-request round count)."""
        steps = [step] * len(params) if isinstance(step, int) else list(step)
        if len(steps) != len(params):
            raise ValueError(f"{len(steps)} steps for {len(params)} requests")
        u = cls.draw(len(params), num_drafts, generator, "cpu")
        accept, sample = u.accept, u.sample  # fresh tensors: overwritten in place below
        seeded = [i for i, sp in enumerate(params) if sp.seed is not None]
        if seeded:  # (per round in the decode loop: one generator re-seeded, one draw and one write per row)
            g = torch.Generator()
            rows = torch.stack([torch.rand(2 * num_drafts + 1, generator=g.manual_seed(
                _splitmix64(params[i].seed ^ _splitmix64(steps[i] & _MASK64)))) for i in seeded])  # type: ignore[operator]
            idx = torch.tensor(seeded)
            accept[idx], sample[idx] = rows[:, :num_drafts], rows[:, num_drafts:]  # accept's D, then sample's D + 1
        dev = torch.device("cpu") if device is None else device
        return cls(to_device(accept, dev), to_device(sample, dev))


@dataclass(frozen=True)
class VerifyResult:
    accepted: torch.Tensor  # [B] long: number of accepted drafts
    tokens: torch.Tensor  # [B, D+1] long: accepted drafts, then the recovered/bonus token, -1 padded
    emitted: torch.Tensor  # [B] long: accepted + 1


def _check(
    t: object,
    name: str,
    dims: str,
    shape: tuple[int, ...] | None,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    n = dims.count(",") + 1
    if t.dim() != n or (shape is not None and tuple(t.shape) != shape):
        want = f"{dims} = {shape}" if shape is not None else dims
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of target_logits)")
    return t


def _param_tensors(
    params: Sequence[SamplingParams], batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(params, SamplingParams) or len(params) != batch:
        got = "a single SamplingParams" if isinstance(params, SamplingParams) else f"{len(params)} entries"
        raise ValueError(f"params must hold one SamplingParams per request (B = {batch}), got {got}")
    for i, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"params[{i}] must be a SamplingParams, got {type(sp).__name__}")
    temp = tensor_on([sp.temperature for sp in params], device, torch.float32)
    top_k = tensor_on([sp.top_k for sp in params], device, torch.long)
    top_p = tensor_on([sp.top_p for sp in params], device, torch.float32)
    return temp, top_k, top_p, temp == 0


FIXED_SCALE = 2.0**32  # probability weights as integers: floor(exp(x - max) * 2^32) <= 2^32


def _scaled(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor,
                                                                            torch.Tensor, torch.Tensor]:
    """(logits / temperature, top_k, top_p, greedy) with the input checks of every entry point."""
    _check(logits, "logits", "[B, T, V]", None, _FLOATS)
    B, T, V = logits.shape
    if V == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension V")
    temp, top_k, top_p, greedy = _param_tensors(params, B, logits.device)
    # Greedy rows are divided by 1: only their argmax is used.
    x = logits.float() / torch.where(greedy, 1.0, temp).view(B, 1, 1)
    if bool((torch.isnan(x) | torch.isposinf(x)).any()) or not bool(torch.isfinite(x).any(-1).all()):
        raise ValueError("logits (after temperature) must be free of NaN/+inf with a finite entry in every row")
    return x, top_k, top_p, greedy


def _weights(x: torch.Tensor) -> torch.Tensor:
    """Fixed-point weights floor(exp(x - max) * 2^32), int64: sums and prefix sums are exact (any
    order), so a kernel reproduces every decision bit for bit from the same float32 exp."""
    return (torch.exp(x - x.amax(-1, keepdim=True)) * FIXED_SCALE).floor().long()


TOPK_FAST_MAX = 1024  # a batch whose rows all need <= this many ranks is ranked by an exact top-k


def _rank_cap(params: Sequence[SamplingParams], vocab: int) -> int:
    """Ranks every row needs (greedy rows: 1, top-k rows: top_k) when all are <= TOPK_FAST_MAX and
    below the vocabulary, else 0 (rank the whole vocabulary). Host values only: no device sync."""
    ks = [1 if sp.greedy else sp.top_k for sp in params]
    cap = max(ks, default=0)
    return cap if cap < vocab and all(0 < k <= TOPK_FAST_MAX for k in ks) else 0


def _ranked(x: torch.Tensor, cap: int) -> torch.Tensor:
    """Token ids by descending scaled logit, ties by lower id: all V (stable sort), or the first
    ``cap`` through top-k on a unique int64 key (order-preserving int32 image of the float32 logit,
    then V - 1 - id), which is the same order without sorting the whole vocabulary."""
    if not cap:
        return torch.sort(x, dim=-1, descending=True, stable=True)[1]
    bits = (x + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0, equal logits get equal keys
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() << 32  # negative floats: reversed order
    v = x.shape[-1]
    key = key + (v - 1 - torch.arange(v, device=x.device))
    return torch.topk(key, cap, dim=-1, largest=True, sorted=True)[1]


def _kept(x: torch.Tensor, w: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
          cap: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept mask [B, T, V], descending order [B, T, V or cap]): top-k, then top-p on the top-k set.
    Ranking by scaled logit, ties by lower id; top-p keeps the smallest prefix whose fixed-point mass
    before it is below top_p times the top-k mass (exact integer prefix sums; top_p compared as
    float32 x int64 in float64). ``cap`` (:func:`_rank_cap`): every row keeps at most that many
    ranks, so only those are ranked; the mask is bitwise the same."""
    B, T, V = x.shape
    order = _ranked(x, cap)
    rank = torch.arange(order.shape[-1], device=x.device)
    keep = (rank < torch.where(top_k == 0, V, top_k).view(B, 1, 1)).expand(B, T, -1)
    ws = w.gather(-1, order).masked_fill(~keep, 0)
    mass_before = ws.cumsum(-1) - ws
    limit = top_p.double().view(B, 1, 1) * ws.sum(-1, keepdim=True).double()
    # top_p == 1 is "off" explicitly (no rounding can cut the tail).
    keep = keep & ((mass_before.double() < limit) | (top_p >= 1).view(B, 1, 1))
    return torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, keep), order


def target_weights(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer target weights ``w`` [B, T, V] int64 and their sums ``z`` [B, T]: the exact form of
    :func:`target_probs` that verification uses (p = w / z). Weights are floor(exp(x - max) * 2^32)
    on the kept set, so a token more than ln(2^32) ~ 22.2 (scaled) logits below the maximum has
    weight 0 (probability below 2.3e-10 of the top token's): the only departure from the softmax.
    Greedy rows: weight 1 at the argmax (lowest id among ties)."""
    x, top_k, top_p, greedy = _scaled(logits, params)
    w = _weights(x)
    mask, order = _kept(x, w, top_k, top_p, _rank_cap(params, x.shape[-1]))
    w = w.masked_fill(~mask, 0)
    one_hot = torch.nn.functional.one_hot(order[..., 0], x.shape[-1])
    w = torch.where(greedy.view(-1, 1, 1), one_hot, w)
    return w, w.sum(-1)


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` [B, T, V] -> float32 probabilities [B, T, V]: temperature, top-k, top-p, renormalise.

    Ranking is by scaled logit, ties broken by lower token id (top-k keeps the lower ids; top-p keeps
    the smallest prefix of that order whose mass reaches ``top_p``, on the top-k-renormalised
    distribution). Greedy requests get a one-hot at the argmax (lowest id among ties).
    """
    x, top_k, top_p, greedy = _scaled(logits, params)
    mask, order = _kept(x, _weights(x), top_k, top_p, _rank_cap(params, x.shape[-1]))
    probs = torch.softmax(x.masked_fill(~mask, -math.inf), dim=-1)
    one_hot = torch.nn.functional.one_hot(order[..., 0], x.shape[-1]).to(torch.float32)
    return torch.where(greedy.view(-1, 1, 1), one_hot, probs)


def sample_categorical(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from non-negative ``weights`` [N, V] (need not sum to 1) with ``u`` [N] in [0, 1).

    ``cdf = cumsum(weights)`` over ids in ascending order; the result is the first id with
    ``cdf > u * cdf[-1]``. If rounding pushes the threshold past the end, the last id with positive
    weight is returned (never a zero-weight id). Rows without positive weight return -1.
    Integer weights (int64) are sampled exactly: threshold ``floor(u * total)`` in float64.
    """
    cdf = weights.cumsum(-1)
    exact = weights.dtype == torch.long
    thr = (u.double() * cdf[:, -1].double()).floor().long() if exact else u * cdf[:, -1]
    idx = torch.searchsorted(cdf, thr.unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    ids = torch.arange(weights.shape[-1], device=weights.device)
    last = torch.where(weights > 0, ids, -1).amax(-1)
    return torch.minimum(idx, last)


def verify(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: Uniforms,
    draft_probs: torch.Tensor | None = None,
    *,
    accept_override: torch.Tensor | None = None,
) -> VerifyResult:
    """Verify ``D`` drafts per request against target logits at ``D + 1`` positions.

    greedy: accept while draft == argmax; emit the argmax at the first mismatch (or at D).
    no ``draft_probs`` (one-hot drafter): accept x iff u < p(x); on rejection sample p without x.
    ``draft_probs`` q: accept x iff p(x) > 0 and u * q(x) <= p(x); on rejection sample max(p - q, 0)
    (p itself if that has no mass, which only an unnormalised q allows).
    All accepted: a bonus token is sampled from p at position D.

    ``accept_override`` [B, D] bool (BENCHMARK ONLY, "synthetic acceptance"): replaces the sampled
    rows' accept test (computed anyway, so the cost is unchanged) with the given decisions; greedy
    rows, the recovered/bonus sampling and everything else are as above. The output then no longer
    follows the target distribution (an accepted draft may even have p(x) = 0).
    """
    _check(draft_tokens, "draft_tokens", "[B, D]", None, (torch.long,))
    B, D = draft_tokens.shape
    _check(target_logits, "target_logits", "[B, D+1, V]", None, _FLOATS)
    V = target_logits.shape[-1]
    dev = target_logits.device
    _check(target_logits, "target_logits", "[B, D+1, V]", (B, D + 1, V), _FLOATS)
    _check(draft_tokens, "draft_tokens", "[B, D]", (B, D), (torch.long,), dev)
    if not isinstance(uniforms, Uniforms):
        raise TypeError(f"uniforms must be a Uniforms, got {type(uniforms).__name__}")
    f32 = (torch.float32,)
    u_acc = _check(uniforms.accept, "uniforms.accept", "[B, D]", (B, D), f32, dev)
    u_smp = _check(uniforms.sample, "uniforms.sample", "[B, D+1]", (B, D + 1), f32, dev)
    for name, u in (("uniforms.accept", u_acc), ("uniforms.sample", u_smp)):
        if not bool(((u >= 0) & (u < 1)).all()):
            raise ValueError(f"{name} must lie in [0, 1)")
    if D and not bool(((draft_tokens >= 0) & (draft_tokens < V)).all()):
        raise ValueError(f"draft_tokens must be token ids in [0, V = {V})")
    q = None
    if draft_probs is not None:
        q = _check(draft_probs, "draft_probs", "[B, D, V]", (B, D, V), _FLOATS, dev).float()
        if not bool((torch.isfinite(q) & (q >= 0)).all()):
            raise ValueError("draft_probs must be finite and >= 0")

    w, z = target_weights(target_logits, params)
    greedy = _param_tensors(params, B, dev)[3]
    rows = torch.arange(B, device=dev)

    # Acceptance tests for all positions at once, exact on the integer weights (p = w / z):
    # u < p(x)  <=>  u * z < w(x);  u * q(x) <= p(x)  <=>  (u * q(x)) * z <= w(x), in float64.
    w_x = w[:, :D].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    z_d = z[:, :D].double()
    if q is None:
        ok = u_acc.double() * z_d < w_x.double()
    else:
        q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        ok = (w_x > 0) & (u_acc.double() * q_x.double() * z_d <= w_x.double())  # never emit p(x) = 0
    if accept_override is not None:
        ok = _check(accept_override, "accept_override", "[B, D]", (B, D), (torch.bool,), dev)
    ok = torch.where(greedy.unsqueeze(-1), draft_tokens == w[:, :D].argmax(-1), ok)
    accepted = ok.long().cumprod(-1).sum(-1) if D else torch.zeros(B, dtype=torch.long, device=dev)

    # One token per request at position n = accepted: recovery if n < D, else bonus from p.
    w_n = w[rows, accepted]
    residual = w_n
    if D:
        n = accepted.clamp(max=D - 1)
        if q is None:
            res = w_n.scatter(-1, draft_tokens[rows, n].unsqueeze(-1), 0)
        else:  # max(p - q, 0) * z = max(w - floor(q * z), 0)
            res = (w_n - (q[rows, n].double() * z[rows, accepted].double()[:, None]).floor().long()).clamp_min(0)
        residual = torch.where((accepted < D).unsqueeze(-1), res, w_n)
        residual = torch.where((residual > 0).any(-1, keepdim=True), residual, w_n)
    token = sample_categorical(residual, u_smp[rows, accepted])
    token = torch.where(greedy, w_n.argmax(-1), token)

    pos = torch.arange(D, device=dev)
    tokens = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    tokens[:, :D] = torch.where(pos < accepted.unsqueeze(-1), draft_tokens, -1)
    tokens.scatter_(1, accepted.unsqueeze(-1), token.unsqueeze(-1))
    return VerifyResult(accepted=accepted, tokens=tokens, emitted=accepted + 1)
