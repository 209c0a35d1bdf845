"""Verify-step attention over a paged KV cache: the FP32 torch reference a generated kernel must match.

Speculative decoding verifies ``Q`` draft positions per request at once. The ``Q`` new tokens are
appended to the cache first, so query row ``i`` of request ``b`` (cache length ``L_b``) sits at
position ``L_b - Q + i`` and attends to cached positions ``0 .. L_b - Q + i`` (causal inside the
block). Query head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA).

``split_tokens`` selects the batch-invariant split-KV algorithm the kernel implements: splits start
at multiples of ``split_tokens`` from position 0, or, given a :class:`SplitRule` (the kernel's
length-adaptive rule), of the size the rule gives for the request's own length (so they depend
only on the request itself), each
split yields FP32 ``(max, sum, acc)`` per row and head, and the splits are merged in ascending
order. It equals the unsplit reference up to FP32 rounding; ``SPLIT_RTOL`` / ``SPLIT_ATOL`` state
the tolerance (``atol`` relative to ``max |V|``) the tests check, for ``L <= 300``; it is meant as
the starting bound for kernel-vs-reference checks too (not yet validated against a kernel).

FP8 caches store ``x / scale`` rounded to FP8 (saturating at the format's finite max, as kernels
do, instead of the NaN / inf a plain cast gives) and load ``fp8 * scale`` in FP32, with one FP32
scale per tensor (K and V separately). An FP16 cache uses the same formula (scale defaults to 1).

:func:`verify_attention` is the entry point: the generated kernel family ("attention",
``runtime/attention_kernel.py``) on CUDA caches, this reference on the CPU.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from .split_rule import SplitRule

__all__ = ["SPLIT_ATOL", "SPLIT_RTOL", "PagedKVCache", "SplitRule", "verify_attention", "verify_attention_reference"]

CACHE_DTYPES = (torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Split vs unsplit: observed <= ~25 FP32 eps of max|V| (worst at split_tokens=1, L=300: one rescale
# per token); both differ from float64 by ~6e-6 on |V| ~ 4. Budget 64 eps of max|V|.
SPLIT_RTOL = 1e-5
SPLIT_ATOL = 64 * torch.finfo(torch.float32).eps  # times max |V| of the request


class PagedKVCache:
    """Paged K/V storage with a block allocator and per-request block tables.

    Layouts: separate pools ``k_pool`` / ``v_pool`` of ``[num_blocks, block_size, Hkv, D]``, or one
    interleaved ``kv_pool`` of ``[num_blocks, 2, block_size, Hkv, D]`` (``k_pool`` / ``v_pool`` are
    then views of it). ``block_tables`` is ``[max_requests, max_blocks_per_request]`` int32 with -1
    for unused entries; ``lengths`` is ``[max_requests]`` int32. Requests are slot indices.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_requests: int,
        max_blocks_per_request: int,
        dtype: torch.dtype = torch.float16,
        interleaved: bool = False,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"cache dtype must be one of {CACHE_DTYPES}, got {dtype}")
        for name, val in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_requests", max_requests),
            ("max_blocks_per_request", max_blocks_per_request),
        ):
            if not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"{name} must be finite and > 0, got {s}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_requests, self.max_blocks_per_request = max_requests, max_blocks_per_request
        self.dtype, self.interleaved = dtype, interleaved
        # Scales live as FP32 0-d tensors so quantise / dequantise round exactly like FP32 kernel math.
        self.k_scale = torch.tensor(k_scale, dtype=torch.float32, device=device)
        self.v_scale = torch.tensor(v_scale, dtype=torch.float32, device=device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if interleaved:
            self.kv_pool: torch.Tensor | None = torch.zeros((num_blocks, 2, *shape[1:]), dtype=dtype, device=device)
            self.k_pool, self.v_pool = self.kv_pool[:, 0], self.kv_pool[:, 1]
        else:
            self.kv_pool = None
            self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
            self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.block_tables = torch.full((max_requests, max_blocks_per_request), -1, dtype=torch.int32)
        self.lengths = torch.zeros(max_requests, dtype=torch.int32)
        self._free = list(range(num_blocks))  # min-heap: lowest free block first, deterministic
        heapq.heapify(self._free)

    # --- bookkeeping ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Tokens one request can hold."""
        return self.max_blocks_per_request * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def length(self, req: int) -> int:
        return int(self.lengths[self._check_req(req)])

    def _check_req(self, req: int) -> int:
        if not isinstance(req, int) or isinstance(req, bool) or not 0 <= req < self.max_requests:
            raise IndexError(f"request {req!r} out of range [0, {self.max_requests})")
        return req

    def _blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)

    def _checked_table(self, req: int, n_tokens: int) -> torch.Tensor:
        """Block ids holding the first ``n_tokens`` tokens, validated (the kernel trusts them)."""
        ids = self.block_tables[req, : self._blocks_for(n_tokens)]
        bad = (ids < 0) | (ids >= self.num_blocks)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise IndexError(f"request {req}: page table entry {j} = {int(ids[j])} out of range [0, {self.num_blocks})")
        return ids.long()

    # --- quantisation --------------------------------------------------------------------------

    def _store(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float32) / scale
        if self.dtype != torch.float16:
            fmax = torch.finfo(self.dtype).max
            y = y.clamp(-fmax, fmax)  # saturate: a plain cast gives NaN (e4m3fn) or inf (e5m2)
        return y.to(self.dtype)

    def dequantize(self, stored: torch.Tensor, which: str) -> torch.Tensor:
        """FP32 values of stored K (``which='k'``) or V (``'v'``) entries: ``stored * scale``."""
        return stored.to(torch.float32) * (self.k_scale if which == "k" else self.v_scale)

    # --- request operations --------------------------------------------------------------------

    def append(self, req: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``T`` tokens (``k``, ``v``: ``[T, Hkv, D]``), allocating blocks as needed."""
        self._check_req(req)
        for name, x in (("k", k), ("v", v)):
            if x.dtype not in _INPUT_DTYPES:
                raise TypeError(f"{name} must be a float tensor ({_INPUT_DTYPES}), got {x.dtype}")
            if x.dim() != 3:
                raise ValueError(f"{name} must be [T, Hkv, D], got shape {tuple(x.shape)}")
            if x.shape[1] != self.num_kv_heads:
                raise ValueError(f"{name} has {x.shape[1]} KV heads, cache has {self.num_kv_heads}")
            if x.shape[2] != self.head_dim:
                raise ValueError(f"{name} has head_dim {x.shape[2]}, cache has {self.head_dim}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
        t, start = k.shape[0], self.length(req)
        end = start + t
        if end > self.capacity:
            raise ValueError(f"request {req}: length {end} exceeds capacity {self.capacity} tokens")
        have, need = self._blocks_for(start), self._blocks_for(end)
        if need - have > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need - have}, {len(self._free)} free")
        for j in range(have, need):
            self.block_tables[req, j] = heapq.heappop(self._free)
        if t == 0:
            return
        pos = torch.arange(start, end)
        blocks = self._checked_table(req, end)[pos // self.block_size].to(self.k_pool.device)
        offs = (pos % self.block_size).to(self.k_pool.device)
        self.k_pool[blocks, offs] = self._store(k, self.k_scale)
        self.v_pool[blocks, offs] = self._store(v, self.v_scale)
        self.lengths[req] = end

    def truncate(self, req: int, length: int) -> None:
        """Roll back to ``length`` tokens; whole blocks past it go back to the allocator."""
        cur = self.length(req)
        if not 0 <= length <= cur:
            raise ValueError(f"request {req}: cannot truncate length {cur} to {length}")
        keep = self._blocks_for(length)
        for j in range(keep, self._blocks_for(cur)):
            heapq.heappush(self._free, int(self.block_tables[req, j]))
            self.block_tables[req, j] = -1
        self.lengths[req] = length

    def release(self, req: int) -> None:
        self.truncate(req, 0)

    def gather(self, req: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's K and V, ``[len, Hkv, D]`` each, dequantised to FP32."""
        n = self.length(req)
        pos = torch.arange(n)
        blocks = self._checked_table(req, n)[pos // self.block_size].to(self.k_pool.device)
        offs = (pos % self.block_size).to(self.k_pool.device)
        return self.dequantize(self.k_pool[blocks, offs], "k"), self.dequantize(self.v_pool[blocks, offs], "v")


def _split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, split: int) -> torch.Tensor:
    """One request via fixed-size KV splits. q ``[Hq, Q, D]``, k/v ``[L, Hq, D]`` (GQA-expanded).

    Each split is computed independently (as one kernel CTA would) and merged in ascending split
    order with the usual rescaling; only the request's own ``L`` decides the split boundaries.
    """
    hq, nq, _ = q.shape
    n = k.shape[0]
    limit = torch.arange(nq) + (n - nq)  # last visible position per query row
    m = torch.full((hq, nq, 1), -math.inf)
    s_tot = torch.zeros(hq, nq, 1)
    acc = torch.zeros(hq, nq, v.shape[-1])
    for lo in range(0, n, split):
        hi = min(lo + split, n)
        s = torch.einsum("hqd,lhd->hql", q, k[lo:hi]) * scale
        visible = torch.arange(lo, hi)[None, :] <= limit[:, None]  # [Q, S]
        s = s.masked_fill(~visible, -math.inf)
        m_j = s.amax(-1, keepdim=True)
        # A split fully past a row's causal limit has m_j = -inf: use 0 so exp gives 0, not NaN.
        p = torch.exp(s - torch.where(torch.isinf(m_j), torch.zeros_like(m_j), m_j))
        l_j = p.sum(-1, keepdim=True)
        acc_j = torch.einsum("hql,lhd->hqd", p, v[lo:hi])
        # Split 0 holds position 0, visible to every row, so m is finite from the first merge on.
        m_new = torch.maximum(m, m_j)
        a, b = torch.exp(m - m_new), torch.exp(m_j - m_new)
        s_tot = s_tot * a + l_j * b
        acc = acc * a + acc_j * b
        m = m_new
    return acc / s_tot


def verify_attention_reference(
    q: torch.Tensor,
    cache: PagedKVCache,
    req_ids: Sequence[int],
    *,
    scale: float | None = None,
    split_tokens: int | SplitRule | None = None,
) -> torch.Tensor:
    """Causal verify attention of ``q`` ``[B, Q, Hq, D]`` over each request's cache -> FP32 ``[B, Q, Hq, D]``.

    ``scale`` defaults to ``1 / sqrt(D)``; scores are ``(q . k) * scale`` in FP32. Requests are
    computed one at a time, so the result for one request never depends on the rest of the batch.
    ``split_tokens``: None (one softmax), a fixed split size, or a :class:`SplitRule` (the split size
    from each request's own length, as the kernel does).
    """
    if q.dtype not in _INPUT_DTYPES:
        raise TypeError(f"q must be a float tensor ({_INPUT_DTYPES}), got {q.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Q, Hq, D], got shape {tuple(q.shape)}")
    nb, nq, hq, d = q.shape
    req_ids = [int(r) for r in req_ids]
    if len(req_ids) != nb:
        raise ValueError(f"{len(req_ids)} request ids for a batch of {nb}")
    if nq < 1:
        raise ValueError("Q must be >= 1")
    hkv = cache.num_kv_heads
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    if d != cache.head_dim:
        raise ValueError(f"q head_dim {d} != cache head_dim {cache.head_dim}")
    if split_tokens is not None and not isinstance(split_tokens, SplitRule) and (
            not isinstance(split_tokens, int) or isinstance(split_tokens, bool) or split_tokens <= 0):
        raise ValueError(f"split_tokens must be a positive int or a SplitRule, got {split_tokens!r}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    group = hq // hkv
    out = torch.empty(nb, nq, hq, d, dtype=torch.float32)
    for b, r in enumerate(req_ids):
        n = cache.length(r)
        if nq > n:
            raise ValueError(f"request {r}: Q = {nq} exceeds its cache length {n} (append the new tokens first)")
        k, v = cache.gather(r)
        k, v = k.cpu().repeat_interleave(group, dim=1), v.cpu().repeat_interleave(group, dim=1)  # head h -> h // group
        qb = q[b].to(torch.float32).cpu().transpose(0, 1)  # [Hq, Q, D]
        if split_tokens is None:
            s = torch.einsum("hqd,lhd->hql", qb, k) * scale
            visible = torch.arange(n)[None, :] <= (torch.arange(nq) + (n - nq))[:, None]
            p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1)
            o = torch.einsum("hql,lhd->hqd", p, v)
        else:
            size = split_tokens(n) if isinstance(split_tokens, SplitRule) else split_tokens
            o = _split_attention(qb, k, v, scale, size)
        out[b] = o.transpose(0, 1)
    return out


def verify_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    req_ids: Sequence[int],
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal verify attention of ``q [B, Q, Hq, D]`` over each request's cache -> FP32 ``[B, Q, Hq, D]``.

    ``backend``: "kernel" (the generated kernel; CUDA caches), "reference" (FP32 torch), or "auto":
    the kernel on CUDA, the reference on the CPU. Inputs are validated either way (head counts,
    head_dim, Q vs length, page table entries) with clear errors.
    """
    if backend not in ("auto", "kernel", "reference"):
        raise ValueError(f"backend must be auto / kernel / reference, got {backend!r}")
    if backend == "reference" or (backend == "auto" and not cache.k_pool.is_cuda):
        return verify_attention_reference(q, cache, req_ids, scale=scale)
    from .attention_kernel import paged_verify_attention

    req_ids = [cache._check_req(int(r)) for r in req_ids]
    if q.dim() != 4 or len(req_ids) != q.shape[0]:
        raise ValueError(f"q must be [B, Q, Hq, D] with one request id per row; got {tuple(q.shape)} "
                         f"and {len(req_ids)} ids")
    nq = q.shape[1]
    for r in req_ids:
        if nq > cache.length(r):
            raise ValueError(f"request {r}: Q = {nq} exceeds its cache length {cache.length(r)} "
                             "(append the new tokens first)")
        cache._checked_table(r, cache.length(r))
    dev = cache.k_pool.device
    idx = torch.tensor(req_ids, dtype=torch.long)
    tables = cache.block_tables[idx].to(dev, non_blocking=True)
    lengths = cache.lengths[idx].to(dev, non_blocking=True)
    return paged_verify_attention(q.to(dev), cache.k_pool, cache.v_pool, tables, lengths,
                                  k_scale=float(cache.k_scale), v_scale=float(cache.v_scale), scale=scale,
                                  validate=False)  # checked above, on the host copies
