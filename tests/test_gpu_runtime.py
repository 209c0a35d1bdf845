"""GPU: runtime modules on the Qwen3.8-27B TP4-rank projection shapes, through the committed tuning
table for this GPU (kernels where it admits them, the fallback elsewhere), loaded through both
checkpoint layouts; CUDA-graph capture/replay and torch.compile on top."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _layer_weights(fmt: str, dev: torch.device, tp: int = 4):
    from dflashgen import quant
    from dflashgen.model import derive_projections, load_model_config

    gen = torch.Generator(device=dev).manual_seed(0)
    for p in derive_projections(load_model_config(), tp):
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


def _kernel_module(lib, split_k: bool):
    """A projection (NVFP4; TP4 shapes first, then TP1) whose M = 8 bucket this GPU's table serves
    with a kernel, with or without split-K (one launch per call either way), as a QuantLinear; skips
    if the table has none. (Since session 44 the H200 table serves no TP4 NVFP4 projection with a
    split-K kernel; TP1 down_proj / o_proj still take one.)"""
    from dflashgen.runtime.linear import QuantLinear

    for tp in (4, 1):
        for p, q in _layer_weights("nvfp4", lib.device, tp):
            mod = QuantLinear(q, p.name, library=lib)
            choice = lib.choose(mod.packed(), 8)
            if choice.path == "kernel" and (lib.kernel(choice.kernel).split_k > 1) == split_k:
                return mod, p
    pytest.skip(f"the table serves no M=8 projection with a {'split-K ' if split_k else ''}kernel")


@pytest.mark.parametrize("split_k", [False, True])
def test_fast_path_matches_the_validated_path(split_k: bool) -> None:
    from dflashgen.runtime import KernelInputError
    from dflashgen.runtime.library import KernelLibrary
    from dflashgen.runtime.linear import quant_linear

    from dflashgen.weights import rel_l2

    lib = KernelLibrary()
    mod, p = _kernel_module(lib, split_k)
    dev = lib.device
    key = (lib.key(mod.packed()), 8, "kernel")
    before = lib.path_counts[key]
    x = torch.randn(8, p.k, device=dev, dtype=torch.float16)
    y0 = mod(x)  # first call at M = 8: the validated path, which prepares the launch
    launch = mod.prepare(8)
    assert launch is not None and launch.calls[0] == 0
    y1 = mod(x)
    assert launch.calls[0] == 1  # the prepared launch served it
    assert torch.equal(y0, y1) and torch.equal(y1, lib.gemm(x, mod.packed()))
    assert torch.equal(y1, quant_linear(x, mod.weights, mod.scales, mod.col_scale, mod._handle))
    assert rel_l2(y1, x.float() @ mod.dequantize().t()) < 1e-3
    assert lib.path_counts[key] == before + 4  # 2 module calls, gemm, the custom op
    # what the prepared launch declines goes to the validated path: same errors, same results
    with pytest.raises(KernelInputError, match="float16"):
        mod(x.float())
    buf = torch.empty(8 * p.k + 8, device=dev, dtype=torch.float16)
    with pytest.raises(KernelInputError, match="aligned"):
        mod(buf[1: 1 + 8 * p.k].view(8, p.k))
    assert torch.equal(mod(x.t().contiguous().t()), y1)  # non-contiguous: copied, same kernel
    if torch.cuda.device_count() > 1:
        with pytest.raises(KernelInputError, match="kernel loaded on"):
            mod(x.to("cuda:1"))
    assert launch.calls[0] == 1
    assert torch.equal(mod(x), y1) and launch.calls[0] == 2
    x3 = x.reshape(2, 4, p.k)  # the decode loop's [B, T, K]: its own prepared launch, same bits
    assert torch.equal(mod(x3), y1.reshape(2, 4, -1)) and torch.equal(mod(x3), y1.reshape(2, 4, -1))
    assert mod.prepare(2, 4).calls[0] == 1
    mod(torch.randn(128, p.k, device=dev, dtype=torch.float16))  # a prefill's M: nothing kept for it
    assert (128, p.k) not in mod._operands().launches
    # out=: the prepared launch writes the caller's buffer, same bits; misfits are clear errors
    calls = launch.calls[0]
    out = torch.full_like(y1, float("nan"))
    assert mod(x, out=out) is out and torch.equal(out, y1) and launch.calls[0] == calls + 1
    with pytest.raises(ValueError, match="overlaps x"):
        both = torch.empty(8 * (p.k + y1.shape[1]), device=dev, dtype=torch.float16)
        mod(both[: 8 * p.k].view(8, p.k).copy_(x), out=both[8 * p.k - 8: 8 * p.k - 8 + y1.numel()].view_as(y1))
    with pytest.raises(ValueError, match="out must be"):
        mod(x, out=torch.empty(8, y1.shape[1] + 1, device=dev, dtype=torch.float16))
    assert launch.calls[0] == calls + 1


@pytest.mark.parametrize("split_k", [False, True])
def test_fast_path_under_graphs_and_streams(split_k: bool) -> None:
    from dflashgen.runtime.library import KernelLibrary

    lib = KernelLibrary()
    mod, p = _kernel_module(lib, split_k)
    dev = lib.device
    x = torch.randn(8, p.k, device=dev, dtype=torch.float16)
    mod(x)
    launch = mod.prepare(8)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # another stream: the launch follows torch's current stream
        y_side = mod(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mod(x)
    calls = launch.calls[0]
    assert calls >= 2
    want = lib.gemm(x, mod.packed())
    assert torch.equal(y_side, want)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, lib.gemm(x, mod.packed()))
    assert torch.equal(mod(x), y) and launch.calls[0] == calls + 1  # eager again, on the default stream
    g.replay()  # the graph keeps its own stream's workspace
    torch.cuda.synchronize()
    assert torch.equal(y, mod(x))


def test_fast_path_follows_replaced_buffers() -> None:
    from dflashgen.runtime.library import KernelLibrary
    from dflashgen.runtime.linear import QuantLinear

    from dflashgen import quant

    lib = KernelLibrary()
    mod, p = _kernel_module(lib, False)
    dev = lib.device
    w2 = quant.quantize_nvfp4(torch.randn(p.n, p.k, device=dev, dtype=torch.float16) * 0.02,
                              [s.n for s in p.segments])
    other = QuantLinear(w2, p.name, library=lib)
    x = torch.randn(8, p.k, device=dev, dtype=torch.float16)
    y_mod, y_other = mod(x), other(x)
    mod(x)  # prepared
    original = {k: v.clone() for k, v in mod.state_dict().items()}
    mod.load_state_dict(other.state_dict(), assign=True)  # new buffer objects
    assert torch.equal(mod(x), y_other) and torch.equal(mod(x), y_other)
    mod.load_state_dict(original)  # in place: the same buffers get the original bits
    assert torch.equal(mod(x), y_mod) and torch.equal(mod(x), y_mod)
    mod.cpu()
    mod.to(dev)  # round trip: new buffers at new addresses
    assert torch.equal(mod(x), y_mod) and torch.equal(mod(x), y_mod)


def test_fast_path_from_threads() -> None:
    import threading

    from dflashgen.runtime.library import KernelLibrary

    lib = KernelLibrary()
    mod, p = _kernel_module(lib, True)
    dev = lib.device
    xs = [torch.randn(8, p.k, device=dev, dtype=torch.float16) for _ in range(4)]
    want = [mod(x) for x in xs]
    bad: list[int] = []

    def worker(i: int) -> None:
        torch.cuda.set_device(dev)
        for _ in range(50):
            if not torch.equal(mod(xs[i]), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
