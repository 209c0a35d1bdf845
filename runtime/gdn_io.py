"""The glue around the gated delta rule step: the generated ``gdn`` family's io kernels on CUDA, the
torch formulation elsewhere (and as their reference).

:func:`gdn_inputs` -- from the conv inputs (time-major ``[B, W - 1 + T, C]`` FP32: the conv state's
W - 1 positions, then the T new ones) and the in_proj output's b / a segments -- the depthwise causal
conv as an explicit W-tap sum (tap 0 the oldest position), SiLU, the q / k L2 norms (q also scaled by
``dk ** -0.5``), ``beta = sigmoid(b)`` and ``log_decay = -exp(A_log) * softplus(a + dt_bias)``: what
the target ran as ~15 torch launches per GDN layer, one launch. :func:`gdn_prefill_inputs` -- the
same for a prefill straight from the conv state ``[B, C, W - 1]`` and the in_proj output's FP16 rows
(no FP32 ``[B, W - 1 + T, C]`` cat in memory), updating the conv state in place. :func:`gdn_gate` -- the gated
RMSNorm ``rms_norm(o) * w * silu(z)`` rounded once to FP16 (out_proj's input): three launches, one.

Both reduce each head in a fixed order that does not depend on B or T (``gdn_io.cuh``), so a
position's bits are those of a one-position call: verify + rollback and the sequential prefill stay
bitwise one-token steps on CUDA. Kernel and torch formulation agree to FP32 rounding (not bitwise:
torch's reductions and ``expf`` differ). No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import ctypes
import math
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from .driver import ArgPack, current_stream
from .gdn_kernel import GdnInputError
from .images import entry_here, family_entries, load_module, loaded_kernel
from .library import mul_to

__all__ = ["GdnDims", "conv_window", "gdn_gate", "gdn_inputs", "gdn_prefill_inputs", "io_available", "l2_norm",
           "gdn_split_inputs", "prefill_inputs_available", "reference_conv", "reference_gate", "reference_inputs",
           "reference_post_conv", "reference_prefill_inputs", "reference_split_inputs", "split_inputs_available"]

Tensor = torch.Tensor
L2_EPS = 1e-6  # as in HF / FLA l2norm


# --------------------------------------------------------------------------- torch formulation


def l2_norm(x: Tensor, scale: float = 1.0) -> Tensor:
    """scale * x * rsqrt(sum(x^2) + eps), as one RMSNorm: sum = n * mean, so eps -> eps / n."""
    n = x.shape[-1]
    return F.rms_norm(x, x.shape[-1:], None, L2_EPS / n) * (scale / math.sqrt(n))


def reference_conv(cat: Tensor, wt: Tensor, t: int) -> Tensor:
    """The causal depthwise conv of ``cat [B, C, W - 1 + T]`` (any strides) with ``wt [C, W, 1]`` as an
    explicit W-tap sum in a fixed order: separate IEEE mul and add (not addcmul, whose FMA contraction
    could differ between the vectorized and strided elementwise kernels torch picks per shape)."""
    conv = cat[..., 0:t] * wt[:, 0]
    for tap in range(1, wt.shape[1]):
        conv = conv + cat[..., tap:tap + t] * wt[:, tap]
    return conv


@torch.no_grad()
def reference_post_conv(conv: Tensor, bet: Tensor, a: Tensor, neg_a: Tensor, dt_bias: Tensor, nk: int, dk: int,
                        nv: int, dv: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k ``[B, T, Hk, dk]`` (L2-normalised, q scaled), v ``[B, T, Hv, dv]`` (a strided view), beta and
    log decay ``[B, T, Hv]`` from the conv output ``[B, C, T]`` and the FP32 b / a ``[B, T, Hv]``."""
    b, _, t = conv.shape
    mixed = F.silu(conv).transpose(1, 2)
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = l2_norm(q.reshape(b, t, nk, dk), dk**-0.5).contiguous()  # no-ops: time-major conv output
    k = l2_norm(k.reshape(b, t, nk, dk)).contiguous()
    beta = torch.sigmoid(bet).contiguous()
    log_decay = (neg_a * F.softplus(a + dt_bias)).contiguous()
    return q, k, v.reshape(b, t, nv, dv), beta, log_decay  # log decay = -A * dt


def reference_inputs(cat_tm: Tensor, zba: Tensor, conv_w: Tensor, dt_bias: Tensor, neg_a: Tensor,
                     dims: GdnDims) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`gdn_inputs` in torch ops (what the target runs off CUDA)."""
    nk, dk, nv, dv = dims
    t = cat_tm.shape[1] - (conv_w.shape[1] - 1)
    bet, a = zba[..., nv * dv:].float().split([nv, nv], dim=-1)
    conv = reference_conv(cat_tm.transpose(1, 2), conv_w[..., None], t)
    return reference_post_conv(conv, bet, a, neg_a, dt_bias, nk, dk, nv, dv)


def conv_window(cat: Tensor, n: Tensor, width: int) -> Tensor:
    """cat[..., b, :, n[b] : n[b] + width] for every request b (cat ``[..., B, C, L]``): the conv state
    after n[b] of a span's positions."""
    idx = n.view(*([1] * (cat.dim() - 3)), -1, 1, 1) + torch.arange(width, device=cat.device)
    return cat.gather(-1, idx.expand(*cat.shape[:-1], width))


def reference_prefill_inputs(conv: Tensor, mixed: Tensor, zba: Tensor, conv_w: Tensor, dt_bias: Tensor, neg_a: Tensor,
                             dims: GdnDims, n: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`gdn_prefill_inputs` in torch ops: the conv inputs' cat made explicitly, then
    :func:`reference_inputs`; ``conv`` updated in place to the window after n[b] (default T) positions."""
    c, width = conv_w.shape
    cat_tm = torch.cat((conv.transpose(1, 2), mixed[..., :c].float()), dim=1)  # [B, W - 1 + T, C]
    out = reference_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims)
    t = mixed.shape[1]
    cat = cat_tm.transpose(1, 2)
    conv.copy_(cat[..., t:] if n is None else conv_window(cat, n.to(conv.device), width - 1))
    return out


def reference_split_inputs(conv: Tensor, mixed: Tensor, zba: Tensor, conv_w: Tensor, dt_bias: Tensor, neg_a: Tensor,
                           dims: GdnDims, cat_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`gdn_split_inputs` in torch ops: the cat made into ``cat_out``, then :func:`reference_inputs`."""
    c = conv_w.shape[0]
    torch.cat((conv.transpose(1, 2), mixed[..., :c]), dim=1, out=cat_out)  # the FP16 rows upcast exactly
    return reference_inputs(cat_out, zba, conv_w, dt_bias, neg_a, dims)


def reference_gate(o: Tensor, z: Tensor, w: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """rms_norm(o) * w * silu(z) for o ``[B, T, Hv, dv]`` FP32, z of o's shape (any float), rounded
    once to ``dtype``; ``[B, T, Hv * dv]``."""
    b, t, nv, dv = o.shape
    g = F.rms_norm(o, (dv,), w, eps)
    return mul_to(g, F.silu(z.reshape(b, t, nv, dv).float()), dtype).reshape(b, t, nv * dv)


# --------------------------------------------------------------------------- the kernels


GdnDims = tuple[int, int, int, int]  # (Hk, dk, Hv, dv): this rank's key heads, key dim, value heads, value dim


@cache
def _entries() -> tuple[dict[str, Any], ...]:
    return tuple(e for e in family_entries("gdn").values() if e.get("mode") == "io")


def _entry(arch: int) -> dict[str, Any] | None:
    return next((e for e in _entries() if e["arch"] == arch), None)


def io_available(device: torch.device | str, dk: int, dv: int, arch: int | None = None) -> bool:
    """Whether :func:`gdn_inputs` / :func:`gdn_gate` launch the generated kernels here: CUDA, an io
    kernel for the serving arch, head dims within its limit (manifest only: nothing is loaded)."""
    e = entry_here(device, arch, "DFLASHGEN_GDN_ARCH", GdnInputError, _entry)
    return e is not None and max(dk, dv) <= int(e["max_d"])


class _IoKernels:
    """The inputs / gate pair for one (arch, device), with persistent launch arguments."""

    def __init__(self, entry: dict[str, Any], device_index: int) -> None:
        mod = load_module(entry, device_index)
        self.name, self.warps, self.max_d = entry["name"], int(entry["warps"]), int(entry["max_d"])
        self.inputs, self.gate = mod.function(self.name), mod.function(self.name + "_gate")
        self.split = mod.function(self.name + "_split")
        self.prefill_tile, self.prefill_max_w = int(entry["prefill_tile"]), int(entry["prefill_max_w"])
        self.prefill_narrow_d = int(entry["prefill_narrow_d"])
        self.prefill = {wide: mod.function(self.name + ("_prefill_wide" if wide else "_prefill"))
                        for wide in (False, True)}
        p, i, ll, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
        self.in_args = ArgPack([p, i, i, i, p, ll, p, p, p, i, i, i, i, f, f, f, p, p, p, p, p])
        self.prefill_args = ArgPack([p, p, ll, i, i, i, p, p, ll, p, p, p, i, i, i, i, f, f, f, p, p, p, p, p])
        self.split_args = ArgPack([p, p, ll, p, i, i, i, p, ll, p, p, p, i, i, i, i, f, f, f, p, p, p, p, p])
        self.gate_args = ArgPack([p, p, ll, p, f, i, i, p])


_KERNELS: dict[tuple[int, int], _IoKernels] = {}


def _kernels(dev: torch.device, arch: int | None) -> tuple[_IoKernels, int]:
    return loaded_kernel(_KERNELS, dev, arch, "DFLASHGEN_GDN_ARCH", GdnInputError, _entry, _IoKernels, "gdn io kernel")


def _rows(name: str, x: Tensor, b: int, t: int, width: int) -> int:
    """The row stride (elements) of a [B, T, >= width] view whose rows are evenly spaced and whose
    channels are contiguous (an in_proj output segment), else a clear error."""
    if x.dim() != 3 or x.shape[:2] != (b, t) or x.shape[2] < width or x.stride(2) != 1:
        raise GdnInputError(f"{name} must be a [B={b}, T={t}, >= {width}] view with contiguous channels, "
                            f"got {tuple(x.shape)} strides {x.stride()}")
    if b > 1 and t > 0 and x.stride(0) != t * x.stride(1):
        raise GdnInputError(f"{name}'s rows must be evenly spaced (strides {x.stride()})")
    return x.stride(1)


def _check_terms(zba: Tensor, conv_w: Tensor, dt_bias: Tensor, neg_a: Tensor, b: int, t: int, c: int, width: int,
                 dims: GdnDims, device: torch.device) -> int:
    """The inputs both input kernels share: zba's row stride, else a clear error."""
    _, _, nv, dv = dims
    if zba.dtype != torch.float16:
        raise GdnInputError(f"zba must be float16, got {zba.dtype}")
    row = _rows("zba", zba, b, t, nv * dv + 2 * nv)
    for name, x, shape in (("conv_w", conv_w, (c, width)), ("dt_bias", dt_bias, (nv,)), ("neg_a", neg_a, (nv,))):
        if x.dtype != torch.float32 or tuple(x.shape) != shape or not x.is_contiguous() or x.device != device:
            raise GdnInputError(f"{name} must be contiguous float32 {list(shape)} on {device}, got "
                                f"{x.dtype} {list(x.shape)} on {x.device}")
    return row


def _outputs(b: int, t: int, dims: GdnDims, dev: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    nk, dk, nv, dv = dims
    q = torch.empty((b, t, nk, dk), device=dev)
    beta = torch.empty((b, t, nv), device=dev)
    return q, torch.empty_like(q), torch.empty((b, t, nv, dv), device=dev), beta, torch.empty_like(beta)


def gdn_inputs(cat_tm: Tensor, zba: Tensor, conv_w: Tensor, dt_bias: Tensor, neg_a: Tensor, dims: GdnDims,
               *, arch: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v, beta, log_decay) for the step from ``cat_tm [B, W - 1 + T, C]`` FP32 (contiguous),
    ``zba [B, T, Hv * dv + 2 Hv]`` FP16 (the in_proj output's z | b | a, rows evenly spaced), the conv
    weight ``[C, W]``, ``dt_bias`` and ``neg_a`` ``[Hv]`` FP32. q, k ``[B, T, Hk, dk]``, v ``[B, T, Hv,
    dv]``, beta / log_decay ``[B, T, Hv]``, all contiguous FP32. CUDA: one launch; else torch."""
    nk, dk, nv, dv = dims
    if cat_tm.device.type != "cuda":
        return reference_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims)
    b, span, c = cat_tm.shape
    width = conv_w.shape[-1]
    t = span - (width - 1)
    if c != 2 * nk * dk + nv * dv or t < 1:
        raise GdnInputError(f"cat_tm [B, W-1+T, C] = {tuple(cat_tm.shape)} does not fit dims {dims}, W = {width}")
    if cat_tm.dtype != torch.float32 or not cat_tm.is_contiguous():
        raise GdnInputError(f"cat_tm must be contiguous float32, got {cat_tm.dtype} strides {cat_tm.stride()}")
    row = _check_terms(zba, conv_w, dt_bias, neg_a, b, t, c, width, dims, cat_tm.device)
    kern, idx = _kernels(cat_tm.device, arch)
    if max(dk, dv) > kern.max_d:
        raise GdnInputError(f"head dims {dk} / {dv} above the io kernel's {kern.max_d}")
    q, k, v, beta, log_decay = outs = _outputs(b, t, dims, cat_tm.device)
    vals = (cat_tm.data_ptr(), width, c, t, zba.data_ptr(), row, conv_w.data_ptr(), dt_bias.data_ptr(),
            neg_a.data_ptr(), nk, dk, nv, dv, L2_EPS, dk**-0.5 / math.sqrt(dk), 1 / math.sqrt(dk),
            q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), log_decay.data_ptr())
    kern.in_args.launch(kern.inputs, (b * t, -(-(2 * nk + nv) // kern.warps), 1), (32 * kern.warps, 1, 1),
                        current_stream(idx), vals)
    return outs


def _state_and_rows(conv: Tensor, mixed: Tensor, conv_w: Tensor, dims: GdnDims) -> tuple[int, int, int, int]:
    """(B, C, W, T) of a conv state ``conv [B, C, W - 1]`` and the FP16 rows ``mixed [B, T, >= C]`` the
    state-reading input kernels take, else a clear error."""
    nk, dk, nv, dv = dims
    b, c, hold = conv.shape
    width = conv_w.shape[-1]
    t = mixed.shape[1] if mixed.dim() == 3 else 0
    if c != 2 * nk * dk + nv * dv or hold != width - 1 or t < 1:
        raise GdnInputError(f"conv [B, C, W-1] = {tuple(conv.shape)} / mixed {tuple(mixed.shape)} do not fit dims "
                            f"{dims}, W = {width}")
    if conv.dtype != torch.float32 or not conv.is_contiguous():
        raise GdnInputError(f"conv must be contiguous float32, got {conv.dtype} strides {conv.stride()}")
    if mixed.dtype != torch.float16 or mixed.device != conv.device:
        raise GdnInputError(f"mixed must be float16 on {conv.device}, got {mixed.dtype} on {mixed.device}")
    return b, c, width, t


def split_inputs_available(device: torch.device | str, dk: int, dv: int, arch: int | None = None) -> bool:
    """Whether :func:`gdn_split_inputs` launches a kernel here (manifest only): an io entry that has it."""
    e = entry_here(device, arch, "DFLASHGEN_GDN_ARCH", GdnInputError, _entry)
    return e is not None and max(dk, dv) <= int(e["max_d"]) and bool(e.get("split"))


def gdn_split_inputs(conv: Tensor, mixed: Tensor, zba: Tensor, conv_w: Tensor, dt_bias: Tensor, neg_a: Tensor,
                     dims: GdnDims, cat_out: Tensor, *, arch: int | None = None,
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`gdn_inputs` of an armed (verify / decode) forward straight from the conv state ``conv [B, C,
    W - 1]`` FP32 (contiguous; only read) and the in_proj output's FP16 rows ``mixed [B, T, >= C]`` (rows
    evenly spaced), writing their time-major cat ``[B, W - 1 + T, C]`` FP32 into ``cat_out`` (contiguous:
    the rollback buffer) -- the same (q, k, v, beta, log_decay), bitwise, as :func:`gdn_inputs` on that
    cat, in one launch instead of torch's cat (two copies) and the inputs kernel. Else torch."""
    nk, dk, nv, dv = dims
    if conv.device.type != "cuda":
        return reference_split_inputs(conv, mixed, zba, conv_w, dt_bias, neg_a, dims, cat_out)
    b, c, width, t = _state_and_rows(conv, mixed, conv_w, dims)
    hold = width - 1
    if (cat_out.dtype != torch.float32 or tuple(cat_out.shape) != (b, hold + t, c) or not cat_out.is_contiguous()
            or cat_out.device != conv.device):
        raise GdnInputError(f"cat_out must be contiguous float32 {[b, hold + t, c]} on {conv.device}, got "
                            f"{cat_out.dtype} {list(cat_out.shape)} strides {cat_out.stride()} on {cat_out.device}")
    mixed_row = _rows("mixed", mixed, b, t, c)
    row = _check_terms(zba, conv_w, dt_bias, neg_a, b, t, c, width, dims, conv.device)
    kern, idx = _kernels(conv.device, arch)
    if max(dk, dv) > kern.max_d:
        raise GdnInputError(f"head dims {dk} / {dv} above the io kernel's {kern.max_d}")
    q, k, v, beta, log_decay = outs = _outputs(b, t, dims, conv.device)
    vals = (conv.data_ptr(), mixed.data_ptr(), mixed_row, cat_out.data_ptr(), width, c, t, zba.data_ptr(), row,
            conv_w.data_ptr(), dt_bias.data_ptr(), neg_a.data_ptr(), nk, dk, nv, dv, L2_EPS, dk**-0.5 / math.sqrt(dk),
            1 / math.sqrt(dk), q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), log_decay.data_ptr())
    kern.split_args.launch(kern.split, (b * t, -(-(2 * nk + nv) // kern.warps), 1), (32 * kern.warps, 1, 1),
                           current_stream(idx), vals)
    return outs


def prefill_inputs_available(device: torch.device | str, dk: int, dv: int, width: int, arch: int | None = None) -> bool:
    """Whether :func:`gdn_prefill_inputs` launches a kernel here: :func:`io_available` and a conv width
    the kernel takes (manifest only)."""
    e = entry_here(device, arch, "DFLASHGEN_GDN_ARCH", GdnInputError, _entry)
    return (e is not None and max(dk, dv) <= int(e["max_d"]) and "prefill_max_w" in e
            and 1 <= width <= int(e["prefill_max_w"]))


def gdn_prefill_inputs(conv: Tensor, mixed: Tensor, zba: Tensor, conv_w: Tensor, dt_bias: Tensor, neg_a: Tensor,
                       dims: GdnDims, *, n: Tensor | None = None, arch: int | None = None,
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`gdn_inputs` of a prefill, without the FP32 conv-input cat: the conv state ``conv [B, C, W - 1]``
    FP32 (contiguous) holds the W - 1 oldest taps, ``mixed [B, T, >= C]`` FP16 (rows evenly spaced: the
    in_proj output's q | k | v segment) the T new ones. The same (q, k, v, beta, log_decay), bitwise,
    as :func:`gdn_inputs` on ``cat(conv^T, mixed)``; then ``conv`` is overwritten with the W - 1 taps
    after ``n[b]`` positions (``n`` [B] int64 on the device, each in [0, T]; None: T) -- the state a
    prefill that commits n[b] positions keeps. CUDA: one launch (no host sync); else torch."""
    nk, dk, nv, dv = dims
    if conv.device.type != "cuda":
        return reference_prefill_inputs(conv, mixed, zba, conv_w, dt_bias, neg_a, dims, n)
    b, c, width, t = _state_and_rows(conv, mixed, conv_w, dims)
    mixed_row = _rows("mixed", mixed, b, t, c)
    row = _check_terms(zba, conv_w, dt_bias, neg_a, b, t, c, width, dims, conv.device)
    if n is not None and (n.dtype != torch.long or tuple(n.shape) != (b,) or n.device != conv.device):
        raise GdnInputError(f"n must be int64 [{b}] on {conv.device}, got {n.dtype} {list(n.shape)} on {n.device}")
    kern, idx = _kernels(conv.device, arch)
    if max(dk, dv) > kern.max_d or not 1 <= width <= kern.prefill_max_w:
        raise GdnInputError(f"head dims {dk} / {dv} or conv width {width} beyond the prefill inputs kernel's "
                            f"{kern.max_d} / {kern.prefill_max_w}")
    q, k, v, beta, log_decay = outs = _outputs(b, t, dims, conv.device)
    vals = (conv.data_ptr(), mixed.data_ptr(), mixed_row, width, c, t, 0 if n is None else n.data_ptr(), zba.data_ptr(),
            row, conv_w.data_ptr(), dt_bias.data_ptr(), neg_a.data_ptr(), nk, dk, nv, dv, L2_EPS,
            dk**-0.5 / math.sqrt(dk), 1 / math.sqrt(dk), q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(),
            log_decay.data_ptr())
    grid = (b * -(-t // kern.prefill_tile), -(-(2 * nk + nv) // kern.warps), 1)
    kern.prefill_args.launch(kern.prefill[max(dk, dv) > kern.prefill_narrow_d], grid, (32 * kern.warps, 1, 1),
                             current_stream(idx), vals)
    return outs


def gdn_gate(o: Tensor, z: Tensor, w: Tensor, eps: float, *, arch: int | None = None) -> Tensor:
    """rms_norm(o) * w * silu(z) in FP16 ``[B, T, Hv * dv]`` for o ``[B, T, Hv, dv]`` FP32 (contiguous),
    z ``[B, T, >= Hv * dv]`` FP16 (rows evenly spaced, e.g. the in_proj output's z segment), w ``[dv]``
    FP32. CUDA: one launch; else :func:`reference_gate`."""
    b, t, nv, dv = o.shape
    if o.device.type != "cuda":
        return reference_gate(o, z[..., :nv * dv], w, eps, torch.float16)
    if o.dtype != torch.float32 or not o.is_contiguous():
        raise GdnInputError(f"o must be contiguous float32, got {o.dtype} strides {o.stride()}")
    if z.dtype != torch.float16:
        raise GdnInputError(f"z must be float16, got {z.dtype}")
    row = _rows("z", z, b, t, nv * dv)
    if w.dtype != torch.float32 or tuple(w.shape) != (dv,) or not w.is_contiguous() or w.device != o.device:
        raise GdnInputError(f"w must be contiguous float32 [{dv}] on {o.device}, got {w.dtype} {list(w.shape)}")
    kern, idx = _kernels(o.device, arch)
    if dv > kern.max_d:
        raise GdnInputError(f"value head dim {dv} above the io kernel's {kern.max_d}")
    out = torch.empty((b, t, nv * dv), dtype=torch.float16, device=o.device)
    if b * t == 0:
        return out
    kern.gate_args.launch(kern.gate, (b * t, -(-nv // kern.warps), 1), (32 * kern.warps, 1, 1), current_stream(idx),
                          (o.data_ptr(), z.data_ptr(), row, w.data_ptr(), eps, nv, dv, out.data_ptr()))
    return out
