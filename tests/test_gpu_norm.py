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
