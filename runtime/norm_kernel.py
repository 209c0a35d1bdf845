"""The fused residual add + RMSNorm (generated family ``norm``) and its torch reference.

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
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from .driver import ArgPack, current_stream
from .images import family_entries, load_module, serving_arch

__all__ = ["NormInputError", "add_rmsnorm", "fused_available", "reference_add_rmsnorm"]

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
    return tuple(family_entries("norm").values())


def _entry(arch: int, hidden: int) -> dict[str, Any] | None:
    """The specialised kernel for ``hidden`` at ``arch``, else the generic one (None: neither)."""
    by_h = {e["hidden"]: e for e in _entries() if e["arch"] == arch}
    return by_h.get(hidden) or by_h.get(None)


def fused_available(device: torch.device | str, hidden: int, arch: int | None = None) -> bool:
    """Whether :func:`add_rmsnorm` launches the generated kernel here (a CUDA device, a kernel for
    this arch, hidden % 4 == 0); manifest only, nothing is compiled or loaded."""
    dev = torch.device(device)
    if dev.type != "cuda" or hidden % 4:
        return False
    try:
        return _entry(kernel_arch(dev, arch), hidden) is not None
    except (NormInputError, RuntimeError):
        return False


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
