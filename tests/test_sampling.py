"""Speculative-decoding verification (``dflashgen.runtime.sampling``): greedy rules, top-k/top-p,
losslessness (chi-square goodness of fit), determinism / batch invariance, input errors."""

from __future__ import annotations

import math

import pytest
import torch
from dflashgen.runtime.sampling import (
    SamplingParams,
    Uniforms,
    sample_categorical,
    target_probs,
    verify,
)

GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams()

# Chi-square goodness of fit at alpha = 1e-4 (a correct sampler fails one check with probability
# 1e-4 for a random seed; seeds are fixed, so the tests are deterministic). Quantiles of chi2 with
# `dof` degrees of freedom at 1 - 1e-4, from scipy.stats.chi2.ppf(1 - 1e-4, dof) (checked below).
CHI2_Q = {3: 21.107513466160444, 4: 23.512742444991076, 5: 25.74483195905612}
V = 6
N = 20000


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).unsqueeze(1)  # [B, 1, V]


def _greedy_logits(argmaxes: list[int], v: int = 5) -> torch.Tensor:
    x = torch.zeros(len(argmaxes), v)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 3.0
    return x


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_acceptance_and_bonus() -> None:
    target = _greedy_logits([2, 0, 4, 1]).expand(3, 4, 5)  # argmax per position: 2, 0, 4, 1
    drafts = torch.tensor([[2, 0, 4], [2, 1, 4], [3, 0, 4]])
    r = verify(drafts, target, [GREEDY] * 3, Uniforms.draw(3, 3, torch.Generator().manual_seed(0)))
    assert r.accepted.tolist() == [3, 1, 0]
    assert r.emitted.tolist() == [4, 2, 1]
    # Row 0: all accepted -> bonus argmax at D; rows 1, 2: argmax at the first mismatch (later match ignored).
    assert r.tokens.tolist() == [[2, 0, 4, 1], [2, 0, -1, -1], [2, -1, -1, -1]]


def test_greedy_lowest_id_tie_break_and_zero_drafts() -> None:
    target = torch.tensor([[[1.0, 3.0, 3.0, 0.0, 3.0]]])
    r = verify(torch.zeros(1, 0, dtype=torch.long), target, [GREEDY], Uniforms.draw(1, 0))
    assert r.tokens.tolist() == [[1]] and r.accepted.tolist() == [0]
    assert target_probs(target, [GREEDY])[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_temperature_zero_is_greedy_whatever_the_uniforms_and_filters() -> None:
    g = torch.Generator().manual_seed(1)
    target = torch.randn(4, 4, 50, generator=g)
    drafts = target[:, :3].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % 50
    params = [SamplingParams(temperature=0.0, top_k=k, top_p=p) for k, p in ((0, 1.0), (3, 0.5), (1, 0.1), (7, 1.0))]
    results = [verify(drafts, target, params, Uniforms.draw(4, 3, g)) for _ in range(3)]
    for r in results:
        assert torch.equal(r.tokens, results[0].tokens)
    assert results[0].accepted.tolist() == [3, 1, 3, 3]
    assert results[0].tokens[1].tolist() == [int(drafts[1, 0]), int(target[1, 1].argmax()), -1, -1]
    # The limit of a tiny temperature is greedy too (well-separated logits).
    cold = verify(drafts, target, [SamplingParams(temperature=1e-4)] * 4, Uniforms.draw(4, 3, g))
    assert torch.equal(cold.tokens, results[0].tokens)


# --- target distribution: temperature, top-k, top-p ------------------------------------------------

P4 = [0.4, 0.1, 0.3, 0.2]


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(top_k=2), [0, 2]),
        (SamplingParams(top_p=0.65), [0, 2]),
        (SamplingParams(top_p=0.71), [0, 2, 3]),
        (SamplingParams(top_p=0.35), [0]),
        (SamplingParams(top_k=3, top_p=0.8), [0, 2, 3]),
        # top-p acts on the top-k-renormalised distribution: 0.4 / 0.7 >= 0.5 keeps only id 0.
        (SamplingParams(top_k=2, top_p=0.5), [0]),
        (SamplingParams(top_k=0, top_p=1.0), [0, 1, 2, 3]),
    ],
)
def test_top_k_top_p_masks(params: SamplingParams, kept: list[int]) -> None:
    probs = target_probs(_logits([[math.log(p) for p in P4]]), [params])[0, 0]
    want = torch.zeros(4)
    want[kept] = torch.tensor(P4)[kept] / sum(P4[i] for i in kept)
    torch.testing.assert_close(probs, want)
    assert (probs > 0).nonzero().flatten().tolist() == kept


def test_ties_resolved_by_token_id() -> None:
    logits = _logits([[1.0, 2.0, 2.0, 2.0, 0.0]])
    assert (target_probs(logits, [SamplingParams(top_k=2)])[0, 0] > 0).tolist() == [False, True, True, False, False]
    # Each tied token has mass ~0.30: top_p 0.5 needs two of them, the lower ids.
    assert (target_probs(logits, [SamplingParams(top_p=0.5)])[0, 0] > 0).tolist() == [False, True, True, False, False]


def test_top_p_one_keeps_the_tail() -> None:
    logits = _logits([[0.0, -30.0, 5.0, -60.0]])
    probs = target_probs(logits, [SamplingParams(top_p=1.0)])[0, 0]
    assert bool((probs > 0).all())
    torch.testing.assert_close(probs, torch.softmax(logits[0, 0], -1))


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_temperature_scaling(t: float) -> None:
    logits = torch.randn(2, 3, 17, generator=torch.Generator().manual_seed(2))
    probs = target_probs(logits, [SamplingParams(temperature=t)] * 2)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / t, -1))


def test_sample_categorical_inverse_cdf() -> None:
    w = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0]] * 5)
    u = torch.tensor([0.0, 0.49, 0.5, 0.75, 1.0 - 2**-24])
    assert sample_categorical(w, u).tolist() == [1, 1, 3, 4, 4]
    # fp tail: u * 3 rounds up to 3.0 in float32; the guard lands on the last positive-weight id.
    assert sample_categorical(torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([1.0 - 2**-24])).tolist() == [1]


# --- losslessness ---------------------------------------------------------------------------------


def _dist(seed: int, top_k: int = 0) -> torch.Tensor:
    """A random distribution over V tokens, peaked enough that p and q differ clearly."""
    x = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5
    return target_probs(x.view(1, 1, V), [SamplingParams(top_k=top_k)])[0, 0]


def _chi2(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of ``tokens`` against ``p`` over its support, and the degrees of freedom."""
    counts = torch.bincount(tokens, minlength=V).double()
    support = p > 0
    assert counts[~support].sum() == 0, "emitted a token with target probability 0"
    expected = p[support].double() * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def _assert_fits(tokens: torch.Tensor, p: torch.Tensor) -> None:
    stat, dof = _chi2(tokens, p)
    assert stat < CHI2_Q[dof], f"chi2 = {stat:.1f} >= {CHI2_Q[dof]:.1f} ({dof} dof, {len(tokens)} samples)"


def _round(with_q: bool, top_k: int, seed: int = 0, rule_accept_all: bool = False):
    """N independent rounds with D = 2: target p_i and draft q_i fixed per position."""
    D = 2
    p = torch.stack([_dist(10 + i, top_k) for i in range(D + 1)])  # [D+1, V]
    # Draft: full support, partly agreeing with the target (as a trained drafter would).
    q = torch.stack([0.6 * _dist(10 + i) + 0.4 * _dist(20 + i) for i in range(D)])  # [D, V]
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(D)], -1)
    logits = p.clamp_min(1e-30).log().masked_fill(p == 0, -math.inf).expand(N, D + 1, V)
    u = Uniforms.draw(N, D, g)
    if rule_accept_all:  # a wrong rule: u = 0 accepts every draft of positive p
        u = Uniforms(torch.zeros_like(u.accept), u.sample)
    params = [SamplingParams(top_k=top_k)] * N
    r = verify(drafts, logits, params, u, q.expand(N, D, V) if with_q else None)
    return r, p, u


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("top_k", [0, 4])
def test_lossless_first_second_and_bonus_positions(with_q: bool, top_k: int) -> None:
    r, p, _ = _round(with_q, top_k)
    assert 0.2 < r.accepted.float().mean() < 1.8  # both outcomes occur often
    _assert_fits(r.tokens[:, 0], p[0])
    # Given the first draft was accepted, the second emitted token is still ~ p_1 ...
    _assert_fits(r.tokens[r.accepted >= 1, 1], p[1])
    # ... and given both were accepted, the bonus token is ~ p_2.
    _assert_fits(r.tokens[r.accepted == 2, 2], p[2])


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
def test_chi2_check_catches_wrong_rules(with_q: bool) -> None:
    # Accepting with probability 1 emits q instead of p.
    r, p, _ = _round(with_q, 0, rule_accept_all=True)
    assert _chi2(r.tokens[:, 0], p[0])[0] > 10 * CHI2_Q[V - 1]
    # Subtler bug: keep the acceptance test but resample from p (not the residual) on rejection.
    r, p, u = _round(with_q, 0)
    wrong = torch.where(r.accepted > 0, r.tokens[:, 0], sample_categorical(p[0].expand(N, V), u.sample[:, 0]))
    assert _chi2(wrong, p[0])[0] > CHI2_Q[V - 1]


def test_chi2_quantiles() -> None:
    chi2 = pytest.importorskip("scipy.stats").chi2
    for dof, q in CHI2_Q.items():
        assert chi2.ppf(1 - 1e-4, dof) == pytest.approx(q)


# --- determinism and batch invariance ------------------------------------------------------------

MIXED = [
    GREEDY,
    SamplingParams(temperature=0.7, top_k=20, seed=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=3, top_p=0.95, seed=7),
    SamplingParams(temperature=0.9, top_p=1.0),
]


def _batch(seed: int, D: int, vocab: int = 1000):
    g = torch.Generator().manual_seed(seed)
    B = len(MIXED)
    logits = torch.randn(B, D + 1, vocab, generator=g) * 3
    drafts = torch.randint(0, vocab, (B, D), generator=g)
    drafts[:, : min(D, 2)] = logits[:, : min(D, 2)].argmax(-1)  # make acceptances likely
    q = torch.softmax(torch.randn(B, D, vocab, generator=g), -1)
    return logits, drafts, q, Uniforms.draw(B, D, g)


@pytest.mark.parametrize("D", range(8))
@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
def test_deterministic_and_batch_invariant(D: int, with_q: bool) -> None:
    logits, drafts, q, u = _batch(D, D)
    qq = q if with_q else None
    r = verify(drafts, logits, MIXED, u, qq)
    again = verify(drafts.clone(), logits.clone(), MIXED, Uniforms(u.accept.clone(), u.sample.clone()), qq)
    assert torch.equal(r.tokens, again.tokens) and torch.equal(r.accepted, again.accepted)
    assert torch.equal(r.emitted, r.accepted + 1)
    assert r.tokens.shape == (len(MIXED), D + 1)
    probs = target_probs(logits, MIXED)
    for b, sp in enumerate(MIXED):
        one = slice(b, b + 1)
        u_one = Uniforms(u.accept[one], u.sample[one])
        alone = verify(drafts[one], logits[one], [sp], u_one, None if qq is None else qq[one])
        assert torch.equal(alone.tokens[0], r.tokens[b]) and torch.equal(alone.accepted[0], r.accepted[b])
        assert torch.equal(target_probs(logits[b : b + 1], [sp])[0], probs[b])
        # Emitted tokens are well-formed: accepted drafts, one target token with p > 0, then -1.
        n = int(r.accepted[b])
        assert torch.equal(r.tokens[b, :n], drafts[b, :n]) and bool((r.tokens[b, n + 1 :] == -1).all())
        assert probs[b, n, r.tokens[b, n]] > 0


def test_seeded_requests_get_batch_independent_uniforms() -> None:
    g = torch.Generator().manual_seed(3)
    batch = Uniforms.for_requests(MIXED, 4, step=11, generator=g)
    for b in (1, 3):  # the seeded requests
        alone = Uniforms.for_requests([MIXED[b]], 4, step=11)
        assert torch.equal(alone.accept[0], batch.accept[b]) and torch.equal(alone.sample[0], batch.sample[b])
    other_step = Uniforms.for_requests([MIXED[1]], 4, step=12)
    assert not torch.equal(other_step.sample[0], batch.sample[1])
    # per-request steps (the decode loop draws one batch per round, each request at its own round)
    mixed_steps = Uniforms.for_requests(MIXED, 4, step=[11, 12, 11, 11, 11], generator=g)
    assert torch.equal(mixed_steps.sample[1], other_step.sample[0])  # seeded, step 12
    assert torch.equal(mixed_steps.accept[3], batch.accept[3])  # seeded, step 11
    with pytest.raises(ValueError, match="steps for"):
        Uniforms.for_requests(MIXED, 4, step=[1], generator=g)


def test_seeded_uniforms_are_the_requests_own_generator_stream() -> None:
    """A seeded row is accept's D then sample's D + 1 uniforms of a CPU generator seeded from (seed,
    step), as two draws from it give (the decode loop draws each seeded row once, re-seeding one
    generator): the values a request sees do not depend on how the batch draws them."""
    from dflashgen.runtime.sampling import _MASK64, _splitmix64

    u = Uniforms.for_requests(MIXED, 7, step=[5, 6, 7, 8, 9], generator=torch.Generator().manual_seed(0))
    for b, sp in enumerate(MIXED):
        if sp.seed is None:
            continue
        g = torch.Generator().manual_seed(_splitmix64(sp.seed ^ _splitmix64((5 + b) & _MASK64)))
        assert torch.equal(u.accept[b], torch.rand(7, generator=g))
        assert torch.equal(u.sample[b], torch.rand(8, generator=g))


# --- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_shape_dtype_and_batch_errors() -> None:
    B, D, vocab = 2, 3, 10
    logits = torch.randn(B, D + 1, vocab)
    drafts = torch.zeros(B, D, dtype=torch.long)
    u = Uniforms.draw(B, D)
    with pytest.raises(ValueError, match=r"target_logits must have shape \[B, D\+1, V\] = \(2, 4, 10\)"):
        verify(drafts, logits[:, :D], [PLAIN] * B, u)
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify(drafts, logits, [PLAIN] * B, u, torch.rand(B, D, vocab + 1))
    with pytest.raises(ValueError, match=r"uniforms\.sample must have shape"):
        verify(drafts, logits, [PLAIN] * B, Uniforms(u.accept, u.accept))
    with pytest.raises(ValueError, match=r"uniforms\.accept must lie in \[0, 1\)"):
        verify(drafts, logits, [PLAIN] * B, Uniforms(torch.ones_like(u.accept), u.sample))
    with pytest.raises(TypeError, match="draft_tokens must have dtype"):
        verify(drafts.int(), logits, [PLAIN] * B, u)
    with pytest.raises(TypeError, match=r"uniforms\.accept must have dtype"):
        verify(drafts, logits, [PLAIN] * B, Uniforms(u.accept.double(), u.sample))
    with pytest.raises(TypeError, match="target_logits must have dtype"):
        verify(drafts, logits.long(), [PLAIN] * B, u)
    with pytest.raises(ValueError, match="draft_tokens must be token ids"):
        verify(drafts + vocab, logits, [PLAIN] * B, u)
    with pytest.raises(ValueError, match="params must hold one SamplingParams per request"):
        verify(drafts, logits, [PLAIN], u)
    with pytest.raises(ValueError, match="logits must have shape"):
        target_probs(logits[0], [PLAIN])
    with pytest.raises(ValueError, match="NaN"):
        target_probs(torch.full((1, 1, 4), float("nan")), [PLAIN])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_ranking_equals_full_sort(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches whose rows all keep <= TOPK_FAST_MAX ranks are ranked by an exact top-k on an int64 key;
    masks, probabilities and weights are bitwise those of the full stable sort, ties (many here:
    coarse logits, -0.0 vs +0.0, -inf) and mixed greedy rows included."""
    from dflashgen.runtime import sampling

    g = torch.Generator().manual_seed(seed)
    B, T, V = 6, 3, 3001
    logits = (torch.randn(B, T, V, generator=g) * 4).round() / 2  # coarse: many equal logits
    logits[0, 0, :50] = -0.0
    logits[1, 1, 100:] = -math.inf
    params = [SamplingParams(top_k=20, top_p=0.95, temperature=0.7), SamplingParams(top_k=1),
              SamplingParams(temperature=0.0), SamplingParams(top_k=128, top_p=0.5),
              SamplingParams(top_k=7, temperature=1.3), SamplingParams(top_k=128, top_p=1.0)]
    assert sampling._rank_cap(params, V) == 128
    fast = (target_probs(logits, params), *sampling.target_weights(logits, params))
    monkeypatch.setattr(sampling, "TOPK_FAST_MAX", 0)  # every row through the full sort
    assert sampling._rank_cap(params, V) == 0
    full = (target_probs(logits, params), *sampling.target_weights(logits, params))
    for a, b in zip(fast, full, strict=True):
        assert torch.equal(a, b)
    assert sampling._rank_cap([SamplingParams(top_k=5), SamplingParams()], V) == 0  # top_k off: all V
    assert sampling._rank_cap([SamplingParams(top_k=V)], V) == 0
