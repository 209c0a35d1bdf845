"""The decoder's norm kernels (generated family ``norm``) and their torch formulations: the fused
residual add + RMSNorm of every norm site (:func:`add_rmsnorm`) and a full-attention layer's q / k
RMSNorm + RoPE with the KV-cache writes (:func:`qk_norm_rope`).

:func:`add_rmsnorm` computes, per row of ``h [..., H]`` (FP32, the residual stream) and the
sublayer output ``y`` (FP16, or None for no add)::

    h_out = h + y                                       FP32
    x     = (h_out * rsqrt(mean(h_out^2) + eps) * w)    rounded once to FP16

-- on CUDA in one launch of the generated kernel (one CTA per row, a fixed reduction order per
hidden size, so each row's bits do not depend on how many rows there are), elsewhere with torch's
ops (:func:`reference_add_rmsnorm`). It replaces three kernels per decoder norm site (the residual
add, ``F.rms_norm`` in FP32, the cast to the projections' FP16). The two agree to FP32 rounding of
the mean (not bitwise: the reduction orders differ); ``h_out`` is bitwise ``h + y`` on both.

Kernel choice: the variant specialised for H when the manifest has it (the configured model's
hidden size), else the generic one; ``arch`` / ``$DFLASHGEN_NORM_ARCH`` picks the image (70: the
compute_70 PTX through the driver's JIT). No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from .driver import ArgPack, current_stream
from .images import entry_here, family_entries, load_module, loaded_kernel, serving_arch

__all__ = ["NormInputError", "add_rmsnorm", "fused_available", "fused_sigmoid_mul", "fused_silu_mul", "qk_norm_rope",
           "qk_rope_available", "reference_add_rmsnorm", "reference_qk_norm_rope", "rope_", "sigmoid_mul_fits",
           "silu_mul_fits"]

Tensor = torch.Tensor


class NormInputError(ValueError):
    """A tensor the fused norm cannot take (dtype, shape, device, layout, alignment)."""


def reference_add_rmsnorm(h: Tensor, y: Tensor | None, w: Tensor, eps: float,
                          out_dtype: torch.dtype = torch.float16) -> tuple[Tensor, Tensor]:
    """torch's ops: (h + y, rms_norm(h + y, w) in ``out_dtype``)."""
    hn = h if y is None else h + y
    return hn, F.rms_norm(hn, hn.shape[-1:], w, eps).to(out_dtype)


def kernel_arch(device: torch.device, arch: int | None = None) -> int:
    return serving_arch(device, arch, "DFLASHGEN_NORM_ARCH", NormInputError)


@cache
def _entries() -> tuple[dict[str, Any], ...]:
    return tuple(e for e in family_entries("norm").values() if e.get("kind", "add_rmsnorm") == "add_rmsnorm")


def _entry(arch: int, hidden: int) -> dict[str, Any] | None:
    """The specialised kernel for ``hidden`` at ``arch``, else the generic one (None: neither)."""
    by_h = {e["hidden"]: e for e in _entries() if e["arch"] == arch}
    return by_h.get(hidden) or by_h.get(None)


def fused_available(device: torch.device | str, hidden: int, arch: int | None = None) -> bool:
    """Whether :func:`add_rmsnorm` launches the generated kernel here (a CUDA device, a kernel for
    this arch, hidden % 4 == 0); manifest only, nothing is compiled or loaded."""
    return hidden % 4 == 0 and entry_here(device, arch, "DFLASHGEN_NORM_ARCH", NormInputError,
                                          lambda a: _entry(a, hidden)) is not None


class _Kernel:
    """One loaded kernel with persistent launch arguments (h, y, w, eps, hidden, h_out, x)."""

    def __init__(self, entry: dict[str, Any], device_index: int) -> None:
        self.name = entry["name"]
        self.threads = int(entry["threads"])
        self.fn = load_module(entry, device_index).function(self.name)
        p = ctypes.c_void_p
        self.args = ArgPack([p, p, p, ctypes.c_float, ctypes.c_int, p, p])


_KERNELS: dict[tuple[int, int, int], _Kernel] = {}


def _kernel(dev: torch.device, hidden: int, arch: int | None) -> tuple[_Kernel, int]:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    a = kernel_arch(dev, arch)
    key = (hidden, a, idx)
    if key not in _KERNELS:
        entry = _entry(a, hidden)
        if entry is None:
            raise NormInputError(f"no sm_{a} add_rmsnorm kernel in the generated manifest: run `dflashgen generate`")
        _KERNELS[key] = _Kernel(entry, idx)
    return _KERNELS[key], idx


def _check(h: Tensor, y: Tensor | None, w: Tensor) -> None:
    hidden = h.shape[-1]
    if h.dtype != torch.float32 or not h.is_contiguous() or h.data_ptr() % 16:
        raise NormInputError(f"h must be contiguous, 16-byte aligned float32, got {h.dtype} strides {h.stride()}")
    if hidden % 4:
        raise NormInputError(f"the hidden size must be a multiple of 4, got {hidden}")
    if y is not None:
        if y.dtype != torch.float16 or tuple(y.shape) != tuple(h.shape) or y.device != h.device:
            raise NormInputError(f"y must be float16 {tuple(h.shape)} on {h.device}, got {y.dtype} "
                                 f"{tuple(y.shape)} on {y.device}")
        if not y.is_contiguous() or y.data_ptr() % 8:
            raise NormInputError(f"y must be contiguous and 8-byte aligned (strides {y.stride()})")
    if w.dtype != torch.float32 or tuple(w.shape) != (hidden,) or w.device != h.device or w.data_ptr() % 16:
        raise NormInputError(f"w must be 16-byte aligned float32 [{hidden}] on {h.device}, got {w.dtype} "
                             f"{tuple(w.shape)} on {w.device}")


def add_rmsnorm(h: Tensor, y: Tensor | None, w: Tensor, eps: float, *,
                arch: int | None = None) -> tuple[Tensor, Tensor]:
    """(h + y, FP16 RMSNorm(h + y) * w) for ``h [..., H]`` FP32, ``y`` FP16 of h's shape or None,
    ``w [H]`` FP32; new tensors (h and y are not modified). CUDA: the generated kernel; otherwise
    :func:`reference_add_rmsnorm`."""
    if h.device.type != "cuda":
        return reference_add_rmsnorm(h, y, w, eps)
    _check(h, y, w)
    hidden = h.shape[-1]
    rows = h.numel() // hidden
    h_out = h if y is None else torch.empty_like(h)
    x = torch.empty(h.shape, dtype=torch.float16, device=h.device)
    if rows == 0:
        return h_out, x
    kern, idx = _kernel(h.device, hidden, arch)
    a = kern.args
    with a.lock:
        vals = (h.data_ptr(), 0 if y is None else y.data_ptr(), w.data_ptr(), eps, hidden,
                0 if y is None else h_out.data_ptr(), x.data_ptr())
        for slot, val in zip(a.values, vals, strict=True):
            slot.value = val
        kern.fn.launch_pack((rows, 1, 1), (kern.threads, 1, 1), a, current_stream(idx))
    return h_out, x


# --------------------------------------------------------------------------- attention inputs


def rope_(x: Tensor, cos: Tensor, sin: Tensor, rd: int) -> Tensor:
    """RoPE on x's first ``rd`` channels, IN PLACE (x: a fresh tensor the caller owns); returns x.
    ``r * cos + rotate_half(r) * sin`` half by half (cos / sin ``[..., rd]`` repeat over the halves):
    a*c - b*s and b*c + a*s are bitwise a*c + (-b)*s and b*c + a*s, and the other channels (3/4 of
    them at partial_rotary_factor 0.25) are not copied."""
    h = rd // 2
    a, b = x[..., :h], x[..., h:2 * h]
    c, s = cos[..., :h], sin[..., :h]
    a_s, b_s = a * s, b * s
    a.mul_(c).sub_(b_s)
    b.mul_(c).add_(a_s)
    return x


def reference_qk_norm_rope(q: Tensor, k: Tensor, v: Tensor, q_w: Tensor, k_w: Tensor, eps: float, cos: Tensor,
                           sin: Tensor, rd: int, pos: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
    """torch's ops: q / k ``[B, T, H, D]`` (any float, any strides) RMS-normed and rotated in FP32; k and
    v ``[B, T, Hkv, D]`` written into the caches ``[B, L, Hkv, D]`` at ``pos [B, T]``; returns q."""
    d = q.shape[-1]
    q = rope_(F.rms_norm(q.float(), (d,), q_w, eps), cos, sin, rd)
    k = rope_(F.rms_norm(k.float(), (d,), k_w, eps), cos, sin, rd)
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    kc[rows, pos] = k.to(kc.dtype)
    vc[rows, pos] = v.to(vc.dtype)
    return q


@cache
def _qk_entries() -> tuple[dict[str, Any], ...]:
    return tuple(e for e in family_entries("norm").values() if e.get("kind") == "qk_rope")


def _qk_entry(arch: int) -> dict[str, Any] | None:
    return next((e for e in _qk_entries() if e["arch"] == arch), None)


def qk_rope_available(device: torch.device | str, head_dim: int, arch: int | None = None) -> bool:
    """Whether :func:`qk_norm_rope` launches the generated kernel here (manifest only)."""
    e = entry_here(device, arch, "DFLASHGEN_NORM_ARCH", NormInputError, _qk_entry)
    return e is not None and head_dim <= int(e["max_d"])


class _QkKernel:
    def __init__(self, entry: dict[str, Any], device_index: int) -> None:
        self.name, self.warps = entry["name"], int(entry["warps"])
        self.fn = load_module(entry, device_index).function(self.name)
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        f = ctypes.c_float
        self.args = ArgPack([p, ll, i, i, i, i, i, i, p, p, f, p, p, p, p, i, f, ll, ll, ll, p, p, ll, ll, ll])


_QK: dict[tuple[int, int], _QkKernel] = {}


def qk_norm_rope(qkv: Tensor, heads: tuple[int, int], d: int, gated: bool, rd: int, q_w: Tensor, k_w: Tensor,
                 eps: float, cos: Tensor, sin: Tensor, pos: Tensor, kc: Tensor, vc: Tensor, *,
                 q_out: Tensor | None = None, q_scale: float = 1.0, head_major: bool = False,
                 arch: int | None = None) -> Tensor:
    """One launch for a full-attention layer's inputs from the q|k|v projection output ``qkv [B, T, N]``
    (FP16, rows evenly spaced, heads ``(Hq, Hkv)``, per q head D or D + D gate channels): q ``[B, T, Hq, D]``
    RMS-normed (``q_w``), rotated (first ``rd`` channels; ``cos`` / ``sin`` ``[B, T, 1, rd]`` FP32: only
    their first halves are read) and times ``q_scale`` in FP32, k likewise (``k_w``, unscaled) and v
    written into the FP16 caches ``kc`` / ``vc`` (contiguous ``[B, L, Hkv, D]``, or ``[B, Hkv, L, D]``
    with ``head_major``) at ``pos [B, T]`` (int64). q goes into ``q_out`` (a ``[B, T, Hq, D]`` FP32 or
    FP16 view, any strides with contiguous channels: e.g. the transpose of a ``[B, Hq, T, D]`` tensor),
    rounded once, or a new FP32 tensor. Returns q. Off CUDA: :func:`reference_qk_norm_rope`."""
    hq, hkv = heads
    b, t, n = qkv.shape
    dev = qkv.device
    if q_out is not None and (q_out.dtype not in (torch.float32, torch.float16) or tuple(q_out.shape) != (b, t, hq, d)
                              or q_out.stride(3) != 1 or q_out.device != dev):
        raise NormInputError(f"q_out must be a float32 / float16 [{b}, {t}, {hq}, {d}] view with contiguous "
                             f"channels on {dev}, got {q_out.dtype} {tuple(q_out.shape)} strides {q_out.stride()}")
    if dev.type != "cuda":  # torch's ops on the same views
        qg, k, v = qkv[..., :hq * d * (2 if gated else 1) + 2 * hkv * d].split(
            [hq * d * (2 if gated else 1), hkv * d, hkv * d], dim=-1)
        q = qg.reshape(b, t, hq, 2 * d)[..., :d] if gated else qg.reshape(b, t, hq, d)
        cache = (kc.transpose(1, 2), vc.transpose(1, 2)) if head_major else (kc, vc)
        q = reference_qk_norm_rope(q, k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d), q_w, k_w, eps, cos, sin,
                                   rd, pos, *cache)
        if q_scale != 1.0:
            q = q * q_scale
        return q if q_out is None else q_out.copy_(q)
    if qkv.dtype != torch.float16 or qkv.stride(2) != 1 or (b > 1 and qkv.stride(0) != t * qkv.stride(1)):
        raise NormInputError(f"qkv must be float16 with contiguous channels and evenly spaced rows, got "
                             f"{qkv.dtype} strides {qkv.stride()}")
    if n < hq * d * (2 if gated else 1) + 2 * hkv * d or rd % 2 or not 0 <= rd <= d:
        raise NormInputError(f"qkv [B, T, {n}] does not hold {hq} + 2 x {hkv} heads of {d} (gated {gated}, rd {rd})")
    for name, c in (("kc", kc), ("vc", vc)):
        heads_dim = (c.shape[1], c.shape[3]) if head_major and c.dim() == 4 else tuple(c.shape[2:])
        if (c.dtype != torch.float16 or c.dim() != 4 or c.shape[0] != b or heads_dim != (hkv, d)
                or not c.is_contiguous() or c.device != dev):
            layout = f"[{b}, {hkv}, L, {d}]" if head_major else f"[{b}, L, {hkv}, {d}]"
            raise NormInputError(f"{name} must be a contiguous float16 cache {layout} on {dev}, got "
                                 f"{c.dtype} {tuple(c.shape)}")
    if vc.shape != kc.shape:
        raise NormInputError(f"kc {tuple(kc.shape)} and vc {tuple(vc.shape)} must have one shape")
    if pos.dtype != torch.long or tuple(pos.shape) != (b, t) or not pos.is_contiguous():
        raise NormInputError(f"pos must be contiguous int64 [{b}, {t}], got {pos.dtype} {tuple(pos.shape)}")
    for name, x, shape in (("cos", cos, (b, t, 1, rd)), ("sin", sin, (b, t, 1, rd)), ("q_w", q_w, (d,)),
                           ("k_w", k_w, (d,))):
        if x.dtype != torch.float32 or tuple(x.shape) != shape or not x.is_contiguous() or x.device != dev:
            raise NormInputError(f"{name} must be contiguous float32 {list(shape)} on {dev}, got {x.dtype} "
                                 f"{list(x.shape)}")
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    a_ = kernel_arch(dev, arch)
    if (a_, idx) not in _QK:
        e = _qk_entry(a_)
        if e is None or d > int(e["max_d"]):
            raise NormInputError(f"no sm_{a_} q / k norm + RoPE kernel for head dim {d}: run `dflashgen generate`")
        _QK[(a_, idx)] = _QkKernel(e, idx)
    kern = _QK[(a_, idx)]
    q = torch.empty((b, t, hq, d), device=dev) if q_out is None else q_out
    if b * t == 0:
        return q
    # cache strides (request, position, head) in elements
    kv_b, kv_l, kv_h = (kc.stride(0), kc.stride(2), kc.stride(1)) if head_major else kc.stride()[:3]
    a = kern.args
    with a.lock:
        vals = (qkv.data_ptr(), qkv.stride(1), t, hq, hkv, d, int(gated), rd, q_w.data_ptr(), k_w.data_ptr(), eps,
                cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), q.data_ptr(), int(q.dtype == torch.float16),
                q_scale, *q.stride()[:3], kc.data_ptr(), vc.data_ptr(), kv_b, kv_l, kv_h)
        for slot, val in zip(a.values, vals, strict=True):
            slot.value = val
        kern.fn.launch_pack((b * t, -(-(hq + 2 * hkv) // kern.warps), 1), (32 * kern.warps, 1, 1), a,
                            current_stream(idx))
    return q


# --------------------------------------------------------------------------- SiLU(gate) * up


@cache
def _kind_entry(kind: str, arch: int) -> dict[str, Any] | None:
    return next((e for e in family_entries("norm").values() if e.get("kind") == kind and e["arch"] == arch), None)


def _silu_entry(arch: int) -> dict[str, Any] | None:
    return _kind_entry("silu_mul", arch)


def _sigmoid_entry(arch: int) -> dict[str, Any] | None:
    return _kind_entry("sigmoid_mul", arch)


class _GlueKernel:
    """A loaded grid-stride glue kernel (SiLU-mul, sigmoid-mul) with persistent launch arguments."""

    ARGS: list[Any] = []

    def __init__(self, entry: dict[str, Any], device_index: int) -> None:
        self.name, self.threads = entry["name"], int(entry["threads"])
        self.fn = load_module(entry, device_index).function(self.name)
        self.args = ArgPack(self.ARGS)

    def launch(self, steps: int, vals: tuple[Any, ...], idx: int) -> None:
        a = self.args
        with a.lock:
            for slot, val in zip(a.values, vals, strict=True):
                slot.value = val
            self.fn.launch_pack((min(_GLUE_CTAS, -(-steps // self.threads)), 1, 1), (self.threads, 1, 1), a,
                                current_stream(idx))


class _SiluKernel(_GlueKernel):
    ARGS = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]


class _SigmoidKernel(_GlueKernel):
    ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_void_p]


_SILU: dict[tuple[int, int], _SiluKernel] = {}
_SIGMOID: dict[tuple[int, int], _SigmoidKernel] = {}
_GLUE_CTAS = 4096  # grid-stride: enough CTAs to fill any GPU several times over, few enough to launch fast


@cache
def _glue_here(kind: str, device: torch.device, arch: int | None, env: str) -> bool:
    """A glue kernel of ``kind`` for this device's serving arch (manifest only; ``env``:
    $DFLASHGEN_NORM_ARCH, part of the key so a changed override is looked up again)."""
    return entry_here(device, arch, "DFLASHGEN_NORM_ARCH", NormInputError,
                      lambda a: _kind_entry(kind, a)) is not None


def silu_mul_fits(y: Tensor, arch: int | None = None) -> bool:
    """Whether :func:`fused_silu_mul` runs the generated kernel on ``y [..., 2 I]``: CUDA, FP16, I % 8 ==
    0, contiguous (or 2-D rows spaced a multiple of 8 channels apart, unit channel stride), 16-byte
    aligned, a kernel for the serving arch."""
    if y.device.type != "cuda" or y.dtype != torch.float16 or y.dim() < 1 or y.shape[-1] % 16 or y.data_ptr() % 16:
        return False
    if not (y.is_contiguous() or (y.dim() == 2 and y.stride(1) == 1 and y.stride(0) % 8 == 0)):
        return False
    return _glue_here("silu_mul", y.device, arch, os.environ.get("DFLASHGEN_NORM_ARCH", ""))


def fused_silu_mul(y: Tensor, *, arch: int | None = None, check: bool = True) -> Tensor:
    """SiLU(gate) * up in FP32, rounded once to FP16, for ``y = [gate | up]`` ``[..., 2 I]`` FP16 on
    CUDA (:func:`silu_mul_fits`; ``check=False``: the caller asked it already): one generated launch
    with torch's arithmetic op for op, where torch takes an upcast copy, a SiLU and a multiply through
    FP32 tensors. Returns a new ``[..., I]`` tensor."""
    if check and not silu_mul_fits(y, arch):
        raise NormInputError(f"fused_silu_mul takes CUDA float16 [..., 2 I] (I % 8 == 0, contiguous or 2-D rows "
                             f"8-channel aligned, 16-byte aligned), got {y.dtype} {tuple(y.shape)} strides "
                             f"{y.stride()} on {y.device}")
    flat = y.reshape(-1, y.shape[-1])  # a view: contiguous, or 2-D already
    cols = y.shape[-1] // 2
    out = torch.empty((*y.shape[:-1], cols), dtype=torch.float16, device=y.device)
    rows = flat.shape[0]
    if rows == 0:
        return out
    kern, idx = loaded_kernel(_SILU, y.device, arch, "DFLASHGEN_NORM_ARCH", NormInputError, _silu_entry, _SiluKernel,
                              "SiLU-mul kernel")
    kern.launch(rows * (cols // 8), (flat.data_ptr(), flat.stride(0), rows, cols, out.data_ptr()), idx)
    return out


# --------------------------------------------------------------------------- attention output gate


def _gate_rows(gate: Tensor) -> Tensor | None:
    """``gate [..., H, D]`` as a ``[rows, H, D]`` view (the leading dims flattened: evenly spaced rows,
    as the q|gate projection's [B, T] rows are), or None where no view does that."""
    try:
        return gate.view(-1, *gate.shape[-2:])
    except RuntimeError:
        return None


def sigmoid_mul_fits(o: Tensor, gate: Tensor, arch: int | None = None) -> bool:
    """Whether :func:`fused_sigmoid_mul` runs the generated kernel: CUDA, ``o [..., H, D]`` FP32
    contiguous, ``gate`` FP16 of o's shape with contiguous channels, its heads and rows (the leading
    dims flattened, evenly spaced) a multiple of 4 channels apart, 8-byte aligned, D % 4 == 0, a
    kernel for the serving arch."""
    if (o.device.type != "cuda" or o.dtype != torch.float32 or not o.is_contiguous() or o.dim() < 2
            or gate.dtype != torch.float16 or gate.shape != o.shape or gate.device != o.device
            or o.shape[-1] % 4 or gate.stride(-1) != 1 or gate.data_ptr() % 8):
        return False
    rows = _gate_rows(gate)
    if rows is None or rows.stride(0) % 4 or rows.stride(1) % 4:
        return False
    return _glue_here("sigmoid_mul", o.device, arch, os.environ.get("DFLASHGEN_NORM_ARCH", ""))


def fused_sigmoid_mul(o: Tensor, gate: Tensor, *, arch: int | None = None, check: bool = True) -> Tensor:
    """``(o * sigmoid(gate.float())).half()`` for ``o [..., H, D]`` FP32 and the FP16 ``gate`` of that
    shape (:func:`sigmoid_mul_fits`; ``check=False``: the caller asked it already): one generated
    launch with torch's arithmetic op for op where torch takes an upcast copy, a sigmoid and a
    multiply. Returns a new contiguous ``[..., H, D]`` FP16 tensor."""
    if check and not sigmoid_mul_fits(o, gate, arch):
        raise NormInputError(f"fused_sigmoid_mul takes CUDA float32 o [..., H, D] (contiguous, D % 4 == 0) and a "
                             f"float16 gate of its shape (contiguous channels, rows and heads 4-channel aligned, "
                             f"8-byte aligned), got o {o.dtype} {tuple(o.shape)}, gate {gate.dtype} "
                             f"{tuple(gate.shape)} strides {gate.stride()} on {gate.device}")
    out = torch.empty(o.shape, dtype=torch.float16, device=o.device)
    heads, d = o.shape[-2:]
    rows = o.numel() // max(1, heads * d)
    if o.numel() == 0:
        return out
    kern, idx = loaded_kernel(_SIGMOID, o.device, arch, "DFLASHGEN_NORM_ARCH", NormInputError, _sigmoid_entry,
                              _SigmoidKernel, "sigmoid-mul kernel")
    g = _gate_rows(gate)
    assert g is not None  # sigmoid_mul_fits
    kern.launch(rows * heads * (d // 4), (o.data_ptr(), g.data_ptr(), g.stride(0), g.stride(1), rows, heads, d,
                                          out.data_ptr()), idx)
    return out
