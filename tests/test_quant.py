"""Quantizers, checkpoint layouts and a cross-check against compressed-tensors' own (de)quantization."""

from __future__ import annotations

import re

import pytest
import torch

from dflashgen.quant import (
    CheckpointError,
    MissingTensorError,
    concat_fp8,
    concat_segments,
    detect_layout,
    from_compressed_tensors_fp8,
    from_compressed_tensors_nvfp4,
    from_modelopt_nvfp4,
    quantize_fp8_channel,
    quantize_nvfp4,
    split_fp8,
    split_segments,
    to_compressed_tensors_fp8,
    to_compressed_tensors_nvfp4,
    to_modelopt_nvfp4,
)
from dflashgen.weights import E2M1_VALUES, FP8ChannelWeight, NVFP4Weight, WeightError, pack_nibbles, rel_l2

F8 = torch.float8_e4m3fn
P = "model.layers.0.mlp.down_proj"


def _w(n: int = 48, k: int = 128, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(dtype)


def _same_nvfp4(a: NVFP4Weight, b: NVFP4Weight) -> None:
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
    assert torch.equal(a.global_scale, b.global_scale)
    assert a.segments == b.segments


def _same_fp8(a: FP8ChannelWeight, b: FP8ChannelWeight) -> None:
    assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
    assert torch.equal(a.scale, b.scale)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("prefix", [P, ""])
def test_nvfp4_layout_round_trips(prefix: str) -> None:
    q = quantize_nvfp4(_w())
    mo = to_modelopt_nvfp4(q, prefix)
    ct = to_compressed_tensors_nvfp4(q, prefix)
    dot = f"{prefix}." if prefix else ""
    assert set(mo) == {dot + s for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    assert set(ct) == {dot + s for s in ("weight_packed", "weight_scale", "weight_global_scale",
                                         "input_global_scale")}
    assert mo[dot + "weight_scale_2"].shape == () and ct[dot + "weight_global_scale"].shape == (1,)
    # ModelOpt stores the multiplier, compressed-tensors the divisor.
    assert float(mo[dot + "weight_scale_2"]) == pytest.approx(1 / float(ct[dot + "weight_global_scale"]),
                                                              rel=1e-6)
    assert detect_layout(mo, prefix) == "modelopt_nvfp4"
    assert detect_layout(ct, prefix) == "ct_nvfp4"
    _same_nvfp4(from_modelopt_nvfp4(mo, prefix), q)
    _same_nvfp4(from_compressed_tensors_nvfp4(ct, prefix), q)


def test_nvfp4_reads_ignore_activation_scales_and_accept_scalar_shapes() -> None:
    q = quantize_nvfp4(_w())
    mo = to_modelopt_nvfp4(q, P)
    del mo[f"{P}.input_scale"]
    mo[f"{P}.weight_scale_2"] = mo[f"{P}.weight_scale_2"].reshape(1)
    ct = to_compressed_tensors_nvfp4(q, P)
    del ct[f"{P}.input_global_scale"]
    ct[f"{P}.weight_global_scale"] = ct[f"{P}.weight_global_scale"].reshape(())
    _same_nvfp4(from_modelopt_nvfp4(mo, P), q)
    _same_nvfp4(from_compressed_tensors_nvfp4(ct, P), q)


def test_ct_divisor_round_trip_is_bit_exact() -> None:
    # fp32 1/(1/x) != x for ~1/6 of values; the writer must still pick a divisor that reads back as g.
    g = torch.Generator().manual_seed(1)
    divisors = torch.exp(torch.empty(400).uniform_(-20, 20, generator=g)).float()
    for d in divisors:
        gs = (1.0 / d.double()).float().reshape(1)
        q = NVFP4Weight(torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(1, 1, dtype=F8), gs, (1,))
        back = from_compressed_tensors_nvfp4(to_compressed_tensors_nvfp4(q, P), P)
        assert torch.equal(back.global_scale, gs)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flat_scale", [False, True])
def test_fp8_layout_round_trip(scale_dtype: torch.dtype, flat_scale: bool) -> None:
    q = quantize_fp8_channel(_w())
    ct = to_compressed_tensors_fp8(q, P, scale_dtype=scale_dtype)
    assert ct[f"{P}.weight_scale"].shape == (q.n, 1) and ct[f"{P}.weight_scale"].dtype == scale_dtype
    if flat_scale:
        ct[f"{P}.weight_scale"] = ct[f"{P}.weight_scale"].reshape(-1)
    assert detect_layout(ct, P) == "ct_fp8_channel"
    back = from_compressed_tensors_fp8(ct, P)
    # A 16-bit scale is rounded once on write (as such publishers do); reading it is exact.
    _same_fp8(back, FP8ChannelWeight(q.weight, q.scale.to(scale_dtype).float()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_detect_unquantized(dtype: torch.dtype) -> None:
    assert detect_layout({f"{P}.weight": _w(dtype=dtype)}, P) == "fp16"


# --------------------------------------------------------------------------- quantizer quality


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantizer_error_is_sane(dtype: torch.dtype) -> None:
    w = _w(64, 256, dtype)
    q4 = quantize_nvfp4(w)
    q8 = quantize_fp8_channel(w)
    assert q4.packed.shape == (64, 128) and q4.block_scale.shape == (64, 16) and q4.global_scale.shape == (1,)
    assert rel_l2(q4.dequantize(), w) < 0.12
    assert rel_l2(q8.dequantize(), w) < 0.05
    # The global multiplier follows amax / (6 * 448) and at least one block scale hits 448.
    amax = float(w.float().abs().max())
    assert float(q4.global_scale) == pytest.approx(amax / 2688, rel=1e-6)
    assert float(q4.block_scale.float().max()) == 448.0
    assert torch.allclose(q8.scale, w.float().abs().amax(1) / 448, rtol=1e-6, atol=0)
    # Non-contiguous input quantizes identically.
    _same_nvfp4(quantize_nvfp4(w.t().contiguous().t()), q4)
    _same_fp8(quantize_fp8_channel(w.t().contiguous().t()), q8)


def test_nvfp4_exact_on_representable_values() -> None:
    # w = e2m1 * 448 * 2^-j * 2^-m: block scales 448 * 2^-j and a power-of-two multiplier 2^-m are
    # exact, and every block holds a +-6 so the quantizer must recover codes and scales exactly.
    g = torch.Generator().manual_seed(2)
    n, k, m = 16, 64, 12
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[:, ::16] = torch.where(torch.rand(n, k // 16, generator=g) < 0.5, 7, 15).to(torch.uint8)
    j = torch.randint(0, 5, (n, k // 16), generator=g)
    j[0, 0] = 0  # the tensor amax is 6 * 448 * 2^-m
    bscale = 448.0 * torch.pow(2.0, -j.float())
    vals = torch.tensor(E2M1_VALUES)[codes.long()]
    w = vals * bscale.repeat_interleave(16, 1) * 2.0**-m
    q = quantize_nvfp4(w)
    want = NVFP4Weight(pack_nibbles(codes), bscale.to(F8), torch.tensor([2.0**-m]), (n,))
    # -0.0 inputs keep their sign code (8), like compressed-tensors, so codes match exactly.
    _same_nvfp4(q, want)
    assert torch.equal(q.dequantize(), w)


def test_fp8_exact_on_representable_values() -> None:
    g = torch.Generator().manual_seed(3)
    n, k = 8, 32
    vals = torch.randn(n, k, generator=g).mul(50).clamp(-440, 440).to(F8).float()
    vals[:, 0] = 448.0
    scale = torch.pow(2.0, -torch.randint(0, 20, (n,), generator=g).float())
    w = vals * scale[:, None]
    q = quantize_fp8_channel(w)
    assert torch.equal(q.scale, scale) and torch.equal(q.weight.float(), vals)
    assert torch.equal(q.dequantize(), w)


def test_zero_blocks_rows_and_segments() -> None:
    w = _w(32, 64)
    w[:16] = 0  # a whole zero segment
    w[20, 16:32] = 0  # a zero block
    q = quantize_nvfp4(w, (16, 16))
    assert float(q.global_scale[0]) == 1.0  # compressed-tensors' fallback divisor 1
    assert torch.equal(q.dequantize()[:16], w[:16]) and torch.equal(q.dequantize()[20, 16:32], w[20, 16:32])
    f = quantize_fp8_channel(w)
    assert torch.equal(f.dequantize()[:16], w[:16])


def test_fused_segments_keep_separate_global_scales() -> None:
    segs = (32, 16, 48)
    mags = (1e-3, 1.0, 30.0)
    w = torch.cat([_w(s, 64, seed=i) * m for i, (s, m) in enumerate(zip(segs, mags, strict=True))])
    q = quantize_nvfp4(w, segs)
    assert q.segments == segs and q.global_scale.shape == (3,)
    deq = q.dequantize()
    for i, part in enumerate(w.split(segs)):
        amax = float(part.abs().max())
        assert float(q.global_scale[i]) == pytest.approx(amax / 2688, rel=1e-6)
        # A shared (max) global scale would push the 1e-3 segment's block scales into FP8 subnormals.
        assert rel_l2(deq.split(segs)[i], part) < 0.12
        # ... and the segment quantizes exactly as if it were its own matrix.
        _same_nvfp4(split_segments(q)[i], quantize_nvfp4(part))
    # Fused -> per-segment checkpoint tensors -> fused again is lossless.
    for to, frm in ((to_modelopt_nvfp4, from_modelopt_nvfp4),
                    (to_compressed_tensors_nvfp4, from_compressed_tensors_nvfp4)):
        ckpt: dict[str, torch.Tensor] = {}
        for name, part in zip(("q_proj", "k_proj", "v_proj"), split_segments(q), strict=True):
            ckpt.update(to(part, name))
        _same_nvfp4(concat_segments([frm(ckpt, name) for name in ("q_proj", "k_proj", "v_proj")]), q)
    with pytest.raises(WeightError, match="split_segments"):
        to_modelopt_nvfp4(q, P)
    with pytest.raises(WeightError, match="split_segments"):
        to_compressed_tensors_nvfp4(q, P)


def test_fp8_split_concat() -> None:
    q = quantize_fp8_channel(_w())
    parts = split_fp8(q, (16, 32))
    assert [p.n for p in parts] == [16, 32]
    _same_fp8(concat_fp8(parts), q)
    with pytest.raises(WeightError, match="different K"):
        concat_fp8([q, quantize_fp8_channel(_w(k=64))])
    with pytest.raises(WeightError, match="segments"):
        split_fp8(q, (16, 16))


# --------------------------------------------------------------------------- compressed-tensors oracle


def _ct_nvfp4_args():  # -> compressed_tensors QuantizationArgs
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    return NVFP4A16["weights"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_quantize_matches_compressed_tensors(dtype: torch.dtype) -> None:
    """Codes and block scales must equal the library's bit for bit.

    We replicate its op order (divisor 2688/amax, fp8(divisor * block_amax / 6), w / (scale / divisor),
    round-half-to-even E2M1), so no tie is allowed to differ. The CPU path is compared (the Triton path
    uses the same thresholds and correctly rounded division). The divisor we *write* may differ from the
    library's by an ulp, because we keep the multiplier 1/divisor; both give the same multiplier."""
    args = _ct_nvfp4_args()
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    # Third segment: exact ties. Its amax 6 * 448 * 2^-10 makes the divisor 2^10 and every block scale
    # exact, so w / (scale / divisor) lands exactly on the midpoints between E2M1 magnitudes.
    ties = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5,
                         -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    step = 448.0 * torch.pow(2.0, -10 - torch.arange(16.0))[:, None]  # one power of two per row
    segs = (32, 48, 16)
    w = torch.cat([_w(32, 128, seed=4), _w(48, 128, seed=5) * 40, (ties.repeat(8) * step)]).to(dtype)
    w[3, :16] = 0  # zero block: the library's eps scale
    q = quantize_nvfp4(w, segs)
    row = 0
    for i, (s, part) in enumerate(zip(segs, w.float().split(segs), strict=True)):
        gdiv = generate_gparam(part.amin(), part.amax())
        blocks = part.view(s, -1, 16)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gdiv)
        packed = quantize_and_pack_fp4(part, scale, global_scale=gdiv, group_size=16)
        assert torch.equal(q.block_scale[row:row + s].float(), scale)
        assert torch.equal(q.packed[row:row + s], packed)
        assert torch.equal(q.global_scale[i:i + 1], (1.0 / gdiv.double()).float())
        written = to_compressed_tensors_nvfp4(split_segments(q)[i], "x")["x.weight_global_scale"]
        assert torch.equal((1.0 / written.double()).float(), (1.0 / gdiv.double()).float())
        row += s
    # Round-half-to-even on the ties, independently of the library.
    want = torch.tensor([7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 15], dtype=torch.uint8)
    assert torch.equal(q.codes()[80:], want.repeat(16, 8))


def test_nvfp4_dequantize_matches_compressed_tensors() -> None:
    """The library's dequantization of our compressed-tensors tensors equals NVFP4Weight.dequantize().

    fp32 path: it computes code * fp32(scale / divisor), we compute fp32(code * scale) * fp32(1 / divisor);
    each side rounds at most twice, so results agree to a few fp32 ulps: rtol 1e-6 (~8 ulp), atol 0
    (zeros are exact on both sides). The compressor path returns bf16: equal to ours within one bf16 ulp.
    """
    args = _ct_nvfp4_args()
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    q = quantize_nvfp4(_w(40, 256, seed=6) * 3)
    ours = q.dequantize()
    ct = to_compressed_tensors_nvfp4(q, "")
    n, k2 = ct["weight_packed"].shape
    vals = unpack_fp4_from_uint8(ct["weight_packed"], n, 2 * k2, dtype=torch.float32)
    # Nibble order and sign codes (including -0) agree with the library's packer in both directions.
    lut = torch.tensor(E2M1_VALUES)
    assert torch.equal(vals, lut[q.codes().long()])
    assert torch.equal(pack_fp4_to_uint8(vals), q.packed)
    theirs = dequantize(x_q=vals, scale=ct["weight_scale"].float(), args=args,
                        global_scale=ct["weight_global_scale"], dtype=torch.float32)
    assert theirs.dtype == torch.float32
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=0)
    state = NVFP4PackedCompressor.decompress(
        {k: v for k, v in ct.items() if k != "input_global_scale"},
        QuantizationScheme(targets=["Linear"], weights=args))
    torch.testing.assert_close(state["weight"].float(), ours.bfloat16().float(), rtol=2**-8, atol=0)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_fp8_matches_compressed_tensors(scale_dtype: torch.dtype) -> None:
    """FP8 quantize and dequantize are bit-exact against the library: the dequant is one multiply of
    exact operands (fp8 has 4 significant bits, bf16 8, so the product is exact in fp32 and its bf16
    rounding equals the library's bf16 multiply)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.quant_scheme import FP8_DYNAMIC
    from compressed_tensors.quantization.utils import calculate_qparams

    args = FP8_DYNAMIC["weights"]
    w = _w(40, 96, seed=7) * torch.logspace(-3, 2, 40)[:, None]
    w[7] = 0
    q = quantize_fp8_channel(w)
    scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
    assert torch.equal(scale.reshape(-1), q.scale)
    theirs_q = quantize(x=w, scale=scale, zero_point=None, args=args, dtype=F8)
    assert torch.equal(theirs_q.view(torch.uint8), q.weight.view(torch.uint8))

    ct = to_compressed_tensors_fp8(q, "", scale_dtype=scale_dtype)
    ours = from_compressed_tensors_fp8(ct, "").dequantize()
    state = FloatQuantizationCompressor.decompress(dict(ct), QuantizationScheme(targets=["Linear"],
                                                                                weights=args))
    assert state["weight"].dtype == scale_dtype
    assert torch.equal(state["weight"], ours.to(scale_dtype))


# --------------------------------------------------------------------------- error paths


def _layouts() -> dict[str, tuple]:
    q4, q8 = quantize_nvfp4(_w()), quantize_fp8_channel(_w())
    return {
        "modelopt": (to_modelopt_nvfp4(q4, P), from_modelopt_nvfp4,
                     ("weight", "weight_scale", "weight_scale_2")),
        "ct_nvfp4": (to_compressed_tensors_nvfp4(q4, P), from_compressed_tensors_nvfp4,
                     ("weight_packed", "weight_scale", "weight_global_scale")),
        "ct_fp8": (to_compressed_tensors_fp8(q8, P), from_compressed_tensors_fp8, ("weight", "weight_scale")),
    }


@pytest.mark.parametrize("layout", ["modelopt", "ct_nvfp4", "ct_fp8"])
def test_missing_tensor_is_named(layout: str) -> None:
    tensors, read, required = _layouts()[layout]
    for suffix in required:
        broken = {k: v for k, v in tensors.items() if k != f"{P}.{suffix}"}
        with pytest.raises(MissingTensorError, match=f"'{P}.{suffix}'") as ei:
            read(broken, P)
        assert isinstance(ei.value, KeyError) and isinstance(ei.value, ValueError)
    with pytest.raises(MissingTensorError, match="model.layers.1"):
        read(tensors, "model.layers.1")


@pytest.mark.parametrize(
    ("layout", "suffix", "bad_dtype", "expected"),
    [
        ("modelopt", "weight", torch.int8, "torch.uint8"),
        ("modelopt", "weight_scale", torch.float16, "torch.float8_e4m3fn"),
        ("modelopt", "weight_scale_2", torch.float16, "torch.float32"),
        ("ct_nvfp4", "weight_packed", torch.int32, "torch.uint8"),
        ("ct_nvfp4", "weight_scale", torch.uint8, "torch.float8_e4m3fn"),
        ("ct_nvfp4", "weight_global_scale", torch.bfloat16, "torch.float32"),
        ("ct_fp8", "weight", torch.float16, "torch.float8_e4m3fn"),
        ("ct_fp8", "weight_scale", torch.float64, "torch.float16 or torch.bfloat16 or torch.float32"),
    ],
)
def test_wrong_dtype_is_named(layout: str, suffix: str, bad_dtype: torch.dtype, expected: str) -> None:
    tensors, read, _ = _layouts()[layout]
    name = f"{P}.{suffix}"
    tensors[name] = tensors[name].float().to(bad_dtype)
    with pytest.raises(CheckpointError, match=rf"{name}: expected dtype {expected}.*got {bad_dtype}"):
        read(tensors, P)


@pytest.mark.parametrize(
    ("layout", "suffix", "shape", "expected"),
    [
        ("modelopt", "weight", (48 * 64,), r"\[N, K/2\]"),
        ("modelopt", "weight_scale", (48, 4), r"\[48, 8\]"),
        ("modelopt", "weight_scale", (8, 48), r"\[48, 8\]"),
        ("modelopt", "weight_scale_2", (2,), r"\[\] or \[1\]"),
        ("ct_nvfp4", "weight_packed", (48, 64, 1), r"\[N, K/2\]"),
        ("ct_nvfp4", "weight_scale", (24, 8), r"\[48, 8\]"),
        ("ct_nvfp4", "weight_global_scale", (1, 1), r"\[\] or \[1\]"),
        ("ct_fp8", "weight", (48 * 128,), r"\[N, K\]"),
        ("ct_fp8", "weight_scale", (48, 2), r"\[48, 1\] or \[48\]"),
        ("ct_fp8", "weight_scale", (1, 1), r"\[48, 1\] or \[48\]"),
    ],
)
def test_wrong_shape_is_named(layout: str, suffix: str, shape: tuple[int, ...], expected: str) -> None:
    tensors, read, _ = _layouts()[layout]
    name = f"{P}.{suffix}"
    t = tensors[name]
    tensors[name] = torch.zeros(shape, dtype=t.dtype)
    got = re.escape(str(list(shape)))
    with pytest.raises(CheckpointError, match=rf"{name}: expected shape .*{expected}, got {got}"):
        read(tensors, P)


def test_bad_values_are_rejected() -> None:
    for layout, suffix in (("modelopt", "weight_scale_2"), ("ct_nvfp4", "weight_global_scale")):
        for v in (0.0, -1.0, float("inf"), float("nan")):
            tensors, read, _ = _layouts()[layout]
            tensors[f"{P}.{suffix}"] = torch.tensor(v)
            with pytest.raises(CheckpointError, match=f"{P}.{suffix}: expected a finite positive"):
                read(tensors, P)
    tensors, read, _ = _layouts()["ct_nvfp4"]
    tensors[f"{P}.weight_global_scale"] = torch.tensor([1e-45])  # reciprocal overflows fp32
    with pytest.raises(CheckpointError, match="no fp32 reciprocal"):
        read(tensors, P)
    for bad, what in ((float("nan"), "NaN"), (-2.0, "non-negative")):
        tensors, read, _ = _layouts()["modelopt"]
        tensors[f"{P}.weight_scale"] = tensors[f"{P}.weight_scale"].clone()
        tensors[f"{P}.weight_scale"][1, 2] = bad
        with pytest.raises(CheckpointError, match=f"{P}.weight_scale: .*{what}"):
            read(tensors, P)
    tensors, read, _ = _layouts()["ct_fp8"]
    tensors[f"{P}.weight"] = tensors[f"{P}.weight"].clone()
    tensors[f"{P}.weight"][0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=f"{P}.weight: contains"):
        read(tensors, P)
    for bad in (-1.0, float("inf")):
        tensors, read, _ = _layouts()["ct_fp8"]
        tensors[f"{P}.weight_scale"] = tensors[f"{P}.weight_scale"].clone()
        tensors[f"{P}.weight_scale"][3] = bad
        with pytest.raises(CheckpointError, match=f"{P}.weight_scale: channel scales"):
            read(tensors, P)


def test_k_not_multiple_of_16() -> None:
    with pytest.raises(WeightError, match="multiple of 16, got K=24"):
        quantize_nvfp4(torch.randn(4, 24))
    for layout, codes in (("modelopt", "weight"), ("ct_nvfp4", "weight_packed")):
        tensors, read, _ = _layouts()[layout]
        tensors[f"{P}.{codes}"] = torch.zeros(48, 12, dtype=torch.uint8)
        with pytest.raises(CheckpointError, match=f"{P}.{codes}: K = 2 \\* 12 = 24 is not"):
            read(tensors, P)


def test_quantizer_input_errors() -> None:
    bads = (torch.randn(64), torch.randint(0, 3, (4, 16)), torch.randn(4, 16).double(), torch.zeros(0, 16))
    for bad in bads:
        with pytest.raises(WeightError):
            quantize_nvfp4(bad)
        with pytest.raises(WeightError):
            quantize_fp8_channel(bad)
    w = torch.randn(4, 16)
    w[1, 1] = float("nan")
    with pytest.raises(WeightError, match="NaN"):
        quantize_nvfp4(w)
    for segs in ((2, 3), (4, 0), ()):
        with pytest.raises(WeightError, match="segments"):
            quantize_nvfp4(torch.randn(4, 16), segs)
    with pytest.raises(WeightError, match="different K"):
        concat_segments([quantize_nvfp4(_w(k=32)), quantize_nvfp4(_w(k=64))])
    with pytest.raises(WeightError):
        concat_segments([])
    with pytest.raises(WeightError, match="scale_dtype"):
        to_compressed_tensors_fp8(quantize_fp8_channel(_w()), P, scale_dtype=torch.int8)


def test_detect_layout_errors() -> None:
    with pytest.raises(MissingTensorError, match=f"'{P}.weight'"):
        detect_layout({}, P)
    with pytest.raises(CheckpointError, match="weight_scale_2"):
        detect_layout({f"{P}.weight": torch.zeros(4, 8, dtype=torch.uint8)}, P)
    w8 = torch.zeros(256, 256, dtype=F8)
    with pytest.raises(MissingTensorError, match=f"'{P}.weight_scale'"):
        detect_layout({f"{P}.weight": w8}, P)
    with pytest.raises(CheckpointError, match="block FP8"):
        detect_layout({f"{P}.weight": w8, f"{P}.weight_scale_inv": torch.ones(2, 2)}, P)
    for shape in ((2, 2), (1,), ()):
        with pytest.raises(CheckpointError, match="not per-channel"):
            detect_layout({f"{P}.weight": w8, f"{P}.weight_scale": torch.ones(shape)}, P)
    with pytest.raises(CheckpointError, match="unsupported weight dtype"):
        detect_layout({f"{P}.weight": torch.zeros(4, 8, dtype=torch.int8)}, P)
