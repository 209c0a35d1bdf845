"""CUDA driver API access through cuda-python: load cubin/PTX images and launch kernels on torch's
current stream. No torch C++ extension, so no dependency on torch's C++ ABI.

Hot launches (every projection call) skip cuda-python's argument marshalling: ``ArgPack`` keeps a
kernel's parameters in persistent ctypes storage updated in place, and ``Function.launch_pack``
calls libcuda's cuLaunchKernel through ctypes (the same driver, microseconds cheaper per call).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


@lru_cache(maxsize=1)
def cu() -> Any:
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python
        except ImportError as e:
            raise DriverError("cuda-python is required to load kernels: pip install 'dflashgen[gpu]'") from e
    return driver


def check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, msg = cu().cuGetErrorString(err)
        raise DriverError(f"{what} failed: {msg.decode() if msg else int(err)}")
    return rest[0] if len(rest) == 1 else rest


def ensure_context(device_index: int) -> None:
    """Make torch's primary context current on this thread (torch creates it lazily)."""
    import torch

    torch.cuda.init()
    with torch.cuda.device(device_index):
        torch.cuda.current_stream().synchronize()  # forces context creation
        ctx = check(cu().cuCtxGetCurrent(), "cuCtxGetCurrent")
        if not int(ctx):
            dev = check(cu().cuDeviceGet(device_index), "cuDeviceGet")
            ctx = check(cu().cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            check(cu().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Module:
    """A loaded cubin or PTX image (PTX is JIT-compiled by the driver for the GPU at hand)."""

    def __init__(self, image: bytes, label: str) -> None:
        self.label = label
        if not image.endswith(b"\0") and image.lstrip().startswith((b"//", b".version")):
            image += b"\0"  # PTX must be NUL-terminated
        self._image = image
        try:
            self.handle = check(cu().cuModuleLoadData(image), f"loading {label}")
        except DriverError as e:
            raise DriverError(f"{e} (image from {label})") from e

    def function(self, name: str) -> Function:
        return Function(check(cu().cuModuleGetFunction(self.handle, name.encode()), f"finding {name} in {self.label}"),
                        name)

    def __del__(self) -> None:
        h = getattr(self, "handle", None)
        if h is not None:
            with contextlib.suppress(Exception):  # interpreter shutdown may have torn down the driver
                cu().cuModuleUnload(h)


def ptr_arg(t: Any) -> ctypes.c_void_p:
    """A kernel pointer argument: a tensor's device address, or NULL for None."""
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


@lru_cache(maxsize=1)
def stream_getter() -> Callable[[int], int]:
    """index -> the raw handle of torch's current stream on that device: torch's own fast accessor
    where it exists (building a torch.cuda.Stream object costs microseconds on every launch)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else lambda index: torch.cuda.current_stream(index).cuda_stream


def current_stream(index: int) -> int:
    """The raw handle of torch's current stream on device ``index``."""
    return int(stream_getter()(index))


@lru_cache(maxsize=1)
def _raw_launch() -> Any:
    """libcuda's cuLaunchKernel via ctypes, or None (then cuda-python launches). PyDLL keeps the GIL
    held across the call, so nothing in Python runs between filling an ArgPack and the launch
    reading it."""
    try:
        fn = ctypes.PyDLL("libcuda.so.1").cuLaunchKernel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@lru_cache(maxsize=1)
def _untyped_launch() -> Any:
    """cuLaunchKernel through ctypes without argtypes, for ``LaunchArgs``: every argument is passed
    as an existing ctypes object, so ctypes converts nothing (per-call conversion of 11 Python ints
    through argtypes is about half of ctypes' cost of a launch)."""
    try:
        fn = ctypes.PyDLL("libcuda.so.1")["cuLaunchKernel"]  # [] gives a fresh function object
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


@lru_cache(maxsize=1)
def _untyped_launch_ex() -> Any:
    """cuLaunchKernelEx through ctypes without argtypes (see ``_untyped_launch``), or None."""
    try:
        fn = ctypes.PyDLL("libcuda.so.1")["cuLaunchKernelEx"]
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (an int flag here)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int64 * 8)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def pdl_enabled(arch: int) -> bool:
    """Whether kernels built for ``arch`` that wait with griddepcontrol.wait launch with programmatic
    stream serialization: sm_90 builds (earlier builds -- the compute_70 PTX on any GPU -- have no
    wait and must launch plainly), unless $DFLASHGEN_PDL is 0."""
    return arch >= 90 and os.environ.get("DFLASHGEN_PDL", "1") != "0"


class TensorMapArg(ctypes.Structure):
    """A ``const __grid_constant__ CUtensorMap`` kernel parameter: the 128 opaque bytes of a tensor map
    (CUtensorMap is 64-byte aligned in CUDA; the kernel's parameter is laid out by the compiler and
    cuLaunchKernel copies the bytes from the address it is given, so host alignment is not required:
    ``_align_`` only takes effect on Python >= 3.13). Usable as an ``ArgPack`` type."""

    _align_ = 64
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]

    def load(self, src: TensorMapArg | int) -> TensorMapArg:
        """Copy the 128 bytes of ``src`` (another TensorMapArg, or an address) into this one."""
        ctypes.memmove(ctypes.addressof(self), ctypes.addressof(src) if isinstance(src, TensorMapArg) else src, 128)
        return self


assert ctypes.sizeof(TensorMapArg) == 128


def encode_tensor_map(address: int, dims: Sequence[int], strides: Sequence[int], box: Sequence[int],
                      dtype: str = "float16", swizzle: str = "128B") -> TensorMapArg:
    """cuTensorMapEncodeTiled over a tensor at ``address`` -> its 128 bytes as a ``TensorMapArg``.
    ``dims`` / ``box``: elements per dimension, innermost (contiguous) first; ``strides``: bytes of
    dimensions 1 .. rank - 1. Interleave none, no L2 promotion beyond 256 B, out-of-bounds boxes
    zero-filled (OOB_FILL_NONE), element strides 1."""
    d = cu()
    rank = len(dims)
    if not (len(box) == rank and len(strides) == rank - 1):
        raise ValueError(f"tensor map: {rank} dims need {rank} box sizes and {rank - 1} strides")
    tmap = check(d.cuTensorMapEncodeTiled(
        getattr(d.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{dtype.upper()}"), rank, address,
        [d.cuuint64_t(int(x)) for x in dims], [d.cuuint64_t(int(x)) for x in strides],
        [d.cuuint32_t(int(x)) for x in box], [d.cuuint32_t(1)] * rank,
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(d.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}"),
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return TensorMapArg().load(int(tmap.getPtr()))


class ArgPack:
    """Persistent storage for one kernel's parameters (ctypes types in parameter order) and the
    array of their addresses that cuLaunchKernel reads. Fill ``values`` and launch under ``lock``."""

    def __init__(self, types: Sequence[type]) -> None:
        self.values = [t() for t in types]
        self._ptrs = (ctypes.c_void_p * len(types))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self._ptrs)
        self.lock = threading.Lock()

    def launch(self, fn: Function, grid: Sequence[int], block: Sequence[int], stream: int,
               values: Sequence[Any], shared: int = 0) -> None:
        """Fill the parameters with ``values`` (in order) and launch ``fn`` with them, under the lock."""
        with self.lock:
            for slot, val in zip(self.values, values, strict=True):
                slot.value = val
            fn.launch_pack(grid, block, self, stream, shared)


class LaunchArgs:
    """Every cuLaunchKernel argument of one kernel launch as persistent ctypes storage: the function,
    grid, block, shared bytes, stream and the address of an ``ArgPack``. Update the ``grid`` and
    ``stream`` values in place and call ``launch`` (caller holds the pack's lock).

    ``pdl``: launch through cuLaunchKernelEx with programmatic stream serialization (sm_90), so the
    kernel may start while the previous one in the stream finishes; only for kernels that execute
    ``griddepcontrol.wait`` before touching anything an earlier kernel writes or reads (the sm_90
    GEMMs: skinny_gemm.cuh ``pdl_wait``). The grid and stream values are then views into the
    launch config, so callers update them the same way."""

    def __init__(self, fn: Function, grid: Sequence[int], block: Sequence[int], pack: ArgPack,
                 shared: int = 0, pdl: bool = False) -> None:
        self.fn = fn
        self.pack = pack
        self._block = tuple(block)
        self._shared = shared
        self._raw = _untyped_launch()
        ex = _untyped_launch_ex() if pdl and self._raw is not None else None
        self.pdl = ex is not None
        if ex is not None:
            self._attr = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION)
            self._attr.value[0] = 1
            cfg = self._cfg = _LaunchConfig()
            cfg.block[:] = list(block)
            cfg.shared, cfg.attrs, cfg.num_attrs = shared, ctypes.pointer(self._attr), 1
            off = _LaunchConfig.grid.offset
            self.grid = [ctypes.c_uint.from_buffer(cfg, off + 4 * i) for i in range(3)]
            for g, v in zip(self.grid, grid, strict=True):
                g.value = v
            self.stream = ctypes.c_void_p.from_buffer(cfg, _LaunchConfig.stream.offset)
            self._raw = ex
            self._args = (ctypes.byref(cfg), ctypes.c_void_p(fn._raw_handle), ctypes.c_void_p(pack.address), None)
            return
        self.grid = [ctypes.c_uint(g) for g in grid]
        self.stream = ctypes.c_void_p(0)
        self._args = (ctypes.c_void_p(fn._raw_handle), *self.grid, *[ctypes.c_uint(b) for b in block],
                      ctypes.c_uint(shared), self.stream, ctypes.c_void_p(pack.address), None)

    def launch(self) -> None:
        raw = self._raw
        if raw is None:  # no libcuda through ctypes: cuda-python's launch, same arguments
            grid = tuple(g.value for g in self.grid)
            self.fn.launch_pack(grid, self._block, self.pack, self.stream.value or 0, self._shared)
            return
        err = raw(*self._args)
        if err:
            check((cu().CUresult(err),), f"launching {self.fn.name}")


class Function:
    def __init__(self, handle: Any, name: str) -> None:
        self.handle = handle
        self.name = name
        self._raw_handle = int(handle)

    def launch_pack(self, grid: Sequence[int], block: Sequence[int], pack: ArgPack, stream: int,
                    shared: int = 0) -> None:
        """Launch with parameters already in ``pack`` (caller holds ``pack.lock``)."""
        raw = _raw_launch()
        if raw is None:
            check(cu().cuLaunchKernel(self.handle, *grid, *block, shared, stream, pack.address, 0),
                  f"launching {self.name}")
            return
        err = raw(self._raw_handle, *grid, *block, shared, stream, pack.address, None)
        if err:
            check((cu().CUresult(err),), f"launching {self.name}")

    def allow_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to ``nbytes`` of dynamic shared memory per CTA (needed above 48 KB)."""
        attr = cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu().cuFuncSetAttribute(self.handle, attr, int(nbytes)), f"shared memory opt-in for {self.name}")

    def attribute(self, attr: str) -> int:
        a = getattr(cu().CUfunction_attribute, attr)
        return int(check(cu().cuFuncGetAttribute(a, self.handle), f"cuFuncGetAttribute {attr}"))

    def launch(self, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], stream: int,
               shared: int = 0, pdl: bool = False) -> None:
        """args: ctypes values in the kernel's parameter order. ``pdl``: programmatic stream
        serialization (cuLaunchKernelEx; see ``LaunchArgs``), only for kernels that execute
        ``griddepcontrol.wait`` before touching memory; a plain launch where libcuda's entry point
        is not reachable through ctypes."""
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        ex = _untyped_launch_ex() if pdl else None
        if ex is None:
            check(cu().cuLaunchKernel(self.handle, *grid, *block, shared, stream, ctypes.addressof(ptrs), 0),
                  f"launching {self.name}")
            return
        attr = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        cfg = _LaunchConfig()
        cfg.grid[:], cfg.block[:] = list(grid), list(block)
        cfg.shared, cfg.stream, cfg.attrs, cfg.num_attrs = shared, stream, ctypes.pointer(attr), 1
        err = ex(ctypes.byref(cfg), ctypes.c_void_p(self._raw_handle), ctypes.c_void_p(ctypes.addressof(ptrs)), None)
        if err:
            check((cu().CUresult(err),), f"launching {self.name}")
