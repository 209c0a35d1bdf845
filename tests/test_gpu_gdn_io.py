"""GPU: the GDN glue kernels (family "gdn", mode "io") on an H200 -- ``gdn_inputs`` (conv, SiLU, q / k
L2 norms, beta, log decay) and ``gdn_gate`` (gated RMSNorm, FP16 out) against their torch formulation
(FP32 rel. error <= 1e-5; FP16 out <= 1e-3), a position's bits the same whatever T and B (one-position
calls == one T-position call, bitwise), ``gdn_prefill_inputs`` (from the conv state and the FP16 rows)
bitwise ``gdn_inputs`` on their cat with the conv state moved to n[b], ``gdn_split_inputs`` (an armed
forward's, writing the cat) likewise, CUDA-graph replay == eager; the
sm_90 cubin and the compute_70 PTX (JIT-compiled by the driver). Skips cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

ARCHS = ["native", 70]
DIMS = [(16, 128, 48, 128), (2, 32, 6, 40)]  # (Hk, dk, Hv, dv): Qwen3.8-27B TP1, a small odd one
WIDTH = 4


def _arch(a: str | int) -> int | None:
    return None if a == "native" else int(a)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _case(b: int, t: int, dims: tuple[int, int, int, int], seed: int):
    nk, dk, nv, dv = dims
    c = 2 * nk * dk + nv * dv
    g = torch.Generator(device="cuda").manual_seed(seed)
    cat_tm = torch.randn(b, WIDTH - 1 + t, c, generator=g, device="cuda")
    # zba as the target has it: the z | b | a segment of a wider in_proj output row
    full = (torch.randn(b, t, c + nv * dv + 2 * nv, generator=g, device="cuda") * 2).half()
    zba = full[..., c:]
    conv_w = torch.randn(c, WIDTH, generator=g, device="cuda") * 0.5
    dt_bias = torch.randn(nv, generator=g, device="cuda")
    neg_a = -torch.rand(nv, generator=g, device="cuda") * 4
    return cat_tm, zba, conv_w, dt_bias, neg_a


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dims", DIMS)
def test_inputs_and_gate_equal_torch(arch: str | int, dims: tuple[int, int, int, int]) -> None:
    from dflashgen.runtime.gdn_io import gdn_gate, gdn_inputs, reference_gate, reference_inputs

    nk, dk, nv, dv = dims
    for b, t in ((1, 1), (3, 8), (2, 16), (1, 40)):
        cat_tm, zba, conv_w, dt_bias, neg_a = _case(b, t, dims, seed=b * 100 + t)
        got = gdn_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims, arch=_arch(arch))
        ref = reference_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims)
        torch.cuda.synchronize()
        for name, x, y in zip(("q", "k", "v", "beta", "log_decay"), got, ref, strict=True):
            assert x.shape == y.shape and x.is_contiguous() and not x.isnan().any(), name
            assert _rel(x, y) <= 1e-5, (name, b, t, _rel(x, y))
        o = torch.randn(b, t, nv, dv, device="cuda")
        w = torch.rand(dv, device="cuda") + 0.5
        out = gdn_gate(o, zba, w, 1e-6, arch=_arch(arch))
        ref_out = reference_gate(o, zba[..., :nv * dv], w, 1e-6, torch.float16)
        assert out.dtype == torch.float16 and out.shape == (b, t, nv * dv)
        assert _rel(out, ref_out) <= 1e-3, _rel(out, ref_out)


@pytest.mark.parametrize("arch", ARCHS)
def test_positions_are_exact_whatever_t_and_b(arch: str | int) -> None:
    """Every position of a T = 8, B = 3 call equals a one-position, one-request call on its own conv
    window, bitwise (what verify + rollback and the sequential prefill rely on)."""
    from dflashgen.runtime.gdn_io import gdn_gate, gdn_inputs

    dims = DIMS[0]
    nk, dk, nv, dv = dims
    b, t = 3, 8
    cat_tm, zba, conv_w, dt_bias, neg_a = _case(b, t, dims, seed=11)
    full = gdn_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims, arch=_arch(arch))
    o = torch.randn(b, t, nv, dv, device="cuda")
    w = torch.rand(dv, device="cuda") + 0.5
    gate = gdn_gate(o, zba, w, 1e-6, arch=_arch(arch))
    for r in (0, 2):
        for p in (0, 5, 7):
            one = gdn_inputs(cat_tm[r:r + 1, p:p + WIDTH].contiguous(), zba[r:r + 1, p:p + 1], conv_w, dt_bias, neg_a,
                             dims, arch=_arch(arch))
            for name, x, y in zip(("q", "k", "v", "beta", "log_decay"), one, full, strict=True):
                assert torch.equal(x[0, 0], y[r, p]), (name, r, p)
            g1 = gdn_gate(o[r:r + 1, p:p + 1].contiguous(), zba[r:r + 1, p:p + 1], w, 1e-6, arch=_arch(arch))
            assert torch.equal(g1[0, 0], gate[r, p])


def _prefill_case(b: int, t: int, dims: tuple[int, int, int, int], width: int, seed: int):
    """conv state [B, C, W - 1] FP32, the in_proj output row [B, T, C | z | b | a] FP16 (mixed and zba
    are views of it, as in the target), conv weight [C, W], dt_bias, neg_a."""
    nk, dk, nv, dv = dims
    c = 2 * nk * dk + nv * dv
    g = torch.Generator(device="cuda").manual_seed(seed)
    conv = torch.randn(b, c, width - 1, generator=g, device="cuda")
    full = (torch.randn(b, t, c + nv * dv + 2 * nv, generator=g, device="cuda") * 2).half()
    conv_w = torch.randn(c, width, generator=g, device="cuda") * 0.5
    dt_bias = torch.randn(nv, generator=g, device="cuda")
    neg_a = -torch.rand(nv, generator=g, device="cuda") * 4
    return conv, full[..., :c], full[..., c:], conv_w, dt_bias, neg_a


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dims", [*DIMS, (2, 256, 3, 192)])  # the last: the _prefill_wide entry (dims > 128)
def test_prefill_inputs_equal_inputs_on_the_cat(arch: str | int, dims: tuple[int, int, int, int]) -> None:
    """gdn_prefill_inputs == gdn_inputs on cat(conv^T, mixed) bitwise (every tile boundary, ragged T,
    widths 1-4), and the conv state after it == the cat's window after n[b] positions (n given or T)."""
    from dflashgen.runtime.gdn_io import conv_window, gdn_inputs, gdn_prefill_inputs

    for b, t, width in ((1, 1, 4), (2, 17, 4), (3, 40, 4), (1, 1023, 4), (2, 33, 2), (2, 5, 1), (1, 20, 3)):
        conv, mixed, zba, conv_w, dt_bias, neg_a = _prefill_case(b, t, dims, width, seed=b * 1000 + t + width)
        for n in (None, torch.randint(0, t + 1, (b,), device="cuda")):
            state = conv.clone()
            got = gdn_prefill_inputs(state, mixed, zba, conv_w, dt_bias, neg_a, dims, n=n, arch=_arch(arch))
            cat_tm = torch.cat((conv.transpose(1, 2), mixed.float()), dim=1)
            ref = gdn_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims, arch=_arch(arch))
            torch.cuda.synchronize()
            for name, x, y in zip(("q", "k", "v", "beta", "log_decay"), got, ref, strict=True):
                assert x.shape == y.shape and x.is_contiguous(), name
                assert torch.equal(x, y), (name, b, t, width, n)
            cat = cat_tm.transpose(1, 2)
            want = cat[..., t:] if n is None else conv_window(cat, n, width - 1)
            assert torch.equal(state, want), (b, t, width, n)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dims", [*DIMS, (2, 256, 3, 192)])
def test_split_inputs_equal_inputs_on_the_cat(arch: str | int, dims: tuple[int, int, int, int]) -> None:
    """gdn_split_inputs (an armed verify forward's inputs from the conv state and the FP16 rows) ==
    gdn_inputs on cat(conv^T, mixed) bitwise, the cat it writes == torch's, every element of it written
    (the buffer starts as NaN), the conv state untouched; T 1-16, widths 1-4, in a CUDA graph too."""
    from dflashgen.runtime.gdn_io import gdn_inputs, gdn_split_inputs

    for b, t, width in ((1, 1, 4), (3, 8, 4), (2, 16, 4), (2, 5, 2), (1, 3, 1), (4, 7, 3)):
        conv, mixed, zba, conv_w, dt_bias, neg_a = _prefill_case(b, t, dims, width, seed=b * 100 + t + width)
        c = conv.shape[1]
        cat_out = torch.full((b, width - 1 + t, c), float("nan"), device="cuda")
        state = conv.clone()
        got = gdn_split_inputs(state, mixed, zba, conv_w, dt_bias, neg_a, dims, cat_out, arch=_arch(arch))
        cat_tm = torch.cat((conv.transpose(1, 2), mixed.float()), dim=1)
        ref = gdn_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims, arch=_arch(arch))
        torch.cuda.synchronize()
        for name, x, y in zip(("q", "k", "v", "beta", "log_decay"), got, ref, strict=True):
            assert x.shape == y.shape and x.is_contiguous(), name
            assert torch.equal(x, y), (name, b, t, width)
        assert torch.equal(cat_out, cat_tm), (b, t, width)
        assert torch.equal(state, conv)
    if arch == "native":  # graph replay with new rows == eager
        cat_out.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = gdn_split_inputs(conv, mixed, zba, conv_w, dt_bias, neg_a, dims, cat_out)
        mixed.copy_(torch.randn_like(mixed.float()).half())
        conv.normal_()
        graph.replay()
        eager_cat = torch.empty_like(cat_out)
        eager = gdn_split_inputs(conv, mixed, zba, conv_w, dt_bias, neg_a, dims, eager_cat)
        torch.cuda.synchronize()
        assert all(torch.equal(x, y) for x, y in zip(outs, eager, strict=True)) and torch.equal(cat_out, eager_cat)


def test_graph_replay_equals_eager() -> None:
    from dflashgen.runtime.gdn_io import gdn_gate, gdn_inputs, gdn_prefill_inputs

    dims = DIMS[0]
    cat_tm, zba, conv_w, dt_bias, neg_a = _case(2, 8, dims, seed=12)
    o = torch.randn(2, 8, dims[2], dims[3], device="cuda")
    w = torch.rand(dims[3], device="cuda") + 0.5
    gdn_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims)  # load outside capture
    gdn_gate(o, zba, w, 1e-6)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    conv, mixed, zba_p, conv_w_p, dt_bias_p, neg_a_p = _prefill_case(2, 20, dims, WIDTH, seed=17)
    n = torch.tensor([20, 7], device="cuda")
    state = conv.clone()
    gdn_prefill_inputs(state, mixed, zba_p, conv_w_p, dt_bias_p, neg_a_p, dims, n=n)
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        outs = (*gdn_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims), gdn_gate(o, zba, w, 1e-6),
                *gdn_prefill_inputs(state, mixed, zba_p, conv_w_p, dt_bias_p, neg_a_p, dims, n=n))
    new = _case(2, 8, dims, seed=13)
    cat_tm.copy_(new[0])
    zba.copy_(new[1])
    state.copy_(conv)
    n.copy_(torch.tensor([3, 20]))
    g.replay()
    replayed_state = state.clone()
    torch.cuda.synchronize()
    state.copy_(conv)
    eager = (*gdn_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, dims), gdn_gate(o, zba, w, 1e-6),
             *gdn_prefill_inputs(state, mixed, zba_p, conv_w_p, dt_bias_p, neg_a_p, dims, n=n))
    assert all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))
    assert torch.equal(replayed_state, state)


def test_bad_inputs_raise() -> None:
    from dflashgen.runtime.gdn_io import gdn_gate, gdn_inputs, gdn_prefill_inputs, gdn_split_inputs
    from dflashgen.runtime.gdn_kernel import GdnInputError

    dims = DIMS[1]
    cat_tm, zba, conv_w, dt_bias, neg_a = _case(2, 4, dims, seed=14)
    with pytest.raises(GdnInputError, match="zba must be float16"):
        gdn_inputs(cat_tm, zba.float(), conv_w, dt_bias, neg_a, dims)
    with pytest.raises(GdnInputError, match="cat_tm must be contiguous"):
        gdn_inputs(cat_tm.transpose(1, 2).contiguous().transpose(1, 2), zba, conv_w, dt_bias, neg_a, dims)
    with pytest.raises(GdnInputError, match="does not fit dims"):
        gdn_inputs(cat_tm, zba, conv_w, dt_bias, neg_a, (dims[0], dims[1], dims[2] + 1, dims[3]))
    conv, mixed, zba2, conv_w2, dt_bias2, neg_a2 = _prefill_case(2, 4, dims, WIDTH, seed=15)
    with pytest.raises(GdnInputError, match="conv must be contiguous"):
        gdn_prefill_inputs(conv.transpose(1, 2).contiguous().transpose(1, 2), mixed, zba2, conv_w2, dt_bias2,
                           neg_a2, dims)
    with pytest.raises(GdnInputError, match="mixed must be float16"):
        gdn_prefill_inputs(conv, mixed.float(), zba2, conv_w2, dt_bias2, neg_a2, dims)
    with pytest.raises(GdnInputError, match="n must be int64"):
        gdn_prefill_inputs(conv, mixed, zba2, conv_w2, dt_bias2, neg_a2, dims, n=torch.ones(2, device="cuda"))
    wide = _prefill_case(2, 4, dims, 6, seed=16)  # conv width 6: above the kernel's 4
    with pytest.raises(GdnInputError, match="conv width 6"):
        gdn_prefill_inputs(*wide, dims)
    with pytest.raises(GdnInputError, match="o must be contiguous"):
        gdn_gate(torch.randn(2, 4, dims[2], dims[3], device="cuda").transpose(0, 1), zba, dt_bias, 1e-6)
    cat_out = torch.empty(2, WIDTH - 1 + 4, conv.shape[1], device="cuda")
    with pytest.raises(GdnInputError, match="cat_out must be contiguous float32"):
        gdn_split_inputs(conv, mixed, zba2, conv_w2, dt_bias2, neg_a2, dims, cat_out[:, 1:])
    with pytest.raises(GdnInputError, match="cat_out must be contiguous float32"):
        gdn_split_inputs(conv, mixed, zba2, conv_w2, dt_bias2, neg_a2, dims, cat_out.half())
    with pytest.raises(GdnInputError, match="mixed must be float16"):
        gdn_split_inputs(conv, mixed.float(), zba2, conv_w2, dt_bias2, neg_a2, dims, cat_out)
