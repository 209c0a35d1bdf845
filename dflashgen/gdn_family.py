"""The gated delta rule kernel family "gdn" (``generated/gdn/sm_XX/``), registered in
``render.FAMILY_MODULES``.

One kernel pair per (arch, key head dim): ``<name>`` (the sequential step over T <= 16 verify / decode
positions: outputs, delta-rule values u and decays for rollback, optionally committing the state after
n[b] positions) and ``<name>_advance`` (the state after n[b] positions from those terms, every GDN
layer in one launch). Rendered from ``templates/gdn.cu.j2``; the logic lives in
``templates/include/dflashgen/gdn.cuh``; ``runtime/gdn_kernel.py`` launches them and holds the torch
reference. Names encode every parameter: ``dfg_sm90_gdn_dk128_t16_r16_c4_w4_mb8_dyn`` (``mb8``: at
least 8 CTAs of 128 threads per SM, i.e. at most 64 registers, 7 on sm_70; ``dyn``: dynamic shared memory
sized for the launch's T -- the manifest's ``smem_per_t`` / ``advance_smem_per_t`` bytes per position -- and
q / k / u staged as 16-byte copies, cp.async on sm_80+, so q, k, o, u and k_out must be 16-byte aligned).

Plus one glue kernel set per arch, ``templates/gdn_io.cu.j2`` (``dfg_sm90_gdnio_w4_d256_pt16``, manifest
``mode: "io"``; logic in ``templates/include/dflashgen/gdn_io.cuh``): ``<name>`` (inputs: the causal
conv as a W-tap sum, SiLU, the q / k L2 norms, beta and the log decay, per position), ``<name>_split``
(the same straight from the conv state and the in_proj output's FP16 rows, writing their FP32 cat into
the rollback buffer: an armed verify forward without torch's cat), ``<name>_prefill`` (the same for a
prefill, 16 positions per warp, the conv state updated in place: no FP32 conv-input tensor; head dims up
to 128, ``<name>_prefill_wide`` up to 256) and ``<name>_gate`` (the gated RMSNorm with SiLU(z), FP16
out) -- what the target ran as ~20 torch
launches per layer; dims at run time, head dims up to 256.

Plus one prefill kernel per (arch, key head dim), ``templates/gdn_prefill.cu.j2``
(``dfg_sm90_gdnpf_dk128_s16_r16_c2_w4_mb4``, manifest ``mode: "prefill"``): the same position body
over any T in one launch (positions staged 16 at a time into two buffers, the next chunk's q / k
copied while this one's positions run), committing the state after n[b] positions
in place, outputs o only -- a prefill that is not armed for rollback, bitwise T one-token steps.

Plus one chunk-form prefill pair per (arch, key head dim), ``templates/gdn_chunk.cu.j2``
(``dfg_sm90_gdnck_dk128_c32_tf32x3_r4``, compute_70 ``dfg_sm70_gdnck_dk128_c32_n16_w4``, manifest
``mode: "chunk"``; logic in
``templates/include/dflashgen/gdn_chunk.cuh``): ``<name>_prep`` (per chunk of 32 positions and key
head: the k.k / q.k products once, then per value head the cumulative log decays and their
exponentials, (I + N)^-1 and the decayed q.k products, into a workspace) and ``<name>`` (the chunks in
order: on sm_80+ the products as 3xTF32 tensor-core MMAs with the state in registers,
``gdn_chunk_mma.cuh``; on compute_70 register-tiled FP32 products, 16 state columns per CTA --
either way instead of one dependency chain per position). The same recurrence in another summation
order: not bitwise the sequential kernels, but a request's bits depend only on its own inputs.
"""

from __future__ import annotations

from functools import lru_cache

from . import __version__
from .model import load_model_config
from .render import FamilyKernel, _env

__all__ = ["ARCHS", "CHUNK", "CHUNK_COLS", "IO_MAX_D", "IO_WARPS", "MAX_T", "PREFILL_CHUNK", "PREFILL_COLS",
           "ROW_LANES", "WARPS", "chunk_kernel_name", "chunk_smem_bytes", "family_kernels", "io_kernel_name",
           "kernel_name", "key_dims", "prefill_kernel_name", "prefill_warps"]

ARCHS = (70, 80, 90)
MAX_T = 16  # positions per launch: the verify block (8) and the target's small-chunk limit
ROW_LANES = 16  # lanes splitting the key dim (gdn.cuh LR); fixes the reduction order
COLS_PER_THREAD = 4
# 32 columns per CTA: a dv = 128 head is 4 CTAs (B1 x 48 heads: 192 CTAs of 4 warps); each CTA stages a
# position's q / k once for 32 columns (16 before: the B8 step's L2 reads of q / k were as many bytes as
# its state)
WARPS = 4
THREADS = 32 * WARPS
# __launch_bounds__ min blocks: without it ptxas aims at full occupancy for 64-thread CTAs (32
# registers) and spills; 8 CTAs per SM allow 128 registers (the dk = 128 step needs ~80).
MIN_BLOCKS = 8
# the step / advance pair: 8 CTAs of 4 warps per SM cap ptxas at 64 registers (state 32 + the position's
# temporaries fit without spills once q / k staging holds no registers): 32 warps resident
STEP_MIN_BLOCKS = 8
# sm_70: its ptxas (NVRTC 12 -> compute_70 -> sm_70) spilled 4 B of the step at 64 registers once the
# reductions scattered (Col::scatter2); 7 CTAs per SM give it 72
STEP_MIN_BLOCKS_SM70 = 7
REPLAY_MIN_BLOCKS = 7  # the replaying step (`_replay`): its extra staging spilled at 64 registers
COLS = WARPS * 2 * COLS_PER_THREAD
PREFILL_CHUNK = 16  # prefill positions staged in shared memory per pass (the step's footprint)
# The prefill kernel: 2 columns per thread and 4 warps per CTA, so twice the warps of the step's layout
# for the same state and the same 16 columns per CTA (a B1 prefill's 48 heads x 128 columns: 1536
# warps, ~12 per SM, against ~6 with 4 columns: the sequential recurrence is latency-bound, and more
# warps hide it; a CTA's q / k staging still serves 16 columns). Columns are independent and each one's
# dot products keep their order (rows per thread, then the row-lane butterfly): the step's bits.
PREFILL_COLS_PER_THREAD = 2
PREFILL_WARPS = 4
PREFILL_MIN_BLOCKS = 4  # 128-thread CTAs: up to 128 registers (the 16-position staging needs ~110)
PREFILL_COLS = PREFILL_WARPS * 2 * PREFILL_COLS_PER_THREAD


def prefill_warps(dk: int) -> int:
    """Warps per prefill CTA: PREFILL_WARPS where a chunk's q / k staging is whole rounds of the CTA's
    float4 loads (gdn.cuh prefill), else half (the small test key dims)."""
    return PREFILL_WARPS if PREFILL_CHUNK * dk // 4 % (32 * PREFILL_WARPS) == 0 else PREFILL_WARPS // 2
# The chunk-form prefill: 32-position chunks (a 1K prompt is 32 sequential chunk steps; prep's
# substitution is one warp wide). compute_70: 16 state columns per 128-thread CTA on CUDA cores (a B1
# prefill's 48 heads x 128 columns: 384 CTAs, 3 per SM at ~75 KB of shared memory each, k
# double-buffered). sm_80+: the tensor-core scan (gdn_chunk_mma.cuh): 16 columns per warp group, the key
# dim split over chunk_split(dk) warps (B1: 48 x 8 x 4 = 1536 warps, ~12 per SM), a CTA per key head's
# value heads (their shared k / q staged once; how many the runtime picks from the shared memory the
# GPU allows: smem_base + smem_per_head bytes each).
CHUNK = 32
CHUNK_COLS = 16
CHUNK_THREADS = CHUNK * CHUNK_COLS // 4  # the CUDA-core scan's, and prep's everywhere
CHUNK_MIN_BLOCKS = 3
CHUNK_MMA_SPLIT = 4  # warps per 16 columns (the key dim split), at most dk / 8
# value heads per CTA at most (the scan's __launch_bounds__: 3 x 4 warps of up to 168 registers; the
# Qwen3.8 GQA groups are 3 value heads per key head)
CHUNK_MMA_MAX_HEADS = 3


def chunk_mma(arch: int) -> bool:
    """Whether the arch's chunk scan runs on tensor cores (TF32 mma.sync: sm_80+)."""
    return arch >= 80


def chunk_split(dk: int) -> int:
    return min(CHUNK_MMA_SPLIT, dk // 8)


def chunk_smem_bytes(dk: int) -> int:
    """The CUDA-core scan's dynamic shared memory (gdn_chunk.cuh ScanSmem): two k buffers and one q of
    rows padded to dk + 4, the state's columns, Tm / P rows padded to CHUNK + 4, v / r, u and weighted
    u, g and beta."""
    return 4 * (3 * CHUNK * (dk + 4) + dk * CHUNK_COLS + 2 * CHUNK * (CHUNK + 4) + 3 * CHUNK * CHUNK_COLS + 2 * CHUNK)


def chunk_mma_smem(dk: int) -> tuple[int, int]:
    """The tensor-core scan's dynamic shared memory (gdn_chunk_mma.cuh Layout) as (bytes per CTA, bytes
    per value head): k and q rows, two buffers each; per head Tm / P rows padded to CHUNK + 8 and v
    rows of 16 + 4 (two buffers each), prep's g / exp(g) / end weights and beta, and the exchanges
    ((split x 2 + 1) x CHUNK / 8 float4 per lane: step A's partial sums, then u)."""
    exchange = (chunk_split(dk) * 2 + 1) * (CHUNK // 8) * 32 * 4  # step A's partial sums, then u
    per_head = 2 * 2 * CHUNK * (CHUNK + 8) + 2 * CHUNK * 20 + 2 * 4 * CHUNK + exchange
    return 4 * 4 * CHUNK * dk, 4 * per_head


def chunk_kernel_name(arch: int, dk: int) -> str:
    if chunk_mma(arch):
        return f"dfg_sm{arch}_gdnck_dk{dk}_c{CHUNK}_tf32x3_r{chunk_split(dk)}"
    return f"dfg_sm{arch}_gdnck_dk{dk}_c{CHUNK}_n{CHUNK_COLS}_w{CHUNK_THREADS // 32}"


def chunk_meta(arch: int, dk: int) -> dict[str, object]:
    """The manifest entry of a chunk kernel: the scan's geometry (``threads``: per value head on
    tensor cores, where a CTA holds several) and shared memory."""
    meta: dict[str, object] = {"dk": dk, "chunk": CHUNK, "cols": CHUNK_COLS, "prep_threads": CHUNK_THREADS,
                               "mode": "chunk"}
    if chunk_mma(arch):
        base, per_head = chunk_mma_smem(dk)
        meta |= {"scan": "tf32x3", "split": chunk_split(dk), "threads": 32 * chunk_split(dk),
                 "max_heads": CHUNK_MMA_MAX_HEADS, "smem_base": base, "smem_per_head": per_head}
    else:
        meta |= {"scan": "fp32", "threads": CHUNK_THREADS, "smem": chunk_smem_bytes(dk)}
    return meta


IO_WARPS = 4  # glue kernels: one warp per (position, head), 4 per CTA (TP1 B1 T8: 8 x 20 CTAs)
IO_MAX_D = 256  # head dims the glue kernels take (gdn_io.cuh MAX_D: 8 channels per lane)
# the prefill inputs kernel: positions per warp (each input read once, the last W - 1 taps held in
# registers; a 1K prompt's TP1 layer is 64 x 20 CTAs, one wave) and the conv widths it takes
IO_PREFILL_TILE = 16
IO_PREFILL_MAX_W = 4
IO_PREFILL_NARROW_D = 128  # head dims <_prefill> takes (4 channels per lane); <_prefill_wide> up to IO_MAX_D


def step_smem_per_t(dk: int) -> int:
    """Bytes of dynamic shared memory per position of a step launch (gdn.cuh step_smem_floats_per_t:
    q and k rows, the CTA's values, beta and decay)."""
    return 4 * (2 * dk + COLS + 2)


def advance_smem_per_t(dk: int) -> int:
    """Bytes per position of an advance launch (gdn.cuh advance_smem_floats_per_t: k, u, decay)."""
    return 4 * (dk + COLS + 1)


def step_min_blocks(arch: int) -> int:
    return STEP_MIN_BLOCKS_SM70 if arch < 80 else STEP_MIN_BLOCKS


def kernel_name(arch: int, dk: int) -> str:
    return (f"dfg_sm{arch}_gdn_dk{dk}_t{MAX_T}_r{ROW_LANES}_c{COLS_PER_THREAD}_w{WARPS}_mb{step_min_blocks(arch)}"
            "_dyn")


def prefill_kernel_name(arch: int, dk: int) -> str:
    return (f"dfg_sm{arch}_gdnpf_dk{dk}_s{PREFILL_CHUNK}_r{ROW_LANES}_c{PREFILL_COLS_PER_THREAD}_w{prefill_warps(dk)}"
            f"_mb{PREFILL_MIN_BLOCKS}")


@lru_cache(maxsize=1)
def key_dims() -> tuple[int, ...]:
    """The configured model's key head dim plus the small ones the test configs use."""
    return tuple(sorted({load_model_config(None).linear_key_head_dim or 128, 16, 32, 64, 128}))


def io_kernel_name(arch: int) -> str:
    return f"dfg_sm{arch}_gdnio_w{IO_WARPS}_d{IO_MAX_D}_pt{IO_PREFILL_TILE}"


def render_io(arch: int) -> str:
    return _env().get_template("gdn_io.cu.j2").render(
        version=__version__, name=io_kernel_name(arch), arch=arch, warps=IO_WARPS, max_d=IO_MAX_D,
        prefill_tile=IO_PREFILL_TILE, prefill_max_w=IO_PREFILL_MAX_W, prefill_narrow_d=IO_PREFILL_NARROW_D)


def render(arch: int, dk: int) -> str:
    return _env().get_template("gdn.cu.j2").render(
        version=__version__, name=kernel_name(arch, dk), arch=arch, dk=dk, maxt=MAX_T, warps=WARPS,
        threads=THREADS, cols=COLS, min_blocks=step_min_blocks(arch), replay_min_blocks=REPLAY_MIN_BLOCKS,
        step_smem_per_t=step_smem_per_t(dk),
        advance_smem_per_t=advance_smem_per_t(dk))


def render_prefill(arch: int, dk: int) -> str:
    return _env().get_template("gdn_prefill.cu.j2").render(
        version=__version__, name=prefill_kernel_name(arch, dk), arch=arch, dk=dk, chunk=PREFILL_CHUNK,
        warps=prefill_warps(dk), threads=32 * prefill_warps(dk), cols=prefill_warps(dk) * 2 * PREFILL_COLS_PER_THREAD,
        cpt=PREFILL_COLS_PER_THREAD, min_blocks=PREFILL_MIN_BLOCKS)


def render_chunk(arch: int, dk: int) -> str:
    meta = chunk_meta(arch, dk)
    return _env().get_template("gdn_chunk.cu.j2").render(
        version=__version__, name=chunk_kernel_name(arch, dk), arch=arch, mma=chunk_mma(arch),
        min_blocks=CHUNK_MIN_BLOCKS, **meta)


def family_kernels() -> list[FamilyKernel]:
    steps = [FamilyKernel(kernel_name(arch, dk), arch, render(arch, dk),
                          {"dk": dk, "max_t": MAX_T, "threads": THREADS, "cols": COLS, "mode": "step",
                           "smem_per_t": step_smem_per_t(dk), "advance_smem_per_t": advance_smem_per_t(dk)})
             for arch in ARCHS for dk in key_dims()]
    prefills = [FamilyKernel(prefill_kernel_name(arch, dk), arch, render_prefill(arch, dk),
                             {"dk": dk, "chunk": PREFILL_CHUNK, "threads": 32 * prefill_warps(dk),
                              "cols": prefill_warps(dk) * 2 * PREFILL_COLS_PER_THREAD,
                              "mode": "prefill"})
                for arch in ARCHS for dk in key_dims()]
    chunks = [FamilyKernel(chunk_kernel_name(arch, dk), arch, render_chunk(arch, dk), chunk_meta(arch, dk))
              for arch in ARCHS for dk in key_dims()]
    io = [FamilyKernel(io_kernel_name(arch), arch, render_io(arch),
                       {"mode": "io", "threads": 32 * IO_WARPS, "warps": IO_WARPS, "max_d": IO_MAX_D,
                        "prefill_tile": IO_PREFILL_TILE, "prefill_max_w": IO_PREFILL_MAX_W,
                        "prefill_narrow_d": IO_PREFILL_NARROW_D, "split": True})
          for arch in ARCHS]
    return steps + prefills + chunks + io
