"""The compact rejection-sampling kernel family (``generated/rejection/sm_XX/``).

Three kernels per (arch, vocab, drafts), rendered from ``templates/rejection.cu.j2``; the logic lives
in ``templates/include/dflashgen/rejection.cuh``:
``<name>_prefilter`` (grid ``(chunks, D + 1, B)``: for rows with ``0 < top_k <= CAP`` and greedy
rows, each ``CHUNK``-token chunk's top-k keys, a superset of the row's top-k), ``<name>`` (describe,
grid ``(D + 1, B)``: the kept set of every position as a key threshold, over the candidates, or by
radix select over the whole vocabulary for the other rows) and ``<name>_decide`` (grid ``B``:
accepted length, recovered / bonus token by an inverse CDF over the kept candidates sorted by id, or
block-wide over the vocabulary).
Specialised for the configured model's vocabulary and the draft counts in use (q7, q3); a generic
variant (vocabulary and drafts at run time, vocab <= 2^24) serves every other model.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

from . import __version__
from .model import load_model_config
from .render import FamilyKernel, _env

__all__ = ["ARCHS", "CAP", "CHUNK", "DRAFTS", "GENERIC_ID_BITS", "family_kernels", "key_plan", "kernel_name",
           "num_chunks", "uses_candidates"]

ARCHS = (70, 80, 90)
DRAFTS = (7, 3)  # DFlash2 q7 and the q3 variant the seed project measured
GENERIC_ID_BITS = 24  # the run-time-vocab variant: vocab <= 2^24
CAP = 128  # largest top_k served by the candidate path (rejection.cuh CAP; the template asserts it)
CHUNK = 4096  # tokens per prefilter CTA (rejection.cuh CHUNK)


def num_chunks(vocab: int) -> int:
    return -(-vocab // CHUNK)


def uses_candidates(temperature: float, top_k: int) -> bool:
    """rejection.cuh cand_k > 0: greedy rows and rows with 0 < top_k <= CAP take the candidate path."""
    try:
        t32 = struct.unpack("f", struct.pack("f", temperature))[0]  # the kernel compares the float32 value
    except OverflowError:  # beyond float32: inf on the device, not greedy
        t32 = math.inf
    return t32 == 0 or 0 < top_k <= CAP


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
        drafts=drafts or 0, id_bits=id_bits, pad=pad, digits=digits, cap=CAP, chunk=CHUNK)


def family_kernels() -> list[FamilyKernel]:
    out = []
    for arch in ARCHS:
        for vocab, drafts in [*((_model_vocab(), d) for d in DRAFTS), (None, None)]:
            out.append(FamilyKernel(kernel_name(arch, vocab, drafts), arch, render(arch, vocab, drafts),
                                    {"vocab": vocab, "drafts": drafts, "threads": 512}))
    return out
