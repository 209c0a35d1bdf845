"""GPU: the generated gated delta rule kernels (family "gdn") on an H200 -- against the torch
reference (rel. error <= 1e-5, FP32), bitwise: a T = 8 step + advance(n) == n one-position steps,
a request's bits the same alone and in a batch of 8, CUDA-graph replay == eager; the sm_90 cubin
and the compute_70 PTX (JIT-compiled by the driver). Skips cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

ARCHS = ["native", 70]


def _arch(a: str | int) -> int | None:
    return None if a == "native" else int(a)


def _inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    s0 = randn(b, hv, dk, dv) * 0.3
    q = torch.nn.functional.normalize(randn(b, t, hk, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(randn(b, t, hk, dk), dim=-1)
    # v as the target passes it: a strided view of the time-major conv output
    c = 2 * hk * dk + hv * dv
    mixed = randn(b, t, c)
    v = mixed[..., 2 * hk * dk:].reshape(b, t, hv, dv)
    beta = torch.rand(b, t, hv, generator=g, device="cuda")
    log_decay = -2 * torch.rand(b, t, hv, generator=g, device="cuda")
    return s0, q, k, v, beta, log_decay


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("t", "hk", "hv", "dk", "dv"), [(8, 16, 48, 128, 128), (1, 16, 48, 128, 128),
                                                         (16, 4, 12, 128, 128), (8, 2, 6, 32, 40)])
def test_kernel_equals_reference(arch: str | int, t: int, hk: int, hv: int, dk: int, dv: int) -> None:
    from dflashgen.runtime.gdn_kernel import gdn_advance, gdn_step, reference_advance, reference_step

    b = 3
    s0, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=t * 100 + dk)
    n = torch.tensor([t, 0, (t + 1) // 2], device="cuda")
    commit, ref_commit = s0.clone(), s0.clone()
    k_out = torch.empty_like(k)
    o, u, d = gdn_step(commit, q, k, v, beta, ld, k_out=k_out, commit=commit, n=n, arch=_arch(arch))
    ro, ru, rd = reference_step(ref_commit, q, k, v, beta, ld, commit=ref_commit, n=n)
    torch.cuda.synchronize()
    assert torch.equal(k_out, k)
    for name, x, y in (("o", o, ro), ("u", u, ru), ("decay", d, rd), ("state", commit, ref_commit)):
        assert _rel(x, y) <= 1e-5, (name, _rel(x, y))
    print(f"gdn T={t} dk={dk} dv={dv} {arch}: o bitwise = reference: {torch.equal(o, ro)}, "
          f"rel {_rel(o, ro):.2e}")
    adv, ref_adv = s0.clone(), s0.clone()
    gdn_advance(adv, k, u, d, n, arch=_arch(arch))
    reference_advance(ref_adv, k, u, d, n)
    assert torch.equal(adv, ref_adv)  # same inputs, mul and add only: bitwise
    assert torch.equal(adv, commit)  # advance == the step's own commit


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_then_advance_is_bitwise_single_steps(arch: str | int) -> None:
    from dflashgen.runtime.gdn_kernel import gdn_advance, gdn_step

    b, t, hk, hv, dk, dv = 4, 8, 16, 48, 128, 128
    s0, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=11)
    a = _arch(arch)
    o, u, d = gdn_step(s0, q, k, v, beta, ld, arch=a)
    n = torch.tensor([8, 1, 0, 5], device="cuda")
    adv = s0.clone()
    gdn_advance(adv, k, u, d, n, arch=a)
    for r in range(b):
        st = s0[r:r + 1].clone()
        for i in range(int(n[r])):
            sl = slice(i, i + 1)
            oi, ui, _ = gdn_step(st, q[r:r + 1, sl].contiguous(), k[r:r + 1, sl].contiguous(), v[r:r + 1, sl],
                                 beta[r:r + 1, sl].contiguous(), ld[r:r + 1, sl].contiguous(), commit=st, arch=a)
            assert torch.equal(oi[0, 0], o[r, i]) and torch.equal(ui[0, 0], u[r, i]), (r, i)
        assert torch.equal(st[0], adv[r]), r


@pytest.mark.parametrize("arch", ARCHS)
def test_request_bits_alone_equal_in_a_batch_of_8(arch: str | int) -> None:
    from dflashgen.runtime.gdn_kernel import gdn_step

    t, hk, hv, dk, dv = 8, 16, 48, 128, 128
    s0, q, k, v, beta, ld = _inputs(8, t, hk, hv, dk, dv, seed=21)
    n = torch.randint(0, t + 1, (8,), device="cuda")
    batch = s0.clone()
    o, u, d = gdn_step(batch, q, k, v, beta, ld, commit=batch, n=n, arch=_arch(arch))
    for r in (0, 3, 7):
        alone = s0[r:r + 1].clone()
        sl = slice(r, r + 1)
        o1, u1, d1 = gdn_step(alone, q[sl], k[sl], v[sl], beta[sl], ld[sl], commit=alone, n=n[sl],
                              arch=_arch(arch))
        assert torch.equal(o1[0], o[r]) and torch.equal(u1[0], u[r]) and torch.equal(d1[0], d[r])
        assert torch.equal(alone[0], batch[r])


def test_graph_replay_equals_eager() -> None:
    """Step (rollback terms into static buffers) + advance of two stacked layers captured once,
    replayed with new inputs and accepted lengths."""
    from dflashgen.runtime.gdn_kernel import gdn_advance, gdn_step

    b, t, hk, hv, dk, dv, layers = 4, 8, 16, 48, 128, 128, 2
    static = [torch.zeros_like(x) for x in _inputs(b, t, hk, hv, dk, dv, seed=0)]
    static[3] = torch.zeros(b, t, hv, dv, device="cuda")  # v: contiguous static buffer
    s_all = torch.zeros(layers, b, hv, dk, dv, device="cuda")
    k_all = torch.zeros(layers, b, t, hk, dk, device="cuda")
    u_all = torch.zeros(layers, b, t, hv, dv, device="cuda")
    d_all = torch.zeros(layers, b, t, hv, device="cuda")
    o_all = torch.zeros(layers, b, t, hv, dv, device="cuda")
    n = torch.zeros(b, dtype=torch.long, device="cuda")

    def run() -> None:
        _, q, k, v, beta, ld = static
        for j in range(layers):
            gdn_step(s_all[j], q, k, v, beta, ld, o=o_all[j], u=u_all[j], decay=d_all[j], k_out=k_all[j])
        gdn_advance(s_all, k_all, u_all, d_all, n)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm up (loads the module) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in (1, 2):
        fresh = _inputs(b, t, hk, hv, dk, dv, seed=seed)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        s_init = torch.stack([fresh[0], fresh[0] * 0.5])
        n.copy_(torch.randint(0, t + 1, (b,), device="cuda"))
        s_all.copy_(s_init)
        graph.replay()
        got = [x.clone() for x in (s_all, o_all, u_all, d_all, k_all)]
        s_all.copy_(s_init)
        run()
        torch.cuda.synchronize()
        for x, y in zip(got, (s_all, o_all, u_all, d_all, k_all), strict=True):
            assert torch.equal(x, y)


def test_bad_inputs_on_cuda() -> None:
    from dflashgen.runtime.gdn_kernel import GdnInputError, gdn_step

    s0, q, k, v, beta, ld = _inputs(2, 8, 2, 4, 32, 16, seed=3)
    with pytest.raises(GdnInputError, match="on cuda"):
        gdn_step(s0, q.cpu(), k, v, beta, ld)
    with pytest.raises(GdnInputError, match="key head dim 48"):
        s, qq, kk, vv, bb, ll = _inputs(2, 8, 2, 4, 48, 16, seed=3)
        gdn_step(s, qq, kk, vv, bb, ll)
    with pytest.raises(GdnInputError, match="cannot run"):
        gdn_step(s0, q, k, v, beta, ld, arch=100)
