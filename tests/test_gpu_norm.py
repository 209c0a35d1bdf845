"""GPU: the fused residual add + RMSNorm kernels (family "norm") on an H200 -- h_out bitwise h + y,
x within FP16 rounding of torch's FP32 rms_norm (rel. L2 <= 1e-3), a row's bits the same whatever
the number of rows (batch invariance), CUDA-graph replay == eager, the decoder's norm sites fused vs
torch's ops on a tiny target; the sm_90 cubin and the compute_70 PTX (JIT-compiled by the driver),
the specialised (hidden 5120) and generic kernels. Skips cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

ARCHS = ["native", 70]


def _arch(a: str | int) -> int | None:
    return None if a == "native" else int(a)


def _inputs(rows: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g, device="cuda") * 3
    y = (torch.randn(rows, hidden, generator=g, device="cuda") * 2).half()
    w = torch.rand(hidden, generator=g, device="cuda") + 0.5
    return h, y, w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hidden", [5120, 64, 4100])
@pytest.mark.parametrize("with_y", [True, False])
def test_kernel_equals_reference(arch: str | int, hidden: int, with_y: bool) -> None:
    from dflashgen.runtime.norm_kernel import _KERNELS, add_rmsnorm

    for rows in (1, 8, 64, 1000):
        h, y, w = _inputs(rows, hidden, seed=rows + hidden)
        y = y if with_y else None
        hn, x = add_rmsnorm(h, y, w, 1e-6, arch=_arch(arch))
        ref_h = h if y is None else h + y
        ref_x32 = torch.nn.functional.rms_norm(ref_h, (hidden,), w, 1e-6)
        torch.cuda.synchronize()
        assert torch.equal(hn, ref_h), "h_out must be bitwise h + y"
        assert x.dtype == torch.float16 and not x.isnan().any()
        assert _rel(x, ref_x32) <= 1e-3, _rel(x, ref_x32)
        # within one FP16 rounding of the FP32 value: |x - ref| <= ulp(ref) (2^-10 relative, + a little
        # for the mean's FP32 rounding)
        assert float(((x.float() - ref_x32).abs() / ref_x32.abs().clamp_min(1e-3)).max()) <= 2e-3
    name = next(k.name for (hh, _, _), k in _KERNELS.items() if hh == hidden)
    assert ("_h5120_" in name) == (hidden == 5120)  # the specialised kernel where generated


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_are_batch_invariant(arch: str | int) -> None:
    from dflashgen.runtime.norm_kernel import add_rmsnorm

    h, y, w = _inputs(64, 5120, seed=3)
    _, full = add_rmsnorm(h, y, w, 1e-6, arch=_arch(arch))
    for rows in (1, 2, 8, 17, 63):
        _, part = add_rmsnorm(h[:rows].contiguous(), y[:rows].contiguous(), w, 1e-6, arch=_arch(arch))
        assert torch.equal(part, full[:rows]), f"rows {rows}"
    for r in (0, 5, 63):  # a row alone
        _, one = add_rmsnorm(h[r:r + 1].contiguous(), y[r:r + 1].contiguous(), w, 1e-6, arch=_arch(arch))
        assert torch.equal(one, full[r:r + 1])


def test_graph_replay_equals_eager() -> None:
    from dflashgen.runtime.norm_kernel import add_rmsnorm

    h, y, w = _inputs(8, 5120, seed=4)
    add_rmsnorm(h, y, w, 1e-6)  # load outside capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        hn, x = add_rmsnorm(h, y, w, 1e-6)
    h2, y2, _ = _inputs(8, 5120, seed=5)
    h.copy_(h2)
    y.copy_(y2)
    g.replay()
    torch.cuda.synchronize()
    eh, ex = add_rmsnorm(h2, y2, w, 1e-6)
    assert torch.equal(hn, eh) and torch.equal(x, ex)


def test_bad_inputs_raise() -> None:
    from dflashgen.runtime.norm_kernel import NormInputError, add_rmsnorm

    h, y, w = _inputs(4, 64, seed=6)
    with pytest.raises(NormInputError, match="y must be float16"):
        add_rmsnorm(h, y.float(), w, 1e-6)
    with pytest.raises(NormInputError, match="h must be"):
        add_rmsnorm(h.half(), y, w, 1e-6)
    with pytest.raises(NormInputError, match="multiple of 4"):
        add_rmsnorm(h[:, :62].contiguous(), y[:, :62].contiguous(), w[:62].contiguous(), 1e-6)


def test_target_fused_norm_sites_match_torch_ops(tmp_path) -> None:
    """A 4-layer Qwen3.8-shaped target: logits with the fused norm sites vs torch's add / rms_norm /
    cast, within FP16 rounding (the only difference is the mean's reduction order)."""
    from dflashgen.runtime.decode_bench import load_target, write_synthetic
    from dflashgen.runtime.norm_kernel import _KERNELS

    write_synthetic(tmp_path, None, 4, "nvfp4", seed=0, device="cuda")
    target = load_target(tmp_path, "nvfp4", device="cuda")
    assert target.fused_norm
    toks = torch.randint(0, target.cfg.vocab_size, (2, 8), device="cuda")
    n = len(_KERNELS)
    fused = target(toks, target.new_state(2, 32))
    assert len(_KERNELS) >= max(n, 1)
    target.fused_norm = False
    plain = target(toks, target.new_state(2, 32))
    err = _rel(fused, plain)
    assert err <= 1e-2, err
    assert bool((fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9)
    print(f"fused vs unfused norm sites: logits rel {err:.2e}")


# --------------------------------------------------------------------------- attention inputs


def _qk_case(b: int, t: int, hq: int, hkv: int, d: int, gated: bool, rd: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = hq * d * (2 if gated else 1) + 2 * hkv * d
    qkv = (torch.randn(b, t, n + 8, generator=g, device="cuda") * 2).half()[..., :n]  # evenly spaced rows
    length = 64
    pos = torch.stack([torch.randperm(length, generator=torch.Generator().manual_seed(seed + r))[:t].sort().values
                       for r in range(b)]).cuda()  # distinct cache rows per request
    ang = torch.randn(b, t, 1, rd // 2, generator=g, device="cuda")
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    q_w, k_w = torch.rand(d, generator=g, device="cuda") + 0.5, torch.rand(d, generator=g, device="cuda") + 0.5
    kc = torch.zeros(b, length, hkv, d, dtype=torch.float16, device="cuda")
    return qkv, pos, cos, sin, q_w, k_w, kc, torch.zeros_like(kc)


def _qk_views(qkv: torch.Tensor, hq: int, hkv: int, d: int, gated: bool):
    b, t, _ = qkv.shape
    qg, k, v = qkv.split([hq * d * (2 if gated else 1), hkv * d, hkv * d], dim=-1)
    q = qg.reshape(b, t, hq, 2 * d)[..., :d] if gated else qg.reshape(b, t, hq, d)
    return q, k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("hq", "hkv", "d", "gated", "rd"), [(24, 4, 256, True, 64), (6, 1, 256, True, 64),
                                                             (4, 2, 64, False, 64), (3, 1, 40, True, 16)])
def test_qk_norm_rope_equals_reference(arch: str | int, hq: int, hkv: int, d: int, gated: bool, rd: int) -> None:
    from dflashgen.runtime.norm_kernel import qk_norm_rope, reference_qk_norm_rope

    for b, t in ((1, 1), (3, 8), (2, 24)):
        qkv, pos, cos, sin, q_w, k_w, kc, vc = _qk_case(b, t, hq, hkv, d, gated, rd, seed=b * 10 + t)
        q = qk_norm_rope(qkv, (hq, hkv), d, gated, rd, q_w, k_w, 1e-6, cos, sin, pos, kc, vc, arch=_arch(arch))
        rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
        rq = reference_qk_norm_rope(*_qk_views(qkv, hq, hkv, d, gated), q_w, k_w, 1e-6, cos, sin, rd, pos, rk, rv)
        torch.cuda.synchronize()
        assert q.shape == (b, t, hq, d) and _rel(q, rq) <= 1e-5, _rel(q, rq)
        assert torch.equal(vc, rv)  # v: a copy
        assert _rel(kc, rk) <= 1e-3 and torch.equal(kc != 0, rk != 0)  # k: FP16 rounding; only pos rows written


@pytest.mark.parametrize("arch", ARCHS)
def test_qk_norm_rope_positions_are_exact(arch: str | int) -> None:
    from dflashgen.runtime.norm_kernel import qk_norm_rope

    hq, hkv, d, rd = 24, 4, 256, 64
    b, t = 3, 8
    qkv, pos, cos, sin, q_w, k_w, kc, vc = _qk_case(b, t, hq, hkv, d, True, rd, seed=21)
    q = qk_norm_rope(qkv, (hq, hkv), d, True, rd, q_w, k_w, 1e-6, cos, sin, pos, kc, vc, arch=_arch(arch))
    for r, p in ((0, 0), (1, 5), (2, 7)):
        k1, v1 = torch.zeros_like(kc[r:r + 1]), torch.zeros_like(vc[r:r + 1])
        one = tuple(x[r:r + 1, p:p + 1].contiguous() for x in (cos, sin, pos))
        q1 = qk_norm_rope(qkv[r:r + 1, p:p + 1], (hq, hkv), d, True, rd, q_w, k_w, 1e-6, *one, k1, v1, arch=_arch(arch))
        slot = int(pos[r, p])
        assert torch.equal(q1[0, 0], q[r, p])
        assert torch.equal(k1[0, slot], kc[r, slot]) and torch.equal(v1[0, slot], vc[r, slot])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("hq", "hkv", "d", "gated", "rd"), [(24, 4, 256, True, 64), (32, 8, 128, False, 128)])
def test_qk_norm_rope_fp16_q_and_head_major_cache(arch: str | int, hq: int, hkv: int, d: int, gated: bool,
                                                  rd: int) -> None:
    """q written as FP16 (the verify kernel's input, the target): the bits of the FP32 q's cast. q
    scaled into a grouped [B, Hq, T, D] FP16 tensor and K / V into head-major caches (the drafter's
    block forward): the bits of the FP32 call's (q * scale).half() and of its caches, transposed."""
    from dflashgen.runtime.norm_kernel import qk_norm_rope

    b, t = 3, 8
    qkv, pos, cos, sin, q_w, k_w, kc, vc = _qk_case(b, t, hq, hkv, d, gated, rd, seed=31)
    args = ((hq, hkv), d, gated, rd, q_w, k_w, 1e-6, cos, sin, pos)
    q32 = qk_norm_rope(qkv, *args, kc, vc, arch=_arch(arch))
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    q16 = torch.full((b, t, hq, d), float("nan"), dtype=torch.float16, device="cuda")
    qk_norm_rope(qkv, *args, k2, v2, q_out=q16, arch=_arch(arch))
    length = kc.shape[1]
    hk = torch.zeros(b, hkv, length, d, dtype=torch.float16, device="cuda")
    hv = torch.zeros_like(hk)
    qr = torch.full((b, hq, t, d), float("nan"), dtype=torch.float16, device="cuda")
    scale = d**-0.5
    qk_norm_rope(qkv, *args, hk, hv, q_out=qr.transpose(1, 2), q_scale=scale, head_major=True, arch=_arch(arch))
    torch.cuda.synchronize()
    assert torch.equal(q16, q32.half()) and torch.equal(k2, kc) and torch.equal(v2, vc)
    assert torch.equal(qr.transpose(1, 2), (q32 * scale).half())
    assert torch.equal(hk.transpose(1, 2), kc) and torch.equal(hv.transpose(1, 2), vc)


@pytest.mark.parametrize("arch", ARCHS)
def test_silu_mul_kernel_is_torchs_ops_bitwise(arch: str | int) -> None:
    """The SiLU-mul glue kernel (family "norm") returns the bits of torch's composition,
    (silu(gate.float()) * up.float()).half(), for 2-D / 3-D inputs, rows spaced wider than they are
    (a slice of a wider buffer), FP16 extremes (overflow to inf), and inside a CUDA graph."""
    import torch.nn.functional as F
    from dflashgen.runtime.library import silu_mul_cat
    from dflashgen.runtime.norm_kernel import fused_silu_mul, silu_mul_fits

    def want(y: torch.Tensor) -> torch.Tensor:
        i = y.shape[-1] // 2
        return (F.silu(y[..., :i].float()) * y[..., i:].float()).half()

    g = torch.Generator(device="cuda").manual_seed(3)
    for shape in [(1, 16), (7, 64), (1023, 2 * 17408), (2, 5, 2 * 4352)]:
        y = (torch.randn(*shape, generator=g, device="cuda") * 4).half()
        y.view(-1)[:4] = torch.tensor([0.0, -0.0, 65504.0, -65504.0], dtype=torch.half, device="cuda")
        y[..., shape[-1] // 2] = 65504.0  # up at the FP16 maximum: products overflow to inf like torch's
        got = fused_silu_mul(y, arch=_arch(arch))
        assert got.shape == (*shape[:-1], shape[-1] // 2) and torch.equal(got, want(y)), shape
    wide = (torch.randn(33, 200, generator=g, device="cuda") * 3).half()
    y = wide[:, :128]  # row stride 200 halves (16-byte aligned rows), 64 + 64 channels
    assert silu_mul_fits(y) and torch.equal(fused_silu_mul(y, arch=_arch(arch)), want(y))
    assert torch.equal(silu_mul_cat(y, torch.float16), want(y))  # the dispatcher the fallback GEMM path uses
    y = (torch.randn(64, 256, generator=g, device="cuda")).half()
    out = fused_silu_mul(y, arch=_arch(arch))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_silu_mul(y, arch=_arch(arch))
    y.copy_((torch.randn(64, 256, generator=g, device="cuda")).half())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want(y)) and not torch.equal(captured, out)


@pytest.mark.parametrize("arch", ARCHS)
def test_sigmoid_gate_kernel_is_torchs_ops_bitwise(arch: str | int) -> None:
    """The attention output gate kernel (family "norm") returns the bits of torch's composition,
    (o * sigmoid(gate.float())).half(), with the gate a strided view into a q|gate projection output
    ([B, T, H, 2D] per head [q | gate]), FP16 gate extremes, overflow to inf, every element written,
    and inside a CUDA graph; the target's call site (library.sigmoid_gate) serves it."""
    from dflashgen.runtime.library import sigmoid_gate
    from dflashgen.runtime.norm_kernel import fused_sigmoid_mul, sigmoid_mul_fits

    def want(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (o * torch.sigmoid(gate.float())).half()

    g = torch.Generator(device="cuda").manual_seed(4)
    for b, t, h, d in [(1, 8, 24, 256), (8, 8, 24, 256), (3, 1, 6, 256), (2, 5, 3, 4)]:
        qg = (torch.randn(b, t, h * 2 * d + 16, generator=g, device="cuda") * 6).half()[..., :h * 2 * d]
        gate = qg.view(b, t, h, 2 * d)[..., d:]
        gate[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 65504.0, -65504.0], dtype=torch.half, device="cuda")
        o = torch.randn(b, t, h, d, generator=g, device="cuda") * 3
        o[0, 0, 0, 2] = 3e38  # the product overflows FP16 to inf like torch's
        assert sigmoid_mul_fits(o, gate), (b, t, h, d)
        got = fused_sigmoid_mul(o, gate, arch=_arch(arch))
        assert got.shape == o.shape and got.is_contiguous() and torch.equal(got, want(o, gate)), (b, t, h, d)
    assert torch.equal(sigmoid_gate(o, gate, torch.float16), want(o, gate))
    assert not sigmoid_mul_fits(o.half(), gate) and not sigmoid_mul_fits(o, gate.float())
    assert not sigmoid_mul_fits(o[..., 1:3], gate[..., 1:3])  # D % 4
    o = torch.randn(8, 8, 24, 256, device="cuda")
    gate = (torch.randn(8, 8, 24, 512, device="cuda")).half()[..., 256:]
    out = fused_sigmoid_mul(o, gate, arch=_arch(arch))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_sigmoid_mul(o, gate, arch=_arch(arch))
    o.copy_(torch.randn_like(o))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want(o, gate)) and not torch.equal(captured, out)
