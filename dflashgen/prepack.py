"""Offline weight prepack into each arch's MMA fragment order (mirrors templates/include/dflashgen/
mma_traits.cuh). Every layout is a reshape + permutation of the (row-permuted, zero-padded) logical
tensor (NVFP4 on sm_89+ adds a bit-level repack of each 8-code word), exactly reversible:
``unpack`` inverts ``prepack``.

Packed weights: per (warp tile, K group) 32 lanes x 16 bytes, tiles outermost, so a warp streams
contiguous 512-byte chunks. NVFP4 block scales: per (tile, group) the bytes each lane needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .weights import FP8ChannelWeight, NVFP4Weight, WeightError, pack_nibbles, unpack_nibbles

# Table-free decoder (sm_70 / sm_80): nibble position p inside a 32-bit word holds element
# NIBBLE_ORDER[p] of the lane's eight consecutive K values, so that half2 pair j = (element 2j,
# 2j+1) sits in nibbles (j, j + 4).
NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# sm_89+ decodes through the hardware E4M3 conversion (decode.cuh): byte i of a word holds element i
# as an E4M3 byte (sign bit 7, e1 e0 m at bits 4..2) and element i + 4 in the other bits (sign 5,
# e1 6, e0 m 1..0). A bit-level repack, inverted exactly by _e4m3_ready_decode.
HW_E4M3_MIN_ARCH = 89

# Zero groups appended to every packed stream: the kernels' register pipeline prefetches up to
# this many groups past a worker's range without bounds checks (PAD_GROUPS in decode.cuh).
PAD_GROUPS = 8
GROUP_BYTES = 512  # one 16-byte load per lane of a warp
SCALE_GROUP_BYTES = 64

ARCH_FAMILY = {70: "sm70", 75: "sm70", 80: "sm80", 86: "sm80", 89: "sm80", 90: "sm80"}
TILE_ROWS = {"sm70": 32, "sm80": 16}
K_GROUP = {("sm70", "nvfp4"): 32, ("sm70", "fp8_channel"): 16, ("sm80", "nvfp4"): 64, ("sm80", "fp8_channel"): 32}


def family(arch: int) -> str:
    try:
        return ARCH_FAMILY[arch]
    except KeyError:
        raise WeightError(f"unsupported arch sm_{arch}; supported: {sorted(ARCH_FAMILY)}") from None


@dataclass(frozen=True)
class Layout:
    """Where every logical weight lands for one (arch, format, N, K, epilogue)."""

    arch: int
    fmt: str  # "nvfp4" | "fp8_channel"
    n: int
    k: int
    silu: bool = False  # fused gate|up: gate and up rows interleaved per thread

    @property
    def fam(self) -> str:
        return family(self.arch)

    @property
    def tile_rows(self) -> int:
        return TILE_ROWS[self.fam]

    @property
    def k_group(self) -> int:
        return K_GROUP[(self.fam, self.fmt)]

    @property
    def hw_e4m3(self) -> bool:
        """The kernel decodes with cvt.rn.f16x2.e4m3x2 (sm_89+); NVFP4 codes are packed E4M3-ready."""
        return self.fam == "sm80" and self.arch >= HW_E4M3_MIN_ARCH

    @property
    def decode_scale(self) -> float:
        """Power of two the kernel's exact decode leaves out (folded into col_scale, decode.cuh)."""
        if self.fmt == "nvfp4":
            return 2.0**6 if self.hw_e4m3 else 2.0**7
        return 1.0 if self.hw_e4m3 else 2.0**8

    @property
    def n_pad(self) -> int:
        t = self.tile_rows
        return (self.n + t - 1) // t * t

    def check(self) -> None:
        if self.k % self.k_group:
            raise WeightError(f"K={self.k} is not a multiple of {self.k_group} ({self.fam} {self.fmt} K group)")
        if self.silu and (self.n % 2 or (self.n // 2) % (self.tile_rows // 2)):
            raise WeightError(f"fused gate|up needs N/2 a multiple of {self.tile_rows // 2}, got N={self.n}")

    def row_map(self) -> torch.Tensor:
        """Layout row -> logical row (or -1 for zero padding)."""
        rows = torch.full((self.n_pad,), -1, dtype=torch.int64)
        if not self.silu:
            rows[: self.n] = torch.arange(self.n)
            return rows
        inter = self.n // 2
        j = torch.arange(inter)
        if self.fam == "sm80":  # per 16-row tile: 8 gate rows then the same 8 up rows
            gate = 16 * (j // 8) + j % 8
            up = gate + 8
        else:  # per 8-row QP block: rows {0,1,4,5} gate, {2,3,6,7} up
            gate = 8 * (j // 4) + (j & 1) + 4 * ((j & 3) >> 1)
            up = gate + 2
        rows[gate] = j
        rows[up] = j + inter
        return rows

    # (view of [N_pad, K] elements, permutation) per layout; the permuted tensor, flattened, is
    # the packed element stream (nibbles for NVFP4 codes, bytes otherwise).
    def weight_view(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        t, g = self.n_pad // self.tile_rows, self.k // self.k_group
        if self.fam == "sm80" and self.fmt == "nvfp4":
            # rows (tile, rsel, g), K (group, p, t, o) -> (tile, group, g, t, p, rsel, o)
            return (t, 2, 8, g, 2, 4, 8), (0, 3, 2, 5, 4, 1, 6)
        if self.fam == "sm80":
            # rows (tile, rsel, g), K (group, t, s, b) -> (tile, group, g, t, rsel, s, b)
            return (t, 2, 8, g, 4, 2, 4), (0, 3, 2, 4, 1, 5, 6)
        # sm70: rows (tile, qp, rhi, rlo) with lane = 16 rhi + 4 qp + rlo; K (group, e)
        return (t, 4, 2, 4, g, self.k_group), (0, 4, 2, 1, 3, 5)

    def scale_view(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """NVFP4 block scales [N_pad, K/16]."""
        t, g = self.n_pad // self.tile_rows, self.k // self.k_group
        if self.fam == "sm80":
            # rows (tile, rsel, g), blocks (group, p, h) -> (tile, group, g, h, p, rsel)
            return (t, 2, 8, g, 2, 2), (0, 3, 2, 5, 4, 1)
        # sm70: rows (tile, qp, rhi, rlo), blocks (group, b) -> (tile, group, rhi, qp, rlo, b)
        return (t, 4, 2, 4, g, 2), (0, 4, 2, 1, 3, 5)


def _silu_view(layout: Layout) -> tuple[int, int]:
    """Fused gate|up rows: layout row ((blk * a + i) * 2 + s) * b + j holds logical row
    s * I + (blk * a + i) * b + j (s = 0 gate, 1 up): (a, b) = (1, 8) on sm80, (2, 2) on sm70."""
    return (1, 8) if layout.fam == "sm80" else (2, 2)


# Row permutations use views only (no index tensors, no host syncs): CUDA-graph safe.
def _permute_rows(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout.silu:
        a, b = _silu_view(layout)
        inter = layout.n // 2
        return x.reshape(2, inter // (a * b), a, b, -1).permute(1, 2, 0, 3, 4).reshape(layout.n, -1)
    return torch.nn.functional.pad(x, (0, 0, 0, layout.n_pad - layout.n))


def _unpermute_rows(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout.silu:
        a, b = _silu_view(layout)
        inter = layout.n // 2
        return x.reshape(inter // (a * b), a, 2, b, -1).permute(2, 0, 1, 3, 4).reshape(layout.n, -1)
    return x[: layout.n]


def _e4m3_ready_encode(codes: torch.Tensor) -> torch.Tensor:
    """[..., 8] E2M1 codes -> [..., 4] bytes in the sm_89+ order (see HW_E4M3_MIN_ARCH)."""
    a, b = codes[..., :4], codes[..., 4:]
    return ((a & 8) << 4) | ((a & 7) << 2) | ((b & 8) << 2) | ((b & 4) << 4) | (b & 3)


def _e4m3_ready_decode(byts: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_e4m3_ready_encode`."""
    a = ((byts >> 4) & 8) | ((byts >> 2) & 7)
    b = ((byts >> 2) & 8) | ((byts >> 4) & 4) | (byts & 3)
    return torch.cat([a, b], dim=-1)


def _to_stream(x: torch.Tensor, view: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    shape, perm = view
    return x.reshape(shape).permute(perm).reshape(-1)


def _from_stream(s: torch.Tensor, view: tuple[tuple[int, ...], tuple[int, ...]], cols: int) -> torch.Tensor:
    shape, perm = view
    permuted = tuple(shape[p] for p in perm)
    inverse = tuple(perm.index(i) for i in range(len(perm)))
    return s.reshape(permuted).permute(inverse).reshape(-1, cols)


@dataclass
class PackedWeight:
    """Device-ready operands of one generated kernel."""

    layout: Layout
    weights: torch.Tensor  # uint8, 16-byte aligned stream
    scales: torch.Tensor | None  # uint8 stream (NVFP4 block scales) or None
    col_scale: torch.Tensor  # float32 [N]: global / channel scale times layout.decode_scale

    @property
    def stream_bytes(self) -> int:
        """Bytes a kernel streams from memory per call: the weights and their block scales."""
        return self.weights.numel() + (self.scales.numel() if self.scales is not None else 0)


def prepack(w: NVFP4Weight | FP8ChannelWeight, layout: Layout) -> PackedWeight:
    layout.check()
    if (w.n, w.k) != (layout.n, layout.k):
        raise WeightError(f"weight is {w.n}x{w.k}, layout expects {layout.n}x{layout.k}")
    if isinstance(w, NVFP4Weight):
        if layout.fmt != "nvfp4":
            raise WeightError(f"NVFP4 weight given to a {layout.fmt} layout")
        codes = _permute_rows(w.codes(), layout)
        stream = _to_stream(codes, layout.weight_view())
        if layout.hw_e4m3:
            weights = _e4m3_ready_encode(stream.reshape(-1, 8)).reshape(-1)
        else:
            stream = stream.reshape(-1, 4, 2).transpose(1, 2).reshape(1, -1)  # NIBBLE_ORDER as a view
            weights = pack_nibbles(stream).reshape(-1)
        bs = _permute_rows(w.block_scale.view(torch.uint8), layout)
        scales = _to_stream(bs, layout.scale_view()).contiguous()
        col = w.column_scale() * layout.decode_scale
    else:
        if layout.fmt != "fp8_channel":
            raise WeightError(f"channel-FP8 weight given to a {layout.fmt} layout")
        raw = _permute_rows(w.weight.view(torch.uint8), layout)
        weights = _to_stream(raw, layout.weight_view()).contiguous()
        scales = None
        col = w.scale * layout.decode_scale
    weights = torch.cat([weights, weights.new_zeros(PAD_GROUPS * GROUP_BYTES)])
    if scales is not None:
        scales = torch.cat([scales, scales.new_zeros(PAD_GROUPS * SCALE_GROUP_BYTES)])
    return PackedWeight(layout, weights.contiguous(), scales, col.to(torch.float32).contiguous())


def unpack(p: PackedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`prepack` for the quantized payload: (codes uint8 [N, K] or FP8 bytes
    [N, K], block scales uint8 [N, K/16] or None)."""
    lay = p.layout
    payload_bytes = lay.n_pad * lay.k // (2 if lay.fmt == "nvfp4" else 1)
    weights = p.weights[:payload_bytes]  # drop the prefetch padding
    if lay.fmt == "nvfp4":
        if lay.hw_e4m3:
            stream = _e4m3_ready_decode(weights.reshape(-1, 4)).reshape(-1)
        else:
            nib = unpack_nibbles(weights.reshape(1, -1))
            stream = nib.reshape(-1, 2, 4).transpose(1, 2).reshape(-1)  # inverse of NIBBLE_ORDER
        codes = _unpermute_rows(_from_stream(stream, lay.weight_view(), lay.k), lay)
        sc = p.scales[: lay.n_pad * lay.k // 16]
        scales = _unpermute_rows(_from_stream(sc, lay.scale_view(), lay.k // 16), lay)
        return codes, scales
    raw = _unpermute_rows(_from_stream(weights, lay.weight_view(), lay.k), lay)
    return raw, None


def pack_nvfp4_roundtrip(w: NVFP4Weight, layout: Layout) -> NVFP4Weight:
    """prepack -> unpack back to a logical NVFP4Weight (used by tests)."""
    codes, scales = unpack(prepack(w, layout))
    return NVFP4Weight(pack_nibbles(codes), scales.view(torch.float8_e4m3fn), w.global_scale, w.segments)
