"""Prepack into each arch's fragment order: reversible, and every element where the kernel reads it."""

from __future__ import annotations

import pytest
import torch

from dflashgen.prepack import (
    NIBBLE_ORDER,
    Layout,
    _e4m3_ready_decode,
    _e4m3_ready_encode,
    pack_nvfp4_roundtrip,
    prepack,
    unpack,
)
from dflashgen.verify import random_fp8, random_nvfp4
from dflashgen.weights import WeightError

CPU = torch.device("cpu")
CASES = [(arch, fmt, n, k, silu) for arch in (70, 80, 90) for fmt in ("nvfp4", "fp8_channel")
         for (n, k, silu) in ((96, 256, False), (24, 128, False), (64, 128, True), (160, 192, False))]


def _weight(fmt: str, n: int, k: int, silu: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if fmt == "nvfp4":
        return random_nvfp4(n, k, (n // 2, n // 2) if silu else (n,), CPU, gen)
    return random_fp8(n, k, CPU, gen)


@pytest.mark.parametrize("arch,fmt,n,k,silu", CASES)
def test_prepack_round_trip(arch: int, fmt: str, n: int, k: int, silu: bool) -> None:
    lay = Layout(arch, fmt, n, k, silu)
    if lay.k % lay.k_group:
        pytest.skip("K not a multiple of this arch's group")
    w = _weight(fmt, n, k, silu)
    p = prepack(w, lay)
    assert p.weights.dtype == torch.uint8 and p.weights.numel() % 16 == 0
    assert not p.weights[-4096:].any(), "prefetch padding is zeros"
    payload, scales = unpack(p)
    if fmt == "nvfp4":
        assert torch.equal(payload, w.codes())
        assert torch.equal(scales, w.block_scale.view(torch.uint8))
        back = pack_nvfp4_roundtrip(w, lay)
        assert torch.equal(back.dequantize(), w.dequantize())
        assert torch.allclose(p.col_scale, w.column_scale() * (64 if arch >= 89 else 128))
    else:
        assert torch.equal(payload, w.weight.view(torch.uint8))
        assert torch.allclose(p.col_scale, w.scale * (1 if arch >= 89 else 256))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
def test_stream_bytes_counts_weights_and_block_scales(fmt: str) -> None:
    n, k = 96, 256
    p = prepack(_weight(fmt, n, k, False), Layout(90, fmt, n, k))
    payload = n * k // 2 + n * k // 16 if fmt == "nvfp4" else n * k  # codes (+ one E4M3 scale per 16)
    pad = p.stream_bytes - payload
    assert 0 < pad <= 2 * 8 * 32 * 16, "only the prefetch padding on top (8 groups x 32 lanes x 16 B per stream)"
    assert p.stream_bytes == p.weights.numel() + (0 if p.scales is None else p.scales.numel())


def _nibble(stream: torch.Tensor, idx: int) -> int:
    b = int(stream[idx // 2])
    return (b >> 4) if idx % 2 else (b & 0xF)


def test_sm80_nvfp4_lane_reads_what_the_kernel_expects() -> None:
    """Independent check of one lane's 16 bytes against mma_traits.cuh's Sm80Traits comments:
    words (p0,row g) (p0,row g+8) (p1,row g) (p1,row g+8); nibble pos -> K offset NIBBLE_ORDER."""
    n, k = 32, 128
    w = _weight("nvfp4", n, k, False, seed=3)
    p = prepack(w, Layout(80, "nvfp4", n, k))
    codes = w.codes()
    groups = k // 64
    for tile in range(n // 16):
        for grp in range(groups):
            for lane in (0, 5, 13, 31):
                g, t = lane // 4, lane % 4
                base = ((tile * groups + grp) * 32 + lane) * 32  # nibble index of the lane's 16 bytes
                for word, (pp, rsel) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                    for pos in range(8):
                        row = tile * 16 + g + 8 * rsel
                        kk = grp * 64 + 32 * pp + 8 * t + NIBBLE_ORDER[pos]
                        assert _nibble(p.weights, base + 8 * word + pos) == int(codes[row, kk])


def test_sm70_fp8_lane_reads_its_row() -> None:
    n, k = 64, 64
    w = _weight("fp8_channel", n, k, False, seed=4)
    p = prepack(w, Layout(70, "fp8_channel", n, k))
    raw = w.weight.view(torch.uint8)
    groups = k // 16
    for lane in range(32):
        qp, i = (lane >> 2) & 3, (lane & 3) + 4 * (lane >> 4)
        for tile in range(n // 32):
            for grp in range(groups):
                base = ((tile * groups + grp) * 32 + lane) * 16
                row = tile * 32 + 8 * qp + i
                assert torch.equal(p.weights[base : base + 16], raw[row, grp * 16 : grp * 16 + 16])


@pytest.mark.parametrize("arch", [70, 90])
def test_silu_layout_pairs_gate_and_up(arch: int) -> None:
    lay = Layout(arch, "nvfp4", 64, 64, silu=True)
    rows = lay.row_map()
    assert sorted(rows.tolist()) == list(range(64))
    inter = 32
    pair = 2 if arch == 70 else 8  # up row sits this far below its gate row
    for lr in range(64):
        j = int(rows[lr])
        if j < inter:
            assert int(rows[lr + pair]) == j + inter


def test_prepack_rejects_mismatches() -> None:
    w = _weight("nvfp4", 32, 128, False)
    with pytest.raises(WeightError, match="layout expects"):
        prepack(w, Layout(90, "nvfp4", 64, 128))
    with pytest.raises(WeightError, match="NVFP4 weight given"):
        prepack(w, Layout(90, "fp8_channel", 32, 128))
    with pytest.raises(WeightError, match="not a multiple"):
        prepack(_weight("nvfp4", 32, 96, False), Layout(90, "nvfp4", 32, 96))
    with pytest.raises(WeightError, match="unsupported arch"):
        Layout(60, "nvfp4", 32, 128).check()


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def _e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def _sm90_nvfp4_decode(word: int) -> tuple[int, int]:
    """decode.cuh's e2m1x8_e4m3, bit for bit."""
    lo = word & 0x9C9C9C9C
    hi = ((word << 2) & 0x8C8C8C8C) | ((word >> 2) & 0x10101010)
    return lo & 0xFFFFFFFF, hi & 0xFFFFFFFF


def test_e4m3_ready_bytes_decode_exactly_for_every_code_pair() -> None:
    """Every (code i, code i + 4) pair in a byte: the sm_89+ decoder yields E4M3 bytes equal to
    e2m1 * 2^-6, signed zero included, and nothing leaks into neighbouring bytes."""
    codes = torch.arange(16, dtype=torch.uint8)
    for a in range(16):
        for b in range(16):
            c = torch.stack([codes[a]] * 4 + [codes[b]] * 4).reshape(1, 8)
            word = int.from_bytes(bytes(_e4m3_ready_encode(c).reshape(-1).tolist()), "little")
            lo, hi = _sm90_nvfp4_decode(word)
            for i in range(4):
                blo, bhi = (lo >> (8 * i)) & 0xFF, (hi >> (8 * i)) & 0xFF
                assert _e4m3(blo) == _e2m1(a) * 2.0**-6 and (blo >> 7) == (a >> 3)
                assert _e4m3(bhi) == _e2m1(b) * 2.0**-6 and (bhi >> 7) == (b >> 3)
            assert torch.equal(_e4m3_ready_decode(_e4m3_ready_encode(c)), c)


def test_sm90_nvfp4_lane_reads_what_the_kernel_expects() -> None:
    """sm_90 (hardware E4M3): word order as on sm_80; decoded byte i of the low word is K offset
    8t + i, of the high word 8t + 4 + i (mma_traits.cuh's HW_E4M3 branch)."""
    n, k = 32, 128
    w = _weight("nvfp4", n, k, False, seed=3)
    lay = Layout(90, "nvfp4", n, k)
    assert lay.hw_e4m3 and lay.decode_scale == 64
    p = prepack(w, lay)
    codes = w.codes()
    groups = k // 64
    for tile in range(n // 16):
        for grp in range(groups):
            for lane in (0, 5, 13, 31):
                g, t = lane // 4, lane % 4
                base = ((tile * groups + grp) * 32 + lane) * 16
                for word, (pp, rsel) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                    raw = int.from_bytes(bytes(p.weights[base + 4 * word : base + 4 * word + 4].tolist()), "little")
                    lo, hi = _sm90_nvfp4_decode(raw)
                    row = tile * 16 + g + 8 * rsel
                    for e in range(8):
                        byte = ((lo if e < 4 else hi) >> (8 * (e % 4))) & 0xFF
                        kk = grp * 64 + 32 * pp + 8 * t + e
                        assert _e4m3(byte) == _e2m1(int(codes[row, kk])) * 2.0**-6
