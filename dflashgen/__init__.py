"""dflashgen: generate, build, tune and run skinny quantized GEMM kernels."""

__version__ = "0.1.0"
