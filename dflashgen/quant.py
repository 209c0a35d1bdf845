"""Weight quantizers (NVFP4, channel FP8) and the checkpoint layouts that carry them.

The quantizers follow the compressed-tensors / llm-compressor arithmetic op for op (global divisor
``2688 / amax``, block scale ``fp8(divisor * block_amax / 6)``, codes ``RNE_e2m1(w / (block_scale /
divisor))``), so their codes and block scales equal the library's bit for bit. The logical
:class:`NVFP4Weight` keeps the *multiplier* ``g = fp32(1 / divisor)`` (about ``amax / 2688``, the
ModelOpt ``weight_scale_2``), which differs from ``block_scale / divisor`` by at most an ulp.

Layouts (names as in shared/reference/formats.md), one logical matrix per prefix:
- ``modelopt_nvfp4``: ``weight`` u8 [N,K/2], ``weight_scale`` e4m3 [N,K/16], ``weight_scale_2`` f32
  scalar (multiplier), ``input_scale`` f32 scalar (ignored on read).
- ``ct_nvfp4``: ``weight_packed``, ``weight_scale``, ``weight_global_scale`` f32 [1] (DIVISOR),
  ``input_global_scale`` f32 [1] (ignored on read).
- ``ct_fp8_channel``: ``weight`` e4m3 [N,K], ``weight_scale`` [N,1] (f32, or bf16/f16 from some publishers).
- ``fp16``: an unquantized ``weight`` (fp16/bf16/fp32).
Fused projections (q|k|v, gate|up) are stored as one checkpoint matrix per segment; use
:func:`split_segments` / :func:`concat_segments` (and :func:`split_fp8` / :func:`concat_fp8`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from dflashgen.checkpoint_io import CheckpointError, MissingTensorError
from dflashgen.weights import NVFP4_BLOCK, FP8ChannelWeight, NVFP4Weight, WeightError

__all__ = [
    "CheckpointError",
    "Layout",
    "MissingTensorError",
    "concat_fp8",
    "concat_segments",
    "detect_layout",
    "from_compressed_tensors_fp8",
    "from_compressed_tensors_nvfp4",
    "from_modelopt_nvfp4",
    "quantize_fp8_channel",
    "quantize_nvfp4",
    "split_fp8",
    "split_segments",
    "to_compressed_tensors_fp8",
    "to_compressed_tensors_nvfp4",
    "to_modelopt_nvfp4",
]

Layout = Literal["modelopt_nvfp4", "ct_nvfp4", "ct_fp8_channel", "fp16"]

FP8_MAX = 448.0
E2M1_MAX = 6.0
_F8 = torch.float8_e4m3fn
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# compressed-tensors replaces an all-zero block scale by this (its fp8 "eps"); the block's codes are 0.
_ZERO_BLOCK_SCALE = 0.125
# Activation scales are meaningless for weight-only use; write the value for an activation amax of
# 6 * 448 (multiplier 1, divisor 1) so the tensors exist and look like a calibrated checkpoint's.
_ACT_SCALE = 1.0
# E2M1 rounding boundaries (midpoints of neighbouring magnitudes). Ties go to the even code (RNE):
# the lower neighbour at 0.25, 1.25, 2.5, 5 and the upper one at 0.75, 1.75, 3.5, exactly as
# compressed-tensors' cast_to_fp4 does.
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIE_UP = (0.75, 1.75, 3.5)


# --------------------------------------------------------------------------- quantizers


def _check_input(w: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in _FLOATS:
        desc = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise WeightError(f"{what} input must be a 2-D fp16/bf16/fp32 tensor [N, K], got {desc}")
    if w.numel() == 0:
        raise WeightError(f"{what} input is empty: {tuple(w.shape)}")
    w32 = w.detach().to(torch.float32).contiguous()  # transposed/sliced inputs are fine
    if not bool(torch.isfinite(w32).all()):
        raise WeightError(f"{what} input contains NaN or Inf")
    return w32


def _e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even E2M1 codes (uint8 0..15) of ``x``; magnitudes above 6 saturate."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _TIE_DOWN:
        code += a > t
    for t in _TIE_UP:
        code += a >= t
    # The sign comes from the sign bit, so -0.0 and tiny negatives give code 8 like compressed-tensors.
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    # Correctly rounded fp32 reciprocal: double rounding via fp64 is innocuous for division.
    return (1.0 / x.to(torch.float64)).to(torch.float32)


def _divisor_for(g: torch.Tensor) -> torch.Tensor:
    """The fp32 divisor written for multiplier g. fp32 1/(1/x) != x for ~1 in 6 x, but every rounded
    reciprocal g = fp32(1/d) (all quantizer outputs, all values read from compressed-tensors) satisfies
    fp32(1/fp32(1/g)) == g (checked exhaustively over whole binades), so those round-trip bit for bit.
    A ModelOpt-sourced g that is no rounded reciprocal reads back within 1 ulp."""
    return _reciprocal(g)


def _segments(segments: Sequence[int] | None, n: int) -> tuple[int, ...]:
    segs = (n,) if segments is None else tuple(int(s) for s in segments)
    if not segs or any(s <= 0 for s in segs) or sum(segs) != n:
        raise WeightError(f"segments {segs} must be positive and add up to N={n}")
    return segs


def quantize_nvfp4(w: torch.Tensor, segments: Sequence[int] | None = None) -> NVFP4Weight:
    """NVFP4-quantize ``w`` [N, K] with one global scale per segment of rows (never shared)."""
    w32 = _check_input(w, "NVFP4")
    n, k = w32.shape
    if k % NVFP4_BLOCK:
        raise WeightError(f"NVFP4 needs K to be a multiple of {NVFP4_BLOCK}, got K={k}")
    segs = _segments(segments, n)
    seg_amax = torch.stack([part.abs().amax() for part in w32.split(segs)])
    # compressed-tensors generate_gparam: an all-zero segment (amax -> tiny -> inf) gets divisor 1.
    divisor = (FP8_MAX * E2M1_MAX / seg_amax.clamp_min(torch.finfo(torch.float32).tiny)).nan_to_num(
        nan=1.0, posinf=1.0, neginf=1.0
    )
    row_div = divisor.repeat_interleave(torch.tensor(segs, device=w32.device))[:, None]
    blocks = w32.view(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    bscale = (row_div * (blocks.abs().amax(-1) / E2M1_MAX)).clamp(-FP8_MAX, FP8_MAX).to(_F8).float()
    bscale = torch.where(bscale == 0, torch.full_like(bscale, _ZERO_BLOCK_SCALE), bscale)
    codes = _e2m1_encode(blocks / (bscale / row_div)[..., None]).view(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Weight(packed.contiguous(), bscale.to(_F8), _reciprocal(divisor), segs)


def quantize_fp8_channel(w: torch.Tensor) -> FP8ChannelWeight:
    """Per-output-channel FP8: scale[n] = amax_n / 448, weight = fp8(w / scale)."""
    w32 = _check_input(w, "channel-FP8")
    scale = w32.abs().amax(dim=1) / FP8_MAX
    # compressed-tensors swaps a zero scale for eps; the row's codes are all 0 either way.
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(torch.float32).eps), scale)
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(_F8)
    return FP8ChannelWeight(q, scale)


# --------------------------------------------------------------------------- segments


def split_segments(q: NVFP4Weight) -> list[NVFP4Weight]:
    """One single-segment weight per segment; the parts own their memory (safetensors-ready)."""
    if len(q.segments) == 1:
        return [q]
    parts, row = [], 0
    for i, s in enumerate(q.segments):
        parts.append(NVFP4Weight(q.packed[row:row + s].clone(), q.block_scale[row:row + s].clone(),
                                 q.global_scale[i:i + 1].clone(), (s,)))
        row += s
    return parts


def concat_segments(parts: Sequence[NVFP4Weight]) -> NVFP4Weight:
    """Fuse weights along N, keeping every part's global scale(s) and segment boundaries."""
    if not parts:
        raise WeightError("concat_segments needs at least one part")
    ks = {p.k for p in parts}
    if len(ks) != 1:
        raise WeightError(f"cannot fuse NVFP4 weights with different K: {[p.k for p in parts]}")
    return NVFP4Weight(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.block_scale for p in parts]),
        torch.cat([p.global_scale for p in parts]),
        tuple(s for p in parts for s in p.segments),
    )


def split_fp8(q: FP8ChannelWeight, sizes: Sequence[int]) -> list[FP8ChannelWeight]:
    segs = _segments(sizes, q.n)
    return [FP8ChannelWeight(w.clone(), s.clone()) for w, s in
            zip(q.weight.split(segs), q.scale.split(segs), strict=True)]


def concat_fp8(parts: Sequence[FP8ChannelWeight]) -> FP8ChannelWeight:
    if not parts:
        raise WeightError("concat_fp8 needs at least one part")
    if len({p.k for p in parts}) != 1:
        raise WeightError(f"cannot fuse FP8 weights with different K: {[p.k for p in parts]}")
    return FP8ChannelWeight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


# --------------------------------------------------------------------------- writers


def _name(prefix: str, suffix: str) -> str:
    # An empty prefix gives module-local names (as compressed-tensors compressors use).
    return f"{prefix}.{suffix}" if prefix else suffix


def _single(q: NVFP4Weight, prefix: str) -> None:
    if not isinstance(q, NVFP4Weight):
        raise WeightError(f"{prefix}: expected an NVFP4Weight, got {type(q).__name__}")
    if len(q.segments) != 1:
        raise WeightError(f"{prefix}: a checkpoint matrix has one global scale, but the weight has "
                          f"segments {q.segments}; write split_segments(q) one prefix each")


def to_modelopt_nvfp4(q: NVFP4Weight, prefix: str) -> dict[str, torch.Tensor]:
    _single(q, prefix)
    return {
        _name(prefix, "weight"): q.packed.contiguous(),
        _name(prefix, "weight_scale"): q.block_scale.contiguous(),
        _name(prefix, "weight_scale_2"): q.global_scale.reshape(()).clone(),
        _name(prefix, "input_scale"): torch.tensor(_ACT_SCALE, dtype=torch.float32),
    }


def to_compressed_tensors_nvfp4(q: NVFP4Weight, prefix: str) -> dict[str, torch.Tensor]:
    _single(q, prefix)
    return {
        _name(prefix, "weight_packed"): q.packed.contiguous(),
        _name(prefix, "weight_scale"): q.block_scale.contiguous(),
        _name(prefix, "weight_global_scale"): _divisor_for(q.global_scale.reshape(1)),
        _name(prefix, "input_global_scale"): torch.tensor([_ACT_SCALE], dtype=torch.float32),
    }


def to_compressed_tensors_fp8(
    q: FP8ChannelWeight, prefix: str, scale_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """``scale_dtype`` bf16/fp16 mimics publishers that store rounded scales (the values change)."""
    if not isinstance(q, FP8ChannelWeight):
        raise WeightError(f"{prefix}: expected an FP8ChannelWeight, got {type(q).__name__}")
    if scale_dtype not in _FLOATS:
        raise WeightError(f"{prefix}: scale_dtype must be one of {_FLOATS}, got {scale_dtype}")
    return {
        _name(prefix, "weight"): q.weight.contiguous(),
        _name(prefix, "weight_scale"): q.scale.to(scale_dtype).reshape(-1, 1).clone(),
    }


# --------------------------------------------------------------------------- readers


def _get(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise MissingTensorError(f"missing tensor {name!r}")
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _expect(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...],
            shapes: Sequence[tuple[int, ...]] | None = None, shape_desc: str = "") -> None:
    if t.dtype not in dtypes:
        exp = dtypes[0] if len(dtypes) == 1 else " or ".join(map(str, dtypes))
        raise CheckpointError(f"{name}: expected dtype {exp}, got {t.dtype}")
    if shapes is not None and tuple(t.shape) not in shapes:
        exp = " or ".join(str(list(s)) for s in shapes)
        raise CheckpointError(f"{name}: expected shape {shape_desc}{exp}, got {list(t.shape)}")


def _check_fp8(t: torch.Tensor, name: str, nonneg: bool) -> None:
    bits = t.view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise CheckpointError(f"{name}: contains float8_e4m3fn NaN (0x7f/0xff)")
    if nonneg and bool(((bits & 0x80) != 0).logical_and(bits != 0x80).any()):
        raise CheckpointError(f"{name}: block scales must be non-negative")


def _positive_scalar(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    t = _get(tensors, name)
    _expect(t, name, (torch.float32,), [(), (1,)], "scalar ")
    v = float(t)
    if not (v > 0 and v != float("inf")):
        raise CheckpointError(f"{name}: expected a finite positive global scale, got {v}")
    return t.detach().reshape(1).clone()


def _read_nvfp4(tensors: Mapping[str, torch.Tensor], prefix: str, codes: str, global_name: str,
                divisor: bool) -> NVFP4Weight:
    cname, sname, gname = _name(prefix, codes), _name(prefix, "weight_scale"), _name(prefix, global_name)
    packed = _get(tensors, cname)
    _expect(packed, cname, (torch.uint8,))
    if packed.dim() != 2 or packed.shape[0] == 0:
        raise CheckpointError(f"{cname}: expected shape [N, K/2], got {list(packed.shape)}")
    n, k = packed.shape[0], 2 * packed.shape[1]
    if k == 0 or k % NVFP4_BLOCK:
        raise CheckpointError(f"{cname}: K = 2 * {packed.shape[1]} = {k} is not a positive multiple "
                              f"of {NVFP4_BLOCK}")
    bscale = _get(tensors, sname)
    _expect(bscale, sname, (_F8,), [(n, k // NVFP4_BLOCK)], "[N, K/16] = ")
    _check_fp8(bscale, sname, nonneg=True)
    g = _positive_scalar(tensors, gname)
    if divisor:
        g = _reciprocal(g)
        if not bool(torch.isfinite(g) & (g > 0)):
            raise CheckpointError(f"{gname}: divisor {float(_get(tensors, gname))} has no fp32 reciprocal")
    return NVFP4Weight(packed.detach().contiguous(), bscale.detach().contiguous(), g, (n,))


def from_modelopt_nvfp4(tensors: Mapping[str, torch.Tensor], prefix: str) -> NVFP4Weight:
    return _read_nvfp4(tensors, prefix, "weight", "weight_scale_2", divisor=False)


def from_compressed_tensors_nvfp4(tensors: Mapping[str, torch.Tensor], prefix: str) -> NVFP4Weight:
    return _read_nvfp4(tensors, prefix, "weight_packed", "weight_global_scale", divisor=True)


def from_compressed_tensors_fp8(tensors: Mapping[str, torch.Tensor], prefix: str) -> FP8ChannelWeight:
    wname, sname = _name(prefix, "weight"), _name(prefix, "weight_scale")
    w = _get(tensors, wname)
    _expect(w, wname, (_F8,))
    if w.dim() != 2 or w.numel() == 0:
        raise CheckpointError(f"{wname}: expected shape [N, K], got {list(w.shape)}")
    _check_fp8(w, wname, nonneg=False)
    n = w.shape[0]
    s = _get(tensors, sname)
    _expect(s, sname, _FLOATS, [(n, 1), (n,)], "(channel scales) ")
    s32 = s.detach().to(torch.float32).reshape(n)
    if not bool((torch.isfinite(s32) & (s32 >= 0)).all()):
        raise CheckpointError(f"{sname}: channel scales must be finite and non-negative")
    return FP8ChannelWeight(w.detach().contiguous(), s32.clone())


def detect_layout(tensors: Mapping[str, torch.Tensor], prefix: str) -> Layout:
    """Which layout holds ``prefix``, from tensor names and dtypes only (nothing is validated)."""
    if _name(prefix, "weight_packed") in tensors:
        return "ct_nvfp4"
    wname = _name(prefix, "weight")
    w = tensors.get(wname)
    if w is None:
        raise MissingTensorError(f"missing tensor {wname!r} (nor {_name(prefix, 'weight_packed')!r})")
    if w.dtype == torch.uint8:
        if _name(prefix, "weight_scale_2") in tensors:
            return "modelopt_nvfp4"
        raise CheckpointError(f"{wname}: uint8 weight without {_name(prefix, 'weight_scale_2')!r}: "
                              "unknown packed layout")
    if w.dtype == _F8:
        if _name(prefix, "weight_scale_inv") in tensors:
            raise CheckpointError(f"{wname}: block FP8 (weight_scale_inv) is not supported")
        sname = _name(prefix, "weight_scale")
        s = _get(tensors, sname)
        if tuple(s.shape) in ((w.shape[0], 1), (w.shape[0],)):
            return "ct_fp8_channel"
        raise CheckpointError(f"{sname}: shape {list(s.shape)} is not per-channel [N, 1] with N="
                              f"{w.shape[0]}; per-tensor and block FP8 are not supported")
    if w.dtype in _FLOATS:
        return "fp16"
    raise CheckpointError(f"{wname}: unsupported weight dtype {w.dtype}")
