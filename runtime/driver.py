"""CUDA driver API access through cuda-python: load cubin/PTX images and launch kernels on torch's
current stream. No torch C++ extension, so no dependency on torch's C++ ABI.

Hot launches (every projection call) skip cuda-python's argument marshalling: ``ArgPack`` keeps a
kernel's parameters in persistent ctypes storage updated in place, and ``Function.launch_pack``
calls libcuda's cuLaunchKernel through ctypes (the same driver, microseconds cheaper per call).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Sequence
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


def current_stream(index: int) -> int:
    """The raw handle of torch's current stream on device ``index``: torch's own fast accessor where
    it exists (building a torch.cuda.Stream object costs microseconds on every launch)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(index)) if raw is not None else torch.cuda.current_stream(index).cuda_stream


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


class ArgPack:
    """Persistent storage for one kernel's parameters (ctypes types in parameter order) and the
    array of their addresses that cuLaunchKernel reads. Fill ``values`` and launch under ``lock``."""

    def __init__(self, types: Sequence[type]) -> None:
        self.values = [t() for t in types]
        self._ptrs = (ctypes.c_void_p * len(types))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self._ptrs)
        self.lock = threading.Lock()


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

    def attribute(self, attr: str) -> int:
        a = getattr(cu().CUfunction_attribute, attr)
        return int(check(cu().cuFuncGetAttribute(a, self.handle), f"cuFuncGetAttribute {attr}"))

    def launch(self, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], stream: int,
               shared: int = 0) -> None:
        """args: ctypes values in the kernel's parameter order."""
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        check(cu().cuLaunchKernel(self.handle, *grid, *block, shared, stream, ctypes.addressof(ptrs), 0),
              f"launching {self.name}")
