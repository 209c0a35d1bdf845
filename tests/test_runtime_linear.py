"""QuantLinear on CPU (fallback path), its custom op under opcheck / torch.compile, and on a GPU the
KernelLibrary path."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from dflashgen.runtime import linear
from dflashgen.runtime.linear import QuantLinear

from dflashgen.quant import quantize_fp8_channel, quantize_nvfp4
from dflashgen.weights import FP8ChannelWeight, NVFP4Weight, reference_gemm, reference_silu_mul, rel_l2

N, K = 192, 256


def _weight(fmt: str, n: int = N, k: int = K, seed: int = 0) -> NVFP4Weight | FP8ChannelWeight:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).half()
    # NVFP4: three segments with very different ranges so a shared global scale would show.
    if fmt == "nvfp4":
        w[: n // 4] *= 8
        return quantize_nvfp4(w, (n // 4, n // 4, n // 2))
    return quantize_fp8_channel(w)


def _x(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half()


@pytest.mark.parametrize("arch", [70, 80, 90])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
def test_fallback_matches_reference(arch: int, fmt: str) -> None:
    w = _weight(fmt)
    mod = QuantLinear(w, "p", arch=arch)
    assert torch.equal(mod.dequantize(), w.dequantize())  # the prepack is lossless
    for m in (1, 8, 33):
        x = _x(m)
        y = mod(x)
        assert y.dtype == torch.float16 and y.shape == (m, N)
        assert rel_l2(y, reference_gemm(x, w)) < 1e-3
    x3 = _x(12).reshape(3, 4, K)  # leading dims are flattened and restored
    assert mod(x3).shape == (3, 4, N)
    assert torch.equal(mod(x3).reshape(12, N), mod(x3.reshape(12, K)))


@pytest.mark.parametrize("arch", [70, 90])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
def test_silu_variant(arch: int, fmt: str) -> None:
    w = _weight(fmt, n=256)
    mod = QuantLinear(w, "gate_up", silu=True, arch=arch)
    assert (mod.in_features, mod.out_features) == (K, 128)
    x = _x(16)
    assert rel_l2(mod(x), reference_silu_mul(reference_gemm(x, w))) < 1e-3
    assert torch.equal(mod.dequantize(), w.dequantize())  # logical row order (gate rows first)


def test_module_basics() -> None:
    w = _weight("nvfp4")
    mod = QuantLinear(w, "layers.0.qkv_proj")
    r = repr(mod)
    for part in ("layers.0.qkv_proj", "format=nvfp4", f"N={N}", f"K={K}", "silu=False", "sm_90", "fallback"):
        assert part in r
    assert set(dict(mod.named_buffers())) == {"weights", "scales", "col_scale_bits"}
    assert torch.equal(mod.col_scale, w.column_scale() * mod.layout.decode_scale)  # one global scale per segment
    x = _x(8)
    y = mod(x)
    mod.half()  # dtype casts must not touch the fp32 scales (stored as int32 bits)
    assert mod.col_scale.dtype == torch.float32 and torch.equal(mod(x), y)
    assert rel_l2(mod(x.float()), reference_gemm(x, w)) < 1e-6  # fp32 input: fp32 fallback matmul
    twin = copy.deepcopy(mod)
    assert twin._handle != mod._handle and torch.equal(twin(x), y)
    handle = mod._handle
    del mod
    gc.collect()
    assert handle not in linear._REGISTRY  # registry entries die with their module
    assert torch.equal(twin(x), y)
    f8 = QuantLinear(_weight("fp8_channel"), "o")
    assert f8.scales is None and f8.fmt == "fp8_channel"


def test_errors() -> None:
    w = _weight("nvfp4")
    mod = QuantLinear(w, "p")
    with pytest.raises(ValueError, match=r"p: expected a float input \[\.\.\., 256\]"):
        mod(torch.zeros(2, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="float input"):
        mod(torch.zeros(2, K, dtype=torch.int32))
    with pytest.raises(TypeError, match="NVFP4Weight or FP8ChannelWeight"):
        QuantLinear(torch.zeros(4, 4), "p")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="p: K=48 is not a multiple of 64"):
        QuantLinear(quantize_nvfp4(torch.randn(16, 48)), "p")

    class FakeLibrary:  # only .arch and .device are used off the GPU
        arch = 80
        device = torch.device("cpu")

    with pytest.raises(ValueError, match="disagrees"):
        QuantLinear(w, "p", library=FakeLibrary(), arch=70)  # type: ignore[arg-type]
    on_cpu = QuantLinear(w, "p", library=FakeLibrary())  # type: ignore[arg-type]
    assert on_cpu.layout.arch == 80 and "path=library" in repr(on_cpu)
    assert rel_l2(on_cpu(_x(4)), reference_gemm(_x(4), w)) < 1e-3  # CPU input: fallback


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
def test_opcheck(fmt: str) -> None:
    mod = QuantLinear(_weight(fmt), "p", silu=fmt == "nvfp4")
    args = (_x(8), mod.weights, mod.scales, mod.col_scale, mod._handle)
    torch.library.opcheck(torch.ops.dflashgen.quant_linear.default, args)


class _Block(torch.nn.Module):
    """gate_up (fused SiLU) -> down, the MLP shape every layer has."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = QuantLinear(_weight("nvfp4", n=256, k=128), "gate_up", silu=True)
        self.down = QuantLinear(_weight("fp8_channel", n=128, k=128, seed=3), "down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(x)) + x


def test_torch_compile_treats_the_op_as_opaque() -> None:
    block = _Block()
    x = _x(8, 128)
    want = block(x)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        assert torch.equal(torch.compile(block, fullgraph=True, backend=record)(x), want)
        assert torch.equal(torch.compile(block, fullgraph=True, backend="aot_eager")(x), want)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count("dflashgen.quant_linear.default") == 2  # one opaque node per projection


@pytest.mark.slow
def test_torch_compile_inductor() -> None:
    block = _Block()
    x = _x(8, 128)
    with torch.no_grad():
        want = block(x)
        compiled = torch.compile(block, fullgraph=True)
        assert rel_l2(compiled(x), want) < 1e-3
        assert compiled(_x(24, 128)).shape == (24, 128)  # another M


@pytest.mark.gpu
def test_library_path_on_gpu() -> None:
    from dflashgen.runtime.library import KernelLibrary

    lib = KernelLibrary(on_mismatch="fallback")
    w = _weight("nvfp4", n=256)
    mod = QuantLinear(w, "p", library=lib).to(lib.device)
    x = _x(8).to(lib.device)
    assert rel_l2(mod(x).cpu(), reference_gemm(x.cpu(), w)) < 1e-3
    assert sum(c for (key, m, _), c in lib.path_counts.items() if m == 8 and "n256/k256" in key) == 1
    silu = QuantLinear(w, "gu", silu=True, library=lib).to(lib.device)
    compiled = torch.compile(silu, fullgraph=True)
    assert rel_l2(compiled(x).cpu(), reference_silu_mul(reference_gemm(x.cpu(), w))) < 1e-3
