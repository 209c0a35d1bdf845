"""GPU: the weight dequantizer (family "dequant") on an H200 -- bitwise torch's dequantize_packed(...).to(
float16) for NVFP4 and channel FP8, plain and fused gate|up layouts, N padded or not, on the sm_90
cubin and the compute_70 PTX (sm_70 layouts, JIT-compiled by the driver); CUDA-graph replay; bad
buffers rejected; and the library's dequantize + cuBLAS path with no kept copies (dequant_cache=0)
bitwise equal to the one keeping every copy, without the FP16 copies' memory. Skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from dflashgen.verify import random_packed

pytestmark = pytest.mark.gpu

SHAPES = [(4120, 5120, False), (8704, 5120, True), (96, 256, False), (512, 1536, True)]


def _packed(arch: int, fmt: str, n: int, k: int, silu: bool, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return random_packed(arch, fmt, n, k, silu, torch.device("cuda"), gen)[1]


@pytest.mark.parametrize("arch", [90, 70])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
@pytest.mark.parametrize("n,k,silu", SHAPES)
def test_kernel_is_torchs_dequantize_bitwise(arch: int, fmt: str, n: int, k: int, silu: bool) -> None:
    from dflashgen.runtime.dequant_kernel import dequantize, dequantize_packed, kernel_arch

    p = _packed(arch, fmt, n, k, silu, seed=n + k)
    assert kernel_arch(p.layout, p.weights.device) == arch  # the generated kernel, not torch's path
    got = dequantize(p)
    want = dequantize_packed(p).to(torch.float16)
    torch.cuda.synchronize()
    assert got.shape == (n, k) and got.dtype == torch.float16
    assert torch.equal(got, want)
    out = torch.full((n, k), float("nan"), dtype=torch.float16, device="cuda")
    assert dequantize(p, out=out) is out and torch.equal(out, want)  # every element written


def test_graph_replay_and_bad_buffers() -> None:
    from dflashgen.runtime.dequant_kernel import DequantInputError, dequantize

    p = _packed(90, "nvfp4", 256, 512, False)
    out = torch.empty(256, 512, dtype=torch.float16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dequantize(p, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dequantize(p, out=out)
    want = out.clone()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    with pytest.raises(DequantInputError, match="out must be"):
        dequantize(p, out=torch.empty(256 * 512 + 1, dtype=torch.float16, device="cuda")[1:].view(256, 512))
    with pytest.raises(DequantInputError, match="out must be"):
        dequantize(p, out=torch.empty(256, 512, dtype=torch.float16, device="cuda").t().contiguous().t())
    with pytest.raises(DequantInputError, match="col_scale"):
        dequantize(type(p)(p.layout, p.weights, p.scales, p.col_scale.cpu()))
    with pytest.raises(DequantInputError, match="block scales"):
        dequantize(type(p)(p.layout, p.weights, None, p.col_scale))


def test_library_fallback_without_kept_copies_matches_and_saves_the_memory() -> None:
    from dflashgen.runtime.library import KernelLibrary

    packs = [_packed(90, "nvfp4", 8704, 5120, True, seed=1), _packed(90, "fp8_channel", 5120, 4352, False, seed=2)]
    x = [torch.randn(300, p.layout.k, device="cuda", dtype=torch.float16) for p in packs]  # above every bucket
    every, none = KernelLibrary(dequant_cache="all"), KernelLibrary(dequant_cache=0)
    ys = [every.gemm(xi, p) for xi, p in zip(x, packs, strict=True)]
    assert len(every.dequantized) == 2 and every.dequantized.bytes == 2 * (8704 * 5120 + 5120 * 4352)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for xi, p, y in zip(x, packs, ys, strict=True):
        assert torch.equal(none.gemm(xi, p), y)  # a copy made per call has the same bits
        assert all(path == "fallback" for (_, m, path) in none.path_counts if m == 300)
    torch.cuda.synchronize()
    assert len(none.dequantized) == 0 and torch.cuda.memory_allocated() <= base + (1 << 20)
    # at most one transient copy (the larger weight, 89 MB) at a time, never both kept
    assert torch.cuda.max_memory_allocated() - base < 2 * 8704 * 5120 + (16 << 20)
