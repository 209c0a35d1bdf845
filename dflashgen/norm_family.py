"""The decoder's norm kernels, family "norm" (``generated/norm/sm_XX/``), registered in
``render.FAMILY_MODULES``: the residual add + RMSNorm of every norm site, and a full-attention
layer's q / k RMSNorm + RoPE with the KV-cache writes.

One kernel per (arch, hidden size): the configured model's hidden size (loops unrolled) and a generic
one (hidden size at run time, any multiple of 4), rendered from ``templates/add_rmsnorm.cu.j2``; the
logic lives in ``templates/include/dflashgen/add_rmsnorm.cuh``; ``runtime/norm_kernel.py`` launches
them and holds the torch reference. Names encode every parameter: ``dfg_sm90_addrmsnorm_h5120_t512``
(``hany``: the generic one).

Plus one attention-input kernel per arch, ``templates/qk_norm_rope.cu.j2`` (``dfg_sm90_qknormrope_w4_d256``,
manifest ``kind: "qk_rope"``; logic in ``qk_norm_rope.cuh``, launched by ``runtime/norm_kernel.py``):
heads, head dim (<= 256) and rotary dim at run time.

Plus one SiLU(gate) * up kernel per arch, ``templates/silu_mul.cu.j2`` (``dfg_sm90_silumul_t256``, manifest
``kind: "silu_mul"``; ``silu_mul.cuh``): the glue after a projection served by dequantize + cuBLAS; and
one attention output gate kernel per arch, ``templates/sigmoid_mul.cu.j2`` (``dfg_sm90_sigmoidmul_t256``,
manifest ``kind: "sigmoid_mul"``; ``silu_mul.cuh``): o * sigmoid(gate) between the verify attention and
o_proj.
"""

from __future__ import annotations

from functools import lru_cache

from . import __version__
from .model import load_model_config
from .render import FamilyKernel, _env

__all__ = ["ARCHS", "QK_MAX_D", "QK_WARPS", "SILU_THREADS", "THREADS", "family_kernels", "hidden_sizes",
           "kernel_name", "qk_kernel_name", "sigmoid_kernel_name", "silu_kernel_name"]

ARCHS = (70, 80, 90)
# One CTA per row: at decode sizes (8-64 rows) few CTAs, so many threads per row keep enough 16-byte
# loads in flight; hidden 5120 is 1280 groups of 4, 2.5 per thread.
THREADS = 512
QK_WARPS = 4  # q / k RMSNorm + RoPE: one warp per (position, head)
QK_MAX_D = 256  # head dims it takes (qk_norm_rope.cuh MAX_D)
SILU_THREADS = 256  # SiLU-mul: a grid-stride loop of 16-byte steps


def kernel_name(arch: int, hidden: int | None) -> str:
    return f"dfg_sm{arch}_addrmsnorm_h{hidden or 'any'}_t{THREADS}"


@lru_cache(maxsize=1)
def hidden_sizes() -> tuple[int | None, ...]:
    """The configured model's hidden size, then None (the generic kernel)."""
    return (load_model_config(None).hidden_size, None)


def render(arch: int, hidden: int | None) -> str:
    return _env().get_template("add_rmsnorm.cu.j2").render(
        version=__version__, name=kernel_name(arch, hidden), arch=arch, hidden=hidden or 0, threads=THREADS)


def qk_kernel_name(arch: int) -> str:
    return f"dfg_sm{arch}_qknormrope_w{QK_WARPS}_d{QK_MAX_D}"


def render_qk(arch: int) -> str:
    return _env().get_template("qk_norm_rope.cu.j2").render(
        version=__version__, name=qk_kernel_name(arch), arch=arch, warps=QK_WARPS, max_d=QK_MAX_D)


def silu_kernel_name(arch: int) -> str:
    return f"dfg_sm{arch}_silumul_t{SILU_THREADS}"


def render_silu(arch: int) -> str:
    return _env().get_template("silu_mul.cu.j2").render(
        version=__version__, name=silu_kernel_name(arch), arch=arch, threads=SILU_THREADS)


def sigmoid_kernel_name(arch: int) -> str:
    return f"dfg_sm{arch}_sigmoidmul_t{SILU_THREADS}"


def render_sigmoid(arch: int) -> str:
    return _env().get_template("sigmoid_mul.cu.j2").render(
        version=__version__, name=sigmoid_kernel_name(arch), arch=arch, threads=SILU_THREADS)


def family_kernels() -> list[FamilyKernel]:
    norms = [FamilyKernel(kernel_name(arch, hidden), arch, render(arch, hidden),
                          {"kind": "add_rmsnorm", "hidden": hidden, "threads": THREADS})
             for arch in ARCHS for hidden in hidden_sizes()]
    qk = [FamilyKernel(qk_kernel_name(arch), arch, render_qk(arch),
                       {"kind": "qk_rope", "threads": 32 * QK_WARPS, "warps": QK_WARPS, "max_d": QK_MAX_D})
          for arch in ARCHS]
    silu = [FamilyKernel(silu_kernel_name(arch), arch, render_silu(arch), {"kind": "silu_mul", "threads": SILU_THREADS})
            for arch in ARCHS]
    gate = [FamilyKernel(sigmoid_kernel_name(arch), arch, render_sigmoid(arch),
                         {"kind": "sigmoid_mul", "threads": SILU_THREADS}) for arch in ARCHS]
    return norms + qk + silu + gate
