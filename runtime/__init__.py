"""dflashgen runtime: load generated kernels and run them on torch tensors (``dflashgen.runtime``)."""

from .driver import DriverError
from .kernels import GemmKernel, KernelInputError, native_arch

__all__ = ["DriverError", "GemmKernel", "KernelInputError", "native_arch"]
