"""Launch the generated grouped verification attention kernels (family "attention") on torch tensors.

:func:`paged_verify_attention` is the device-level entry: FP16 queries ``[B, nq, Hq, D]`` (nq <= 8),
K/V pools ``[num_blocks, page, Hkv, D]`` (FP16 / FP8 E5M2 / E4M3; two tensors, or the two halves of
one interleaved ``[num_blocks, 2, page, Hkv, D]`` pool), an int32 block table ``[B, W]`` and int32
lengths ``[B]`` on the device -> FP32 ``[B, nq, Hq, D]``. Query row i of request b sits at position
``lengths[b] - nq + i`` (the new tokens are already in the cache). Everything is launched on torch's
current stream from device tensors, so a CUDA graph captured once replays with new lengths and tables.

Kernel choice depends only on (GPU arch, heads, head_dim, KV dtype, page size), never on the batch;
the kernel's split rule (``entry_rule``) gives each request a split size from its own length, so a
request's output is bitwise the same in any batch. sm_9x GPUs run
the sm_90 kernels, sm_8x the sm_80 ones, sm_7x the sm_70 ones; ``DFLASHGEN_ATTN_ARCH=70`` (or
``arch=70``) runs the sm_70 build's compute_70 PTX through the driver JIT on a newer GPU.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from functools import cache
from typing import Any

import torch

from . import driver as _driver
from .driver import TensorMapArg, current_stream, pdl_enabled
from .split_rule import SplitRule

log = logging.getLogger("dflashgen")

__all__ = [
    "AttentionInputError",
    "attention_entries",
    "check_inputs",
    "dense_verify_attention",
    "dense_verify_serves",
    "device_errors",
    "entry_rule",
    "kernel_arch",
    "paged_verify_attention",
    "pool_tensor_map",
    "select_kernel",
    "validate_contents",
]

KV_TAG = {torch.float16: "fp16", torch.float8_e5m2: "e5m2", torch.float8_e4m3fn: "e4m3"}
_LOG2E = 1.4426950408889634
_GRID_YZ = 65535  # the largest grid y / z dimension
_ERR_BITS = {1: "a length below the query rows or beyond the block table", 2: "a block table entry out of range"}


class AttentionInputError(ValueError):
    """An argument does not fit the attention kernels (dtype, device, shape, heads, page table, length)."""


def _fail(msg: str) -> None:
    raise AttentionInputError(msg)


@cache
def attention_entries() -> tuple[dict[str, Any], ...]:
    from .images import family_entries

    return tuple(family_entries("attention").values())


def kernel_arch(device: torch.device, arch: int | None = None) -> int:
    """Which build serves this GPU: 90 / 80 / 70, or ``arch`` / $DFLASHGEN_ATTN_ARCH when given."""
    from .images import serving_arch

    return serving_arch(device, arch, "DFLASHGEN_ATTN_ARCH", AttentionInputError)


def select_kernel(arch: int, hq: int, hkv: int, d: int, kv: str, page: int, name: str | None = None) -> dict[str, Any]:
    """The manifest entry serving these parameters: the schedule's default, or the kernel ``name``.
    DFLASHGEN_ATTN_WG=0 serves a default sm_90a wgmma kernel's mma.sync fallback instead (its
    entry's ``fallback``: the next schedule of attention.yaml's default_for list). Cached: an eager
    call pays a dictionary lookup, not a scan of the manifest."""
    return _select(arch, hq, hkv, d, kv, page, name, os.environ.get("DFLASHGEN_ATTN_WG", "1") == "0")


@cache
def _select(arch: int, hq: int, hkv: int, d: int, kv: str, page: int, name: str | None,
            wg_off: bool) -> dict[str, Any]:
    found = [e for e in attention_entries() if (e["arch"], e["hq"], e["hkv"], e["d"], e["kv"], e["page"])
             == (arch, hq, hkv, d, kv, page)]
    if name is None and wg_off:
        name = next((e.get("fallback") for e in found if e["default"] and e.get("wg")), None)
    found = [e for e in found if (e["name"] == name if name is not None else e["default"])]
    if not found:
        have = sorted({(e["hq"], e["hkv"], e["d"], e["kv"], e["page"]) for e in attention_entries()
                       if e["arch"] == arch})
        what = f"kernel {name!r}" if name else "kernel"
        _fail(f"no sm_{arch} attention {what} for {hq} query / {hkv} KV heads, head_dim {d}, {kv} KV, page {page}; "
              f"generated (Hq, Hkv, D, kv, page): {have}")
    return found[0]


def entry_rule(entry: dict[str, Any]) -> SplitRule:
    """The split rule a manifest entry's kernel was rendered with."""
    return SplitRule.of(entry["split"], entry.get("short", ()))


class _Launcher:
    """The two functions of one kernel on one device, loaded on first use."""

    def __init__(self, entry: dict[str, Any], device_index: int) -> None:
        from .images import load_module

        mod = load_module(entry, device_index)
        self.main, self.merge = mod.function(entry["name"]), mod.function(entry["name"] + "_merge")
        self.main.allow_dynamic_smem(entry["smem"])
        self.pdl = pdl_launch(entry)


def serving_entry(entry: dict[str, Any], nb: int, capacity: int, device_index: int) -> dict[str, Any]:
    """The served schedule for ``nb`` requests in a block table of ``capacity`` tokens: its deep twin
    (manifest ``deep``: more ring stages, one CTA per SM, the same bits) when ``nb`` requests of that
    length would occupy at most one CTA per SM -- the served ring's second CTA per SM would never
    come, and the deeper ring keeps more bytes in flight (schedules/attention.yaml ``deep_for``).
    Decided on the host from the batch size and the table's width, never the device-side lengths, so
    a CUDA graph captures one kernel; both give every request the same bits, so the choice is not
    visible in any output. ``DFLASHGEN_ATTN_DEEP=0`` keeps the served schedule."""
    deep = entry.get("deep")
    if not deep or os.environ.get("DFLASHGEN_ATTN_DEEP", "1") == "0":
        return entry
    ctas = nb * entry["hkv"] * int(entry.get("hs", 1)) * entry_rule(entry).splits(capacity)
    if ctas > _sm_count(device_index):
        return entry
    return select_kernel(entry["arch"], entry["hq"], entry["hkv"], entry["d"], entry["kv"], entry["page"], deep)


@cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def pdl_launch(entry: dict[str, Any]) -> bool:
    """Whether a kernel's two functions launch with programmatic stream serialization. sm_90 builds
    wait (griddepcontrol.wait) before touching memory and release their successor at their start
    (templates/verify_attention.cu.j2), so the merge's CTAs are placed while the main kernel runs.
    Other builds (the compute_70 PTX on any GPU) have no wait and launch plainly, as does every
    kernel under DFLASHGEN_PDL=0."""
    return pdl_enabled(int(entry["arch"]))


_LAUNCHERS: dict[tuple[str, int], _Launcher] = {}
_ERR: dict[int, torch.Tensor] = {}


def _launcher(entry: dict[str, Any], device_index: int) -> _Launcher:
    key = (entry["name"], device_index)
    if key not in _LAUNCHERS:
        _LAUNCHERS[key] = _Launcher(entry, device_index)
    return _LAUNCHERS[key]


def _err_flag(device_index: int) -> torch.Tensor:
    if device_index not in _ERR:
        _ERR[device_index] = torch.zeros(1, dtype=torch.int32, device=f"cuda:{device_index}")
    return _ERR[device_index]


def device_errors(device: torch.device | int = 0, clear: bool = True) -> list[str]:
    """What the kernels flagged on this device since the last call (synchronises): inputs that were
    not validated on the host (CUDA-graph replays) and turned out bad. Such requests read no memory
    out of bounds; a bad length yields NaN rows."""
    idx = device if isinstance(device, int) else (device.index or 0)
    if idx not in _ERR:
        return []
    bits = int(_ERR[idx].item())
    if clear:
        _ERR[idx].zero_()
    return [msg for bit, msg in _ERR_BITS.items() if bits & bit]


# tma: 1 kernels read K / V through a tensor map of each pool: 4-d (D, Hkv, page, num_blocks), innermost
# first, byte strides from the pool's; a box is one 64-column (128-byte, SWIZZLE_128B) atom of one KV
# head's page of tokens, which lands as one swizzled block of the wgmma tile (verify_attention_wgmma.cuh).
TMA_BOX_COLS = 64
_TMAPS: dict[tuple, TensorMapArg] = {}
_TMAPS_MAX = 64  # distinct pools (views) kept; the oldest is dropped past this


def pool_tensor_map(pool: torch.Tensor) -> TensorMapArg:
    """The TMA tensor map of a ``[num_blocks, page, Hkv, D]`` FP16 pool (a view of an interleaved pool
    too: its block stride), cached per (address, shape, strides, dtype, device). Rebuilt only for a new
    pool, so eager launches pay a dictionary lookup; a CUDA graph keeps the map it captured (the pool
    tensors of a graph stay put)."""
    key = (pool.data_ptr(), tuple(pool.shape), tuple(pool.stride()), pool.dtype, pool.device)
    tm = _TMAPS.get(key)
    if tm is None:
        if pool.dtype != torch.float16:
            _fail(f"the TMA attention kernels read FP16 KV pools, not {pool.dtype}")
        num_blocks, page, hkv, d = pool.shape
        es = pool.element_size()
        if d % TMA_BOX_COLS or page > 256:
            _fail(f"TMA attention: head_dim {d} must be a multiple of {TMA_BOX_COLS} and page {page} <= 256")
        tm = _driver.encode_tensor_map(pool.data_ptr(), (d, hkv, page, num_blocks),
                                       (pool.stride(2) * es, pool.stride(1) * es, pool.stride(0) * es),
                                       (TMA_BOX_COLS, 1, page, 1), "float16", "128B")
        if len(_TMAPS) >= _TMAPS_MAX:
            _TMAPS.pop(next(iter(_TMAPS)))
        _TMAPS[key] = tm
    return tm


def _require_cuda(q: torch.Tensor) -> None:
    if not q.is_cuda:
        _fail("paged_verify_attention runs on CUDA tensors (use verify_attention_reference on the CPU)")


def _stream(dev: torch.device) -> tuple[int, int]:
    """(device index, torch's current stream handle) for a launch."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    return idx, current_stream(idx)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_pool(name: str, pool: torch.Tensor, ref: torch.Tensor | None) -> None:
    if pool.dtype not in KV_TAG:
        _fail(f"{name} must be float16 / float8_e5m2 / float8_e4m3fn, got {pool.dtype}")
    if pool.dim() != 4:
        _fail(f"{name} must be [num_blocks, page, Hkv, D], got shape {tuple(pool.shape)}")
    _, page, hkv, d = pool.shape
    if pool.stride()[1:] != (hkv * d, d, 1):
        _fail(f"{name}: each block must be a contiguous [page, Hkv, D] array (strides {pool.stride()})")
    if pool.data_ptr() % 16 or pool.stride(0) % 8:
        _fail(f"{name} must be 16-byte aligned")
    if ref is not None and (pool.shape != ref.shape or pool.dtype != ref.dtype or pool.stride() != ref.stride()
                            or pool.device != ref.device):
        _fail(f"k_pool and v_pool differ: {tuple(ref.shape)} {ref.dtype} {ref.stride()} vs "
              f"{tuple(pool.shape)} {pool.dtype} {pool.stride()}")


def validate_contents(block_tables: torch.Tensor, lengths: torch.Tensor, nq: int, page: int,
                       num_blocks: int) -> None:
    """Host-side checks of lengths and the pages they use (one device sync)."""
    lens, table = lengths.cpu().long(), block_tables.cpu().long()
    cap = table.shape[1] * page
    for b, n in enumerate(lens.tolist()):
        if n < nq:
            _fail(f"request {b}: length {n} is shorter than the {nq} query rows (append the new tokens first)")
        if n > cap:
            _fail(f"request {b}: length {n} exceeds the block table's capacity {cap} tokens "
                  f"({table.shape[1]} blocks of {page})")
        ids = table[b, : -(-n // page)]
        bad = (ids < 0) | (ids >= num_blocks)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            _fail(f"request {b}: page table entry {j} = {int(ids[j])} out of range [0, {num_blocks})")


def check_inputs(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 lengths: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    """Structural checks (no device sync, any device) -> (B, nq, Hq, D, num_blocks, page, Hkv)."""
    _check_pool("k_pool", k_pool, None)
    _check_pool("v_pool", v_pool, k_pool)
    for name, t in (("k_pool", k_pool), ("block_tables", block_tables), ("lengths", lengths)):
        if t.device != q.device:
            _fail(f"{name} is on {t.device}, q on {q.device}")
    if q.dim() != 4:
        _fail(f"q must be [B, nq, Hq, D], got shape {tuple(q.shape)}")
    nb, nq, hq, d = q.shape
    num_blocks, page, hkv, dk = k_pool.shape
    if d != dk:
        _fail(f"q head_dim {d} != cache head_dim {dk}")
    if hq % hkv:
        _fail(f"query heads {hq} not a multiple of KV heads {hkv}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        _fail(f"q must be a float tensor, got {q.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != nb:
        _fail(f"block_tables must be int32 [B={nb}, W], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if not block_tables.is_contiguous():  # the kernel derives the capacity from the row stride
        _fail("block_tables must be contiguous")
    if lengths.dtype != torch.int32 or lengths.shape != (nb,) or not lengths.is_contiguous():
        _fail(f"lengths must be a contiguous int32 [B={nb}], got {lengths.dtype} {tuple(lengths.shape)}")
    return nb, nq, hq, d, num_blocks, page, hkv


def paged_verify_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    kernel: str | None = None,
    arch: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Causal verify attention with the generated kernel -> FP32 ``[B, nq, Hq, D]`` (see module doc).

    ``validate`` checks lengths and page ids on the host (one sync); it is skipped while a CUDA graph
    is being captured, where bad values set :func:`device_errors` instead. ``kernel`` picks a
    schedule by name (benchmarks); the default schedule otherwise.
    """
    _require_cuda(q)
    nb, nq, hq, d, num_blocks, page, hkv = check_inputs(q, k_pool, v_pool, block_tables, lengths)
    dev = q.device
    kv = KV_TAG[k_pool.dtype]
    entry = select_kernel(kernel_arch(dev, arch), hq, hkv, d, kv, page, kernel)
    if not 1 <= nq <= entry["qrows"]:
        _fail(f"{nq} query rows per request; the kernel serves 1..{entry['qrows']}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (math.isfinite(float(s)) and float(s) > 0):
            _fail(f"{name} must be finite and > 0, got {s}")
    if out is None:
        out = torch.empty(nb, nq, hq, d, dtype=torch.float32, device=dev)
    elif out.shape != (nb, nq, hq, d) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != dev:
        _fail(f"out must be a contiguous float32 {(nb, nq, hq, d)} tensor on {dev}")
    if nb == 0:
        return out
    if validate and not _capturing():
        validate_contents(block_tables, lengths, nq, page, num_blocks)

    qh = q.to(torch.float16).contiguous()
    cap = block_tables.shape[1] * page
    max_splits = entry_rule(entry).max_splits(cap)  # lengths are on the device: size for any up to cap
    if max_splits > _GRID_YZ or nb > _GRID_YZ:
        _fail(f"{nb} requests x {max_splits} splits (block table capacity {cap} tokens): the launch grid takes "
              f"at most {_GRID_YZ} of each")
    rows = entry["rows"]
    part_o = torch.empty(nb * hkv * max_splits * rows * d, dtype=torch.float16, device=dev)  # O / sum per split
    part_ml = torch.empty(nb * hkv * max_splits * rows * 2, dtype=torch.float32, device=dev)
    fp8_unit = 256.0 if kv == "e4m3" else 1.0  # E4M3 decodes to value * 2^-8 (exact)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    idx, stream = _stream(dev)
    if kernel is None:  # (the twin has the served split rule: the workspace above fits it)
        entry = serving_entry(entry, nb, cap, idx)
    fn = _launcher(entry, idx)
    err = _err_flag(idx)
    vp = ctypes.c_void_p
    # tma: 1 kernels take the K and V pools' tensor maps after the other parameters
    maps = [pool_tensor_map(k_pool), pool_tensor_map(v_pool)] if entry.get("tma") else []
    # Grid (row parts x KV heads, requests, splits): the split index varies slowest, so the CTAs that
    # work (every request's low splits) are dispatched before those past a request's split count, which
    # exit (the grid is sized for the table's capacity), and spread over the SMs (bench/NOTES.md, session 5).
    fn.main.launch(
        (int(entry.get("hs", 1)) * hkv, nb, max_splits), (entry["threads"], 1, 1),
        [vp(qh.data_ptr()), ctypes.c_int(nq), vp(k_pool.data_ptr()), vp(v_pool.data_ptr()),
         ctypes.c_longlong(k_pool.stride(0)), ctypes.c_int(num_blocks), vp(block_tables.data_ptr()),
         ctypes.c_int(block_tables.stride(0)), vp(lengths.data_ptr()),
         ctypes.c_float(sm_scale * _LOG2E * float(k_scale) * fp8_unit), vp(part_o.data_ptr()),
         vp(part_ml.data_ptr()), ctypes.c_int(max_splits), vp(err.data_ptr()), *maps],
        stream, shared=int(entry["smem"]), pdl=fn.pdl)
    fn.merge.launch(
        (rows, hkv, nb), (d // 4, 1, 1),
        [vp(part_o.data_ptr()), vp(part_ml.data_ptr()), ctypes.c_int(nq), vp(lengths.data_ptr()), ctypes.c_int(cap),
         ctypes.c_int(max_splits), ctypes.c_float(float(v_scale) * fp8_unit), vp(out.data_ptr())],
        stream, pdl=fn.pdl)
    return out


def kernel_supported(device: torch.device, hq: int, hkv: int, d: int, dtype: torch.dtype, page: int) -> bool:
    """Is there a default kernel for these parameters on this device (no launch, no errors)?"""
    if device.type != "cuda" or dtype not in KV_TAG:
        return False
    try:
        select_kernel(kernel_arch(device), hq, hkv, d, KV_TAG[dtype], page)
    except Exception:  # no manifest, no family, no such shape: the caller uses the reference
        return False
    return True


@cache
def _dense_table(batch: int, blocks: int, device: torch.device) -> torch.Tensor:
    return torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)


DENSE_PAGE = 16
QUERY_ROWS = 8  # query rows per request one verify-attention launch serves (the q7 verify block)


@cache
def _warn_reference(what: str) -> None:
    # Once per cache shape: on a GPU the FP32 reference is a slow path, never a silent one.
    log.warning("dflashgen: no verify-attention kernel for %s (needs a contiguous FP16/FP8 cache of whole "
                "%d-token pages and served heads): using the FP32 reference", what, DENSE_PAGE)


def dense_verify_serves(device: torch.device, hq: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`dense_verify_attention` runs the generated kernel for ``hq`` query heads over these
    caches ``[B, max_len, Hkv, D]`` on ``device`` (else it returns None)."""
    _, max_len, hkv, d = k_cache.shape
    return (max_len % DENSE_PAGE == 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and kernel_supported(device, hq, hkv, d, k_cache.dtype, DENSE_PAGE))


def dense_verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           lengths: torch.Tensor) -> torch.Tensor | None:
    """Verify attention over contiguous per-request caches ``[B, max_len, Hkv, D]`` (the target model's
    DecodeState), viewed as a paged cache of 16-token blocks. ``q [B, T, Hq, D]``; query t of request
    b at position ``lengths[b] - T + t``. T > 8 (prefill) runs as 8-row chunks. Returns None when no
    kernel applies (CPU, FP32 cache, unserved heads): the caller uses its reference path."""
    b, t, hq, d = q.shape
    _, max_len, hkv, _ = k_cache.shape
    if not dense_verify_serves(q.device, hq, k_cache, v_cache):
        if q.is_cuda:
            _warn_reference(f"cache [{b}, {max_len}, {hkv}, {d}] {k_cache.dtype}"
                            f"{'' if k_cache.is_contiguous() else ' (non-contiguous)'}")
        return None
    blocks = max_len // DENSE_PAGE
    kp = k_cache.view(b * blocks, DENSE_PAGE, hkv, d)
    vp = v_cache.view(b * blocks, DENSE_PAGE, hkv, d)
    table = _dense_table(b, blocks, q.device)
    lens = lengths.to(device=q.device, dtype=torch.int32)  # no copy when the caller passes int32 lengths
    if t <= QUERY_ROWS:  # a verify block: one launch writes the result
        return paged_verify_attention(q, kp, vp, table, lens, validate=False)
    out = torch.empty(b, t, hq, d, dtype=torch.float32, device=q.device)
    for c0 in range(0, t, QUERY_ROWS):
        c1 = min(c0 + QUERY_ROWS, t)
        out[:, c0:c1] = paged_verify_attention(q[:, c0:c1], kp, vp, table, lens - (t - c1), validate=False)
    return out
