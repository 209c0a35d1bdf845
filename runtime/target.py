"""The target model: a Qwen3.5 / Qwen3.8 hybrid decoder (Gated DeltaNet + gated full attention) in plain torch.

Every linear projection is a module from :func:`~dflashgen.runtime.checkpoint.load_model_projections`
(generated kernels on a GPU, the dequantize fallback on CPU). Everything else -- embeddings, RMSNorm
weights, q/k norms, GDN conv1d / ``A_log`` / ``dt_bias`` / gated-norm weights -- is a
:class:`NonLinearWeights`: read by HF name from a real checkpoint, or drawn deterministically from a
seed where the checkpoint lacks it (synthetic checkpoints hold only the projections).

All math outside the projections runs in FP32 (projection inputs are cast to ``act_dtype``, FP16 on a
GPU). Glue that a long prefill pays per [T, width] element is kept to what the math needs, without
changing a bit: a projection's output stays in ``act_dtype`` where its consumer upcasts it exactly
(the residual adds, the GDN conv's cat, another projection), and an FP32 product that feeds a
projection is rounded once on its store (:func:`~.library.mul_to`) rather than written in FP32 and cast.

:class:`DecodeState` holds per-request lengths, KV caches and GDN recurrent + conv states; with
:meth:`DecodeState.checkpoint` armed, a forward keeps the gated-delta terms from which
:meth:`DecodeState.rollback` restores any accepted length exactly (speculative verify rounds).

GDN recurrence: up to 16 positions (decode, verify, short prefills) run position by position through
:func:`~.gdn_kernel.gdn_step` (the generated "gdn" kernel on CUDA, its op-for-op torch reference on
CPU) with the causal conv as an explicit W-tap sum: a position's bits do not depend on T, the batch
or the accepted length, so a verify round rolled back to n equals n one-token steps bitwise. Longer
inputs not armed for rollback (prefill) take the same sequential path on CUDA through the family's
prefill kernel (:func:`~.gdn_kernel.gdn_prefill`: any T in one launch per layer, the step's
roundings), or with ``DFLASHGEN_GDN_PREFILL=chunked`` through the generated chunk-form kernels
(:func:`~.gdn_kernel.gdn_prefill_chunked`: ~1e-7 from those bits, still per request; ~10% faster per
GDN layer on the H200, nothing end to end, so opt-in); on CPU,
where no prefill kernel exists for the key dim, or armed (``checkpoint``) for more than 16 positions
they run in the torch matrix (chunk) form, which rounds per chunk.
Forward and rollback use static shapes, update the state in place and never sync with the host
(``check=False``), so :mod:`~.graphs` captures them as CUDA graphs per batch size.

Batch invariance: no op reduces across requests; attention runs batched over each request's own
cache (keys past its length masked to probability 0); the GDN recurrence and conv are per request.
A request's logits can still differ from a single-request run by FP32 rounding (not bitwise): the
projections run at M = B x T rows (CPU and GPU GEMMs round per shape; on a GPU
:mod:`~.invariance` removes that for the projections), and a prefill's reference attention (and, on
CPU, its GDN chunk form) round per (batch, length) shape (a batch-invariant target prefills requests
one at a time). On CUDA a prefill's GDN recurrence is the sequential kernel: per request and position
exactly the rounding of one-token steps.

Tensor parallelism (:meth:`TargetModel.from_checkpoint` with ``tp > 1`` and a :class:`~.parallel.TPContext`):
each rank holds its projection shards (wrapped by :func:`~.parallel.wrap_projections`: column-parallel
outputs stay local, o_proj / out_proj / down_proj all-reduce, the lm_head's vocab slices are
all-gathered) and computes exactly its heads: attention query (+ gate) heads ``[r*H/tp, (r+1)*H/tp)``
and KV heads ``[r*Hkv/tp, ...)`` (head ``r*Hkv//tp`` replicated when Hkv < tp, as the loader reads it);
GDN key / value heads likewise, with the matching rows of conv1d, ``A_log`` and ``dt_bias``
(:func:`shard_nonlinear`). Per-head-dim weights (q/k norms, the gated norm), embeddings and the
RMSNorms are replicated. Every rank returns the same gathered logits; its :class:`DecodeState`
holds only its heads' KV / GDN state.
"""

from __future__ import annotations

import functools
import math
import os
import zlib
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch
import torch.nn.functional as F

from dflashgen.deployment import Deployment
from dflashgen.model import FULL, GDN_IN_PROJ, ModelConfig

from .attention_kernel import DENSE_PAGE, QUERY_ROWS, dense_verify_attention, dense_verify_serves
from .checkpoint import CheckpointReader, load_model_projections
from .gdn_io import (
    conv_window,
    gdn_gate,
    gdn_inputs,
    gdn_prefill_inputs,
    gdn_split_inputs,
    io_available,
    prefill_inputs_available,
    reference_conv,
    reference_gate,
    reference_post_conv,
    split_inputs_available,
)
from .gdn_kernel import (
    chunk_available,
    gdn_advance,
    gdn_prefill,
    gdn_prefill_chunked,
    gdn_step,
    per_value_head,
    prefill_available,
)
from .library import KernelLibrary, sigmoid_gate, silu_mul_cat
from .norm_kernel import (
    add_rmsnorm,
    fused_available,
    qk_norm_rope,
    qk_rope_available,
    reference_add_rmsnorm,
    reference_qk_norm_rope,
)
from .parallel import TPContext, wrap_projections

__all__ = ["DecodeState", "NonLinearWeights", "TargetModel", "local_heads", "nonlinear_shapes", "shard_nonlinear"]

Tensor = torch.Tensor


R = TypeVar("R")


def drain(steps: Generator[Any, None, R]) -> R:
    """Run a step generator (:meth:`TargetModel.forward_steps`) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _gdn_dims(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    """(key heads, value heads, key dim, value dim, conv width) of a GDN layer."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, w = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    assert nk and nv and dk and dv and w, "GDN layers need the linear-attention config keys"
    return nk, nv, dk, dv, w


def local_heads(cfg: ModelConfig, tp: int = 1) -> tuple[int, int, int, int]:
    """(attention query heads, KV heads, GDN key heads, GDN value heads) one rank of ``tp`` holds;
    KV heads fewer than ``tp`` are replicated (one per rank). Same split as ``derive_projections``."""
    def split(what: str, n: int) -> int:
        if n % tp:
            raise ValueError(f"{what}={n} is not divisible by tp={tp}")
        return n // tp

    nh = nkv = nk = nv = 0
    if FULL in cfg.layer_types:
        nh, kv = split("num_attention_heads", cfg.num_attention_heads), cfg.num_key_value_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(f"num_key_value_heads={kv} cannot split over tp={tp}")
        nkv = max(1, kv // tp)
    if any(lt != FULL for lt in cfg.layer_types):
        knum, vnum, *_ = _gdn_dims(cfg)
        nk, nv = split("linear_num_key_heads", knum), split("linear_num_value_heads", vnum)
    return nh, nkv, nk, nv


def shard_nonlinear(weights: NonLinearWeights, cfg: ModelConfig, tp: int, rank: int) -> NonLinearWeights:
    """Rank ``rank``'s part of the non-projection weights, matching the projection shards: GDN conv1d
    rows of its q, k and v heads, ``A_log`` / ``dt_bias`` of its value heads; the rest replicated."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside 0..{tp - 1}")
    if tp == 1:
        return weights
    _, _, nk_l, nv_l = local_heads(cfg, tp)
    out = dict(weights.tensors)
    for i, lt in enumerate(cfg.layer_types):
        if lt == FULL:
            continue
        nk, _, dk, dv, _ = _gdn_dims(cfg)
        p = f"model.layers.{i}.linear_attn"
        qk, kn, vn = nk_l * dk, nk * dk, nv_l * dv
        conv = weights.tensors[f"{p}.conv1d.weight"]
        out[f"{p}.conv1d.weight"] = torch.cat((conv[rank * qk:(rank + 1) * qk],
                                               conv[kn + rank * qk:kn + (rank + 1) * qk],
                                               conv[2 * kn + rank * vn:2 * kn + (rank + 1) * vn])).contiguous()
        for n in ("A_log", "dt_bias"):
            out[f"{p}.{n}"] = weights.tensors[f"{p}.{n}"][rank * nv_l:(rank + 1) * nv_l].contiguous()
    return NonLinearWeights(out, weights.missing)


def _inner(m: torch.nn.Module) -> torch.nn.Module:
    """The shard module under a ColumnParallel / RowParallel wrapper (the module itself if bare)."""
    inner = getattr(m, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else m


def _unit_offset(cfg: ModelConfig) -> bool:
    # Qwen3-Next / 3.5 store zero-centred RMSNorm weights (output * (1 + w)); dense Qwen3 stores w.
    return cfg.family == "qwen3_hybrid"


def nonlinear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF checkpoint name -> shape of every parameter that is not a linear projection."""
    h = cfg.hidden_size
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i, lt in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        s[f"{p}.input_layernorm.weight"] = (h,)
        s[f"{p}.post_attention_layernorm.weight"] = (h,)
        if lt == FULL:
            s[f"{p}.self_attn.q_norm.weight"] = (cfg.head_dim,)
            s[f"{p}.self_attn.k_norm.weight"] = (cfg.head_dim,)
        else:
            nk, nv, dk, dv, w = _gdn_dims(cfg)
            s[f"{p}.linear_attn.conv1d.weight"] = (2 * nk * dk + nv * dv, 1, w)  # depthwise over q|k|v
            s[f"{p}.linear_attn.A_log"] = (nv,)
            s[f"{p}.linear_attn.dt_bias"] = (nv,)
            s[f"{p}.linear_attn.norm.weight"] = (dv,)  # gated RMSNorm, plain (not zero-centred) weight
    return s


def _draw(name: str, shape: tuple[int, ...], seed: int, unit_offset: bool) -> Tensor:
    # One generator per name: any subset of names can be (re)drawn independently of the others.
    g = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (1 << 62))

    def randn() -> Tensor:
        return torch.randn(shape, generator=g)

    if name.endswith("embed_tokens.weight"):
        return randn() * 0.02
    if name.endswith("conv1d.weight"):
        return randn() / math.sqrt(shape[-1])
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.1, 2.0, generator=g).log()  # decay rates A in [0.1, 2]
    if name.endswith("dt_bias"):
        return randn() * 0.5
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * randn()
    return 0.1 * randn() + (0.0 if unit_offset else 1.0)  # RMSNorm weights: effective scale ~ 1 +- 0.1


@dataclass
class NonLinearWeights:
    """Non-projection parameters by HF name, in HF conventions (zero-centred norms for hybrid models),
    FP32. ``missing`` lists the names drawn from the seed instead of read from a checkpoint."""

    tensors: dict[str, Tensor]
    missing: tuple[str, ...] = ()

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0) -> NonLinearWeights:
        """Deterministic stand-ins (a pure function of cfg, name and seed); real checkpoints provide these."""
        off = _unit_offset(cfg)
        t = {n: _draw(n, s, seed, off) for n, s in nonlinear_shapes(cfg).items()}
        return cls(t, tuple(t))

    @classmethod
    def from_checkpoint(cls, source: str | os.PathLike[str] | Mapping[str, Tensor], cfg: ModelConfig,
                        seed: int = 0) -> NonLinearWeights:
        """Read every tensor present under its HF name (a checkpoint directory or a ``{name: tensor}``
        dict); draw the rest from ``seed`` (e.g. for a synthetic checkpoint, which holds only projections)."""
        off = _unit_offset(cfg)
        tensors: dict[str, Tensor] = {}
        missing: list[str] = []
        with CheckpointReader(source) as r:
            for name, shape in nonlinear_shapes(cfg).items():
                if name not in r:
                    missing.append(name)
                    tensors[name] = _draw(name, shape, seed, off)
                    continue
                t = r.read(name).float()
                if t.numel() != math.prod(shape):  # conv1d may be stored [C, W] or [C, 1, W]
                    raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)} "
                                     f"(in {r.where(name)})")
                tensors[name] = t.reshape(shape)
        return cls(tensors, tuple(missing))


# --------------------------------------------------------------------------- decode state


class DecodeState:
    """Per-request decode state for ``batch`` requests of up to ``max_len`` positions.

    ``lengths[b]``: positions already in request b's caches. KV caches are contiguous
    ``[B, max_len, Hkv, D]`` tensors (entries past ``lengths`` are stale and never attended).
    GDN: recurrent state ``[B, Hv, dk, dv]`` FP32 and conv state ``[B, C, W-1]`` (the last W-1 conv
    inputs, oldest first) per layer.

    Every tensor is updated in place and verify scratch lives in preallocated buffers, so a forward
    and a rollback can be captured in a CUDA graph and replayed; :meth:`narrow` gives the first
    ``b`` slots as a state of views (one graph per batch size over the same storage).

    Rollback without per-position snapshots: an armed (``checkpoint``) forward of T positions leaves
    the GDN recurrent state at S0 (before the forward) and keeps, per layer, the per-position terms of
    the gated delta rule -- keys k_t, delta-rule values u_t and decays d_t -- from which
    :meth:`rollback` replays ``S <- d_t S + k_t u_t^T`` for the first n positions with the step's own
    update (:func:`~.gdn_kernel.gdn_advance`, every layer in one launch): bitwise a ``num_new`` commit
    and n one-token steps. That replay is deferred: rollback records n, and the next armed forward's
    GDN steps replay it as they read the state anyway (one state read per round instead of two);
    reading ``ssm`` / ``ssm_all`` (or :meth:`settle`) applies it first, so the state read is always
    the rolled-back one (``DFLASHGEN_GDN_FOLD=0``: rollback advances at once). A forward of more than
    16 positions keeps chunk terms instead (keys, values, cumulative log decays) and rolls back by the
    closed form ``exp(G_n) S0 + sum_{i<n} exp(G_n - G_i) k_i u_i^T``.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype = torch.float32, *, tp: int = 1) -> None:
        """tp: the tensor-parallel degree; the state holds one rank's heads (:func:`local_heads`)."""
        self.batch, self.max_len = batch, max_len
        _, nkv_l, nk_l, nv_l = local_heads(cfg, tp)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        for i, lt in enumerate(cfg.layer_types):
            if lt == FULL:
                shape = (batch, max_len, nkv_l, cfg.head_dim)
                # zeros, not empty: masked keys are multiplied by probability 0, and 0 * NaN = NaN
                self.k[i] = torch.zeros(shape, dtype=kv_dtype, device=device)
                self.v[i] = torch.zeros(shape, dtype=kv_dtype, device=device)
        # GDN states of all layers stacked [layers, B, ...] (ssm[i] / conv[i] are per-layer views), so a
        # rollback is one batched computation over every layer rather than a few kernels per layer.
        self.gdn_index = {i: j for j, i in enumerate(i for i, lt in enumerate(cfg.layer_types) if lt != FULL)}
        n_gdn = len(self.gdn_index)
        dk = dv = w = 1
        if n_gdn:
            _, _, dk, dv, w = _gdn_dims(cfg)
        self._ssm_all = torch.zeros(n_gdn, batch, nv_l, dk, dv, dtype=torch.float32, device=device)
        self.conv_all = torch.zeros(n_gdn, batch, 2 * nk_l * dk + nv_l * dv, w - 1, dtype=torch.float32,
                                    device=device)
        self._ssm = {i: self._ssm_all[j] for i, j in self.gdn_index.items()}
        self.conv = {i: self.conv_all[j] for i, j in self.gdn_index.items()}
        self._deferred = False  # a rollback ever deferred its GDN replay (sticky: graph replays may re-arm it)
        self._nk = nk_l
        self._armed = 0  # positions the next forward keeps rollback terms for (0: commit everything)
        self._span = 0  # positions of the armed forward awaiting rollback (0: none)
        self._gdn_seq = True  # the armed forward kept sequential-step terms (T <= 16), else chunk terms
        self._bufs: dict[str, Tensor] = {}  # verify scratch, full batch; narrowed states slice it
        self._root: DecodeState = self
        self._lo = 0

    def narrow(self, batch: int) -> DecodeState:
        """Slots ``[0, batch)`` as a state of views: forwards / rollbacks on it update this state."""
        if not 1 <= batch <= self.batch:
            raise ValueError(f"cannot narrow a state of {self.batch} requests to {batch}")
        sub = object.__new__(DecodeState)
        sub.batch, sub.max_len = batch, self.max_len
        sub.lengths = self.lengths[:batch]
        sub.gdn_index, sub._nk = self.gdn_index, self._nk
        sub._ssm_all, sub.conv_all = self._ssm_all[:, :batch], self.conv_all[:, :batch]
        for name in ("k", "v", "_ssm", "conv"):
            setattr(sub, name, {i: t[:batch] for i, t in getattr(self, name).items()})
        sub._armed, sub._span, sub._bufs, sub._root, sub._gdn_seq = 0, 0, {}, self._root, True
        return sub

    @property
    def ssm_all(self) -> Tensor:
        """GDN recurrent states of every layer ``[layers, B, Hv, dk, dv]`` FP32, any deferred rollback applied."""
        self.settle()
        return self._ssm_all

    @property
    def ssm(self) -> dict[int, Tensor]:
        """Layer index -> its GDN recurrent state ``[B, Hv, dk, dv]`` (a view of ``ssm_all``), settled."""
        self.settle()
        return self._ssm

    def settle(self) -> None:
        """Apply a deferred GDN rollback now (every slot of the root state, every layer: one
        :func:`~.gdn_kernel.gdn_advance`; a no-op where nothing is pending). Device work only, no sync."""
        root = self._root
        if not root._deferred:
            return
        n = root._bufs["gdn_replay"]
        gdn_advance(root._ssm_all, root.stacked("gdn_k"), root.stacked("gdn_u"), root.stacked("gdn_decay"), n)
        n.zero_()

    def replay_terms(self, t: int) -> tuple[Tensor, Tensor] | None:
        """For an armed forward of t <= 16 positions whose GDN steps fold the deferred rollback in: the
        per-request replay counts ``[B]`` and the steps' arrival counters ``[layers, B, Hk]`` (zeros).
        None where rollbacks advance at once. A deferred replay kept in terms of another T is applied first
        (the forward's terms reuse those buffers)."""
        if not _gdn_fold() or not self.gdn_index:
            self.settle()  # (a replay deferred before the fold was switched off: its steps read the state raw)
            return None
        held = self._root._bufs.get("stacked:gdn_u")
        if held is not None and held.shape[2] != t:
            self.settle()
        return self.buffer("gdn_replay", (), torch.long), self.stacked("gdn_arrive", (self._nk,), torch.int32)

    def buffer(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """Scratch ``[batch, *shape]`` that persists across forwards (allocated once, full batch, in the
        root state, so graphs captured at any batch size read and write the same storage).
        ``shape=None``: the existing buffer."""
        root = self._root
        buf = root._bufs.get(name)
        if shape is None:
            if buf is None:
                raise RuntimeError(f"decode state buffer {name!r} was never written")
        elif buf is None or buf.shape[1:] != shape or buf.dtype != dtype:
            buf = root._bufs[name] = torch.zeros((root.batch, *shape), dtype=dtype, device=root.lengths.device)
        return buf[:self.batch]

    def stacked(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """Like :meth:`buffer`, ``[GDN layers, batch, *shape]`` (layer-major: one batched op
        covers every layer; ``[j]`` is GDN layer j's contiguous ``[batch, *shape]`` block)."""
        root = self._root
        key = "stacked:" + name
        buf = root._bufs.get(key)
        if shape is None:
            if buf is None:
                raise RuntimeError(f"decode state buffer {name!r} was never written")
        elif buf is None or buf.shape[2:] != shape or buf.dtype != dtype:
            buf = root._bufs[key] = torch.zeros((len(self.gdn_index), root.batch, *shape), dtype=dtype,
                                                device=root.lengths.device)
        return buf[:, :self.batch]

    def checkpoint(self, positions: int) -> None:
        """Arm the next forward (of at most ``positions`` positions) to keep what :meth:`rollback` needs
        to restore any length it passes through. Until that rollback the GDN state is pending."""
        if positions < 1:
            raise ValueError(f"positions must be >= 1, got {positions}")
        self._armed = positions

    def rollback(self, lengths: Tensor, *, check: bool = True) -> None:
        """Restore request b to "after position ``lengths[b]``" (absolute length, within the last
        checkpointed forward's range [before, after]); once per armed forward. KV entries past the
        length become stale. ``check=False``: no validation (no host sync; CUDA-graph capture)."""
        if self._span == 0:
            raise RuntimeError("rollback needs a forward run after checkpoint()")
        t = self._span
        base = self.buffer("base")
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        n = lengths - base
        if check and (lengths.shape != (self.batch,) or bool((n < 0).any()) or bool((n > t).any())):
            raise ValueError(f"rollback lengths {lengths.tolist()} outside the checkpointed range "
                             f"[{base.tolist()}, +{t}]")
        if self.gdn_index:  # every layer at once
            if self._gdn_seq:  # the step's own update: bitwise n committed single steps
                if _gdn_fold():  # deferred: the next armed forward's steps (or settle) replay it
                    self.buffer("gdn_replay", (), torch.long).copy_(n)
                    self._root._deferred = True
                else:  # one launch, now
                    gdn_advance(self._ssm_all, self.stacked("gdn_k"), self.stacked("gdn_u"),
                                self.stacked("gdn_decay"), n)
                cat = self.stacked("gdn_conv_cat").transpose(-1, -2)  # stored time-major
            else:  # a chunk-form forward (T > 16): its closed form
                _gdn_state_at(self.ssm_all, self.stacked("k"), self.stacked("u"), self.stacked("g"), n,
                              out=self.ssm_all)
                cat = self.stacked("conv_cat")
            self.conv_all.copy_(conv_window(cat, n, self.conv_all.shape[-1]))
        self.lengths.copy_(lengths)
        self._span = 0

    def commit(self) -> None:
        """Keep every position of a pending armed forward (a rollback to its full length)."""
        if self._span:
            self.rollback(self.buffer("base") + self._span, check=False)

    def reset(self, index: int) -> None:
        """Empty request slot ``index`` (a new request starts there)."""
        self.commit()
        self.lengths[index] = 0
        self.ssm_all[:, index].zero_()
        self.conv_all[:, index].zero_()


def _gdn_state_at(s0: Tensor, k: Tensor, u: Tensor, g: Tensor, n: Tensor, out: Tensor | None = None) -> Tensor:
    """Gated delta rule state after the first ``n[b]`` positions of a chunk that started at ``s0``.

    s0 [..., B, H, dk, dv]; k [..., B, H, T, dk] keys, u [..., B, H, T, dv] new values, g [..., B, H, T]
    cumulative log decay (inclusive); n [B] in [0, T] (leading dims: e.g. stacked layers).
    ``exp(G_n) s0 + sum_{i<n} exp(G_n - G_i) k_i u_i^T`` with G_0 = 0. ``out`` may be ``s0``."""
    t = k.shape[-2]
    nb = n.view(*([1] * (g.dim() - 3)), -1, 1, 1)  # [..., B, 1, 1]
    g_ext = torch.cat((torch.zeros_like(g[..., :1]), g), dim=-1)  # [..., B, H, T+1]: G_0 = 0
    g_n = g_ext.gather(-1, nb.expand(*g.shape[:-1], 1))  # [..., B, H, 1]
    live = torch.arange(t, device=k.device) < nb  # positions i < n
    w = torch.exp((g_n - g).masked_fill(~live, -math.inf))  # [B, H, T], 0 past n
    upd = (k * w[..., None]).transpose(-1, -2) @ u  # [B, H, dk, dv]
    scale = torch.exp(g_n)[..., None]
    if out is None:
        return s0 * scale + upd
    return out.mul_(scale).add_(upd)


# --------------------------------------------------------------------------- model


def _rms_norm(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    return F.rms_norm(x, x.shape[-1:], w, eps)  # x * rsqrt(mean(x^2) + eps) * w; fused on CUDA


def dequantized_projections(model: TargetModel) -> dict[str, torch.nn.Module]:
    """Every projection of ``model`` dequantized once into an FP32 ``nn.Linear`` (logical row
    order, so a fused gate|up takes the unfused SiLU path): the fast, deterministic CPU path (the
    CPU fallback would dequantize on every call)."""
    mods = {f"layers.{i}.{k}": m for i, md in enumerate(model.proj) for k, m in md.items()}
    out: dict[str, torch.nn.Module] = {}
    for name, m in {**mods, "lm_head": model.lm_head}.items():
        w = m.dequantize() if hasattr(m, "dequantize") else m.weight.float()
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w.float()
        out[name] = lin
    return out


class TargetModel(torch.nn.Module):
    """Hybrid decoder over loaded projection modules. ``forward(tokens, state)`` appends the tokens
    to each request and returns FP32 logits ``[B, T, V]``."""

    def __init__(self, cfg: ModelConfig, projections: Mapping[str, torch.nn.Module], weights: NonLinearWeights,
                 *, device: torch.device | str | None = None, act_dtype: torch.dtype | None = None,
                 ctx: TPContext | None = None) -> None:
        """device: where the non-projection weights live (default: the lm_head's). act_dtype: the
        projections' input dtype (default FP16 on CUDA, where the kernels need it, else FP32).
        ctx: tensor parallelism (world size > 1): ``projections`` are this rank's wrapped shards,
        ``weights`` the full non-projection weights (sharded here)."""
        super().__init__()
        self.cfg = cfg
        self.tp = ctx.world_size if ctx is not None else 1
        self.rank = ctx.rank if ctx is not None else 0
        self.tp_group = ctx.group if ctx is not None and self.tp > 1 else None
        if self.tp > 1 and self.tp_group is None:
            raise ValueError(f"TP{self.tp} needs a TPContext with a process group (init_tp)")
        self.heads = local_heads(cfg, self.tp)  # (q heads, KV heads, GDN key heads, GDN value heads) here
        # Set by load_target(..., invariant=True) once its projections are batch-invariant: the decoder
        # then prefills joining requests one at a time (SpecDecoder._prefill) for byte-identity.
        self.batch_invariant = False
        self.library: KernelLibrary | None = None  # from_checkpoint: the one its projections go through
        weights = shard_nonlinear(weights, cfg, self.tp, self.rank)
        lm = projections["lm_head"]
        if device is None:
            device = next(iter([*lm.parameters(), *lm.buffers()])).device
        self.device = torch.device(device)
        self.act_dtype = act_dtype or (torch.float16 if self.device.type == "cuda" else torch.float32)
        self.eps = cfg.rms_norm_eps
        # Generated glue kernels (CUDA, FP16 projections), each with an A/B switch ($env=0: torch's ops).
        def glue(env: str, available: Callable[[], bool]) -> bool:
            return self.act_dtype == torch.float16 and os.environ.get(env, "1") != "0" and available()

        gdn_dims = _gdn_dims(cfg)
        # the residual add + RMSNorm + FP16 cast of each norm site
        self.fused_norm = glue("DFLASHGEN_FUSED_NORM", lambda: fused_available(self.device, cfg.hidden_size))
        # a full-attention layer's q / k norms, RoPE and cache writes (FP16 caches too)
        self.fused_qk = glue("DFLASHGEN_FUSED_QK", lambda: qk_rope_available(self.device, cfg.head_dim))
        # the GDN layers' glue: conv, SiLU, q / k norms, beta / decay; the gated norm
        self.gdn_io = glue("DFLASHGEN_GDN_IO", lambda: io_available(self.device, gdn_dims[2], gdn_dims[3]))
        # ... and of an unarmed forward (prefill, plain decoding) straight from the conv state and the
        # in_proj output's FP16 rows: no FP32 conv-input cat (same bits)
        self.gdn_prefill_io = self.gdn_io and glue("DFLASHGEN_GDN_PREFILL_IO", lambda: prefill_inputs_available(
            self.device, gdn_dims[2], gdn_dims[3], gdn_dims[4]))
        # ... and of an armed (verify) forward, writing the conv-input cat the rollback keeps itself
        # (no torch cat: two copies per layer; same bits)
        self.gdn_split_io = self.gdn_io and glue("DFLASHGEN_GDN_SPLIT_IO", lambda: split_inputs_available(
            self.device, gdn_dims[2], gdn_dims[3]))
        for m in projections.values():
            # Plain (FP16) nn.Linear layers must match the activation dtype; QuantLinear takes any float.
            m = _inner(m)
            if isinstance(m, torch.nn.Linear) and m.weight.dtype != self.act_dtype:
                m.to(self.act_dtype)
        self.lm_head = lm
        self.proj = torch.nn.ModuleList(
            torch.nn.ModuleDict({k.split(".", 2)[2]: m for k, m in projections.items()
                                 if k.startswith(f"layers.{i}.")})
            for i in range(cfg.num_hidden_layers))
        off = 1.0 if _unit_offset(cfg) else 0.0
        w = {n: t.to(self.device, torch.float32) for n, t in weights.tensors.items()}
        # Effective multiplicative norm weights (zero-centred ones get their +1 here, once).
        self.w: dict[str, Tensor] = {
            n: (t + off if n.endswith("norm.weight") and "linear_attn" not in n else t) for n, t in w.items()}
        # GDN decay rate -exp(A_log), once (not per forward)
        self.neg_a = {i: -torch.exp(self.w[f"model.layers.{i}.linear_attn.A_log"])
                      for i, lt in enumerate(cfg.layer_types) if lt != FULL}
        rd = int(cfg.head_dim * cfg.partial_rotary_factor) // 2 * 2
        self.rotary_dim = rd
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64, device=self.device) / rd)

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike[str], cfg: ModelConfig, deployment: Deployment, *,
                        library: KernelLibrary | None = None, seed: int = 0,
                        act_dtype: torch.dtype | None = None, tp: int = 1, rank: int = 0,
                        ctx: TPContext | None = None) -> TargetModel:
        """Projections through the kernel library (or the CPU fallback) + non-projection weights by HF
        name, drawn from ``seed`` where the checkpoint lacks them.

        Tensor parallel: pass ``ctx`` (from :func:`~.parallel.init_tp`; ``tp`` / ``rank`` default to
        its world size / rank and must agree with it). Each rank reads only its projection shards and
        wraps them; the non-projection weights are sharded to the same heads."""
        if ctx is not None:
            if (tp, rank) != (1, 0) and (tp, rank) != (ctx.world_size, ctx.rank):
                raise ValueError(f"tp={tp}, rank={rank} disagree with the TPContext "
                                 f"(world size {ctx.world_size}, rank {ctx.rank})")
            tp, rank = ctx.world_size, ctx.rank
        elif tp > 1:
            raise ValueError(f"tp={tp} needs a TPContext (init_tp) for the collectives")
        projections = load_model_projections(directory, cfg, deployment, tp, rank, library=library)
        weights = NonLinearWeights.from_checkpoint(directory, cfg, seed)
        device: torch.device | str = library.device if library is not None else "cpu"
        if tp > 1:
            assert ctx is not None
            device = ctx.device
            projections = wrap_projections({k: m.to(device) for k, m in projections.items()}, cfg, ctx)
            target = cls(cfg, projections, weights, device=device, act_dtype=act_dtype, ctx=ctx)
        else:
            target = cls(cfg, projections, weights, device=device, act_dtype=act_dtype)
        target.library = library
        return target

    def new_state(self, batch: int, max_len: int) -> DecodeState:
        # FP16 KV on a GPU: what the generated verify-attention kernels read (FP32 reference on CPU).
        kv = torch.float16 if torch.device(self.device).type == "cuda" else torch.float32
        # Whole 16-token pages: the kernels view the cache as a paged one (dense_verify_attention);
        # a ragged tail would send every layer to the FP32 reference.
        max_len = -(-max_len // DENSE_PAGE) * DENSE_PAGE
        return DecodeState(self.cfg, batch, max_len, self.device, kv, tp=self.tp)

    def _proj(self, mod: torch.nn.Module, x: Tensor) -> Tensor:
        """mod(x) in ``act_dtype``, as the projection returns it: for consumers that upcast it exactly
        themselves (another projection, a promoting add / cat / multiply) -- no FP32 copy in memory."""
        return mod(x.to(self.act_dtype))

    def _lin(self, mod: torch.nn.Module, x: Tensor) -> Tensor:
        return self._proj(mod, x).float()

    def _p(self, i: int, name: str) -> torch.nn.Module:
        return self.proj[i][name]  # type: ignore[index]

    @overload
    def forward(self, tokens: Tensor, state: DecodeState, num_new: Tensor | None = None, *,
                taps: None = None, check: bool = True, logits: bool = True) -> Tensor: ...

    @overload
    def forward(self, tokens: Tensor, state: DecodeState, num_new: Tensor | None = None, *,
                taps: Sequence[int], check: bool = True, logits: bool = True) -> tuple[Tensor, dict[int, Tensor]]: ...

    def forward(self, tokens: Tensor, state: DecodeState, num_new: Tensor | None = None, *,
                taps: Sequence[int] | None = None, check: bool = True,
                logits: bool = True) -> Tensor | tuple[Tensor, dict[int, Tensor]]:
        """Append ``tokens [B, T]`` at positions ``state.lengths + t``; logits ``[B, T, V]`` FP32.

        num_new: per-request count of real tokens (right padding beyond it, e.g. prompts of different
        lengths): every position is computed, but request b only advances by ``num_new[b]``.
        taps: decoder layer indices (0-based) whose output hidden states ``[B, T, H]`` FP32 to return
        as ``(logits, {layer: hidden})`` -- HF ``hidden_states[layer + 1]``, what a DFlash drafter is
        conditioned on. None (default): logits only.
        check: validate lengths / num_new against the state (host syncs). ``False`` for CUDA-graph
        capture: the caller validates on the host. The work itself never syncs.
        logits: False skips the final norm and the lm_head (an empty ``[B, T, 0]`` tensor is returned):
        prefill only needs the state (and taps), not ``B x T x V`` logits.
        """
        return drain(self.forward_steps(tokens, state, num_new, taps=taps, check=check, logits=logits))

    @torch.no_grad()
    def forward_steps(self, tokens: Tensor, state: DecodeState, num_new: Tensor | None = None, *,
                      taps: Sequence[int] | None = None, check: bool = True, logits: bool = True,
                      ) -> Generator[int, None, Tensor | tuple[Tensor, dict[int, Tensor]]]:
        """:meth:`forward` one decoder layer at a time: yields each layer's index once its work is
        queued and returns what ``forward`` returns. The same operations in the same order, so the
        same bits; a caller can interleave other work between layers (SpecDecoder queues a joining
        request's prefill on a side stream a few layers per round). The state is complete only once
        the generator returns."""
        tap_set = set(taps) if taps is not None else set()
        if bad := sorted(i for i in tap_set if not 0 <= i < self.cfg.num_hidden_layers):
            raise ValueError(f"taps {bad} outside layers [0, {self.cfg.num_hidden_layers})")
        tapped: dict[int, Tensor] = {}
        b, t = tokens.shape
        if b != state.batch:
            raise ValueError(f"tokens have {b} requests, the state {state.batch}")
        if state._armed and t > state._armed:
            raise ValueError(f"forward of {t} positions, but checkpoint() armed {state._armed}")
        state.commit()  # an armed forward nobody rolled back keeps all its positions
        base = state.lengths.clone()
        n_new = None if num_new is None else torch.as_tensor(num_new, dtype=torch.long, device=base.device)
        kv_len = None  # keys a long (prefill) forward's attention reads: all visible ones, when known
        if check:
            kv_len = int(base.max()) + t
            if kv_len > state.max_len:
                raise ValueError(f"{t} new positions overflow max_len={state.max_len} (lengths {base.tolist()})")
            if n_new is not None and (n_new.shape != (b,) or bool((n_new < 0).any()) or bool((n_new > t).any())):
                raise ValueError(f"num_new must be {b} counts in [0, {t}], got {n_new.tolist()}")
        keep = state._armed > 0
        # an armed verify forward's GDN steps replay the deferred rollback (DecodeState.settle's work)
        replay = state.replay_terms(t) if keep and t <= _SMALL_CHUNK else None
        pos = base[:, None] + torch.arange(t, device=base.device)  # [B, T]
        ang = pos[..., None].double() * self.inv_freq  # fp64 angles: exact per position, any batch
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos().float()[:, :, None], emb.sin().float()[:, :, None]  # [B, T, 1, rd]

        ends = (base + t).to(torch.int32)  # each request's visible length after this forward (attention)
        h = self.w["model.embed_tokens.weight"][tokens]
        r: Tensor | None = None  # the last sublayer's output, added to h by the next norm site
        for i, lt in enumerate(self.cfg.layer_types):
            p = f"model.layers.{i}"
            h, x = self._add_norm(h, r, f"{p}.input_layernorm.weight")
            r = (self._attention(i, x, pos, ends, cos, sin, state, kv_len) if lt == FULL
                 else self._gdn(i, x, state, n_new, keep, replay))
            h, x = self._add_norm(h, r, f"{p}.post_attention_layernorm.weight")
            r = self._mlp(i, x)
            if i in tap_set:
                h, r = h + r, None
                tapped[i] = h
            yield i
        out = (self._lin(self.lm_head, self._add_norm(h, r, "model.norm.weight")[1]) if logits
               else h.new_empty(b, t, 0))

        if replay is not None:  # every layer replayed it (a device op: graph replays redo it)
            replay[0].zero_()
        if keep:
            state.buffer("base", (), torch.long).copy_(base)
            state._span = t
            state._gdn_seq = t <= _SMALL_CHUNK
        state.lengths.copy_(base + (n_new if n_new is not None else t))
        state._armed = 0
        return out if taps is None else (out, {i: tapped[i] for i in taps})

    def _add_norm(self, h: Tensor, r: Tensor | None, name: str) -> tuple[Tensor, Tensor]:
        """(h + r, the RMSNorm ``name`` of it); r: a sublayer's output, or None (nothing to add). On
        CUDA one generated kernel (:func:`~.norm_kernel.add_rmsnorm`) whose output is already the
        projections' FP16 input; otherwise torch's add and FP32 ``rms_norm`` (the consumers cast)."""
        w = self.w[name]
        if self.fused_norm and (r is None or (r.dtype is torch.float16 and r.is_contiguous())) and h.is_contiguous():
            return add_rmsnorm(h, r, w, self.eps)
        return reference_add_rmsnorm(h, r, w, self.eps, h.dtype)  # FP32 x: the consumers cast

    def _mlp(self, i: int, x: Tensor) -> Tensor:
        """down(SiLU(gate) * up) in ``act_dtype`` (the residual add upcasts it exactly). SiLU(gate) * up
        is computed in FP32 and rounded once to ``act_dtype``, the down projection's input (fused
        epilogue or :func:`~.library.silu_mul`): never an FP32 [T, I] copy in memory."""
        gu = self._p(i, "gate_up_proj")
        y = self._proj(gu, x)
        if not getattr(_inner(gu), "silu", False):  # unfused: [gate | up] (this rank's slices of each)
            y = silu_mul_cat(y, self.act_dtype)
        return self._proj(self._p(i, "down_proj"), y)

    def _attention(self, i: int, x: Tensor, pos: Tensor, ends: Tensor, cos: Tensor, sin: Tensor, state: DecodeState,
                   kv_len: int | None = None) -> Tensor:
        """ends: ``pos[:, -1] + 1`` as int32 (made once per forward)."""
        cfg, (b, t, _) = self.cfg, x.shape
        (nh, nkv, _, _), d = self.heads, cfg.head_dim  # this rank's heads
        p = f"model.layers.{i}.self_attn"
        # act_dtype pieces, each upcast (exactly) where it is used: q and k into the contiguous FP32
        # copies their norms would make anyway, v not at all on its way into an FP16 cache
        qkv = self._proj(self._p(i, "qkv_proj"), x)
        qg, k, v = qkv.split([nh * d * (2 if cfg.attn_output_gate else 1), nkv * d, nkv * d], dim=-1)
        gate = None
        if cfg.attn_output_gate:  # per head [q(D) | gate(D)]
            qg = qg.view(b, t, nh, 2 * d)
            q, gate = qg[..., :d], qg[..., d:]
        else:
            q = qg.view(b, t, nh, d)
        kc, vc = state.k[i], state.v[i]
        q_w, k_w = self.w[f"{p}.q_norm.weight"], self.w[f"{p}.k_norm.weight"]
        if (self.fused_qk and qkv.dtype is torch.float16 and kc.dtype is torch.float16 and vc.dtype is torch.float16
                and kc.is_contiguous() and vc.is_contiguous()):
            # q / k norms, RoPE and the cache writes in one generated launch (norm_kernel.qk_norm_rope); q
            # in FP16 where the verify kernel takes it (its cast of the FP32 q: the same bits, one launch less)
            q16 = t <= QUERY_ROWS and dense_verify_serves(x.device, nh, kc, vc)
            q = qk_norm_rope(qkv, (nh, nkv), d, bool(cfg.attn_output_gate), self.rotary_dim, q_w, k_w, self.eps,
                             cos, sin, pos, kc, vc,
                             q_out=torch.empty((b, t, nh, d), dtype=torch.float16, device=x.device) if q16 else None)
        else:
            q = reference_qk_norm_rope(q, k.view(b, t, nkv, d), v.view(b, t, nkv, d), q_w, k_w, self.eps, cos, sin,
                                       self.rotary_dim, pos, kc, vc)
        # The generated verify-attention kernel on CUDA (FP16/FP8 cache) for decode / verify forwards;
        # longer (prefill) forwards on CUDA through torch's fused attention (_attend_fused); the FP32
        # reference elsewhere. Query t of request b sits at pos[b, t] = n_vis[b] - T + t.
        out = dense_verify_attention(q, kc, vc, ends) if t <= QUERY_ROWS else None
        if out is None and _fused_prefill_attention(q):
            out = self._attend_fused(q, kc, vc, pos, kv_len)
        o = self._attend(q, kc, vc, pos) if out is None else out  # [B, T, H, D], any strides
        if gate is not None:  # FP32 gate; the product lands contiguous in o_proj's input dtype
            o = sigmoid_gate(o, gate, self.act_dtype)
        # act_dtype out: the residual add upcasts it exactly
        return self._proj(self._p(i, "o_proj"), o.reshape(b, t, nh * d))

    @staticmethod
    def _attend_fused(q: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, kv_len: int | None) -> Tensor:
        """:meth:`_attend`'s contract through ``F.scaled_dot_product_attention`` (FP16 operands, FP32
        softmax and accumulation inside the fused kernel) over the first ``kv_len`` cache positions
        (None: the whole cache), so a 1K-token prefill layer reads ~1K keys instead of the cache's
        capacity and never materialises FP32 [B, H, T, L] scores (the reference's ~0.9 ms per layer).
        It rounds differently from the reference (FP16 P V products; GPU test: relative L2 <= 2e-3),
        which is allowed because every path -- speculative, plain, any batch -- prefills through it;
        ``DFLASHGEN_PREFILL_ATTENTION=reference`` restores the reference. Returns [B, T, H, D]."""
        b, t, h, d = q.shape
        cap, hkv = kc.shape[1], kc.shape[2]
        # keys 16-aligned (the fused kernels' mask stride); the extra ones are masked like the rest
        length = cap if kv_len is None else min(cap, -(-kv_len // 16) * 16)
        dt = torch.float16 if kc.dtype.itemsize == 1 else kc.dtype  # the cache's type (FP8: FP16, exact)
        # [B, Hkv, L, D] views (an FP8 cache upcast before the heads are repeated: once per KV head)
        k, v = kc[:, :length].transpose(1, 2).to(dt), vc[:, :length].transpose(1, 2).to(dt)
        gqa = hkv != h and _native_gqa(q.device)
        if hkv != h and not gqa:  # grouped heads: one copy per query head (the memory-efficient kernel wants them)
            k = k.repeat_interleave(h // hkv, dim=1)
            v = v.repeat_interleave(h // hkv, dim=1)
        visible = torch.arange(length, device=q.device) <= pos[:, :, None]  # [B, T, L]
        o = F.scaled_dot_product_attention(q.transpose(1, 2).to(dt), k, v, attn_mask=visible[:, None],
                                           scale=d**-0.5, enable_gqa=gqa)
        return o.transpose(1, 2)  # [B, T, H, D] view

    @staticmethod
    def _attend(q: Tensor, kc: Tensor, vc: Tensor, pos: Tensor) -> Tensor:
        """Causal GQA attention (FP32 reference) of queries q [B, T, H, D] at positions pos [B, T] over
        each request's own cache [B, L, Hkv, D] (keys at positions <= the query's; the rest -- stale
        entries past a request's length -- get probability exactly 0). Static shapes, no host sync:
        CUDA-graph capturable. Returns [B, T, H, D] (a strided view). A generated verify-attention kernel
        (runtime/attention.py) replaces this behind the same contract."""
        b, t, h, d = q.shape
        hkv, length = kc.shape[2], kc.shape[1]
        g = h // hkv
        scale = d**-0.5
        qb = torch.empty((b, hkv, g, t, d), dtype=q.dtype, device=q.device)  # grouped by KV head
        kt = kc.permute(0, 2, 3, 1).float()
        if math.frexp(scale)[0] == 0.5:
            # a power of two (d = 64, 256, ...): scaling q is exact, so (q * scale) @ k^T is bitwise
            # (q @ k^T) * scale (outside FP32's subnormal range), with the scale in the copy that groups
            # q rather than a pass over the [B, Hkv, G*T, L] scores (~200 MB per 1K-token prefill layer)
            torch.mul(q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4), scale, out=qb)
            s = qb.view(b, hkv, g * t, d) @ kt  # [B, Hkv, G*T, L]
        else:
            qb.copy_(q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4))
            s = (qb.view(b, hkv, g * t, d) @ kt).mul_(scale)  # in place: no second scores buffer
        hidden = torch.arange(length, device=q.device) > pos[:, :, None]  # [B, T, L]: keys past the query
        s = s.view(b, hkv, g, t, length).masked_fill_(hidden[:, None, None], float("-inf"))
        o = s.softmax(-1).view(b, hkv, g * t, length) @ vc.permute(0, 2, 1, 3).float()  # [B, Hkv, G*T, D]
        return o.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).flatten(2, 3)  # a view: heads stay grouped

    def _gdn(self, i: int, x: Tensor, state: DecodeState, n_new: Tensor | None, keep: bool,
             replay: tuple[Tensor, Tensor] | None = None) -> Tensor:
        b, t, _ = x.shape
        _, _, dk, dv, _ = _gdn_dims(self.cfg)
        _, _, nk, nv = self.heads  # this rank's key / value heads
        p = f"model.layers.{i}.linear_attn"
        # in_proj_qkvz and in_proj_ba fused: one GEMM launch, rows [q | k | v | z | b | a] (this rank's
        # heads of each); the pieces are views of its output, kept in act_dtype: the conv inputs upcast
        # exactly inside the cat below, z / b / a (FP32 math) in one small cast
        c = 2 * nk * dk + nv * dv
        mixed, zba = self._proj(self._p(i, GDN_IN_PROJ), x).split([c, nv * dv + 2 * nv], dim=-1)
        io = self.gdn_io and zba.dtype is torch.float16  # the generated glue kernels (gdn_io)
        form = "step" if t <= _SMALL_CHUNK else "torch" if keep else _prefill_form(x.device, dk)
        w = self.w[f"{p}.norm.weight"]
        if io and self.gdn_prefill_io and not keep and form != "torch":
            # unarmed (prefill, plain decoding): the inputs straight from the conv state and the FP16
            # rows, the conv state moved to n_new in the same launch (no FP32 cat); same bits
            inputs = gdn_prefill_inputs(state.conv[i], mixed, zba, self.w[f"{p}.conv1d.weight"].view(c, -1),
                                        self.w[f"{p}.dt_bias"], self.neg_a[i], (nk, dk, nv, dv), n=n_new)
            o = self._gdn_commit(state.ssm[i], inputs, n_new, form == "chunked")
        elif io and self.gdn_split_io and keep and form == "step":
            # armed (verify): the inputs straight from the conv state and the FP16 rows, their cat written
            # into the rollback buffer by the same launch; same bits
            buf = state.stacked("gdn_conv_cat", (t + state.conv[i].shape[-1], c))[state.gdn_index[i]]
            inputs = gdn_split_inputs(state.conv[i], mixed, zba, self.w[f"{p}.conv1d.weight"].view(c, -1),
                                      self.w[f"{p}.dt_bias"], self.neg_a[i], (nk, dk, nv, dv), buf)
            o = self._gdn_armed_step(i, inputs, state, replay)
        else:
            # conv inputs [B, C, W-1+T] FP32, stored time-major so the conv output's q / k / v rows are
            # contiguous; an armed short forward writes them straight into its rollback buffer (no copy)
            parts = (state.conv[i].transpose(1, 2), mixed)
            if keep and t <= _SMALL_CHUNK:
                buf = state.stacked("gdn_conv_cat", (t + state.conv[i].shape[-1], c))[state.gdn_index[i]]
                cat = torch.cat(parts, dim=1, out=buf).transpose(1, 2)
            else:
                cat = torch.cat(parts, dim=1).transpose(1, 2)
            if form != "torch":
                # decode / verify / unarmed prefill: the sequential kernel (module docstring: exactness),
                # or for a prefill the chunk-form kernels where $DFLASHGEN_GDN_PREFILL asks for them
                o = self._gdn_steps(i, cat, zba, state, n_new, keep, io, replay, chunked=form == "chunked")
            else:
                bet, a = zba[..., nv * dv:].float().split([nv, nv], dim=-1)
                o = self._gdn_chunked(i, cat, bet, a, state, n_new, keep).transpose(1, 2)
        # gated RMSNorm with SiLU(z) (FP32), rounded once to out_proj's input dtype
        o = (gdn_gate(o.contiguous(), zba, w, self.eps) if io
             else reference_gate(o, zba[..., :nv * dv], w, self.eps, self.act_dtype))
        return self._proj(self._p(i, "out_proj"), o)  # act_dtype: the residual upcasts

    def _gdn_inputs(self, i: int, conv: Tensor, bet: Tensor, a: Tensor,
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """q, k [B, T, Hk, dk] (L2-normalised, q scaled), v [B, T, Hv, dv] (a strided view), beta and
        log decay [B, T, Hv] from the conv output [B, C, T] and the b / a segments of in_proj_qkvzba."""
        _, _, dk, dv, _ = _gdn_dims(self.cfg)
        _, _, nk, nv = self.heads
        return reference_post_conv(conv, bet, a, self.neg_a[i], self.w[f"model.layers.{i}.linear_attn.dt_bias"],
                                   nk, dk, nv, dv)

    def _gdn_steps(self, i: int, cat: Tensor, zba: Tensor, state: DecodeState, n_new: Tensor | None,
                   keep: bool, io: bool, replay: tuple[Tensor, Tensor] | None = None,
                   chunked: bool = False) -> Tensor:
        """T <= 16 positions through :func:`~.gdn_kernel.gdn_step` (the generated kernel on CUDA), an
        unarmed T > 16 (prefill) through :func:`~.gdn_kernel.gdn_prefill` (one launch, commit only;
        ``chunked``: :func:`~.gdn_kernel.gdn_prefill_chunked` instead, the caller's choice of form):
        position by position, so any T, batch and accepted length round exactly like one-token
        decoding. The conv is an explicit W-tap sum in a fixed order (no cuDNN algorithm choice per
        shape). Armed (``keep``, T <= 16): the state stays, k / u / decays go to the stacked rollback
        buffers. ``io``: conv, SiLU, norms, beta and decay in one generated launch (:func:`~.gdn_io.gdn_inputs`,
        the same per-position arithmetic for any T). Returns o [B, T, Hv, dv]."""
        b, c, span = cat.shape
        width = self.cfg.linear_conv_kernel_dim or 1
        t = span - (width - 1)
        wt = self.w[f"model.layers.{i}.linear_attn.conv1d.weight"].view(c, width, 1)
        _, _, dk, dv, _ = _gdn_dims(self.cfg)
        _, _, nk, nv = self.heads
        cat_tm = cat.transpose(1, 2)  # the time-major tensor torch.cat made (_gdn)
        dt_bias = self.w[f"model.layers.{i}.linear_attn.dt_bias"]
        if io and cat_tm.is_contiguous():
            q, k, v, beta, log_decay = gdn_inputs(cat_tm, zba, wt.view(c, width), dt_bias, self.neg_a[i],
                                                  (nk, dk, nv, dv))
        else:
            bet, a = zba[..., nv * dv:].float().split([nv, nv], dim=-1)
            q, k, v, beta, log_decay = self._gdn_inputs(i, reference_conv(cat, wt, t), bet, a)
        if keep:  # the conv inputs are already in the "gdn_conv_cat" buffer (_gdn)
            return self._gdn_armed_step(i, (q, k, v, beta, log_decay), state, replay)
        o = self._gdn_commit(state.ssm[i], (q, k, v, beta, log_decay), n_new, chunked)
        state.conv[i].copy_(cat[..., t:] if n_new is None else conv_window(cat, n_new, width - 1))
        return o

    @staticmethod
    def _gdn_armed_step(i: int, inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], state: DecodeState,
                        replay: tuple[Tensor, Tensor] | None) -> Tensor:
        """An armed forward's step from its inputs: the state stays (after replaying a deferred rollback:
        ``replay``), the terms the rollback needs go to the stacked buffers. o [B, T, Hv, dv]."""
        q, k, v, beta, log_decay = inputs
        j = state.gdn_index[i]
        t, nv, dv = v.shape[1:]
        o, _, _ = gdn_step(state._ssm[i], q, k, v, beta, log_decay, u=state.stacked("gdn_u", (t, nv, dv))[j],
                           decay=state.stacked("gdn_decay", (t, nv))[j],
                           k_out=state.stacked("gdn_k", tuple(k.shape[1:]))[j],
                           replay_n=None if replay is None else replay[0],
                           arrive=None if replay is None else replay[1][j])
        return o

    @staticmethod
    def _gdn_commit(s0: Tensor, inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], n_new: Tensor | None,
                    chunked: bool) -> Tensor:
        """An unarmed forward's recurrence from its inputs (q, k, v, beta, log_decay), the state ``s0``
        committed after n_new[b] (default T) positions in place; o [B, T, Hv, dv]. T <= 16: the step
        kernel; longer: the sequential prefill kernel, or the chunk-form pair where ``chunked``."""
        q, k, v, beta, log_decay = inputs
        if q.shape[1] <= _SMALL_CHUNK:
            o, _, _ = gdn_step(s0, q, k, v, beta, log_decay, commit=s0, n=n_new)  # in place
        elif chunked:
            o = gdn_prefill_chunked(s0, q, k, v, beta, log_decay, n=n_new)  # in place: prep + scan
        else:
            o = gdn_prefill(s0, q, k, v, beta, log_decay, n=n_new)  # in place, one launch
        return o

    def _gdn_chunked(self, i: int, cat: Tensor, bet: Tensor, a: Tensor, state: DecodeState,
                     n_new: Tensor | None, keep: bool) -> Tensor:
        """Long inputs (prefill, T > 16) in matrix (chunk) form; returns o [B, Hv, T, dv]."""
        b, c, span = cat.shape
        _, _, dk, dv, width = _gdn_dims(self.cfg)
        t = span - (width - 1)
        p = f"model.layers.{i}.linear_attn"
        conv = F.conv1d(cat, self.w[f"{p}.conv1d.weight"].view(c, 1, width), groups=c)
        q, k, v, beta, log_decay = self._gdn_inputs(i, conv, bet, a)
        nv = self.heads[3]
        q, k = per_value_head(q, nv).transpose(1, 2), per_value_head(k, nv).transpose(1, 2)  # [B, Hv, T, dk]
        v, beta, log_decay = v.transpose(1, 2), beta.transpose(1, 2), log_decay.transpose(1, 2)

        s0 = state.ssm[i]
        if keep:  # one chunk; the state stays at s0 until rollback picks the accepted length
            o, kk, u, g = _gdn_chunk(s0, q, k, v, beta, log_decay)
            j = state.gdn_index[i]
            for name, val in (("k", kk), ("u", u), ("g", g), ("conv_cat", cat)):
                state.stacked(name, tuple(val.shape[1:]))[j].copy_(val)
        else:
            step = t if t <= _SMALL_CHUNK else _CHUNK
            s, final, outs = s0, s0, []
            for c0 in range(0, t, step):
                c1 = min(c0 + step, t)
                o_c, kk, u, g = _gdn_chunk(s, q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], beta[..., c0:c1],
                                           log_decay[..., c0:c1])
                outs.append(o_c)
                if n_new is not None:  # request b's state after its n_new[b] real positions
                    here = ((n_new > c0) & (n_new <= c1)).view(b, 1, 1, 1)
                    final = torch.where(here, _gdn_state_at(s, kk, u, g, (n_new - c0).clamp(0, c1 - c0)), final)
                if c1 < t or n_new is None:
                    s = _gdn_state_at(s, kk, u, g, torch.full((b,), c1 - c0, dtype=torch.long, device=s.device))
            o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
            if n_new is None:
                state.ssm[i].copy_(s)
                state.conv[i].copy_(cat[..., t:])
            else:
                state.ssm[i].copy_(final)
                state.conv[i].copy_(conv_window(cat, n_new, width - 1))
        return o


def _fused_prefill_attention(q: Tensor) -> bool:
    """Whether a long (prefill) forward's attention runs fused (:meth:`TargetModel._attend_fused`): on
    CUDA (queries of any float type: FP16 / BF16 operands, those of the cache, FP16 for an FP8 one),
    unless ``DFLASHGEN_PREFILL_ATTENTION=reference``."""
    return q.device.type == "cuda" and os.environ.get("DFLASHGEN_PREFILL_ATTENTION", "") != "reference"


@functools.cache
def _native_gqa(device: torch.device) -> bool:
    """Whether the fused prefill attention passes grouped K / V heads as they are (``enable_gqa``)
    rather than repeated per query head: sm_90 with cuDNN attention enabled, whose fused kernel takes
    them directly -- bitwise the repeated form's output on the H200 at Qwen3.8's shapes (1023 x 1024,
    24 / 4 heads of 256: 207 vs 267 us, bench/h200-2026-12-01-s33/call4/sdpa.txt). Elsewhere (a V100:
    no cuDNN attention; there the memory-efficient kernel needs equal head counts and enable_gqa
    would fall back to the unfused math path) the heads are repeated."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and torch.backends.cuda.cudnn_sdp_enabled())


PREFILL_FORMS = ("sequential", "chunked", "torch")


def _prefill_form(device: torch.device, dk: int) -> str:
    """How an unarmed forward of more than 16 positions (a prefill) runs the GDN recurrence:
    ``sequential`` (the family's prefill kernel: bitwise one-token steps), ``chunked`` (the generated
    chunk-form kernels, :func:`~.gdn_kernel.gdn_prefill_chunked`: FP32 products over 32-position
    chunks, ~1e-6 from the sequential bits) or ``torch`` (the torch chunk form, any device).
    ``$DFLASHGEN_GDN_PREFILL`` picks (default ``sequential``); a form without a kernel for ``dk`` on
    this device falls back to ``torch``. Tests patch this to run the torch reference sequentially on CPU."""
    form = os.environ.get("DFLASHGEN_GDN_PREFILL", "") or "sequential"
    if form not in PREFILL_FORMS:
        raise ValueError(f"DFLASHGEN_GDN_PREFILL={form!r}: one of {', '.join(PREFILL_FORMS)}")
    if form == "sequential" and prefill_available(device, dk):
        return form
    if form == "chunked" and chunk_available(device, dk):
        return form
    return "torch"


_SMALL_CHUNK = 16  # chunks up to this size invert (I + N) by nilpotent products: matmuls only


def _gdn_fold() -> bool:
    """Whether a sequential GDN rollback is deferred into the next armed forward's steps
    (``DFLASHGEN_GDN_FOLD=0``: advanced at once, one extra launch and state pass per round)."""
    return os.environ.get("DFLASHGEN_GDN_FOLD", "1") != "0"
# Longer inputs (prefill) run in chunks of this size through a triangular solve. Eager prefill is
# launch-bound (~45 launches per chunk and layer), so chunks are long; every decay term is
# exp(G_t - G_i) or exp(G_t) <= 1, so FP32 stays finite at any chunk length.
_CHUNK = 256


def _unit_lower_solve(n: Tensor, rhs: Tensor) -> Tensor:
    """Solve (I + N) X = rhs for strictly lower-triangular N [..., T, T]. For T <= 16:
    (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8) since N^T = 0 -- batched matmuls only, so the
    verify chunk stays CUDA-graph capturable and free of solver heuristics."""
    t = n.shape[-1]
    if t > _SMALL_CHUNK:
        eye = torch.eye(t, device=n.device, dtype=n.dtype)
        return torch.linalg.solve_triangular(eye + n, rhs, upper=False, unitriangular=True)
    x = rhs - n @ rhs
    p, span = n, 2
    while span < t:
        p = p @ p  # N^span
        x = x + p @ x
        span *= 2
    return x


def _gdn_chunk(s0: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor,
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gated delta rule over a chunk of T positions in matrix form (FP32).

    Per head: S_t = exp(g_t) S_{t-1} + k_t u_t^T with u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),
    output o_t = S_t^T q_t. With G the inclusive cumulative log decay and D_ti = exp(G_t - G_i) (i <= t),
    u solves (I + N) u = beta (v - exp(G) K S0), N_ti = beta_t D_ti k_t.k_i (i < t), and
    o = exp(G) Q S0 + (Q K^T * D) u. Returns (o [B, H, T, dv], k, u, G) -- the terms
    :func:`_gdn_state_at` needs for the state after any prefix."""
    t = k.shape[2]
    g = log_decay.cumsum(-1)  # [B, H, T]
    ks, qs = (torch.cat((k, q), dim=2) @ s0).split(t, dim=2)  # [B, H, T, dv] each: one read of S0
    causal = torch.ones(t, t, dtype=torch.bool, device=k.device).tril()
    dec = torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~causal, -math.inf))  # [B, H, T, T]
    eg = torch.exp(g)[..., None]
    n = ((k @ k.transpose(-1, -2)) * dec * beta[..., None]).tril(-1)
    u = _unit_lower_solve(n, beta[..., None] * (v - eg * ks))
    o = eg * qs + ((q @ k.transpose(-1, -2)) * dec) @ u
    return o, k, u, g
