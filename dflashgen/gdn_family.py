"""The gated delta rule kernel family "gdn" (``generated/gdn/sm_XX/``), registered in
``render.FAMILY_MODULES``.

One kernel pair per (arch, key head dim): ``<name>`` (the sequential step over T <= 16 verify / decode
positions: outputs, delta-rule values u and decays for rollback, optionally committing the state after
n[b] positions) and ``<name>_advance`` (the state after n[b] positions from those terms, every GDN
layer in one launch). Rendered from ``templates/gdn.cu.j2``; the logic lives in
``templates/include/dflashgen/gdn.cuh``; ``runtime/gdn_kernel.py`` launches them and holds the torch
reference. Names encode every parameter: ``dfg_sm90_gdn_dk128_t16_r16_c4_w2_mb8``.
"""

from __future__ import annotations

from functools import lru_cache

from . import __version__
from .model import load_model_config
from .render import FamilyKernel, _env

__all__ = ["ARCHS", "MAX_T", "ROW_LANES", "WARPS", "family_kernels", "kernel_name", "key_dims"]

ARCHS = (70, 80, 90)
MAX_T = 16  # positions per launch: the verify block (8) and the target's small-chunk limit
ROW_LANES = 16  # lanes splitting the key dim (gdn.cuh LR); fixes the reduction order
COLS_PER_THREAD = 4
WARPS = 2  # 16 columns per CTA: a dv = 128 head is 8 CTAs, so B1 x 48 heads already fills 384 CTAs
THREADS = 32 * WARPS
# __launch_bounds__ min blocks: without it ptxas aims at full occupancy for 64-thread CTAs (32
# registers) and spills; 8 CTAs per SM allow 128 registers (the dk = 128 step needs ~80).
MIN_BLOCKS = 8
COLS = WARPS * 2 * COLS_PER_THREAD


def kernel_name(arch: int, dk: int) -> str:
    return f"dfg_sm{arch}_gdn_dk{dk}_t{MAX_T}_r{ROW_LANES}_c{COLS_PER_THREAD}_w{WARPS}_mb{MIN_BLOCKS}"


@lru_cache(maxsize=1)
def key_dims() -> tuple[int, ...]:
    """The configured model's key head dim plus the small ones the test configs use."""
    return tuple(sorted({load_model_config(None).linear_key_head_dim or 128, 16, 32, 64, 128}))


def render(arch: int, dk: int) -> str:
    return _env().get_template("gdn.cu.j2").render(
        version=__version__, name=kernel_name(arch, dk), arch=arch, dk=dk, maxt=MAX_T, warps=WARPS,
        threads=THREADS, cols=COLS, min_blocks=MIN_BLOCKS)


def family_kernels() -> list[FamilyKernel]:
    return [FamilyKernel(kernel_name(arch, dk), arch, render(arch, dk),
                         {"dk": dk, "max_t": MAX_T, "threads": THREADS, "cols": COLS})
            for arch in ARCHS for dk in key_dims()]
