"""Load built kernels and launch them with full input validation.

``GemmKernel`` is one generated kernel (one tile schedule); calling it with an FP16 activation and
a ``PackedWeight`` returns y = x W^T (or SiLU(gate) * up for the fused variant). Every launch goes
on torch's current stream, so it is safe under CUDA graph capture.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from dflashgen.prepack import Layout, PackedWeight, family

from .driver import ArgPack, Function, LaunchArgs, Module, ensure_context, pdl_enabled, stream_getter

_F16 = torch.float16


class KernelInputError(ValueError):
    """An argument does not fit the kernel (dtype, device, shape, alignment, layout, M)."""


def _fail(msg: str) -> None:
    raise KernelInputError(msg)


# DFLASHGEN_L2_PREFETCH (sm_90): how many K groups of each weight stream a warp asks L2 for before
# waiting on the previous kernel (programmatic dependent launch), so they move under its tail.
# Unset: the measured default below; "0": off; "1": whole streams of weights up to this many bytes;
# an integer > 1: the first that many groups of every kernel's streams.
L2_PREFETCH_MAX_BYTES = 24 << 20
# The launch's last argument packs the prefetch depth (bits 0-15) with LAUNCH_PDL_EARLY (skinny_gemm.cuh):
# DFLASHGEN_PDL_TRIGGER=early has sm_90 mma.sync GEMMs release the next launch right after their own
# griddepcontrol.wait instead of after their main loop ("end", the default); timing only, never bits.
LAUNCH_PREFETCH_MASK, LAUNCH_PDL_EARLY = 0xFFFF, 1 << 16


def pdl_trigger_early() -> bool:
    raw = os.environ.get("DFLASHGEN_PDL_TRIGGER", "end").strip() or "end"
    if raw not in ("end", "early"):
        raise ValueError(f"DFLASHGEN_PDL_TRIGGER must be 'end' or 'early', got {raw!r}")
    return raw == "early"


# The default (bench/h200-2026-12-01-s20, call3 + call5: every served M <= 16 kernel at 0 / 2 / 3 / 4 /
# 6 / 8 / 16 groups): channel-FP8 kernels of <= 16 rows gain 2-6% from about a quarter of each K
# worker's stream, up to 6 groups, and lose when the stream is short (n4120 at 5 groups per worker,
# k1536 at 6: +3-6%), so nothing below 8; every NVFP4 kernel lost (+2-10% at 4 groups) and stays off.
# Launches of more than L2_PREFETCH_DEFAULT_MAX_M rows go without it (call7: the same kernels serving
# M = 24-48 with several row blocks were up to 6% slower with it). A tuning table may name a depth per
# bucket (`prefetch_groups`, raced by `dflashgen tune`); the variable, when set, overrides both.
L2_PREFETCH_MIN_GROUPS, L2_PREFETCH_SHARE, L2_PREFETCH_CAP, L2_PREFETCH_DEFAULT_MAX_M = 8, 4, 6, 16


def _l2_prefetch_env() -> str:
    return os.environ.get("DFLASHGEN_L2_PREFETCH", "").strip()


def l2_prefetch_groups(arch: int, fmt: str, n_pad: int, k: int, groups_per_worker: int | None = None,
                       rows: int | None = None) -> int:
    """The ``prefetch_groups`` argument of an sm_90 GEMM launch (0: no prefetch); results never
    depend on it (a cache hint), only timing. ``groups_per_worker`` / ``rows``: the kernel's K
    groups per K worker and row tile (the default needs them; without them it is off)."""
    raw = _l2_prefetch_env()
    if raw == "":
        if arch < 90 or fmt != "fp8_channel" or groups_per_worker is None or rows is None or rows > 16:
            return 0
        if groups_per_worker < L2_PREFETCH_MIN_GROUPS:
            return 0
        return min(L2_PREFETCH_CAP, groups_per_worker // L2_PREFETCH_SHARE)
    try:
        v = int(raw)
    except ValueError as e:
        raise ValueError(f"DFLASHGEN_L2_PREFETCH must be an integer >= 0, got {raw!r}") from e
    if v < 0:
        raise ValueError(f"DFLASHGEN_L2_PREFETCH must be an integer >= 0, got {raw!r}")
    if arch < 90 or v == 0:
        return 0
    if v > 1:
        return v
    weight_bytes = n_pad * k * (9 / 16 if fmt == "nvfp4" else 1)  # NVFP4: codes + one E4M3 per 16
    return 1 << 30 if weight_bytes <= L2_PREFETCH_MAX_BYTES else 0  # the kernel clamps to its range


class GemmKernel:
    def __init__(self, entry: dict[str, Any], image_path: Path, max_m: int, device: torch.device) -> None:
        self.entry = entry
        self.name: str = entry["name"]
        self.arch: int = entry["arch"]
        self.n, self.k, self.n_out, self.n_pad = entry["n"], entry["k"], entry["n_out"], entry["n_pad"]
        self.silu = entry["epilogue"] == "silu"
        self.fmt: str = entry["format"]
        self.rows: int = entry["tile"]["rows"]
        self.warps_n: int = entry["tile"]["warps_n"]
        # CTAs along K (grid z, partial slots): the plan's split_k, or split_k x warps_k for a wsplit
        # tile (one CTA per K worker, skinny_gemm.cuh WSPLIT)
        self.split_k: int = entry.get("ctas_k", entry["kplan"]["split_k"])
        self.threads: int = entry["threads"]
        # bytes of dynamic shared memory per CTA (x_smem rings above 48 KB), 0: static only
        self.dynamic_smem: int = entry["smem_bytes"] if entry.get("smem_dynamic") else 0
        # programmatic dependent launch: sm_90 GEMMs wait (griddepcontrol.wait) before touching
        # anything but their weights, so each may start while the previous kernel finishes and
        # prefetch its weight stream under that kernel's tail; DFLASHGEN_PDL=0 launches plainly
        self.pdl: bool = pdl_enabled(self.arch)
        kp = entry["kplan"]
        workers = kp["split_k"] * kp["warps_k"]
        self.prefetch_groups = l2_prefetch_groups(self.arch, self.fmt, self.n_pad, self.k,
                                                  -(-self.k // kp["k_group"] // workers), self.rows)
        # DFLASHGEN_L2_PREFETCH set: it decides every launch's depth (the tuner then races none)
        self.prefetch_from_env = _l2_prefetch_env() != ""
        self.pdl_early = self.pdl and pdl_trigger_early()
        self.max_m = max_m
        self.layout = Layout(self.arch, self.fmt, self.n, self.k, self.silu)
        tiles = self.n_pad // self.layout.tile_rows
        per_cta = entry["tile"]["warp_nt"] * entry["tile"]["warps_n"]
        # (a persist tile: its CTA count, and grid z 1 beside its partial slots)
        self._grid_y: int = entry.get("grid_y", -(-tiles // per_cta))
        self._grid_z: int = entry.get("grid_z", self.split_k)
        self.device = torch.device("cuda", device.index or 0) if device.type == "cuda" else device
        self.image_path = image_path
        self._fn: Function | None = None
        self._last_weight: tuple[weakref.ref[torch.Tensor] | None, ...] | None = None
        # what x.get_device() reports for a tensor on the kernel's device (-1: CPU, for fakes in tests)
        self._dev_index: int = self.device.index if self.device.type == "cuda" else -1
        # split-K scratch per stream: (FP32 partials, int32 tickets), and one such pair (tickets
        # zeroed) made ahead, outside capture, for a stream first seen under CUDA graph capture
        self._workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._spare: tuple[torch.Tensor, torch.Tensor] | None = None
        self._generic: GemmLaunch | None = None  # the launch __call__ rebinds to each call's weight

    def prefetch_for(self, m: int, tuned: int | None = None) -> int:
        """The ``prefetch_groups`` argument of a launch of M rows: DFLASHGEN_L2_PREFETCH when set,
        else the table's tuned depth for the bucket, else the default rule (<= 16 rows only)."""
        if self.arch < 90:
            return 0
        if self.prefetch_from_env:
            return self.prefetch_groups
        if tuned is not None:
            return tuned
        return self.prefetch_groups if m <= L2_PREFETCH_DEFAULT_MAX_M else 0

    def _function(self) -> Function:
        if self._fn is None:  # loaded on first launch, so validation needs no GPU
            ensure_context(self.device.index or 0)
            self.module = Module(self.image_path.read_bytes(), str(self.image_path))
            fn = self.module.function(self.name)
            if self.dynamic_smem:
                fn.allow_dynamic_smem(self.dynamic_smem)
            self._fn = fn
        return self._fn

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

    def _tickets(self, m: int) -> torch.Tensor:
        """Zeroed split-K ticket counters for launches of up to m rows, one int32 per (row block, N
        tile, warp along N): the SPLIT_K warps holding the same outputs (one per CTA along z) each
        take a ticket and the one that draws the last sums the partials. That ticket also wraps the
        counter back to 0 (atomicInc), so every launch leaves its counters zeroed: a buffer zeroed
        once serves every later launch on its stream and every replay of a graph that captured it."""
        return torch.zeros((-(-m // self.rows) * self._grid_y * self.warps_n,), dtype=torch.int32,
                           device=self.device)

    def _capturing(self) -> bool:
        if self.device.type != "cuda":
            return False
        with torch.cuda.device(self.device):
            return torch.cuda.is_current_stream_capturing()

    def _workspace(self, stream: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Split-K scratch for a launch of m rows on ``stream`` (torch's current stream): FP32
        partials ``[split_k, m, n_pad]`` and the ticket counters. Up to 64 rows: one pair per
        stream, sized for 64 rows and kept. Launches on one stream run one after another and each
        leaves its counters at 0, so the next launch (or a replay of a graph captured on that
        stream) finds them zeroed; two streams get two pairs, so their launches may overlap. Graphs
        captured on one stream share its pair: replay them one at a time (DecodeGraphs does), not
        concurrently on several streams. Above 64 rows every call gets its own pair, the counters
        zeroed on the stream before the launch (under capture that memset is part of the graph)."""
        if m > 64:
            ws = (torch.empty((self.split_k * m * self.n_pad,), dtype=torch.float32, device=self.device),
                  self._tickets(m))
        elif (ws := self._workspaces.get(stream)) is None:
            if not self._capturing():
                ws = self._pair()
            elif self._spare is not None:
                # Nothing is allocated under capture: a memset captured here would zero the counters
                # only when this graph replays (not before an eager launch or another graph captured
                # on this stream), and a buffer from the graph's private pool would outlive the graph
                # here, so freeing it later could release that pool, a cudaFree, during another
                # capture. The spare was made by an earlier launch outside capture (torch.cuda.graph
                # synchronizes the device before capturing, so its counters are zero).
                ws, self._spare = self._spare, None
            else:
                raise RuntimeError(f"{self.name}: first split-K launch on a stream inside CUDA graph capture, "
                                   "and no zeroed ticket counters at hand: launch the kernel once outside "
                                   "capture first (a warm-up)")
            self._workspaces[stream] = ws
        if self._spare is None and not self._capturing():
            self._spare = self._pair()
        return ws

    def _pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A workspace for launches of up to min(max M, 64) rows: FP32 partials and zeroed tickets."""
        rows = min(self.max_m, 64)
        return (torch.empty((self.split_k * rows * self.n_pad,), dtype=torch.float32, device=self.device),
                self._tickets(rows))

    def prepare(self, w: PackedWeight, m: int, prefetch: int | None = None) -> GemmLaunch:
        """A launch bound to weight ``w`` and M rows, validated here once: calling it with a
        fitting x writes two pointers and launches (``GemmLaunch.__call__``)."""
        if not isinstance(w, PackedWeight):
            _fail(f"{self.name}: weight must be a PackedWeight from dflashgen.prepack, got {type(w).__name__}")
        if m < 1 or m > self.max_m:
            _fail(f"{self.name}: M={m} outside the supported range 1..{self.max_m}")
        self._validate_weight(w)
        launch = GemmLaunch(self)
        launch.bind(w, m, prefetch)
        return launch

    def __call__(self, x: torch.Tensor, w: PackedWeight, out: torch.Tensor | None = None,
                 prefetch: int | None = None) -> torch.Tensor:
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
            # a weak back-reference: no kernel <-> launch cycle, so a kernel (and the split-K
            # workspaces it holds) is freed when its last user lets go, not whenever the cyclic GC
            # runs (possibly inside another stream's CUDA graph capture, where a free is an error)
            g = self._generic = GemmLaunch(weakref.proxy(self))
        with g.lock:
            g.bind(w, m, prefetch)
            g.launch(x.data_ptr(), out.data_ptr(), g.get_stream(self._dev_index))
        return out


class GemmLaunch:
    """One GemmKernel launch with every argument in persistent ctypes storage. ``bind`` writes the
    weight's pointers, M and the grid; ``launch`` writes x, out, the stream and its split-K
    workspace, and launches. A split-K kernel reduces its partials itself (the last warp to
    finish each warp tile sums them in split order), so every call is one launch. A launch bound once and
    kept (``GemmKernel.prepare``; QuantLinear keeps one per input shape) costs two pointer writes
    per call. Fill and launch under ``lock``: threads sharing a launch would otherwise interleave
    their pointers (a thread switch can come between the writes and the driver call)."""

    def __init__(self, kern: GemmKernel) -> None:
        fn = kern._function()
        self.kern = kern
        self.lock = threading.Lock()
        self.get_stream = stream_getter()
        # calls through __call__, for KernelLibrary.path_counts (a cell: the count outlives the launch)
        self.calls = [0]
        self.count_key: tuple[str, int, str] | None = None
        self.m = 0
        self._x_bytes = self._y_bytes = 0
        self._dev = kern._dev_index
        self._split = kern.split_k > 1
        self._stream = -1  # the stream the workspace pointers were written for
        # x, M, weights, scales, col_scale, out, partials (unused without split-K) [, tickets],
        # L2 prefetch groups
        params = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * (6 if self._split else 5), ctypes.c_int]
        self._main = LaunchArgs(fn, (1, kern._grid_y, kern._grid_z), (kern.threads, 1, 1), ArgPack(params),
                                shared=kern.dynamic_smem, pdl=kern.pdl)

    def bind(self, w: PackedWeight, m: int, prefetch: int | None = None) -> None:
        """Point the launch at a validated weight and M rows (caller holds ``lock``); ``prefetch``:
        the table's tuned L2 prefetch depth for this M's bucket (``GemmKernel.prefetch_for``)."""
        v = self._main.pack.values
        v[1].value, v[2].value = m, w.weights.data_ptr()
        v[3].value = 0 if w.scales is None else w.scales.data_ptr()
        v[4].value = w.col_scale.data_ptr()
        pf = min(self.kern.prefetch_for(m, prefetch), LAUNCH_PREFETCH_MASK)
        v[-1].value = pf | (LAUNCH_PDL_EARLY if self.kern.pdl_early else 0)
        self._main.grid[0].value = -(-m // self.kern.rows)  # row blocks fastest: weights hit L2
        if self._split and m > 64:
            self._stream = -1  # above 64 rows each call gets its own workspace
        self.m = m
        self._x_bytes, self._y_bytes = 2 * m * self.kern.k, 2 * m * self.kern.n_out  # FP16 x [M, K], y [M, N_out]

    def launch(self, x_ptr: int, out_ptr: int, stream: int) -> None:
        """Launch on ``stream`` (torch's current stream) for x and out at these addresses (caller
        holds ``lock``)."""
        main = self._main
        v = main.pack.values
        v[0].value, v[5].value = x_ptr, out_ptr
        ws = None
        if stream != self._stream:  # the split-K workspace is per stream (graphs keep their own)
            main.stream.value = stream
            if self._split:
                ws = self.kern._workspace(stream, self.m)
                v[6].value, v[7].value = ws[0].data_ptr(), ws[1].data_ptr()
            self._stream = stream if not self._split or self.m <= 64 else -1
        main.launch()
        del ws  # a per-call workspace (M > 64) is freed once the launch is queued on the stream

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
