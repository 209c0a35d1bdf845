"""Load built kernels and launch them with full input validation.

``GemmKernel`` is one generated kernel (one tile schedule); calling it with an FP16 activation and
a ``PackedWeight`` returns y = x W^T (or SiLU(gate) * up for the fused variant). Every launch goes
on torch's current stream, so it is safe under CUDA graph capture.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from dflashgen.prepack import Layout, PackedWeight, family

from .driver import ArgPack, Function, LaunchArgs, Module, ensure_context, stream_getter

_F16 = torch.float16


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
        self.device = torch.device("cuda", device.index or 0) if device.type == "cuda" else device
        self.image_path = image_path
        self._fns: tuple[Function, Function | None] | None = None
        self._last_weight: tuple[weakref.ref[torch.Tensor] | None, ...] | None = None
        # what x.get_device() reports for a tensor on the kernel's device (-1: CPU, for fakes in tests)
        self._dev_index: int = self.device.index if self.device.type == "cuda" else -1
        self._workspaces: dict[int, torch.Tensor] = {}
        self._generic: GemmLaunch | None = None  # the launch __call__ rebinds to each call's weight

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
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.dtype != torch.float16 or tuple(out.shape) != (m, self.n_out) \
                    or not out.is_contiguous() or out.device != self.device:
                _fail(f"{self.name}: out must be a contiguous float16 [{m}, {self.n_out}] tensor on {self.device}, "
                      f"got {getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))} "
                      f"on {getattr(out, 'device', '?')}")
            if overlaps(x.data_ptr(), 2 * x.numel(), out.data_ptr(), 2 * out.numel()):
                _fail(f"{self.name}: out overlaps x (the kernel reads x while it writes out)")
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
                                       and out.is_cuda and out.get_device() == self._dev_index
                                       and not overlaps(x.data_ptr(), 2 * x.numel(), out.data_ptr(),
                                                        2 * out.numel())))

    def _workspace(self, stream: int) -> torch.Tensor:
        """Split-K partials, one buffer per stream sized for max M (launches on one stream are
        ordered, so reuse is safe; a graph captured on a stream keeps that stream's buffer)."""
        ws = self._workspaces.get(stream)
        if ws is None:
            ws = torch.empty((self.split_k * min(self.max_m, 64) * self.n_pad,), dtype=torch.float32,
                             device=self.device)
            self._workspaces[stream] = ws
        return ws

    def prepare(self, w: PackedWeight, m: int) -> GemmLaunch:
        """A launch bound to weight ``w`` and M rows, validated here once: calling it with a
        fitting x writes two pointers and launches (``GemmLaunch.__call__``)."""
        if not isinstance(w, PackedWeight):
            _fail(f"{self.name}: weight must be a PackedWeight from dflashgen.prepack, got {type(w).__name__}")
        if m < 1 or m > self.max_m:
            _fail(f"{self.name}: M={m} outside the supported range 1..{self.max_m}")
        self._validate_weight(w)
        launch = GemmLaunch(self)
        launch.bind(w, m)
        return launch

    def __call__(self, x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._quick_ok(x, out):
            m = x.shape[0]
            if not self._weight_seen(w):
                self.validate(x, w, out)
        else:
            m = self.validate(x, w, out)
        if out is None:
            out = x.new_empty((m, self.n_out))
        g = self._generic
        if g is None:
            g = self._generic = GemmLaunch(self)
        with g.lock:
            g.bind(w, m)
            g.launch(x.data_ptr(), out.data_ptr(), g.get_stream(self._dev_index))
        return out


class GemmLaunch:
    """One GemmKernel launch (plus its split-K reduce) with every argument in persistent ctypes
    storage. ``bind`` writes the weight's pointers, M and the grid; ``launch`` writes x, out, the
    stream and its split-K workspace, and launches. A launch bound once and kept (``GemmKernel.prepare``;
    QuantLinear keeps one per input shape) costs two pointer writes per call. Fill and launch under ``lock``:
    threads sharing a launch would otherwise interleave their pointers (a thread switch can come
    between the writes and the driver call)."""

    def __init__(self, kern: GemmKernel) -> None:
        fn, reduce_fn = kern._functions()
        self.kern = kern
        self.lock = threading.Lock()
        self.get_stream = stream_getter()
        # calls through __call__, for KernelLibrary.path_counts (a cell: the count outlives the launch)
        self.calls = [0]
        self.count_key: tuple[str, int, str] | None = None
        self.m = 0
        self._x_bytes = self._y_bytes = 0
        self._dev = kern._dev_index
        self._stream = -1  # the stream the workspace pointers were written for
        # x, M, weights, scales, col_scale, out, workspace | workspace, M, col_scale, out
        self._main = LaunchArgs(fn, (1, kern._grid_y, kern.split_k), (kern.threads, 1, 1),
                                ArgPack([ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 5]))
        self._reduce = None if reduce_fn is None else LaunchArgs(
            reduce_fn, (1, 1, 1), (256, 1, 1),
            ArgPack([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]))

    def bind(self, w: PackedWeight, m: int) -> None:
        """Point the launch at a validated weight and M rows (caller holds ``lock``)."""
        kern, red = self.kern, self._reduce
        v = self._main.pack.values
        v[1].value, v[2].value = m, w.weights.data_ptr()
        v[3].value = 0 if w.scales is None else w.scales.data_ptr()
        v[4].value = w.col_scale.data_ptr()
        self._main.grid[0].value = -(-m // kern.rows)  # row blocks fastest: weights hit L2
        if red is not None:
            r = red.pack.values
            r[1].value, r[2].value = m, w.col_scale.data_ptr()
            red.grid[0].value = -(-(m * kern.n_out) // 256)
            if m > 64:
                self._stream = -1  # above 64 rows each call gets its own workspace
        self.m = m
        self._x_bytes, self._y_bytes = 2 * m * kern.k, 2 * m * kern.n_out  # FP16 x [M, K], y [M, N_out]

    def launch(self, x_ptr: int, out_ptr: int, stream: int) -> None:
        """Launch on ``stream`` for x and out at these addresses (caller holds ``lock``)."""
        main, red = self._main, self._reduce
        v = main.pack.values
        v[0].value, v[5].value = x_ptr, out_ptr
        ws = None
        if stream != self._stream:  # the split-K workspace is per stream (graphs keep their own)
            main.stream.value = stream
            if red is not None:
                red.stream.value = stream
                ws = self._workspace(stream)
                v[6].value = red.pack.values[0].value = ws.data_ptr()
            self._stream = stream if red is None or self.m <= 64 else -1
        main.launch()
        if red is not None:
            red.pack.values[3].value = out_ptr
            red.launch()
        del ws  # a per-call workspace (M > 64) is freed once both launches are queued on the stream

    def _workspace(self, stream: int) -> torch.Tensor:
        kern = self.kern
        if self.m <= 64:
            return kern._workspace(stream)
        return torch.empty((kern.split_k * self.m * kern.n_pad,), dtype=torch.float32, device=kern.device)

    def __call__(self, x: torch.Tensor, out_shape: tuple[int, ...], out: torch.Tensor | None = None,
                 ) -> torch.Tensor | None:
        """y of shape ``out_shape`` (M x N_out elements) = the kernel on x, a torch.Tensor of
        M x K elements whose shape the caller has checked ([..., K] with M rows in all), written
        into ``out`` when given (no allocation), or None when x or out does not fit in some other
        way (dtype, device, layout, alignment, overlap) or another thread holds the launch: then
        the caller takes the validated path, which says what is wrong."""
        if (x.dtype is not _F16 or x.get_device() != self._dev or not x.is_contiguous()
                or (xp := x.data_ptr()) % 16):
            return None
        if out is None:
            out = x.new_empty(out_shape)
            op = out.data_ptr()
        elif (type(out) is not torch.Tensor or out.dtype is not _F16 or out.shape != out_shape
              or not out.is_contiguous() or out.get_device() != self._dev
              or overlaps(xp, self._x_bytes, op := out.data_ptr(), self._y_bytes)):
            return None
        if not self.lock.acquire(False):
            return None
        try:
            self.launch(xp, op, self.get_stream(self._dev))
            self.calls[0] += 1
        finally:
            self.lock.release()
        return out


def overlaps(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    """Whether the byte ranges [a, a + a_bytes) and [b, b + b_bytes) intersect."""
    return a < b + b_bytes and b < a + a_bytes


def native_arch(device: torch.device | None = None) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    arch = 10 * major + minor
    family(arch)  # raises for an unsupported GPU
    return arch
