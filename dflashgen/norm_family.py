"""The fused residual-add + RMSNorm kernel family "norm" (``generated/norm/sm_XX/``), registered in
``render.FAMILY_MODULES``.

One kernel per (arch, hidden size): the configured model's hidden size (loops unrolled) and a generic
one (hidden size at run time, any multiple of 4), rendered from ``templates/add_rmsnorm.cu.j2``; the
logic lives in ``templates/include/dflashgen/add_rmsnorm.cuh``; ``runtime/norm_kernel.py`` launches
them and holds the torch reference. Names encode every parameter: ``dfg_sm90_addrmsnorm_h5120_t512``
(``hany``: the generic one).
"""

from __future__ import annotations

from functools import lru_cache

from . import __version__
from .model import load_model_config
from .render import FamilyKernel, _env

__all__ = ["ARCHS", "THREADS", "family_kernels", "hidden_sizes", "kernel_name"]

ARCHS = (70, 80, 90)
# One CTA per row: at decode sizes (8-64 rows) few CTAs, so many threads per row keep enough 16-byte
# loads in flight; hidden 5120 is 1280 groups of 4, 2.5 per thread.
THREADS = 512


def kernel_name(arch: int, hidden: int | None) -> str:
    return f"dfg_sm{arch}_addrmsnorm_h{hidden or 'any'}_t{THREADS}"


@lru_cache(maxsize=1)
def hidden_sizes() -> tuple[int | None, ...]:
    """The configured model's hidden size, then None (the generic kernel)."""
    return (load_model_config(None).hidden_size, None)


def render(arch: int, hidden: int | None) -> str:
    return _env().get_template("add_rmsnorm.cu.j2").render(
        version=__version__, name=kernel_name(arch, hidden), arch=arch, hidden=hidden or 0, threads=THREADS)


def family_kernels() -> list[FamilyKernel]:
    return [FamilyKernel(kernel_name(arch, hidden), arch, render(arch, hidden),
                         {"hidden": hidden, "threads": THREADS})
            for arch in ARCHS for hidden in hidden_sizes()]
