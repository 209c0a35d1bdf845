"""DFlash2 block drafter ("q7") in plain torch, plus its :class:`~dflashgen.runtime.spec_decode.Drafter`.

One non-causal pass over a block of ``block_size`` (8) positions -- the last verified token followed by
``block_size - 1`` mask tokens -- proposes ``block_size - 1`` (7) drafts. The block is embedded with the
target's embeddings and decoded with the target's lm_head (shared, never copied). The drafter is
conditioned on the target's hidden states after layers ``target_layers`` for every verified position:
concatenated, fused by ``fc`` + ``hidden_norm`` to the drafter width, and projected by every drafter
layer's k/v projections into extra keys/values in front of the block's own (HF DFlash convention).

Per request, :class:`DFlashDrafter` keeps those context keys/values (after k_norm and RoPE, at their
absolute positions) in a small cache: appended with each round's accepted positions, cropped on
rollback. A context position's K/V depends only on the target hidden state at that position, so
appending is exact (up to GEMM shape rounding).

Weights: drawn from a seed under ``load_state_dict``-compatible names (``fc.weight``,
``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``norm.weight``); real DFlash2 weights load by those names. Norm weights are plain (Qwen3: ``x * w``).
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from .host import tensor_on, to_device
from .library import silu_mul, silu_mul_cat
from .norm_kernel import add_rmsnorm, fused_available, qk_norm_rope, qk_rope_available
from .sampling import SamplingParams, sample_categorical, target_probs
from .spec_decode import RequestContext
from .target import TargetModel

__all__ = ["BlockDrafter", "DFlashDrafter", "DrafterConfig", "StaticDFlashDrafter", "block_drafter_cost"]

Tensor = torch.Tensor
KV = list[tuple[Tensor, Tensor]]  # per drafter layer: (K, V) [L, Hkv, D]

# HF / DFlash config keys -> DrafterConfig fields.
_ALIASES = {
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "target_layer_ids": "target_layers",
}


@dataclass(frozen=True)
class DrafterConfig:
    """DFlash2 drafter shape; defaults = the Qwen3.8-27B drafter (shared/reference/qwen38-27b.md).

    ``target_layers``: 0-based target decoder layers whose outputs condition the drafter (HF
    ``hidden_states[i + 1]``); ``target_hidden_size``: the target's hidden size (fc input = len x it).
    """

    num_layers: int = 5
    hidden_size: int = 5120
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 17408
    block_size: int = 8
    mask_token_id: int = 248070
    target_layers: tuple[int, ...] = (5, 19, 33, 47, 61)
    target_hidden_size: int = 5120
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(self.target_layers))
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "target_hidden_size"):
            _check_int(f, getattr(self, f), 1)
        _check_int("block_size", self.block_size, 2)
        _check_int("mask_token_id", self.mask_token_id, 0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"DrafterConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"DrafterConfig.head_dim must be even (RoPE), got {self.head_dim}")
        t = self.target_layers
        if not t or len(set(t)) != len(t):
            raise ValueError(f"DrafterConfig.target_layers must be non-empty and unique, got {list(t)}")
        for x in t:
            _check_int("target_layers", x, 0)
        for f in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"DrafterConfig.{f} must be a finite number > 0, got {v!r}")

    @property
    def num_draft(self) -> int:
        return self.block_size - 1

    @classmethod
    def tiny(cls, target_hidden_size: int = 64, mask_token_id: int = 0, target_layers: Sequence[int] = (0, 2),
             **overrides: Any) -> DrafterConfig:
        """A CPU-test-sized drafter (2 layers, 4 Q / 2 KV heads x 16) at the target's width."""
        kw: dict[str, Any] = dict(num_layers=2, hidden_size=target_hidden_size, num_heads=4, num_kv_heads=2,
                                  head_dim=16, intermediate_size=2 * target_hidden_size, mask_token_id=mask_token_id,
                                  target_layers=tuple(target_layers), target_hidden_size=target_hidden_size)
        return cls(**{**kw, **overrides})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, strict: bool = True) -> DrafterConfig:
        """From field names or HF / DFlash keys (``num_hidden_layers``, ``target_layer_ids``, a nested
        ``dflash_config``...). ``strict``: unknown keys are an error naming them; else ignored."""
        flat = dict(raw)
        flat.update(flat.pop("dflash_config", None) or {})
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        unknown = []
        for k, v in flat.items():
            f = _ALIASES.get(k, k)
            if f in names:
                kw[f] = v
            else:
                unknown.append(k)
        if unknown and strict:
            raise ValueError(f"DrafterConfig: unknown keys {sorted(unknown)}")
        if "target_layers" in kw and not isinstance(kw["target_layers"], list | tuple):
            raise ValueError(f"DrafterConfig.target_layers must be a list of ints, got {kw['target_layers']!r}")
        return cls(**kw)


def _check_int(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"DrafterConfig.{name} must be an integer >= {lo}, got {v!r}")


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    # torch's rms_norm (one kernel on CUDA instead of the spelled-out form's five)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """x [..., N, heads, D] rotated by the tables ``rope`` of its positions (BlockDrafter._rope_tables):
    x cos + rotate_half(x) sin, with rotate_half(x) sin = roll(x, D / 2) [-sin | sin] (three kernels)."""
    cos, sin_signed = rope
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def _lin(k: int, n: int, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Linear:
    return torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)


def _share_rows(mods: Sequence[torch.nn.Linear]) -> Tensor:
    """One ``[sum N, K]`` weight whose consecutive row blocks become ``mods``' weights (views): the
    forward runs projections of one input as one GEMM, while loading or reseeding in place keeps the
    checkpoint names. Moving the modules (``.to``) breaks the sharing; :func:`_rows_of` then says no."""
    w = torch.cat([m.weight.detach() for m in mods])
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(w[off:off + n], requires_grad=m.weight.requires_grad)
        off += n
    return w


def _rows_of(w: Tensor, mods: Sequence[torch.nn.Linear]) -> bool:
    """Whether ``mods``' weights are still the consecutive row blocks of ``w`` (see :func:`_share_rows`)."""
    ptr, step = w.data_ptr(), w.stride(0) * w.element_size()
    for m in mods:
        if m.weight.data_ptr() != ptr or m.weight.device != w.device:
            return False
        ptr += m.weight.shape[0] * step
    return True


class _Norm(torch.nn.Module):
    """An RMSNorm weight, FP32 whatever the drafter's dtype: the norms run in FP32 (the fused
    add-RMSNorm takes FP32 weights), so no per-call upcast copy; loading casts exactly."""

    def __init__(self, n: int, device: torch.device | str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n, device=device, dtype=torch.float32))


class _Attn(torch.nn.Module):
    def __init__(self, cfg: DrafterConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        h, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj, self.o_proj = _lin(h, nh * d, device, dtype), _lin(nh * d, h, device, dtype)
        self.k_proj, self.v_proj = _lin(h, nkv * d, device, dtype), _lin(h, nkv * d, device, dtype)
        self.q_norm, self.k_norm = _Norm(d, device), _Norm(d, device)


class _MLP(torch.nn.Module):
    def __init__(self, cfg: DrafterConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = (_lin(h, i, device, dtype), _lin(h, i, device, dtype),
                                                        _lin(i, h, device, dtype))


class _Layer(torch.nn.Module):
    def __init__(self, cfg: DrafterConfig, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = _Norm(cfg.hidden_size, device)
        self.self_attn = _Attn(cfg, device, dtype)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, device)
        self.mlp = _MLP(cfg, device, dtype)


class BlockDrafter(torch.nn.Module):
    """The DFlash2 network. ``embed`` (``[V, H]`` tensor or an embedding module) and ``lm_head`` are the
    target's, held by reference and not registered (not in ``state_dict``, not moved by ``.to``)."""

    def __init__(self, cfg: DrafterConfig, embed: Tensor | torch.nn.Module, lm_head: torch.nn.Module, *,
                 seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 act_dtype: torch.dtype | None = None) -> None:
        """act_dtype: the lm_head's input dtype (the target's; default ``dtype``)."""
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        e_dim = embed.shape[-1] if isinstance(embed, Tensor) else getattr(embed, "embedding_dim", h)
        if e_dim != h:
            raise ValueError(f"target embeddings have width {e_dim}, DrafterConfig.hidden_size is {h}")
        self._shared = (embed, lm_head)  # a tuple: not registered as parameters / submodules
        self.act_dtype = act_dtype or dtype

        self.fc = _lin(len(cfg.target_layers) * cfg.target_hidden_size, h, device, dtype)
        self.hidden_norm = _Norm(h, device)
        self.layers = torch.nn.ModuleList(_Layer(cfg, device, dtype) for _ in range(cfg.num_layers))
        self.norm = _Norm(h, device)
        # per layer: q|k|v and gate|up as one weight each (one GEMM, one input cast per group);
        # fused_projections=False runs them one by one (same weights; GEMM shapes round differently)
        self._fused = [(_share_rows((la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj)),
                        _share_rows((la.mlp.gate_proj, la.mlp.up_proj))) for la in self._layers()]
        self.fused_projections = True
        self._fused_norm_at: dict[tuple[torch.device, int, torch.dtype], bool] = {}
        self.reseed(seed)

    @classmethod
    def for_target(cls, target: TargetModel, cfg: DrafterConfig, *, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> BlockDrafter:
        """Shares ``target``'s embeddings and lm_head; checks the taps, width and mask id against it."""
        tc = target.cfg
        if bad := [i for i in cfg.target_layers if i >= tc.num_hidden_layers]:
            raise ValueError(f"DrafterConfig.target_layers {bad} outside the target's {tc.num_hidden_layers} layers")
        if cfg.target_hidden_size != tc.hidden_size:
            raise ValueError(f"DrafterConfig.target_hidden_size={cfg.target_hidden_size}, target has {tc.hidden_size}")
        if cfg.mask_token_id >= tc.vocab_size:
            raise ValueError(f"DrafterConfig.mask_token_id={cfg.mask_token_id} outside the vocab ({tc.vocab_size})")
        return cls(cfg, target.w["model.embed_tokens.weight"], target.lm_head, seed=seed, dtype=dtype,
                   device=target.device, act_dtype=target.act_dtype)

    @torch.no_grad()
    def reseed(self, seed: int) -> None:
        """Deterministic stand-in weights, one generator per name (as the target's non-linear weights):
        linears ~ N(0, 1/fan_in), norms 1 +- 0.1."""
        for name, p in self.named_parameters():
            g = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (1 << 62))
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * r if p.dim() == 1 else r / math.sqrt(p.shape[1]))

    # ------------------------------------------------------------------ pieces

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def _layers(self) -> list[_Layer]:
        return list(self.layers)  # type: ignore[arg-type]

    def _proj(self, m: torch.nn.Linear, x: Tensor) -> Tensor:
        """m(x) in the weight's dtype (the residual add and the norms upcast it exactly)."""
        return m(x.to(m.weight.dtype))

    def _lin(self, m: torch.nn.Linear, x: Tensor) -> Tensor:
        return self._proj(m, x).float()

    def _lins(self, li: int, group: int, mods: Sequence[torch.nn.Linear], x: Tensor,
              rows: slice = slice(None)) -> tuple[Tensor, ...]:
        """``mods`` (all of one input) applied to ``x``, in the weights' dtype: one GEMM over layer
        ``li``'s shared weight ``group`` (0: q|k|v, 1: gate|up; ``rows``: a sub-range of its blocks) where
        the sharing holds and ``fused_projections`` is on, else one GEMM each."""
        y = self._group(li, group, mods, x, rows)
        if y is not None:
            return y.split([m.weight.shape[0] for m in mods], dim=-1)
        return tuple(self._proj(m, x) for m in mods)

    def _group(self, li: int, group: int, mods: Sequence[torch.nn.Linear], x: Tensor,
               rows: slice = slice(None)) -> Tensor | None:
        """:meth:`_lins`' one GEMM (its outputs side by side), or None where it does not apply."""
        w = self._fused[li][group]
        if self.fused_projections and _rows_of(w[rows], mods):
            return F.linear(x.to(w.dtype), w[rows])
        return None

    def _fused_norm(self, h: Tensor) -> bool:
        """Whether :meth:`_add_norm` runs the target's generated add-RMSNorm kernel (FP16 projections on
        a GPU with one; ``$DFLASHGEN_FUSED_NORM=0``: torch's ops, as for the target)."""
        key = (h.device, h.shape[-1], self.fc.weight.dtype)
        if key not in self._fused_norm_at:
            self._fused_norm_at[key] = (self.fc.weight.dtype is torch.float16 and h.is_cuda
                                        and os.environ.get("DFLASHGEN_FUSED_NORM", "1") != "0"
                                        and fused_available(h.device, h.shape[-1]))
        return self._fused_norm_at[key]

    def _add_norm(self, h: Tensor, r: Tensor | None, norm: _Norm) -> tuple[Tensor, Tensor]:
        """(h + r, RMSNorm(h + r) * w in the projections' dtype): h the FP32 residual stream, r a
        sublayer's output in its GEMM's dtype (the add upcasts it exactly) or None. FP16 on a GPU: one
        generated launch (the target's add-RMSNorm) instead of an upcast, add, norm and cast."""
        w = norm.weight.float()
        if (self._fused_norm(h) and h.dtype is torch.float32 and h.is_contiguous()
                and (r is None or (r.dtype is torch.float16 and r.is_contiguous()))):
            return add_rmsnorm(h, r, w, self.cfg.rms_norm_eps)
        hn = h if r is None else h + r
        return hn, _rms_norm(hn, w, self.cfg.rms_norm_eps).to(self.fc.weight.dtype)

    def _mlp(self, li: int, layer: Any, y: Tensor) -> Tensor:
        """Layer ``li``'s SwiGLU MLP of its normed input ``y``, in the weights' dtype: SiLU(gate) * up in
        FP32, rounded once (over the fused [gate | up] output: one generated launch for FP16 on a GPU)."""
        mlp = layer.mlp
        gu = self._group(li, 1, (mlp.gate_proj, mlp.up_proj), y)
        if gu is not None:
            act = silu_mul_cat(gu, gu.dtype)
        else:
            gate, up = (self._proj(m, y) for m in (mlp.gate_proj, mlp.up_proj))
            act = silu_mul(gate, up, gate.dtype)
        return self._proj(mlp.down_proj, act)

    def _rope_tables(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos, [-sin | sin] [..., N, 1, D] (FP32) of absolute positions pos [..., N]: full-width rotary
        (Qwen3), made once per forward and shared by every layer's q and k (:func:`_rope`)."""
        d = self.cfg.head_dim
        # fp64 angles, computed here (not a buffer) so .to(fp16) cannot round them
        inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=pos.device) / d)
        ang = pos[..., None].double() * inv_freq
        sin = ang.sin()
        return torch.cat((ang, ang), -1).cos().float()[..., None, :], torch.cat((-sin, sin), -1).float()[..., None, :]

    def embed(self, tokens: Tensor) -> Tensor:
        e = self._shared[0]
        return (e[tokens] if isinstance(e, Tensor) else e(tokens)).float()

    def logits(self, h: Tensor) -> Tensor:
        # contiguous: for a strided [B, S, H] view (the block's mask positions) cuBLAS picked a
        # narrow-tile kernel passing over the 2.5 GB lm_head ~B times (H200: 2.45 vs 0.63 ms at B4)
        lm = self._shared[1]
        return lm(h.to(self.act_dtype).contiguous()).float()

    @torch.no_grad()
    def context_kv(self, hidden: Tensor, positions: Tensor) -> KV:
        """Context keys/values of every layer for target hidden states ``hidden [N, len(taps) * Ht]``
        (taps concatenated in ``target_layers`` order) at absolute ``positions [N]``: K FP32 (normed,
        rotated), V in the weights' dtype."""
        cfg = self.cfg
        _, fused = self._add_norm(self._lin(self.fc, hidden.float()), None, self.hidden_norm)
        rope = self._rope_tables(positions)
        out: KV = []
        kv_rows = slice(cfg.num_heads * cfg.head_dim, None)  # k|v: the shared weight's rows after q
        for li, layer in enumerate(self._layers()):
            att = layer.self_attn
            k, v = self._lins(li, 0, (att.k_proj, att.v_proj), fused, kv_rows)
            k = _rope(_rms_norm(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim).float(), att.k_norm.weight.float(),
                                cfg.rms_norm_eps), rope)
            out.append((k, v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)))
        return out

    @torch.no_grad()
    def append_context_static(self, hidden: Tensor, pos: Tensor, context: KV) -> None:
        """:meth:`context_kv` of ``hidden [B, T, len(taps) * Ht]`` at positions ``pos [B, T]`` written into
        the static per-slot caches ``context[layer] = (K, V)`` ``[B, Hkv, capacity, D]`` (head-major) at
        those positions. FP16 on a GPU (:meth:`_fused_qk`): each layer's k norm, RoPE and both cache
        writes as one qk-norm-RoPE launch over the k|v GEMM's output (no q heads); else torch's ops."""
        cfg, (b, t) = self.cfg, pos.shape
        nkv, d = cfg.num_kv_heads, cfg.head_dim
        kv_rows = slice(cfg.num_heads * d, None)  # k|v: the shared weight's rows after q
        if self._fused_qk(hidden.device, context[0][0].dtype):
            _, fused = self._add_norm(self._lin(self.fc, hidden.reshape(b * t, -1).float()), None, self.hidden_norm)
            cos, _ = rope = self._rope_tables(pos)
            ksin, pos = self._kernel_rope(rope, pos)
            for li, layer in enumerate(self._layers()):
                att = layer.self_attn
                kv = self._group(li, 0, (att.k_proj, att.v_proj), fused, kv_rows)
                if kv is None:  # the sharing broke (moved modules): one GEMM each
                    kv = torch.cat(self._lins(li, 0, (att.k_proj, att.v_proj), fused), -1)
                kw = att.k_norm.weight
                qk_norm_rope(kv.view(b, t, 2 * nkv * d), (0, nkv), d, False, d, kw, kw, cfg.rms_norm_eps, cos, ksin,
                             pos, *context[li], head_major=True)
            return
        rows = torch.arange(b, device=pos.device)[:, None]
        for (kc, vc), (k, v) in zip(context, self.context_kv(hidden.reshape(b * t, -1), pos.reshape(-1)), strict=True):
            kc[rows, :, pos] = k.view(b, t, nkv, d).to(kc.dtype)  # [rows, :, pos] indexes as [B, T, Hkv, D]
            vc[rows, :, pos] = v.view(b, t, nkv, d).to(vc.dtype)

    def _layers_forward(self, x: Tensor, attend: Callable[[int, Any, Tensor], Tensor]) -> Tensor:
        """The decoder layers over block embeddings ``x [B, S, H]`` -> final-normed hidden states in the
        projections' dtype; ``attend(li, layer, y)`` -> ``[B, S, heads * D]`` in that dtype is layer li's
        attention of the block's normed input ``y`` (its q / k / v: :meth:`_block_qkv`)."""
        h, r = x.float(), None
        for li, layer in enumerate(self._layers()):
            h, y = self._add_norm(h, r, layer.input_layernorm)
            r = self._proj(layer.self_attn.o_proj, attend(li, layer, y))
            h, y = self._add_norm(h, r, layer.post_attention_layernorm)
            r = self._mlp(li, layer, y)
        return self._add_norm(h, r, self.norm)[1]

    @torch.no_grad()
    def forward_embeds(self, x: Tensor, start: Sequence[int], context: Sequence[KV]) -> Tensor:
        """Block hidden states ``x [B, S, H]`` at positions ``start[b] + s`` over request b's context
        K/V ``context[b]`` (``[layer] -> (K, V) [start[b], Hkv, D]``) -> final-normed ``[B, S, H]`` (the
        projections' dtype). Attention is NOT causal inside the block: every position sees the whole
        context and block; the reference form (FP32 scores, softmax and products, per request)."""
        cfg, (b, s, _) = self.cfg, x.shape
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pos = torch.tensor(list(start), dtype=torch.long, device=x.device)[:, None] + torch.arange(s, device=x.device)

        rope = self._rope_tables(pos)

        def attend(li: int, layer: Any, y: Tensor) -> Tensor:
            q, k, v = self._block_qkv(li, layer, y, rope)
            o = torch.empty(b, s, nh, d, device=x.device)
            for r in range(b):  # per request over its own context: batch composition cannot change its math
                kc, vc = context[r][li]
                kr = torch.cat((kc.float(), k[r]), 0).permute(1, 0, 2)[:, None]  # [Hkv, 1, L+S, D]
                vr = torch.cat((vc.float(), v[r].float()), 0).permute(1, 0, 2)[:, None]
                qr = q[r].view(s, nkv, nh // nkv, d).permute(1, 2, 0, 3)  # [Hkv, G, S, D]
                p = ((qr @ kr.transpose(-1, -2)) * d**-0.5).softmax(-1)  # no mask: non-causal block
                o[r] = (p @ vr).permute(2, 0, 1, 3).reshape(s, nh, d)
            return o.view(b, s, nh * d).to(v.dtype)

        return self._layers_forward(x, attend)

    def _block_qkv(self, li: int, layer: Any, y: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Drafter layer ``li``'s normed, rotated q [B, S, H, D] and k [B, S, Hkv, D] (FP32) and v [B, S,
        Hkv, D] (the weights' dtype) of the block's normed input ``y`` (rope: the block positions' tables)."""
        cfg, (b, s, _) = self.cfg, y.shape
        nh, nkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        att = layer.self_attn
        q, k, v = self._lins(li, 0, (att.q_proj, att.k_proj, att.v_proj), y)
        q = _rope(_rms_norm(q.reshape(b, s, nh, d).float(), att.q_norm.weight.float(), eps), rope)
        k = _rope(_rms_norm(k.reshape(b, s, nkv, d).float(), att.k_norm.weight.float(), eps), rope)
        return q, k, v.reshape(b, s, nkv, d)

    @torch.no_grad()
    def forward_embeds_static(self, x: Tensor, ctx_len: Tensor, context: KV) -> Tensor:
        """:meth:`forward_embeds` over static per-slot context caches: ``context[layer] = (K, V)``
        ``[B, Hkv, capacity, D]`` (head-major) of which the first ``ctx_len[b]`` positions are request
        b's; the block sits at positions ``ctx_len[b] + s``, and its K / V are WRITTEN there (capacity
        must hold ``ctx_len + S``; positions past ``ctx_len`` are scratch) so each layer's attention is
        two batched products over the cache in place (head-major: each (slot, head) one contiguous
        [capacity, D] matrix), positions past ``ctx_len + S`` masked. Static shapes, no host sync
        (CUDA-graph capturable). The products and the scores run in the cache's dtype (FP16 on CUDA,
        FP32 accumulation; q pre-scaled), the softmax in FP32 (rounded to the cache's dtype for the P V
        product): the same math as :meth:`forward_embeds` up to those roundings (an FP32 cache: up to
        FP32 summation order)."""
        cfg, (b, s, _) = self.cfg, x.shape
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = nh // nkv
        pos = ctx_len[:, None] + torch.arange(s, device=x.device)  # [B, S]
        cap = context[0][0].shape[2]
        hidden = (torch.arange(cap, device=x.device) >= (ctx_len + s)[:, None])[:, None, None]  # [B, 1, 1, cap]
        rows = torch.arange(b, device=x.device)[:, None]
        ct = context[0][0].dtype
        rope = self._rope_tables(pos)
        fused = self._fused_qk(x.device, ct)
        if fused:
            ksin, pos = self._kernel_rope(rope, pos)

        def attend(li: int, layer: Any, y: Tensor) -> Tensor:
            kc, vc = context[li]  # [B, Hkv, cap, D]
            att = layer.self_attn
            qr = torch.empty((b, nh, s, d), dtype=ct, device=x.device)  # [B, Hkv, G, S, D]: grouped, scaled
            qkv = self._group(li, 0, (att.q_proj, att.k_proj, att.v_proj), y) if fused else None
            if qkv is not None:  # q / k norms, RoPE, scaled q and the block's K / V cache rows in one launch
                qk_norm_rope(qkv, (nh, nkv), d, False, d, att.q_norm.weight, att.k_norm.weight, self.cfg.rms_norm_eps,
                             rope[0], ksin, pos, kc, vc, q_out=qr.transpose(1, 2), q_scale=d**-0.5, head_major=True)
            else:
                q, k, v = self._block_qkv(li, layer, y, rope)
                kc[rows, :, pos] = k.to(ct)  # [rows, :, pos] indexes as [B, S, Hkv, D]
                vc[rows, :, pos] = v.to(ct)
                torch.mul(q.view(b, s, nkv, g, d).permute(0, 2, 3, 1, 4), d**-0.5, out=qr.view(b, nkv, g, s, d))
            sc = (qr.view(b, nkv, g * s, d) @ kc.transpose(-1, -2)).masked_fill_(hidden, float("-inf"))
            p = sc.softmax(-1, dtype=torch.float32).to(ct)  # no causal mask: the block sees itself
            o = (p @ vc).view(b, nkv, g, s, d).permute(0, 3, 1, 2, 4)  # [B, S, Hkv, G, D]
            return o.reshape(b, s, nh * d).to(att.o_proj.weight.dtype)

        return self._layers_forward(x, attend)

    def _kernel_rope(self, rope: tuple[Tensor, Tensor], pos: Tensor) -> tuple[Tensor, Tensor]:
        """The qk-norm-RoPE kernel's sin table and positions for :meth:`_rope_tables`' ``rope`` at ``pos``:
        it reads the first halves of cos and of +sin, so ``[-sin | sin]`` rolled to ``[sin | -sin]``; int64."""
        return rope[1].roll(self.cfg.head_dim // 2, -1), pos.long().contiguous()

    def _fused_qk(self, device: torch.device, cache_dtype: torch.dtype) -> bool:
        """Whether the static block forward runs each layer's q / k norms, RoPE and cache writes as the
        target's generated qk-norm-RoPE launch: FP16 projections and cache on a GPU with one (head dim
        <= its maximum); ``$DFLASHGEN_FUSED_QK=0``: torch's ops, as for the target."""
        return (self.fc.weight.dtype is torch.float16 and cache_dtype is torch.float16 and device.type == "cuda"
                and os.environ.get("DFLASHGEN_FUSED_QK", "1") != "0" and qk_rope_available(device, self.cfg.head_dim))

    @torch.no_grad()
    def forward(self, tokens: Tensor, start: Sequence[int], context: Sequence[KV]) -> Tensor:
        """Block tokens ``[B, S]`` -> logits ``[B, S - 1, V]`` of positions 1.. (the mask positions)."""
        return self.logits(self.forward_embeds(self.embed(tokens), start, context)[:, 1:])


class _ContextCache:
    """One request's context K/V per drafter layer, preallocated and grown by doubling."""

    def __init__(self) -> None:
        self.length = 0
        self.kv: KV = []

    def append(self, kv: KV) -> None:
        n = kv[0][0].shape[0] if kv else 0
        if not n:
            return
        if not self.kv or self.length + n > self.kv[0][0].shape[0]:
            cap = max(16, 2 * (self.length + n))
            grown: KV = []
            for i, (k, v) in enumerate(kv):
                gk, gv = k.new_zeros((cap, *k.shape[1:])), v.new_zeros((cap, *v.shape[1:]))
                if self.kv:
                    gk[:self.length], gv[:self.length] = self.kv[i][0][:self.length], self.kv[i][1][:self.length]
                grown.append((gk, gv))
            self.kv = grown
        for (ck, cv), (k, v) in zip(self.kv, kv, strict=True):
            ck[self.length:self.length + n], cv[self.length:self.length + n] = k, v
        self.length += n

    def view(self, num_layers: int, like: Tensor, nkv: int, d: int) -> KV:
        if not self.kv:  # empty context (1-token prompt)
            z = like.new_zeros((0, nkv, d))
            return [(z, z)] * num_layers
        return [(k[:self.length], v[:self.length]) for k, v in self.kv]


class DFlashDrafter:
    """:class:`~dflashgen.runtime.spec_decode.Drafter` over a :class:`BlockDrafter`.

    Tap hook (``needs_taps = True``; :class:`~dflashgen.runtime.spec_decode.SpecDecoder` drives it):
    the decoder runs the target with ``taps=self.taps`` and calls ``observe(rid, start, hidden)`` with
    the concatenated tapped hidden states of request ``rid``'s verified positions ``start..`` (the
    prefilled prompt, then each round's kept positions). ``observe`` first crops the cache to
    ``start`` (rollback), so positions are never duplicated. ``release(rid)`` drops a finished request.

    ``propose`` needs exactly ``len(tokens) - 1`` cached context positions per request (the pending
    token is block position 0). Drafts are the argmax (one-hot q, DFlash's practice); ``sampled=True``:
    sampled requests draw from the drafter's distribution under their temperature / top-k / top-p,
    returned as q for verification with draft probabilities.
    """

    needs_taps = True

    def __init__(self, model: BlockDrafter, seed: int = 0, *, sampled: bool = False) -> None:
        self.model = model
        self.num_draft = model.cfg.num_draft
        self.taps: tuple[int, ...] = model.cfg.target_layers
        self.sampled = sampled
        self.label = f"dflash2 block drafter (block {model.cfg.block_size}{_draft_kind(sampled)})"
        self.gen = torch.Generator().manual_seed(seed)  # draft sampling only: losslessness never depends on it
        self._cache: dict[int, _ContextCache] = {}

    def context_len(self, rid: int) -> int:
        c = self._cache.get(rid)
        return c.length if c else 0

    def crop(self, rid: int, length: int) -> None:
        c = self._cache.get(rid)
        if c is None and length:
            raise ValueError(f"request {rid} has no context to crop to {length}")
        if c is not None:
            if not 0 <= length <= c.length:
                raise ValueError(f"request {rid}: crop to {length} outside [0, {c.length}]")
            c.length = length  # entries past it are stale and overwritten by the next append

    def observe(self, rid: int, start: int, hidden: Tensor) -> None:
        """Target hidden states ``[n, len(taps) * Ht]`` of request ``rid`` at positions ``start..start+n``."""
        self.crop(rid, start)
        c = self._cache.setdefault(rid, _ContextCache())
        if hidden.shape[0]:
            pos = torch.arange(start, start + hidden.shape[0], device=hidden.device)
            c.append(self.model.context_kv(hidden, pos))

    def release(self, rid: int) -> None:
        self._cache.pop(rid, None)

    @torch.no_grad()
    def draft_logits(self, contexts: Sequence[RequestContext]) -> Tensor:
        """Drafter logits ``[B, D, V]`` of the mask positions, block ``[pending token, mask x D]``."""
        m, cfg = self.model, self.model.cfg
        start = [len(c.tokens) - 1 for c in contexts]
        for c, n in zip(contexts, start, strict=True):
            if self.context_len(c.rid) != n:
                raise RuntimeError(f"request {c.rid}: the drafter holds {self.context_len(c.rid)} context "
                                   f"positions, needs {n} (observe() the target's tapped hidden states)")
        dev = m.device
        block = torch.full((len(contexts), cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = tensor_on([c.tokens[-1] for c in contexts], dev, torch.long)
        like = torch.empty(0, device=dev)
        ctx = [self._cache[c.rid].view(cfg.num_layers, like, cfg.num_kv_heads, cfg.head_dim) for c in contexts]
        return m(block, start, ctx)

    @torch.no_grad()
    def propose(self, contexts: Sequence[RequestContext]) -> tuple[Tensor, Tensor | None]:
        return _drafts(self.draft_logits(contexts), [c.params for c in contexts], self.gen, self.sampled)


def block_drafter_cost(drafter: BlockDrafter | DFlashDrafter, seed: int = 0,
                       ) -> Callable[[Sequence[RequestContext]], None]:
    """A :class:`~dflashgen.runtime.spec_decode.ReplayDrafter` ``cost_model``: each round, feed every
    request's new context positions (random stand-in hidden states: same shapes, so the same cost as
    real taps) into a DFlashDrafter and run its block forward; the drafts are discarded. Requests
    absent from a round are finished and released. A request's first round also pays its prompt's
    context projections (the real decoder does that at prefill)."""
    dd = drafter if isinstance(drafter, DFlashDrafter) else DFlashDrafter(drafter, seed)
    cfg = dd.model.cfg
    width = len(cfg.target_layers) * cfg.target_hidden_size
    g = torch.Generator().manual_seed(seed)
    dev = dd.model.device

    def cost(contexts: Sequence[RequestContext]) -> None:
        live = {c.rid for c in contexts}
        for rid in [r for r in dd._cache if r not in live]:
            dd.release(rid)
        for c in contexts:
            n, have = len(c.tokens) - 1, dd.context_len(c.rid)
            start = have if have <= n else 0  # shorter history: a new request reusing the rid
            dd.observe(c.rid, start, torch.randn(n - start, width, generator=g).to(dev))
        dd.propose(contexts)

    return cost


class StaticDFlashDrafter:
    """A DFlash2 drafter over static per-slot buffers, so one round's draft work is one CUDA graph
    per batch size (:class:`~dflashgen.runtime.spec_decode.SpecDecoder` drives it by slot).

    Per slot (the decoder's request slot, via ``assign``): context K/V of every drafter layer in a
    preallocated head-major ``[max_batch, Hkv, capacity, D]`` cache (the drafter's weight dtype) and its
    length ``ctx_len``. The decoder
    stages the last verify round's tapped hidden states of all slots at once (``observe_round``:
    ``[b, T, len(taps) * H]`` with each slot's base position and kept count); the next ``propose``
    replays one step -- append the staged positions' context K/V (all T written, only the kept ones
    counted), then the non-causal block forward over [pending token, masks] attending to each slot's
    context (positions past ``ctx_len`` masked) and the lm_head -- and returns drafts from its logits.
    Prompts (``observe`` at start 0) are appended eagerly. ``graphs=False`` runs the same step
    eagerly (bitwise-identical); graphs are captured by ``capture()`` while no request is in flight.
    """

    needs_taps = True

    def __init__(self, model: BlockDrafter, max_batch: int, max_len: int, positions: int | None = None, *,
                 graphs: bool | None = None, seed: int = 0, sampled: bool = False) -> None:
        cfg = model.cfg
        self.model, self.num_draft, self.taps = model, cfg.num_draft, cfg.target_layers
        self.positions = positions or cfg.block_size  # verify positions staged per round
        self.sampled = sampled  # sampled requests' drafts drawn from the drafter (q returned); else argmax
        self.label = f"dflash2 block drafter (block {cfg.block_size}, static slots{_draft_kind(sampled)})"
        # a staged round may keep up to `positions` past max_len (the verify overshoot the target's state
        # holds until the host rolls a finished request back; pipelined rounds draft from it), and the
        # block forward writes its own K / V after the context
        self.max_batch, self.capacity = max_batch, max_len + self.positions + cfg.block_size
        dev = model.device
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        width = len(cfg.target_layers) * cfg.target_hidden_size
        shape = (max_batch, cfg.num_kv_heads, self.capacity, cfg.head_dim)  # head-major: read in place
        # in the drafter's weight dtype (FP16 on CUDA): half the bytes of FP32, and the block's attention
        # over the whole capacity runs as FP16 products (forward_embeds_static)
        ct = model.fc.weight.dtype
        self.k = [torch.zeros(shape, device=dev, dtype=ct) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=dev, dtype=ct) for _ in range(cfg.num_layers)]
        self.ctx_len = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(max_batch, self.positions, width, device=dev)
        self.h_base = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.h_keep = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.block = torch.full((max_batch, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=dev)
        self.slot_of: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self._graphs: dict[int, tuple[Any, Tensor]] = {}
        self._pre: tuple[int, Tensor] | None = None  # a prelaunched step: (batch, logits)

    # ------------------------------------------------------------------ decoder hooks

    def assign(self, rid: int, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"slot {slot} outside the drafter's {self.max_batch} slots")
        self.slot_of[rid] = slot

    def release(self, rid: int) -> None:
        self.slot_of.pop(rid, None)

    @torch.no_grad()
    def prelaunch(self, pending: Tensor) -> None:
        """Queue the next round's step for slots ``[0, b)`` before the host has read this round's
        outcome: ``pending`` ``[b]`` (device) is each slot's next pending token, the step appends the
        round staged by ``observe_round`` as ``propose`` would. The next ``propose`` whose slots lie in
        ``[0, b)`` takes these logits instead of running the step (the rows of slots that finished in
        between are dropped); ``cancel`` (or any other ``propose``) discards them. Re-running the step
        after a discarded prelaunch is harmless: the staged round is already appended (nothing new is
        counted), and the positions it rewrites lie past the context length until the next round's
        staging overwrites them."""
        b = pending.shape[0]
        self.block[:b, 0].copy_(pending)
        self._pre = (b, self._run(b))

    def cancel(self) -> None:
        """Drop a prelaunched step (its slots changed: a request joined)."""
        self._pre = None

    def context_len(self, rid: int) -> int:
        """Context positions appended for ``rid`` (a staged round is appended by the next ``propose``)."""
        return int(self.ctx_len[self.slot_of[rid]])

    @torch.no_grad()
    def observe(self, rid: int, start: int, hidden: Tensor) -> None:
        """Eager append (prompts): positions ``start..`` of request ``rid``'s slot; later ones are stale."""
        s = self.slot_of[rid]
        n = hidden.shape[0]
        if start + n > self.capacity:
            raise ValueError(f"request {rid}: context of {start + n} positions exceeds {self.capacity}")
        if n:
            pos = torch.arange(start, start + n, device=self.ctx_len.device)
            for layer, (k, v) in enumerate(self.model.context_kv(hidden, pos)):
                self.k[layer][s, :, start:start + n] = k.transpose(0, 1)
                self.v[layer][s, :, start:start + n] = v.transpose(0, 1)
        self.ctx_len[s] = start + n
        self.h_base[s], self.h_keep[s] = start + n, 0  # nothing staged for this slot

    def observe_round(self, hidden: Tensor, base: Tensor, keep: Tensor) -> None:
        """Stage a verify round of slots ``[0, b)``: hidden ``[b, T, width]``, base positions and kept
        counts ``[b]`` (0 for empty slots); appended by the next ``propose``."""
        b = hidden.shape[0]
        self.hidden[:b].copy_(hidden)
        self.h_base[:b].copy_(base)
        self.h_keep[:b].copy_(keep)

    # ------------------------------------------------------------------ the step

    def _step(self, b: int) -> Tensor:
        m = self.model
        t, dev = self.positions, self.ctx_len.device
        # 1. append the staged round (every position written; only the kept ones counted)
        pos = self.h_base[:b, None] + torch.arange(t, device=dev)  # [b, T]
        m.append_context_static(self.hidden[:b], pos, [(k[:b], v[:b]) for k, v in zip(self.k, self.v, strict=True)])
        self.ctx_len[:b].copy_(self.h_base[:b] + self.h_keep[:b])
        self.h_base[:b].copy_(self.ctx_len[:b])
        self.h_keep[:b].zero_()
        # 2. the block forward over each slot's context (positions >= ctx_len masked) + the lm_head
        h = m.forward_embeds_static(m.embed(self.block[:b]), self.ctx_len[:b],
                                    [(k[:b], v[:b]) for k, v in zip(self.k, self.v, strict=True)])
        return m.logits(h[:, 1:])

    @torch.no_grad()
    def capture(self) -> None:
        """One CUDA graph per batch size (no-op for eager steps or when done); needs no request in flight."""
        if not self.graphs or self._graphs:
            return
        self.h_keep.zero_()
        self.h_base.copy_(self.ctx_len)
        side = torch.cuda.Stream(device=self.ctx_len.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in range(1, self.max_batch + 1):
                for _ in range(2):
                    self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        try:
            for b in range(1, self.max_batch + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._step(b)
                self._graphs[b] = (g, out)
        except RuntimeError as e:  # the same step eagerly, said loudly
            logging.getLogger("dflashgen").warning(
                "dflashgen: CUDA graph capture of the draft pass failed (%s); running it eagerly", e)
            self._graphs.clear()
            self.graphs = False
        self.ctx_len.zero_()
        self.h_base.zero_()
        torch.cuda.synchronize(self.ctx_len.device)

    @torch.no_grad()
    def draft_logits(self, contexts: Sequence[RequestContext]) -> tuple[Tensor, list[int]]:
        slots = [self.slot_of[c.rid] for c in contexts]
        b = max(slots) + 1
        pre, self._pre = self._pre, None
        if pre is not None and b <= pre[0]:  # prelaunched with these slots' pending tokens (prelaunch)
            return pre[1], slots
        tok = torch.tensor([c.tokens[-1] for c in contexts], dtype=torch.long)
        self.block[tensor_on(slots, self.block.device), 0] = to_device(tok, self.block.device)
        return self._run(b), slots

    def _run(self, b: int) -> Tensor:
        """The step for slots ``[0, b)``: its captured graph replayed, else eagerly."""
        if b in self._graphs:
            g, out = self._graphs[b]
            g.replay()
            return out
        return self._step(b)

    @torch.no_grad()
    def propose(self, contexts: Sequence[RequestContext]) -> tuple[Tensor, Tensor | None]:
        logits, slots = self.draft_logits(contexts)
        if slots != list(range(logits.shape[0])):  # the contexts' rows (idle slots out); none to pick when all run
            # through pinned memory: a plain host tensor's copy would wait for the draft pass to finish, and
            # the GPU then idles while the host prepares the verify round
            logits = logits[tensor_on(slots, logits.device)]
        return _drafts(logits, [c.params for c in contexts], self.gen, self.sampled)


def _draft_kind(sampled: bool) -> str:
    return ", sampled drafts with q" if sampled else ""


def _drafts(logits: Tensor, params: list[SamplingParams], gen: torch.Generator, sampled: bool,
            ) -> tuple[Tensor, Tensor | None]:
    """Drafts from drafter logits ``[B, D, V]``: the argmax, verified without draft probabilities (q
    one-hot: DFlash's own practice). ``sampled``: sampled requests' drafts are drawn from the
    drafter's distribution under their temperature / top-k / top-p, returned as q for verification
    with draft probabilities (full-vocabulary work per draft position: ~1 ms per round at B8 with
    Qwen3.8's 248K vocabulary); greedy requests keep the argmax."""
    tokens = logits.argmax(-1)
    if not sampled or all(p.greedy for p in params):
        return tokens, None  # verification ignores q for greedy requests
    q = target_probs(logits, params)  # greedy rows: one-hot (ignored)
    b, d, v = q.shape
    u = to_device(torch.rand(b * d, generator=gen), logits.device)
    draws = sample_categorical(q.reshape(b * d, v), u).view(b, d)
    greedy = tensor_on([p.greedy for p in params], logits.device)
    return torch.where(greedy[:, None], tokens, draws), q
