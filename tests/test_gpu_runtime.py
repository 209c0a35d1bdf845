"""GPU: runtime modules on the Qwen3.8-27B TP4-rank projection shapes, through the committed tuning
table for this GPU (kernels where it admits them, the fallback elsewhere), loaded through both
checkpoint layouts; CUDA-graph capture/replay and torch.compile on top."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _layer_weights(fmt: str, dev: torch.device):
    from dflashgen import quant
    from dflashgen.model import derive_projections, load_model_config

    gen = torch.Generator(device=dev).manual_seed(0)
    for p in derive_projections(load_model_config(), 4):
        if p.name == "lm_head":
            continue
        w = torch.randn(p.n, p.k, device=dev, generator=gen, dtype=torch.float16) * 0.02
        if fmt == "nvfp4":
            q = quant.quantize_nvfp4(w, [s.n for s in p.segments])
            # through the checkpoint layouts and back: what a real load does
            parts = [quant.from_modelopt_nvfp4(quant.to_modelopt_nvfp4(s, "m"), "m")
                     for s in quant.split_segments(q)]
            parts = [quant.from_compressed_tensors_nvfp4(quant.to_compressed_tensors_nvfp4(s, "c"), "c")
                     for s in parts]
            q = quant.concat_segments(parts)
        else:
            ct = quant.to_compressed_tensors_fp8(quant.quantize_fp8_channel(w), "c")
            q = quant.from_compressed_tensors_fp8(ct, "c")
        yield p, q


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
def test_tp4_projections_dispatch_and_graphs(fmt: str) -> None:
    from dflashgen.runtime.library import KernelLibrary
    from dflashgen.runtime.linear import QuantLinear, quant_linear

    from dflashgen.weights import reference_gemm, reference_silu_mul, rel_l2

    lib = KernelLibrary()  # the committed table for this GPU; refuses a mismatched one
    dev = lib.device
    for p, q in _layer_weights(fmt, dev):
        for silu in ([False, True] if p.name == "gate_up_proj" else [False]):
            mod = QuantLinear(q, p.name, silu=silu, library=lib)
            for m in (1, 8, 16, 64):
                x = torch.randn(m, p.k, device=dev, dtype=torch.float16)
                ref = reference_gemm(x, q)
                ref = reference_silu_mul(ref) if silu else ref
                y = mod(x)
                assert rel_l2(y, ref) < 1e-3, (p.name, silu, m)
                # the eager fast path and the custom op (what torch.compile sees) launch the same kernel
                assert torch.equal(y, quant_linear(x, mod.weights, mod.scales, mod.col_scale, mod._handle))
            # CUDA graph with changing inputs
            x = torch.randn(8, p.k, device=dev, dtype=torch.float16)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                mod(x)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = mod(x)
            x.copy_(torch.randn_like(x))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, mod(x.clone()))
    kernels_used = sum(c for (_, _, path), c in lib.path_counts.items() if path == "kernel")
    assert kernels_used > 0, "the table admitted no kernel on this GPU"


def test_compiled_block_uses_the_op() -> None:
    from dflashgen.runtime.library import KernelLibrary
    from dflashgen.runtime.linear import QuantLinear

    from dflashgen import quant
    from dflashgen.weights import reference_gemm, rel_l2

    lib = KernelLibrary()
    dev = lib.device
    w = quant.quantize_nvfp4(torch.randn(5120, 1536, device=dev, dtype=torch.float16) * 0.02)
    mod = QuantLinear(w, "o_proj", library=lib)
    compiled = torch.compile(lambda t: mod(t) * 2, fullgraph=True)
    x = torch.randn(8, 1536, device=dev, dtype=torch.float16)
    assert rel_l2(compiled(x), 2 * reference_gemm(x, w)) < 1e-3
