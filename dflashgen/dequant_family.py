"""The weight dequantizer, family "dequant" (``generated/dequant/sm_XX/``), registered in
``render.FAMILY_MODULES``: a prepacked GEMM weight back to FP16 ``[N, K]`` for the dequantize + cuBLAS
path (a prefill's rows; M buckets no kernel wins), so that path needs no FP16 copy of the model.

One kernel per (arch, weight format), rendered from ``templates/dequant.cu.j2``; the logic lives in
``templates/include/dflashgen/dequant.cuh`` on the GEMM kernels' own decoder (``mma_traits.cuh``),
so a layout is decoded exactly as its GEMMs decode it. ``runtime/dequant_kernel.py`` launches them.
Names: ``dfg_sm90_dequant_nvfp4_w8`` (8 warps per CTA, one packed chunk each). Not part of the GEMM
library hash: a tuning table stays valid when this family changes.
"""

from __future__ import annotations

from . import __version__
from .render import FamilyKernel, _env

__all__ = ["ARCHS", "FORMATS", "WARPS", "family_kernels", "kernel_name"]

ARCHS = (70, 80, 90)
FORMATS = ("nvfp4", "fp8_channel")
WARPS = 8  # chunks per CTA: 8 x 2 KB of staging at most
_SHORT = {"nvfp4": "nvfp4", "fp8_channel": "fp8"}
_ENUM = {"nvfp4": "NVFP4", "fp8_channel": "FP8"}


def kernel_name(arch: int, fmt: str) -> str:
    return f"dfg_sm{arch}_dequant_{_SHORT[fmt]}_w{WARPS}"


def render(arch: int, fmt: str) -> str:
    return _env().get_template("dequant.cu.j2").render(
        version=__version__, name=kernel_name(arch, fmt), arch=arch, fmt=fmt, fmt_enum=_ENUM[fmt], warps=WARPS,
        traits="Sm70Traits" if arch < 80 else "Sm80Traits")


def family_kernels() -> list[FamilyKernel]:
    return [FamilyKernel(kernel_name(arch, fmt), arch, render(arch, fmt),
                         {"kind": "dequant", "format": fmt, "threads": 32 * WARPS, "warps": WARPS})
            for arch in ARCHS for fmt in FORMATS]
