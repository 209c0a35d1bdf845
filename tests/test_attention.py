"""Verify-step attention reference (``dflashgen.runtime.attention``): paged cache, naive float64
agreement, split-KV vs unsplit, the length-adaptive split rule, batch invariance, rollback, error paths."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from dflashgen.runtime.attention import (
    SPLIT_ATOL,
    SPLIT_RTOL,
    PagedKVCache,
    SplitRule,
    verify_attention_reference,
)

FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)


def _cache(hkv: int, d: int, *, block: int = 16, dtype=torch.float16, interleaved=False, reqs=8, **kw):
    return PagedKVCache(
        256, block, hkv, d, max_requests=reqs, max_blocks_per_request=80, dtype=dtype, interleaved=interleaved, **kw
    )


def _fill(cache: PagedKVCache, lengths: list[int], seed: int = 0, chunks: int = 3) -> None:
    """Append random K/V for requests 0..B-1 in a few ragged chunks (exercises partial blocks)."""
    g = torch.Generator().manual_seed(seed)
    for r, n in enumerate(lengths):
        k = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=g) * 2
        v = torch.randn(n, cache.num_kv_heads, cache.head_dim, generator=g)
        cuts = sorted({0, n, *torch.randint(0, n + 1, (chunks,), generator=g).tolist()})
        for lo, hi in pairwise(cuts):
            cache.append(r, k[lo:hi], v[lo:hi])


def _naive(q: torch.Tensor, cache: PagedKVCache, reqs: list[int], scale: float) -> torch.Tensor:
    """Per query row / head softmax in float64 over the cache's own dequantised values."""
    nb, nq, hq, _ = q.shape
    group = hq // cache.num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, r in enumerate(reqs):
        k, v = (t.double() for t in cache.gather(r))
        n = k.shape[0]
        for i in range(nq):
            for h in range(hq):
                kv = h // group
                s = (k[: n - nq + i + 1, kv] @ q[b, i, h].double()) * scale
                w = torch.exp(s - s.max())
                out[b, i, h] = (w / w.sum()) @ v[: n - nq + i + 1, kv]
    return out


def _q(nb: int, nq: int, hq: int, d: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(nb, nq, hq, d, generator=torch.Generator().manual_seed(seed))


TP4 = (6, 1, 256)  # one TP4 rank of Qwen3.8-27B: 6 q heads on 1 KV head (GQA group 6), head_dim 256
CASES = [  # (lengths, Q, block size, (Hq, Hkv, D)); lengths straddle block boundaries
    ([8], 8, 4, TP4),
    ([1, 2], 1, 4, (24, 4, 32)),  # full head counts, small head_dim
    ([15, 16, 17, 64], 8, 16, TP4),
    ([3, 4, 5, 300], 3, 4, TP4),
    ([63, 65, 128, 257], 8, 16, (24, 4, 32)),
]


@pytest.mark.parametrize("lengths,nq,block,heads", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, *FP8])
def test_reference_matches_naive(lengths, nq, block, heads, interleaved, dtype):
    hq, hkv, d = heads
    scales = {"k_scale": 0.05, "v_scale": 0.02} if dtype in FP8 else {}
    cache = _cache(hkv, d, block=block, dtype=dtype, interleaved=interleaved, **scales)
    _fill(cache, lengths)
    q = _q(len(lengths), nq, hq, d)
    reqs = list(range(len(lengths)))
    out = verify_attention_reference(q, cache, reqs)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), _naive(q, cache, reqs, 1 / math.sqrt(d)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, *FP8])
def test_storage_roundtrip(dtype):
    cache = _cache(2, 8, block=4, dtype=dtype, k_scale=0.5, v_scale=0.25)
    k, v = torch.randn(11, 2, 8) * 100, torch.randn(11, 2, 8)  # large K: FP8 saturates, never NaN/inf
    cache.append(0, k, v)
    gk, gv = cache.gather(0)
    assert gk.dtype == torch.float32 and gk.shape == (11, 2, 8)
    fmax = torch.finfo(dtype).max
    exp_k = (k / 0.5).clamp(-fmax, fmax).to(dtype).float() * 0.5
    assert torch.equal(gk, exp_k) and torch.isfinite(gk).all()
    assert torch.equal(gv, (v / 0.25).to(dtype).float() * 0.25)


def test_interleaved_equals_separate():
    outs = []
    for inter in (False, True):
        cache = _cache(1, 64, block=4, dtype=torch.float8_e4m3fn, interleaved=inter, k_scale=0.1)
        _fill(cache, [9, 40])
        outs.append(verify_attention_reference(_q(2, 8, 6, 64), cache, [0, 1], split_tokens=16))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("split", [1, 7, 16, 64, 512])
def test_split_matches_unsplit(split):
    lengths = [8, 16, 17, 100, 300]
    cache = _cache(1, 256, block=16)
    _fill(cache, lengths)
    q = _q(len(lengths), 8, 6, 256) * 3  # sharper softmax: larger rescaling across splits
    reqs = list(range(len(lengths)))
    ref = verify_attention_reference(q, cache, reqs)
    got = verify_attention_reference(q, cache, reqs, split_tokens=split)
    vmax = max(float(cache.gather(r)[1].abs().max()) for r in reqs)
    torch.testing.assert_close(got, ref, rtol=SPLIT_RTOL, atol=SPLIT_ATOL * vmax)


def test_batch_invariance():
    """Request 0's output is bitwise fixed whatever shares its batch (split-KV and unsplit)."""
    cache = _cache(1, 256, block=16, reqs=6)
    _fill(cache, [77, 5, 300, 16, 200, 9], seed=3)
    q0 = _q(1, 5, 6, 256, seed=7)
    for split in (None, 32):
        alone = verify_attention_reference(q0, cache, [0], split_tokens=split)[0]
        for others in ([1], [2, 3], [4, 5, 1], [2, 2, 2]):
            q = torch.cat([q0, _q(len(others), 5, 6, 256, seed=len(others))])
            got = verify_attention_reference(q, cache, [0, *others], split_tokens=split)[0]
            assert torch.equal(got, alone)
            q_last = torch.cat([_q(len(others), 5, 6, 256, seed=9), q0])
            got = verify_attention_reference(q_last, cache, [*others, 0], split_tokens=split)[-1]
            assert torch.equal(got, alone)


@pytest.mark.parametrize("block", [4, 16])
def test_rollback_then_reappend(block):
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(70, 1, 256, generator=g), torch.randn(70, 1, 256, generator=g)
    k2, v2 = torch.randn(8, 1, 256, generator=g), torch.randn(8, 1, 256, generator=g)
    cache = _cache(1, 256, block=block)
    cache.append(0, k, v)  # 70 tokens, last 8 are drafts; accept 3 -> keep 65
    free_before = cache.num_free_blocks
    cache.truncate(0, 65)
    assert cache.length(0) == 65
    assert cache.num_free_blocks == free_before + (-(-70 // block) - -(-65 // block))
    assert (cache.block_tables[0, -(-65 // block) :] == -1).all()
    cache.append(0, k2, v2)
    fresh = _cache(1, 256, block=block)
    fresh.append(0, torch.cat([k[:65], k2]), torch.cat([v[:65], v2]))
    q = _q(1, 8, 6, 256)
    for split in (None, 16):
        assert torch.equal(
            verify_attention_reference(q, cache, [0], split_tokens=split),
            verify_attention_reference(q, fresh, [0], split_tokens=split),
        )
    cache.release(0)
    assert cache.length(0) == 0 and cache.num_free_blocks == cache.num_blocks


def test_cache_errors():
    with pytest.raises(TypeError, match="cache dtype"):
        _cache(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale"):
        _cache(1, 8, k_scale=0.0)
    cache = PagedKVCache(4, 4, 2, 8, max_requests=2, max_blocks_per_request=3)
    ok = torch.zeros(2, 2, 8)
    with pytest.raises(IndexError, match="request 2"):
        cache.append(2, ok, ok)
    with pytest.raises(ValueError, match="KV heads"):
        cache.append(0, torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="head_dim"):
        cache.append(0, ok, torch.zeros(2, 2, 4))
    with pytest.raises(TypeError, match="float tensor"):
        cache.append(0, ok.int(), ok)
    with pytest.raises(ValueError, match="tokens"):
        cache.append(0, ok, torch.zeros(3, 2, 8))
    with pytest.raises(ValueError, match="capacity"):
        cache.append(0, torch.zeros(13, 2, 8), torch.zeros(13, 2, 8))
    cache.append(0, torch.zeros(12, 2, 8), torch.zeros(12, 2, 8))  # 3 of 4 blocks
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        cache.append(1, torch.zeros(5, 2, 8), torch.zeros(5, 2, 8))
    assert cache.length(1) == 0 and cache.num_free_blocks == 1  # failed append changed nothing
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(0, 13)
    cache.block_tables[0, 1] = 4  # corrupt page table
    with pytest.raises(IndexError, match="page table entry 1 = 4"):
        cache.gather(0)
    cache.block_tables[0, 1] = -1
    with pytest.raises(IndexError, match="out of range"):
        verify_attention_reference(torch.zeros(1, 1, 2, 8), cache, [0])


def test_attention_errors():
    cache = _cache(2, 8, block=4)
    _fill(cache, [5])
    with pytest.raises(ValueError, match="not a multiple"):
        verify_attention_reference(torch.zeros(1, 1, 3, 8), cache, [0])
    with pytest.raises(ValueError, match="head_dim"):
        verify_attention_reference(torch.zeros(1, 1, 4, 16), cache, [0])
    with pytest.raises(ValueError, match="exceeds its cache length"):
        verify_attention_reference(torch.zeros(1, 6, 4, 8), cache, [0])
    with pytest.raises(ValueError, match="exceeds its cache length 0"):
        verify_attention_reference(torch.zeros(1, 1, 4, 8), cache, [1])
    with pytest.raises(ValueError, match="request ids"):
        verify_attention_reference(torch.zeros(2, 1, 4, 8), cache, [0])
    with pytest.raises(ValueError, match="B, Q, Hq, D"):
        verify_attention_reference(torch.zeros(1, 4, 8), cache, [0])
    with pytest.raises(TypeError, match="float tensor"):
        verify_attention_reference(torch.zeros(1, 1, 4, 8, dtype=torch.int32), cache, [0])
    with pytest.raises(ValueError, match="split_tokens"):
        verify_attention_reference(torch.zeros(1, 1, 4, 8), cache, [0], split_tokens=0)
    with pytest.raises(ValueError, match="split_tokens"):
        verify_attention_reference(torch.zeros(1, 1, 4, 8), cache, [0], split_tokens=True)
    with pytest.raises(IndexError, match="request 9"):
        verify_attention_reference(torch.zeros(1, 1, 4, 8), cache, [9])


# --- the length-adaptive split rule (runtime/split_rule.py): the kernels render the same rule ---------

RULE = SplitRule.of(32, [(40, 8), (100, 16)])  # <= 40 tokens: 8-token splits, <= 100: 16, else 32


def test_split_rule_sizes_and_grid() -> None:
    assert [RULE(n) for n in (1, 40, 41, 100, 101, 5000)] == [8, 8, 16, 16, 32, 32]
    assert [RULE.splits(n) for n in (1, 40, 41, 100, 101)] == [1, 5, 3, 7, 4]
    assert RULE.tag == "sp32_le40s8_le100s16" and SplitRule(512).tag == "sp512"
    # max_splits(cap) is the most splits any length up to cap has (the launch grid): brute force.
    for cap in (1, 8, 39, 40, 41, 64, 100, 101, 150, 1000):
        assert RULE.max_splits(cap) == max(RULE.splits(n) for n in range(1, cap + 1)), cap
    assert SplitRule(64).max_splits(65) == 2


@pytest.mark.parametrize("split,tiers", [(0, ()), (32, ((40, 0),)), (32, ((40, 8), (40, 16))),
                                         (32, ((100, 16), (40, 8))), (32, ((40, 16), (100, 8))),
                                         (32, ((40, 32),)), (32, ((40, 64),)), (32, ((40,),))])
def test_split_rule_rejects_bad_tiers(split, tiers) -> None:
    with pytest.raises(ValueError, match="bad split rule"):
        SplitRule(split, tiers)


def test_split_rule_reference_is_fixed_split_per_length() -> None:
    """The rule's reference == the fixed-split reference at the size the rule gives each length, on
    both sides of each threshold (and close to the unsplit reference)."""
    lengths = [8, 40, 41, 100, 101, 300]
    cache = _cache(1, 256, block=16)
    _fill(cache, lengths, seed=4)
    q = _q(len(lengths), 8, 6, 256, seed=2) * 3
    got = verify_attention_reference(q, cache, list(range(len(lengths))), split_tokens=RULE)
    for r, n in enumerate(lengths):
        fixed = verify_attention_reference(q[r:r + 1], cache, [r], split_tokens=RULE(n))[0]
        assert torch.equal(got[r], fixed), n
    ref = verify_attention_reference(q, cache, list(range(len(lengths))))
    vmax = max(float(cache.gather(r)[1].abs().max()) for r in range(len(lengths)))
    torch.testing.assert_close(got, ref, rtol=SPLIT_RTOL, atol=SPLIT_ATOL * vmax)


def test_split_rule_batch_invariance() -> None:
    """With the rule, each request's output is bitwise the same alone or in ragged batches whose other
    requests sit on the other side of the thresholds."""
    lengths = [40, 41, 100, 101, 9, 300]
    cache = _cache(1, 256, block=16, reqs=len(lengths))
    _fill(cache, lengths, seed=8)
    q = _q(len(lengths), 8, 6, 256, seed=5)
    alone = [verify_attention_reference(q[r:r + 1], cache, [r], split_tokens=RULE)[0] for r in range(len(lengths))]
    for batch in ([0, 1], [3, 2, 5], [5, 4, 3, 2, 1, 0], [1, 1, 0]):
        got = verify_attention_reference(q[batch], cache, batch, split_tokens=RULE)
        for i, r in enumerate(batch):
            assert torch.equal(got[i], alone[r]), (batch, r)
