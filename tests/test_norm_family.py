"""The fused residual add + RMSNorm family ("norm"): rendering, manifest entries, kernel choice, the
torch reference and its input checks, the decoder's norm sites on the CPU path (the same ops in the
same order as before the fusion), and the sm_70 (NVRTC + ptxas 12.9) / sm_90 (nvcc, when present)
compiles without spills. The kernel against the reference runs on a GPU (tests/test_gpu_norm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import built_family
from dflashgen.runtime import norm_kernel
from dflashgen.runtime.norm_kernel import NormInputError, add_rmsnorm, fused_available, reference_add_rmsnorm

from dflashgen import norm_family
from dflashgen.model import load_model_config
from dflashgen.render import FAMILY_MODULES, family_kernels, generated_dir, load_manifest

HIDDEN = load_model_config(None).hidden_size  # Qwen3.8-27B: 5120


def test_family_renders_specialised_and_generic_kernels() -> None:
    assert FAMILY_MODULES["norm"] == "dflashgen.norm_family"
    every = family_kernels("norm")
    ks = [k for k in every if k.meta["kind"] == "add_rmsnorm"]
    qk = [k for k in every if k.meta["kind"] == "qk_rope"]
    silu = [k for k in every if k.meta["kind"] == "silu_mul"]
    gate = [k for k in every if k.meta["kind"] == "sigmoid_mul"]
    assert len(ks) + len(qk) + len(silu) + len(gate) == len(every)
    assert {k.name for k in silu} == {f"dfg_sm{a}_silumul_t256" for a in (70, 80, 90)}
    assert {k.name for k in gate} == {f"dfg_sm{a}_sigmoidmul_t256" for a in (70, 80, 90)}
    for k, fn in [(k, "silu_mul") for k in silu] + [(k, "sigmoid_mul") for k in gate]:
        # one per arch, shapes at run time; torch's arithmetic in the header
        assert f"{k.name}(" in k.source and f"{fn}<256>(" in k.source and k.meta["threads"] == 256
        assert "#include <dflashgen/silu_mul.cuh>" in k.source
    assert {k.name for k in qk} == {f"dfg_sm{a}_qknormrope_w4_d256" for a in (70, 80, 90)}
    for k in qk:  # one per arch, dims at run time; the logic in the header
        assert f"{k.name}(" in k.source and "qk_norm_rope<4>(" in k.source
        assert "#include <dflashgen/qk_norm_rope.cuh>" in k.source
    assert {(k.arch, k.meta["hidden"]) for k in ks} == {(a, h) for a in (70, 80, 90) for h in (HIDDEN, None)}
    again = {k.name: k.source for k in family_kernels("norm")}
    for k in ks:
        assert again[k.name] == k.source  # deterministic
        h = k.meta["hidden"]
        assert k.name == f"dfg_sm{k.arch}_addrmsnorm_h{h or 'any'}_t512"  # every parameter in the name
        assert "DO NOT EDIT" in k.source.splitlines()[0] and "#include <dflashgen/add_rmsnorm.cuh>" in k.source
        assert f"{k.name}(" in k.source and f"add_rmsnorm<512, {h or 0}>" in k.source  # the specialisation only


def test_manifest_lists_the_family_and_files_exist() -> None:
    entries = load_manifest()["families"]["norm"]
    assert len(entries) == 15
    for e in entries:
        assert (generated_dir() / e["file"]).is_file() and e["family"] == "norm"
        if e["kind"] == "add_rmsnorm":
            assert e["threads"] == norm_family.THREADS == 512
        elif e["kind"] in ("silu_mul", "sigmoid_mul"):
            assert e["threads"] == norm_family.SILU_THREADS == 256
        else:
            assert (e["kind"], e["threads"], e["warps"], e["max_d"]) == ("qk_rope", 128, 4, 256)


def test_kernel_choice_prefers_the_specialised_hidden_size() -> None:
    assert norm_kernel._entry(90, HIDDEN)["name"] == f"dfg_sm90_addrmsnorm_h{HIDDEN}_t512"
    assert norm_kernel._entry(70, 64)["name"] == "dfg_sm70_addrmsnorm_hany_t512"  # generic: any multiple of 4
    assert not fused_available("cpu", HIDDEN)  # CPU: torch's ops


@pytest.mark.parametrize("arch", [70, 80, 90])
def test_family_compiles_without_spills(arch: int) -> None:
    for a, entries in built_family(arch, "_(addrmsnorm|qknormrope|silumul|sigmoidmul)_", 5):
        assert set(entries) == {a.name}
        assert f".entry {a.name}(" in a.ptx.read_text()


def test_reference_is_torchs_add_and_rms_norm() -> None:
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(3, 5, 64, generator=g), torch.rand(64, generator=g) + 0.5
    y = torch.randn(3, 5, 64, generator=g).half()
    hn, x = add_rmsnorm(h, y, w, 1e-6)  # CPU: the reference
    assert torch.equal(hn, h + y) and x.dtype == torch.float16
    assert torch.equal(x, F.rms_norm(h + y, (64,), w, 1e-6).half())
    hn0, x0 = reference_add_rmsnorm(h, None, w, 1e-6)
    assert hn0 is h and torch.equal(x0, F.rms_norm(h, (64,), w, 1e-6).half())


def test_input_checks_name_the_tensor() -> None:
    h, w = torch.zeros(2, 64), torch.ones(64)
    norm_kernel._check(h, torch.zeros(2, 64).half(), w)  # fine
    cases = [((h.double(), None, w), "h must be"), ((h[:, :62].contiguous(), None, w[:62]), "multiple of 4"),
             ((h.t().contiguous().t(), None, w), "h must be"), ((h, torch.zeros(2, 64), w), "y must be float16"),
             ((h, torch.zeros(2, 32).half(), w), "y must be"),
             ((h, torch.zeros(64, 2).half().t(), w), "y must be contiguous"),
             ((h, None, torch.ones(32)), "w must be"), ((h, None, w.half()), "w must be")]
    for args, match in cases:
        with pytest.raises(NormInputError, match=match):
            norm_kernel._check(*args)


def test_qk_norm_rope_off_cuda_fills_q_out_and_a_head_major_cache() -> None:
    """The wrapper's CPU path (torch's ops): q scaled into a caller's [B, T, Hq, D] view (here the
    transpose of a grouped [B, Hq, T, D] FP16 tensor, the drafter's), K / V into a head-major cache at
    the same rows as a position-major one; a q_out it cannot fill is refused by name."""
    from dflashgen.runtime.norm_kernel import qk_norm_rope

    g = torch.Generator().manual_seed(5)
    b, t, hq, hkv, d, cap = 2, 3, 4, 2, 16, 8
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=g).half()
    ang = torch.randn(b, t, 1, d // 2, generator=g)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    q_w, k_w = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    pos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    args = ((hq, hkv), d, False, d, q_w, k_w, 1e-6, cos, sin, pos)
    kc, vc = torch.zeros(b, cap, hkv, d).half(), torch.zeros(b, cap, hkv, d).half()
    q = qk_norm_rope(qkv, *args, kc, vc)
    hk, hv = torch.zeros(b, hkv, cap, d).half(), torch.zeros(b, hkv, cap, d).half()
    qr = torch.empty(b, hq, t, d).half()
    got = qk_norm_rope(qkv, *args, hk, hv, q_out=qr.transpose(1, 2), q_scale=d**-0.5, head_major=True)
    assert got.data_ptr() == qr.data_ptr() and torch.equal(qr.transpose(1, 2), (q * d**-0.5).half())
    assert torch.equal(hk.transpose(1, 2), kc) and torch.equal(hv.transpose(1, 2), vc) and kc.abs().sum() > 0
    for bad in (torch.empty(b, t, hq, d, dtype=torch.float64), torch.empty(b, t, hq + 1, d),
                torch.empty(b, t, d, hq).transpose(2, 3)):
        with pytest.raises(NormInputError, match="q_out must be"):
            qk_norm_rope(qkv, *args, kc, vc, q_out=bad)


def test_target_norm_sites_on_cpu_are_the_unfused_ops() -> None:
    """TargetModel._add_norm on CPU: h + r then FP32 rms_norm, bitwise the pre-fusion ops."""
    from types import SimpleNamespace

    from dflashgen.runtime.target import TargetModel, _rms_norm

    g = torch.Generator().manual_seed(1)
    h, r, w = torch.randn(2, 3, 32, generator=g), torch.randn(2, 3, 32, generator=g).half(), torch.rand(32, generator=g)
    fake = SimpleNamespace(w={"n": w}, eps=1e-6, fused_norm=False)
    hn, x = TargetModel._add_norm(fake, h, r, "n")  # type: ignore[arg-type]
    assert torch.equal(hn, h + r) and torch.equal(x, _rms_norm(h + r, w, 1e-6)) and x.dtype == torch.float32
    h0, x0 = TargetModel._add_norm(fake, h, None, "n")  # type: ignore[arg-type]
    assert h0 is h and torch.equal(x0, _rms_norm(h, w, 1e-6))


def test_silu_mul_cat_off_cuda_is_torchs_ops_and_the_kernel_refuses_what_it_cannot_take() -> None:
    """Off CUDA (or for a layout the kernel cannot take) ``silu_mul_cat`` is torch's composition on the
    halves; the kernel entry point names what is wrong instead of computing anything."""
    from dflashgen.runtime.library import silu_mul, silu_mul_cat

    y = torch.randn(5, 3, 32).half()
    assert torch.equal(silu_mul_cat(y, torch.float16), (F.silu(y[..., :16].float()) * y[..., 16:].float()).half())
    assert torch.equal(silu_mul_cat(y.float(), torch.float32), silu_mul(*y.float().chunk(2, dim=-1), torch.float32))
    assert not norm_kernel.silu_mul_fits(y)
    with pytest.raises(norm_kernel.NormInputError, match="CUDA float16"):
        norm_kernel.fused_silu_mul(y)


def test_sigmoid_gate_off_cuda_is_torchs_ops_and_the_kernel_refuses_what_it_cannot_take() -> None:
    """Off CUDA ``sigmoid_gate`` is torch's composition (o * sigmoid(gate.float()), rounded once); the
    kernel entry point names what is wrong instead of computing anything."""
    from dflashgen.runtime.library import mul_to, sigmoid_gate

    g = torch.Generator().manual_seed(2)
    o = torch.randn(2, 3, 4, 8, generator=g)
    qg = torch.randn(2, 3, 4, 16, generator=g).half()  # per head [q | gate], as the q|gate projection
    gate = qg[..., 8:]
    assert torch.equal(sigmoid_gate(o, gate, torch.float16), (o * torch.sigmoid(gate.float())).half())
    assert torch.equal(sigmoid_gate(o, gate, torch.float32), mul_to(o, torch.sigmoid(gate.float()), torch.float32))
    assert not norm_kernel.sigmoid_mul_fits(o, gate)
    with pytest.raises(norm_kernel.NormInputError, match="CUDA float32 o"):
        norm_kernel.fused_sigmoid_mul(o, gate)
    assert norm_kernel._gate_rows(gate).shape == (6, 4, 8)  # [B, T] rows evenly spaced: one view
    assert norm_kernel._gate_rows(gate.transpose(0, 1)) is None
