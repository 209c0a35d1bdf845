"""GPU: the generated gated delta rule kernels (family "gdn") on an H200 -- against the torch
reference (rel. error <= 1e-5, FP32), bitwise: a T = 8 step + advance(n) == n one-position steps,
a request's bits the same alone and in a batch of 8, CUDA-graph replay == eager, the prefill kernel
(any T) == T one-position steps; the sm_90 cubin and the compute_70 PTX (JIT-compiled by the
driver). Skips cleanly without a GPU."""

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
    assert torch.equal(adv, ref_adv)  # same inputs, products and fmas only (no expf): bitwise
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
@pytest.mark.parametrize(("t", "hk", "hv", "dk", "dv"), [(8, 16, 48, 128, 128), (7, 2, 6, 32, 40)])
def test_replaying_step_is_advance_then_step(arch: str | int, t: int, hk: int, hv: int, dk: int, dv: int) -> None:
    """The step with a deferred rollback folded in (replay_n: the previous step's terms, then this
    step) == advance(n) followed by the plain step, bitwise: state, o, u, decay and k_out; the
    arrival counters are left at 0, every group's terms written once (repeated: the counters reset)."""
    from dflashgen.runtime.gdn_kernel import gdn_advance, gdn_step

    b = 3
    a = _arch(arch)
    s0, q0, k0, v0, beta0, ld0 = _inputs(b, t, hk, hv, dk, dv, seed=61 + dk)
    _, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=62 + dk)
    u_t, d_t, k_t = (torch.empty(b, t, hv, dv, device="cuda"), torch.empty(b, t, hv, device="cuda"),
                     torch.empty(b, t, hk, dk, device="cuda"))
    gdn_step(s0, q0, k0, v0, beta0, ld0, u=u_t, decay=d_t, k_out=k_t, arch=a)  # the previous round's terms
    n = torch.tensor([t, 0, t // 2 + 1], device="cuda")
    ref = s0.clone()
    gdn_advance(ref, k_t, u_t, d_t, n, arch=a)
    ro, ru, rd = gdn_step(ref, q, k, v, beta, ld, arch=a)
    arrive = torch.zeros(b, hk, dtype=torch.int32, device="cuda")
    for rep in range(2):
        st, uu, dd, kk = s0.clone(), u_t.clone(), d_t.clone(), k_t.clone()
        o, _, _ = gdn_step(st, q, k, v, beta, ld, u=uu, decay=dd, k_out=kk, replay_n=n, arrive=arrive, arch=a)
        torch.cuda.synchronize()
        assert torch.equal(st, ref), rep
        assert torch.equal(o, ro) and torch.equal(uu, ru) and torch.equal(dd, rd) and torch.equal(kk, k), rep
        assert not arrive.any(), rep


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("t", [1, 8, 16])
def test_step_bits_do_not_depend_on_the_v_layout(arch: str | int, t: int) -> None:
    """The step copies v as float4 when its channels are contiguous and 16-byte aligned with batch /
    position strides a multiple of 4, element by element otherwise (gdn.cuh step): same bits either way,
    with dynamic shared memory sized for T = 1, 8 and 16. dv = 40: a column block only half there."""
    from dflashgen.runtime.gdn_kernel import gdn_step

    b, hk, hv, dk, dv = 2, 4, 12, 128, 40
    s0, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=31 + t)
    a = _arch(arch)
    dense = v.contiguous()
    odd = torch.empty(dense.numel() + 1, device="cuda")[1:].view(dense.shape)  # 4 bytes past alignment
    odd.copy_(dense)
    wide = torch.zeros(b, t, 2 * hv * dv, device="cuda")
    wide[..., ::2] = dense.reshape(b, t, hv * dv)
    strided = wide[..., ::2].reshape(b, t, hv, dv)  # channel stride 2
    padded = torch.zeros(b, t, hv * dv + 1, device="cuda")
    padded[..., :hv * dv] = dense.reshape(b, t, hv * dv)
    ragged = padded[..., :hv * dv].reshape(b, t, hv, dv)  # position stride hv * dv + 1 (odd)
    # at T = 1 the position stride of the size-1 axis is arbitrary: the batch stride is the odd one
    assert strided.stride(3) == 2 and ragged.stride(0 if t == 1 else 1) % 4 and odd.data_ptr() % 16
    k_out = torch.empty_like(k)
    want = gdn_step(s0, q, k, dense, beta, ld, k_out=k_out, arch=a)
    assert torch.equal(k_out, k)
    for name, view in (("strided", v), ("misaligned", odd), ("channel stride 2", strided), ("odd stride", ragged)):
        got = gdn_step(s0, q, k, view, beta, ld, arch=a)
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), name


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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("t", "hk", "hv", "dk", "dv"), [(45, 16, 48, 128, 128), (100, 2, 6, 32, 40),
                                                         (17, 4, 12, 64, 128), (16, 2, 6, 32, 40),
                                                         (32, 16, 48, 128, 128), (1, 2, 6, 32, 40)])
def test_prefill_is_bitwise_one_token_steps(arch: str | int, t: int, hk: int, hv: int, dk: int, dv: int) -> None:
    """The prefill kernel (any T, one launch, commit in place) == T one-position gdn_step launches
    bitwise: outputs at every position and the state after all T; with ragged n (0, 17, T - 3, T) the
    state after n[b] (n = 0: untouched), the same outputs; within 1e-5 of the torch reference."""
    from dflashgen.runtime.gdn_kernel import gdn_prefill, gdn_step, reference_step

    b, a = 4, _arch(arch)
    s0, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=t + dk)
    full = s0.clone()
    o = gdn_prefill(full, q, k, v, beta, ld, arch=a)
    n = torch.tensor([t, 0, min(17, t), t - 3], device="cuda")
    ragged = s0.clone()
    o_r = gdn_prefill(ragged, q, k, v, beta, ld, n=n, arch=a)
    steps, upto = s0.clone(), s0.clone()
    for i in range(t):
        sl = slice(i, i + 1)
        args = (q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl], beta[:, sl].contiguous(),
                ld[:, sl].contiguous())
        oi, _, _ = gdn_step(steps, *args, commit=steps, arch=a)
        assert torch.equal(oi[:, 0], o[:, i]), i
        gdn_step(upto, *args, commit=upto, n=(n > i).long(), arch=a)  # n = 0 once request b is done
    torch.cuda.synchronize()
    assert torch.equal(full, steps) and torch.equal(o_r, o)
    assert torch.equal(ragged, upto) and torch.equal(ragged[1], s0[1])
    ref = s0.clone()
    ro, _, _ = reference_step(ref, q, k, v, beta, ld, commit=ref, n=n)
    assert _rel(o_r, ro) <= 1e-5 and _rel(ragged, ref) <= 1e-5, (_rel(o_r, ro), _rel(ragged, ref))
    # a request's bits alone == in the batch
    alone = s0[2:3].clone()
    o1 = gdn_prefill(alone, q[2:3], k[2:3], v[2:3], beta[2:3], ld[2:3], n=n[2:3], arch=a)
    assert torch.equal(o1[0], o[2]) and torch.equal(alone[0], ragged[2])


def _reference64(s0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                 ld: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in FP64, position by position: outputs for every position and the state after
    n[b] positions (n[b] = 0: S0)."""
    hv = s0.shape[1]
    rep = hv // k.shape[2]
    s = s0.double()
    kk, qq = k.double().repeat_interleave(rep, dim=2), q.double().repeat_interleave(rep, dim=2)
    out, commit = [], s.clone()
    for t in range(k.shape[1]):
        s = s * ld[:, t].double().exp()[..., None, None]
        u = beta[:, t].double()[..., None] * (v[:, t].double() - torch.einsum("bhkv,bhk->bhv", s, kk[:, t]))
        s = s + kk[:, t][..., :, None] * u[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, qq[:, t]))
        commit = torch.where((n == t + 1).view(-1, 1, 1, 1), s, commit)
    return torch.stack(out, dim=1), commit


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("t", "hk", "hv", "dk", "dv"), [(1023, 16, 48, 128, 128), (100, 2, 6, 32, 40),
                                                         (77, 4, 12, 64, 128), (33, 2, 4, 16, 16),
                                                         (32, 16, 48, 128, 128), (5, 2, 6, 32, 40),
                                                         (70, 4, 4, 64, 32)])
def test_chunked_prefill_matches_the_recurrence(arch: str | int, t: int, hk: int, hv: int, dk: int, dv: int) -> None:
    """The chunk-form prefill kernels (prep + scan) against the recurrence in FP64: outputs and the
    state after ragged n[b] (T, 0, mid-chunk, T - 3) within 1e-5, next to the sequential kernel's own
    error; a request's bits alone (its own T) == padded in the batch (chunks start at its first
    position; every sum runs over its positions <= t)."""
    from dflashgen.runtime.gdn_kernel import gdn_prefill, gdn_prefill_chunked

    b, a = 4, _arch(arch)
    s0, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=t + dk + 7)
    n = torch.tensor([t, 0, min(t, 45), max(t - 3, 1)], device="cuda")
    chunked, seq = s0.clone(), s0.clone()
    o = gdn_prefill_chunked(chunked, q, k, v, beta, ld, n=n, arch=a)
    o_seq = gdn_prefill(seq, q, k, v, beta, ld, n=n, arch=a)
    ro, rs = _reference64(s0, q, k, v, beta, ld, n)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.equal(chunked[1], s0[1])
    errs = {"o": _rel(o.double(), ro), "state": _rel(chunked.double(), rs)}
    seq_errs = {"o": _rel(o_seq.double(), ro), "state": _rel(seq.double(), rs)}
    print(f"chunked prefill T={t} dk={dk} dv={dv} {arch}: rel. to FP64 {errs} (sequential kernel {seq_errs})")
    assert max(errs.values()) <= 1e-5, errs
    for r in (2, 3):  # alone, with T = n[r]: the same bits as in the padded batch
        m = int(n[r])
        alone = s0[r:r + 1].clone()
        o1 = gdn_prefill_chunked(alone, q[r:r + 1, :m].contiguous(), k[r:r + 1, :m].contiguous(), v[r:r + 1, :m],
                                 beta[r:r + 1, :m].contiguous(), ld[r:r + 1, :m].contiguous(), arch=a)
        assert torch.equal(o1[0], o[r, :m]) and torch.equal(alone[0], chunked[r]), r


def test_prefill_of_1023_tokens_timing() -> None:
    """Not a gate: CUDA-event medians at Qwen3.8 shapes (16 key / 48 value heads, dk = dv = 128), T =
    1023, B = 1 and 4, per layer: the sequential prefill kernel and the chunk-form kernels (prep +
    scan), printed (the pytest log keeps them)."""
    from dflashgen.runtime.gdn_kernel import gdn_prefill, gdn_prefill_chunked

    t = 1023
    for b in (1, 4):
        s0, q, k, v, beta, ld = _inputs(b, t, 16, 48, 128, 128, seed=5)
        s = s0.clone()
        times = {}
        for name, fn in (("sequential", gdn_prefill), ("chunked", gdn_prefill_chunked)):
            fn(s, q, k, v, beta, ld)
            ms = []
            for _ in range(7):
                s.copy_(s0)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn(s, q, k, v, beta, ld)
                e1.record()
                torch.cuda.synchronize()
                ms.append(e0.elapsed_time(e1))
            times[name] = sorted(ms)[len(ms) // 2]
        print(f"gdn prefill T={t} B={b}: sequential {times['sequential']:.3f} ms, chunked {times['chunked']:.3f} ms "
              f"per layer ({times['sequential'] / times['chunked']:.2f}x)")


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
    from dflashgen.runtime.gdn_kernel import gdn_prefill, prefill_available

    assert prefill_available("cuda", 128) and not prefill_available("cuda", 48) and not prefill_available("cpu", 128)
    odd = torch.empty(q.numel() + 1, device="cuda")[1:].view(q.shape)  # 4 bytes past an aligned start
    odd.copy_(q)
    with pytest.raises(GdnInputError, match="16-byte aligned"):
        gdn_prefill(s0.clone(), odd, k, v, beta, ld)
    from dflashgen.runtime.gdn_kernel import chunk_available, gdn_prefill_chunked

    assert chunk_available("cuda", 128) and not chunk_available("cuda", 48) and not chunk_available("cpu", 128)
    with pytest.raises(GdnInputError, match="q must start at 16-byte aligned"):
        gdn_prefill_chunked(s0.clone(), odd, k, v, beta, ld)
    with pytest.raises(GdnInputError, match="CUDA kernels only"):
        gdn_prefill_chunked(s0.cpu(), q.cpu(), k.cpu(), v.cpu(), beta.cpu(), ld.cpu())
    with pytest.raises(GdnInputError, match="q must start at 16-byte aligned"):
        gdn_step(s0, odd, k, v, beta, ld)  # the step stages q / k as float4 too
    o = torch.empty(2 * 8 * 4 * 16 + 1, device="cuda")[1:].view(2, 8, 4, 16)  # 4 bytes past alignment
    with pytest.raises(GdnInputError, match="o must start at 16-byte aligned"):
        gdn_step(s0, q, k, v, beta, ld, o=o)
    from dflashgen.runtime.gdn_kernel import gdn_advance

    _, u, d = gdn_step(s0, q, k, v, beta, ld)
    u_odd = torch.empty(u.numel() + 1, device="cuda")[1:].view(u.shape)
    u_odd.copy_(u)
    with pytest.raises(GdnInputError, match="u must start at 16-byte aligned"):
        gdn_advance(s0.clone(), k, u_odd, d, torch.full((2,), 8, device="cuda"))
