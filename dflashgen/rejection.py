"""The compact rejection-sampling kernel family (``generated/rejection/sm_XX/``).

One fused pair of kernels per (arch, vocab, drafts) -- ``<name>`` (describe) (grid ``(D + 1, B)``: the
kept set of every position as a key threshold, by radix select) and ``<name>_decide`` (grid ``B``:
accepted length, recovered / bonus token by a block-wide inverse CDF) -- rendered from
``templates/rejection.cu.j2``; the logic lives in ``templates/include/dflashgen/rejection.cuh``.
Specialised for the configured model's vocabulary and the draft counts in use (q7, q3); a generic
variant (vocabulary and drafts at run time, vocab <= 2^24) serves every other model.
"""

from __future__ import annotations

from functools import lru_cache

from . import __version__
from .model import load_model_config
from .render import FamilyKernel, _env

__all__ = ["ARCHS", "DRAFTS", "GENERIC_ID_BITS", "family_kernels", "key_plan", "kernel_name"]

ARCHS = (70, 80, 90)
DRAFTS = (7, 3)  # DFlash2 q7 and the q3 variant the seed project measured
GENERIC_ID_BITS = 24  # the run-time-vocab variant: vocab <= 2^24


def key_plan(vocab: int | None) -> tuple[int, int, int]:
    """(id bits, pad bits, 8-bit radix digits) of the 64-bit sort key ``logit bits | V-1-id``."""
    id_bits = max(1, (vocab - 1).bit_length()) if vocab else GENERIC_ID_BITS
    if vocab is not None and vocab > 1 << GENERIC_ID_BITS:
        raise ValueError(f"vocab {vocab} above 2^{GENERIC_ID_BITS}")
    digits = -(-(32 + id_bits) // 8)
    return id_bits, digits * 8 - 32 - id_bits, digits


def kernel_name(arch: int, vocab: int | None = None, drafts: int | None = None) -> str:
    return f"dfg_sm{arch}_rejection_" + (f"v{vocab}_d{drafts}" if vocab and drafts else "generic")


@lru_cache(maxsize=1)
def _model_vocab() -> int:
    return load_model_config(None).vocab_size  # the embedded default (Qwen3.8-27B)


def render(arch: int, vocab: int | None, drafts: int | None) -> str:
    id_bits, pad, digits = key_plan(vocab)
    return _env().get_template("rejection.cu.j2").render(
        version=__version__, name=kernel_name(arch, vocab, drafts), arch=arch, vocab=vocab or 0,
        drafts=drafts or 0, id_bits=id_bits, pad=pad, digits=digits)


def family_kernels() -> list[FamilyKernel]:
    out = []
    for arch in ARCHS:
        for vocab, drafts in [*((_model_vocab(), d) for d in DRAFTS), (None, None)]:
            out.append(FamilyKernel(kernel_name(arch, vocab, drafts), arch, render(arch, vocab, drafts),
                                    {"vocab": vocab, "drafts": drafts, "threads": 512}))
    return out
