"""A prepacked weight back to FP16 ``[N, K]`` on the GPU: the generated family ``dequant``.

:func:`dequantize` returns ``dequantize_packed(packed).to(dtype)`` -- bitwise -- for the dequantize +
cuBLAS path (``library.fallback_gemm``): on CUDA for FP16 one launch of the generated kernel for the
layout's arch (it decodes each packed chunk with the GEMM kernels' own decoder, scales in FP32 and
rounds once), elsewhere torch's ops (the FP32 dequantization, then a cast). The kernel reads 0.5 (NVFP4)
or 1 (FP8) byte per weight and writes 2, so an FP16 copy made per call costs about what reading it
does; the library keeps copies only within its ``dequant_cache`` budget.

Which build decodes a layout: the one with the same decoder (``prepack.Layout`` family and hardware
E4M3): sm_70 / sm_75 layouts the sm_70 kernel (the compute_70 PTX through the driver's JIT on newer
GPUs), sm_80 / sm_86 the sm_80 one, sm_90 the sm_90 one; other layouts take torch's path.
"""

from __future__ import annotations

import ctypes
import os
import re
import weakref
from functools import cache
from typing import Any

import torch

from dflashgen.prepack import Layout, PackedWeight, unpack
from dflashgen.weights import FP8ChannelWeight, NVFP4Weight, pack_nibbles

from .driver import ArgPack, current_stream
from .images import family_entries, load_module

__all__ = ["AUTO_RESERVE", "AUTO_RESERVE_MIN", "DequantCache", "DequantInputError", "dequantize", "dequantize_packed",
           "kernel_arch", "parse_budget"]

Tensor = torch.Tensor

# layout arch -> the build whose Traits decode that layout exactly (same family and E4M3 decoder)
_KERNEL_ARCH = {70: 70, 75: 70, 80: 80, 86: 80, 90: 90}


class DequantInputError(ValueError):
    """A packed weight or output buffer the dequantize kernel cannot take."""


def dequantize_packed(packed: PackedWeight) -> Tensor:
    """FP32 weights [N, K] from a packed weight (logical row order): torch's ops, the reference."""
    payload, scales = unpack(packed)
    lay = packed.layout
    if lay.fmt == "nvfp4":
        ones = torch.ones(1, device=payload.device)
        w = NVFP4Weight(pack_nibbles(payload), scales.view(torch.float8_e4m3fn), ones, (lay.n,))
        return w.dequantize() * (packed.col_scale / lay.decode_scale)[:, None]
    w8 = FP8ChannelWeight(payload.view(torch.float8_e4m3fn), packed.col_scale / lay.decode_scale)
    return w8.dequantize()


def kernel_arch(layout: Layout, device: torch.device) -> int | None:
    """The dequant build for ``layout`` on ``device`` (None: torch's path): a CUDA device that can run
    it, and a kernel in the generated manifest."""
    arch = _KERNEL_ARCH.get(layout.arch)
    if device.type != "cuda" or arch is None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if arch > 10 * major + minor:
        return None
    return arch if _entry(arch, layout.fmt) is not None else None


@cache
def _entry(arch: int, fmt: str) -> dict[str, Any] | None:
    try:
        entries = family_entries("dequant").values()
    except RuntimeError:  # no dequant family in this manifest
        return None
    return next((e for e in entries if e["arch"] == arch and e.get("format") == fmt), None)


class _Kernel:
    def __init__(self, entry: dict[str, Any], device_index: int) -> None:
        self.name, self.warps = entry["name"], int(entry["warps"])
        self.fn = load_module(entry, device_index).function(self.name)
        p, i = ctypes.c_void_p, ctypes.c_int
        self.args = ArgPack([p, p, p, i, i, i, i, p])


_KERNELS: dict[tuple[str, int], _Kernel] = {}


def _check(packed: PackedWeight, out: Tensor, dev: torch.device) -> None:
    lay = packed.layout
    payload = lay.n_pad * lay.k // (2 if lay.fmt == "nvfp4" else 1)
    w, s, col = packed.weights, packed.scales, packed.col_scale
    bad = []
    if w.dtype != torch.uint8 or w.device != dev or not w.is_contiguous() or w.numel() < payload or w.data_ptr() % 16:
        bad.append(f"weights must be a contiguous 16-byte aligned uint8 stream of >= {payload} bytes on {dev}, "
                   f"got {w.dtype} {w.numel()} bytes on {w.device}")
    if lay.fmt == "nvfp4" and (s is None or s.dtype != torch.uint8 or s.device != dev or not s.is_contiguous()
                               or s.numel() < lay.n_pad * lay.k // 16 or s.data_ptr() % 4):
        bad.append(f"NVFP4 block scales must be a contiguous 4-byte aligned uint8 stream of >= "
                   f"{lay.n_pad * lay.k // 16} bytes on {dev}")
    if col.dtype != torch.float32 or col.device != dev or not col.is_contiguous() or col.shape != (lay.n,):
        bad.append(f"col_scale must be contiguous float32 [{lay.n}] on {dev}, got {col.dtype} "
                   f"{tuple(col.shape)} on {col.device}")
    if out.dtype != torch.float16 or out.device != dev or not out.is_contiguous() or out.shape != (lay.n, lay.k) \
            or out.data_ptr() % 16:
        bad.append(f"out must be a contiguous 16-byte aligned float16 [{lay.n}, {lay.k}] on {dev}, got "
                   f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if bad:
        raise DequantInputError("dequantize: " + "; ".join(bad))


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float16, out: Tensor | None = None) -> Tensor:
    """``dequantize_packed(packed).to(dtype)`` ``[N, K]`` on the weights' device, bitwise: the generated
    kernel where one decodes this layout on this device and ``dtype`` is FP16, else torch's ops; into
    ``out`` when given. Buffers the kernel cannot take raise :class:`DequantInputError`."""
    lay, dev = packed.layout, packed.weights.device
    arch = kernel_arch(lay, dev) if dtype == torch.float16 else None
    if arch is None:
        w = dequantize_packed(packed).to(dtype)
        return w if out is None else out.copy_(w)
    if out is None:
        out = torch.empty((lay.n, lay.k), dtype=torch.float16, device=dev)
    _check(packed, out, dev)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    entry = _entry(arch, lay.fmt)
    assert entry is not None  # kernel_arch found it
    kern = _KERNELS.get((entry["name"], idx))
    if kern is None:
        kern = _KERNELS[(entry["name"], idx)] = _Kernel(entry, idx)
    tiles, groups = lay.n_pad // lay.tile_rows, lay.k // lay.k_group
    if tiles * groups == 0:
        return out
    scales = packed.scales.data_ptr() if packed.scales is not None else 0
    kern.args.launch(kern.fn, (-(-tiles * groups // kern.warps), 1, 1), (32 * kern.warps, 1, 1), current_stream(idx),
                     (packed.weights.data_ptr(), scales, packed.col_scale.data_ptr(), lay.n, lay.k, int(lay.silu),
                      tiles, out.data_ptr()))
    return out


# --------------------------------------------------------------------------- the copies kept


# "auto": keep a copy only while this much of the GPU's memory stays free: a tenth, at least 4 GiB (on the
# H200 the whole Qwen3.8-27B TP1 set is kept beside the decode-bench's B8 state; on a 32 GB V100 the
# copies stop 4 GiB short of full)
AUTO_RESERVE, AUTO_RESERVE_MIN = 0.1, 4 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_budget(value: int | str | None) -> int | str | None:
    """A ``dequant_cache`` budget: ``"auto"``, ``None`` / ``"all"`` (no limit), or bytes (an int, or a
    string such as ``"0"``, ``"512MiB"``, ``"12G"``)."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        if isinstance(value, int) and value < 0:
            raise ValueError(f"dequant_cache must be >= 0 bytes, got {value}")
        return value
    text = str(value).strip().lower()
    if text in ("auto", "all"):
        return None if text == "all" else "auto"
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", text)
    if m is None:
        raise ValueError(f"dequant_cache must be 'auto', 'all' or a size such as 0, 512MiB, 12G; got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


class DequantCache:
    """The dequantize + cuBLAS path's weight copies (``dtype``, ``[N, K]``), kept within a budget.

    ``budget`` (:func:`parse_budget`; None here: ``$DFLASHGEN_DEQUANT_CACHE``, else ``"auto"``):
    ``"auto"`` keeps a copy while the GPU keeps :data:`AUTO_RESERVE` of its memory (at least
    :data:`AUTO_RESERVE_MIN` bytes) free as the driver counts it (off the GPU: always); ``"all"``
    every copy (2 bytes per weight: an FP16 model beside the quantized one); a byte count at most
    that many bytes; ``0`` none (a copy is made per call: the GEMM of a prefill then reads ~4x its
    weight bytes in FP16, written just before). First come, first kept; nothing is evicted, since a
    prefill walks every layer in turn and an LRU would miss on every call. A copy goes when its
    packed weight is garbage-collected. Kept or not, a copy has the same bits, so the budget changes
    speed and memory, never results. None is taken during CUDA graph capture (its memory would
    belong to the graph's pool)."""

    def __init__(self, budget: int | str | None = None) -> None:
        self.budget = parse_budget(os.environ.get("DFLASHGEN_DEQUANT_CACHE", "auto") if budget is None else budget)
        self.bytes = 0
        self._copies: dict[tuple[int, torch.dtype], Tensor] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def weight(self, packed: PackedWeight, dtype: torch.dtype) -> Tensor:
        """``dequantize(packed, dtype)``: the kept copy, or a new one (kept if the budget allows)."""
        key = (id(packed.weights), dtype)
        w = self._copies.get(key)
        if w is None:
            w = dequantize(packed, dtype)
            if self._admit(w):
                self._copies[key] = w
                self.bytes += w.numel() * w.element_size()
                weakref.finalize(packed.weights, self._drop, key)
        return w

    def _admit(self, w: Tensor) -> bool:
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        if self.budget == "auto":
            if not w.is_cuda:
                return True
            free, total = torch.cuda.mem_get_info(w.device)  # w is allocated: counted as used
            return free >= max(AUTO_RESERVE * total, AUTO_RESERVE_MIN)
        return self.budget is None or self.bytes + w.numel() * w.element_size() <= int(self.budget)

    def _drop(self, key: tuple[int, torch.dtype]) -> None:
        w = self._copies.pop(key, None)
        if w is not None:
            self.bytes -= w.numel() * w.element_size()

    def clear(self) -> None:
        """Drop every kept copy."""
        self._copies.clear()
        self.bytes = 0
