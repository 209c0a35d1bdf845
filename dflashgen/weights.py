"""Quantized weight containers in their logical (checkpoint-independent) form, their exact
dequantization, and the FP32 reference GEMM every kernel is checked against.

Logical form:
- NVFP4: ``packed`` uint8 [N, K/2] (E2M1 codes, element 2b in the low nibble of byte b),
  ``block_scale`` float8_e4m3fn [N, K/16], ``global_scale`` float32 [S] *multipliers*, one per
  logical N-segment (fused q|k|v|z or gate|up keep one each), ``segments`` the S segment sizes.
- Channel FP8: ``weight`` float8_e4m3fn [N, K], ``scale`` float32 [N].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NVFP4_BLOCK = 16
# E2M1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class WeightError(ValueError):
    """A weight tensor has the wrong dtype, shape or contents."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise WeightError(msg)


@dataclass
class NVFP4Weight:
    packed: torch.Tensor  # uint8 [N, K/2]
    block_scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    global_scale: torch.Tensor  # float32 [S], multipliers
    segments: tuple[int, ...]

    def __post_init__(self) -> None:
        self.segments = tuple(int(s) for s in self.segments) or (self.packed.shape[0],)
        _check(self.packed.dtype == torch.uint8 and self.packed.dim() == 2,
               f"NVFP4 codes must be uint8 [N, K/2], got {self.packed.dtype} {tuple(self.packed.shape)}")
        n, k2 = self.packed.shape
        _check(self.block_scale.dtype == torch.float8_e4m3fn,
               f"NVFP4 block scales must be float8_e4m3fn, got {self.block_scale.dtype}")
        _check(tuple(self.block_scale.shape) == (n, (2 * k2) // NVFP4_BLOCK) and (2 * k2) % NVFP4_BLOCK == 0,
               f"NVFP4 block scales must be [N, K/16] = [{n}, {(2 * k2) // NVFP4_BLOCK}], "
               f"got {tuple(self.block_scale.shape)}")
        self.global_scale = self.global_scale.reshape(-1).to(torch.float32)
        _check(sum(self.segments) == n, f"segments {self.segments} do not add up to N={n}")
        _check(self.global_scale.numel() == len(self.segments),
               f"{len(self.segments)} segments need {len(self.segments)} global scales, "
               f"got {self.global_scale.numel()}")

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * 2

    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes, uint8 [N, K] with values 0..15."""
        return unpack_nibbles(self.packed)

    def column_scale(self) -> torch.Tensor:
        """Per-output-channel global multiplier, float32 [N] (the segment's global scale)."""
        # expand + cat, not repeat_interleave with a tensor: no host sync, so CUDA-graph safe
        return torch.cat([self.global_scale[i : i + 1].expand(n) for i, n in enumerate(self.segments)])

    def dequantize(self) -> torch.Tensor:
        """Exact FP32 weights [N, K]."""
        vals = e2m1_to_float(self.codes())
        bs = self.block_scale.to(torch.float32).repeat_interleave(NVFP4_BLOCK, dim=1)
        return vals * bs * self.column_scale().to(vals.device)[:, None]


@dataclass
class FP8ChannelWeight:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]

    def __post_init__(self) -> None:
        _check(self.weight.dtype == torch.float8_e4m3fn and self.weight.dim() == 2,
               f"channel-FP8 weight must be float8_e4m3fn [N, K], got {self.weight.dtype} "
               f"{tuple(self.weight.shape)}")
        _check(self.scale.numel() == self.weight.shape[0],
               f"channel-FP8 scale must have N={self.weight.shape[0]} entries, got {tuple(self.scale.shape)}")
        self.scale = self.scale.reshape(-1).to(torch.float32)

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    def column_scale(self) -> torch.Tensor:
        return self.scale

    def dequantize(self) -> torch.Tensor:
        return self.weight.to(torch.float32) * self.scale[:, None]


QuantWeight = NVFP4Weight | FP8ChannelWeight


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> float32 values, by arithmetic (no lookup-table tensor, so it is
    safe inside CUDA graph capture)."""
    c = codes.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).to(torch.float32)) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def reference_gemm(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """FP32 reference: the same FP16 input times the exactly dequantized weights, in FP32."""
    wf = w.dequantize().to(x.device)
    return x.to(torch.float32) @ wf.t()


def reference_silu_mul(y: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for a fused gate|up output [M, 2I] -> [M, I], in FP32."""
    gate, up = y.to(torch.float32).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.to(torch.float32)
    ref = ref.to(torch.float32)
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))
