"""Load built kernels and launch them with full input validation.

``GemmKernel`` is one generated kernel (one tile schedule); calling it with an FP16 activation and
a ``PackedWeight`` returns y = x W^T (or SiLU(gate) * up for the fused variant). Every launch goes
on torch's current stream, so it is safe under CUDA graph capture.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import Any

import torch

from dflashgen.prepack import Layout, PackedWeight, family

from .driver import ArgPack, Function, Module, current_stream, ensure_context


class KernelInputError(ValueError):
    """An argument does not fit the kernel (dtype, device, shape, alignment, layout, M)."""


def _fail(msg: str) -> None:
    raise KernelInputError(msg)


class GemmKernel:
    def __init__(self, entry: dict[str, Any], image_path: Path, max_m: int, device: torch.device) -> None:
        self.entry = entry
        self.name: str = entry["name"]
        self.arch: int = entry["arch"]
        self.n, self.k, self.n_out, self.n_pad = entry["n"], entry["k"], entry["n_out"], entry["n_pad"]
        self.silu = entry["epilogue"] == "silu"
        self.fmt: str = entry["format"]
        self.rows: int = entry["tile"]["rows"]
        self.split_k: int = entry["kplan"]["split_k"]
        self.threads: int = entry["threads"]
        self.max_m = max_m
        self.layout = Layout(self.arch, self.fmt, self.n, self.k, self.silu)
        tiles = self.n_pad // self.layout.tile_rows
        per_cta = entry["tile"]["warp_nt"] * entry["tile"]["warps_n"]
        self._grid_y = -(-tiles // per_cta)
        self.device = torch.device(device.type, device.index if device.index is not None else 0)
        self.image_path = image_path
        self._fns: tuple[Function, Function | None] | None = None
        self._last_weight: tuple[weakref.ref[torch.Tensor] | None, ...] | None = None
        self._dev_index = self.device.index
        # x, M, weights, scales, col_scale, out, workspace | workspace, M, col_scale, out
        self._main_args = ArgPack([ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 5])
        self._reduce_args = ArgPack([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p])
        self._workspaces: dict[int, torch.Tensor] = {}

    def _functions(self) -> tuple[Function, Function | None]:
        if self._fns is None:  # loaded on first launch, so validation needs no GPU
            ensure_context(self.device.index or 0)
            self.module = Module(self.image_path.read_bytes(), str(self.image_path))
            reduce_fn = self.module.function(self.name + "_reduce") if self.split_k > 1 else None
            self._fns = (self.module.function(self.name), reduce_fn)
        return self._fns

    def validate(self, x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None) -> int:
        if not isinstance(x, torch.Tensor):
            _fail(f"{self.name}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float16:
            _fail(f"{self.name}: x must be float16, got {x.dtype}")
        if x.device.type != "cuda":
            _fail(f"{self.name}: x must be a CUDA tensor, got device {x.device}")
        if x.device != self.device:
            _fail(f"{self.name}: x is on {x.device}, kernel loaded on {self.device}")
        if x.dim() != 2:
            _fail(f"{self.name}: x must be 2-D [M, K], got shape {tuple(x.shape)}")
        m, k = x.shape
        if k != self.k:
            _fail(f"{self.name}: x has K={k}, kernel is built for K={self.k}")
        if not x.is_contiguous():
            _fail(f"{self.name}: x must be contiguous (strides {x.stride()})")
        if x.data_ptr() % 16:
            _fail(f"{self.name}: x must be 16-byte aligned (address {x.data_ptr():#x})")
        if m < 1 or m > self.max_m:
            _fail(f"{self.name}: M={m} outside the supported range 1..{self.max_m}")
        if not isinstance(w, PackedWeight):
            _fail(f"{self.name}: weight must be a PackedWeight from dflashgen.prepack, got {type(w).__name__}")
        if not self._weight_seen(w):
            self._validate_weight(w)
            self._last_weight = tuple(None if t is None else weakref.ref(t)
                                      for t in (w.weights, w.scales, w.col_scale))
        if out is not None and (out.dtype != torch.float16 or tuple(out.shape) != (m, self.n_out)
                                or not out.is_contiguous() or out.device != self.device):
            _fail(f"{self.name}: out must be a contiguous float16 [{m}, {self.n_out}] tensor "
                  f"on {self.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        return m

    def _weight_seen(self, w: PackedWeight) -> bool:
        last = self._last_weight
        if last is None or not isinstance(w, PackedWeight):
            return False
        rw, rs, rc = last
        return (rw() is w.weights and rc() is w.col_scale  # type: ignore[misc]
                and (w.scales is None if rs is None else rs() is w.scales))

    def _validate_weight(self, w: PackedWeight) -> None:
        # Checked once per weight: a projection passes the same buffers on every call, and these
        # checks are most of the host cost (the buffers' identity is remembered through weakrefs).
        if w.layout != self.layout:
            _fail(f"{self.name}: weight is packed for {w.layout}, kernel needs {self.layout}")
        tensors = [("weights", w.weights), ("col_scale", w.col_scale)]
        if self.fmt == "nvfp4":
            if w.scales is None:
                _fail(f"{self.name}: NVFP4 weight is missing its block scales")
            tensors.append(("scales", w.scales))
        for label, t in tensors:
            if t.device != self.device or not t.is_contiguous():
                _fail(f"{self.name}: weight {label} must be contiguous on {self.device}, got {t.device}")
        if w.weights.data_ptr() % 16 or (w.scales is not None and w.scales.data_ptr() % 4):
            _fail(f"{self.name}: packed weight buffers must be 16-byte aligned")
        if w.col_scale.dtype != torch.float32 or w.col_scale.numel() != self.n:
            _fail(f"{self.name}: col_scale must be float32 [{self.n}]")

    def _quick_ok(self, x: torch.Tensor, out: torch.Tensor | None) -> bool:
        """The common case in one expression (the full ``validate`` explains any failure)."""
        ok = (type(x) is torch.Tensor and x.dtype is torch.float16 and x.is_cuda
              and x.get_device() == self._dev_index and x.dim() == 2 and x.shape[1] == self.k
              and 1 <= x.shape[0] <= self.max_m and x.is_contiguous() and x.data_ptr() % 16 == 0)
        return ok and (out is None or (type(out) is torch.Tensor and out.dtype is torch.float16
                                       and out.shape == (x.shape[0], self.n_out) and out.is_contiguous()
                                       and out.is_cuda and out.get_device() == self._dev_index))

    def _workspace(self, stream: int) -> torch.Tensor:
        """Split-K partials, one buffer per stream sized for max M (launches on one stream are
        ordered, so reuse is safe; a graph captured on a stream keeps that stream's buffer)."""
        ws = self._workspaces.get(stream)
        if ws is None:
            ws = torch.empty((self.split_k * min(self.max_m, 64) * self.n_pad,), dtype=torch.float32,
                             device=self.device)
            self._workspaces[stream] = ws
        return ws

    def __call__(self, x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._quick_ok(x, out):
            m = x.shape[0]
            if not self._weight_seen(w):
                self.validate(x, w, out)
        else:
            m = self.validate(x, w, out)
        fn, reduce_fn = self._functions()
        if out is None:
            out = x.new_empty((m, self.n_out))
        stream = current_stream(self._dev_index)
        ws = 0
        if self.split_k > 1:
            ws = (self._workspace(stream) if m <= 64 else
                  torch.empty((self.split_k * m * self.n_pad,), dtype=torch.float32, device=x.device)).data_ptr()
        grid = (-(-m // self.rows), self._grid_y, self.split_k)  # row blocks fastest: weights hit L2
        a = self._main_args
        with a.lock:
            v = a.values
            v[0].value, v[1].value, v[2].value = x.data_ptr(), m, w.weights.data_ptr()
            v[3].value = 0 if w.scales is None else w.scales.data_ptr()
            v[4].value, v[5].value, v[6].value = w.col_scale.data_ptr(), out.data_ptr(), ws
            fn.launch_pack(grid, (self.threads, 1, 1), a, stream)
        if reduce_fn is not None:
            r = self._reduce_args
            with r.lock:
                v = r.values
                v[0].value, v[1].value, v[2].value, v[3].value = ws, m, w.col_scale.data_ptr(), out.data_ptr()
                reduce_fn.launch_pack((-(-(m * self.n_out) // 256), 1, 1), (256, 1, 1), r, stream)
        return out


def native_arch(device: torch.device | None = None) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    arch = 10 * major + minor
    family(arch)  # raises for an unsupported GPU
    return arch
