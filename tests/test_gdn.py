"""The gated delta rule kernel family "gdn" (CPU): rendering, manifest, the sm_70 (NVRTC + ptxas 12.9)
and sm_80 / sm_90 (nvcc, when present) compiles without spills, and the torch reference the kernel
mirrors: equal to the chunk (matrix) form within FP32 rounding, a T-position step followed by
advance(n) bitwise equal to n one-position steps, the target's rollback, and greedy equivalence with
the per-request prefill of a batch-invariant target. GPU tests: tests/test_gpu_gdn.py."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from conftest import built_family, single_thread, spy_on_prefill, tiny_fp32_target
from dflashgen.runtime import target as target_mod
from dflashgen.runtime.decode_bench import TINY
from dflashgen.runtime.gdn_kernel import (
    GdnInputError,
    fma32,
    gdn_advance,
    gdn_prefill,
    gdn_step,
    per_value_head,
    reference_step,
)
from dflashgen.runtime.sampling import SamplingParams
from dflashgen.runtime.spec_decode import NgramDrafter, SpecDecoder, plain_greedy
from dflashgen.runtime.target import TargetModel, _gdn_chunk, _gdn_state_at

from dflashgen import gdn_family
from dflashgen.model import parse_model_config
from dflashgen.render import FAMILY_MODULES, family_kernels, generated_dir, load_manifest

CFG = parse_model_config(TINY)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


# --------------------------------------------------------------------------- family


def test_family_renders_every_arch_and_key_dim() -> None:
    assert FAMILY_MODULES["gdn"] == "dflashgen.gdn_family"
    every = family_kernels("gdn")
    ks = [k for k in every if k.meta["mode"] == "step"]
    pf = [k for k in every if k.meta["mode"] == "prefill"]
    io = [k for k in every if k.meta["mode"] == "io"]
    ck = [k for k in every if k.meta["mode"] == "chunk"]
    assert len(ks) + len(pf) + len(io) + len(ck) == len(every)
    assert {(k.arch, k.meta["dk"]) for k in ck} == {(a, d) for a in (70, 80, 90) for d in gdn_family.key_dims()}
    for k in ck:  # prep + scan; chunk, columns and warps in the name; the header's smem size checked at compile
        dk = k.meta["dk"]
        assert f"{k.name}_prep(" in k.source and f"{k.name}(" in k.source and f"prep<{dk}, 32, 128>" in k.source
        assert "DO NOT EDIT" in k.source.splitlines()[0] and k.meta["prep_threads"] == 128
        if k.arch >= 80:  # the tensor-core scan: the key dim split over r warps per 16 columns, up to 3 heads
            r = min(4, dk // 8)
            assert k.name == f"dfg_sm{k.arch}_gdnck_dk{dk}_c32_tf32x3_r{r}"
            assert (k.meta["chunk"], k.meta["cols"], k.meta["threads"], k.meta["scan"]) == (32, 16, 32 * r, "tf32x3")
            assert (k.meta["smem_base"], k.meta["max_heads"]) == (4 * 4 * 32 * dk, 3)
            assert k.meta["smem_per_head"] == 4 * (4 * 32 * 40 + 2 * 32 * 20 + 8 * 32 + (2 * r + 1) * 4 * 32 * 4)
            assert k.meta["smem_base"] + 3 * k.meta["smem_per_head"] <= 227 * 1024  # 3 heads on sm_90
            assert f"mma::scan<{dk}, 32, {r}>" in k.source and "#include <dflashgen/gdn_chunk_mma.cuh>" in k.source
            assert f"smem_per_head_bytes<{dk}, 32, {r}>() == {k.meta['smem_per_head']}" in k.source
            assert f"__launch_bounds__({96 * r}, 1)" in k.source
        else:  # compute_70: no TF32 MMA, the CUDA-core scan
            assert k.name == f"dfg_sm{k.arch}_gdnck_dk{dk}_c32_n16_w4"
            assert (k.meta["chunk"], k.meta["cols"], k.meta["threads"], k.meta["scan"]) == (32, 16, 128, "fp32")
            assert k.meta["smem"] == 4 * (96 * (dk + 4) + 16 * dk + 64 * 36 + 96 * 16 + 64)
            assert f"scan<{dk}, 32, 16, 128>" in k.source and "#include <dflashgen/gdn_chunk.cuh>" in k.source
            assert f"scan_smem_bytes<{dk}, 32, 16>() == {k.meta['smem']}" in k.source
    assert {k.name for k in io} == {f"dfg_sm{a}_gdnio_w4_d256_pt16" for a in (70, 80, 90)}
    for k in io:  # one set per arch, dims at run time
        assert f"{k.name}(" in k.source and f"{k.name}_gate(" in k.source and f"{k.name}_prefill(" in k.source
        assert "#include <dflashgen/gdn_io.cuh>" in k.source
        assert "inputs<4>(" in k.source and "gate<4>(" in k.source and (k.meta["warps"], k.meta["max_d"]) == (4, 256)
        assert "prefill_inputs<4, 16, dflashgen::gdn_io::PER_LANE>(" in k.source  # _prefill_wide; _prefill: 4 per lane
        assert (k.meta["prefill_tile"], k.meta["prefill_max_w"], k.meta["prefill_narrow_d"]) == (16, 4, 128)
    assert {(k.arch, k.meta["dk"]) for k in ks} == {(a, d) for a in (70, 80, 90) for d in gdn_family.key_dims()}
    assert {(k.arch, k.meta["dk"]) for k in pf} == {(a, d) for a in (70, 80, 90) for d in gdn_family.key_dims()}
    for k in pf:
        w = gdn_family.prefill_warps(k.meta["dk"])
        assert w == (4 if k.meta["dk"] >= 32 else 2)
        assert k.name == f"dfg_sm{k.arch}_gdnpf_dk{k.meta['dk']}_s16_r16_c2_w{w}_mb4"
        assert "DO NOT EDIT" in k.source.splitlines()[0] and "#include <dflashgen/gdn.cuh>" in k.source
        assert f"{k.name}(" in k.source and f"prefill<{k.meta['dk']}, 16, {w}, 2>" in k.source
    assert 128 in gdn_family.key_dims()  # Qwen3.8-27B
    again = {k.name: k.source for k in family_kernels("gdn")}
    for k in ks:
        assert again[k.name] == k.source  # deterministic
        mb = 7 if k.arch < 80 else 8  # sm_70's step: 72 registers (its ptxas spilled at 64)
        assert k.name == f"dfg_sm{k.arch}_gdn_dk{k.meta['dk']}_t16_r16_c4_w4_mb{mb}_dyn"  # every parameter in the name
        dk = k.meta["dk"]  # dynamic shared memory per position: q, k rows, 32 values, beta, decay / k, u, decay
        assert (k.meta["smem_per_t"], k.meta["advance_smem_per_t"]) == (4 * (2 * dk + 34), 4 * (dk + 33))
        assert f"__launch_bounds__(128, {mb})" in k.source and "__launch_bounds__(128, 7)" in k.source  # _replay: 7
        assert "DO NOT EDIT" in k.source.splitlines()[0] and "#include <dflashgen/gdn.cuh>" in k.source
        assert f"{k.name}(" in k.source and f"{k.name}_advance(" in k.source and f"{k.name}_replay(" in k.source
        # the specialisations only; logic in the header
        assert f"step<{k.meta['dk']}, 16, 4, false>" in k.source and f"step<{k.meta['dk']}, 16, 4, true>" in k.source


def test_manifest_lists_the_family_and_files_exist() -> None:
    entries = load_manifest()["families"]["gdn"]
    assert len(entries) == 3 * 3 * len(gdn_family.key_dims()) + 3
    for e in entries:
        assert (generated_dir() / e["file"]).is_file() and e["family"] == "gdn"
        if e["mode"] == "io":
            assert (e["threads"], e["warps"], e["max_d"]) == (128, 4, 256)
        elif e["mode"] == "chunk":
            assert e["prep_threads"] == 128 and e == {**gdn_family.chunk_meta(e["arch"], e["dk"]), **e}
            if e["arch"] < 80:  # CUDA cores: 16 columns per 128-thread CTA, 3 per SM
                assert (e["threads"], e["cols"], e["chunk"], e["scan"]) == (128, 16, 32, "fp32")
                assert e["smem"] == gdn_family.chunk_smem_bytes(e["dk"]) <= 75 * 1024
        elif e["mode"] == "step":
            assert (e["threads"], e["cols"], e["max_t"]) == (128, 32, 16)
            assert e["smem_per_t"] == 4 * (2 * e["dk"] + 34) and e["advance_smem_per_t"] == 4 * (e["dk"] + 33)
        else:
            w = 4 if e["dk"] >= 32 else 2  # 4 warps where a chunk's q / k staging is whole rounds of 128 threads
            assert (e["mode"], e["threads"], e["cols"], e["chunk"]) == ("prefill", 32 * w, 4 * w, 16)
            assert f"_c2_w{w}_" in e["name"]  # 2 columns per thread: twice the step layout's warps


@pytest.mark.parametrize("arch", [70, 80, 90])
def test_family_compiles_without_spills(arch: int) -> None:
    for a, entries in built_family(arch, "_gdn(pf|io|ck)?_", 3 * len(gdn_family.key_dims()) + 1):  # none spill
        prefill = "_gdnpf_" in a.name
        if "_gdnck_" in a.name:  # prep + scan, the scan's shared memory dynamic
            assert set(entries) == {a.name, a.name + "_prep"}
            continue
        if "_gdnio_" in a.name:
            assert set(entries) == {a.name, a.name + "_gate", a.name + "_prefill", a.name + "_prefill_wide",
                                    a.name + "_split"}
            continue
        assert set(entries) == ({a.name} if prefill else {a.name, a.name + "_advance", a.name + "_replay"})
        ptx = a.ptx.read_text()
        assert f".entry {a.name}(" in ptx and (prefill or f".entry {a.name}_advance(" in ptx)


# --------------------------------------------------------------------------- the reference


def _inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    s0 = randn(b, hv, dk, dv) * 0.3
    q = torch.nn.functional.normalize(randn(b, t, hk, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(randn(b, t, hk, dk), dim=-1)
    v = randn(b, t, hv, dv)
    beta = torch.rand(b, t, hv, generator=g)
    log_decay = -2 * torch.rand(b, t, hv, generator=g)
    return tuple(x.to(device) for x in (s0, q, k, v, beta, log_decay))


@pytest.mark.parametrize(("t", "hk", "hv", "dk", "dv"), [(8, 2, 4, 32, 48), (16, 1, 3, 16, 16), (1, 2, 2, 20, 8)])
def test_reference_equals_chunk_form(t: int, hk: int, hv: int, dk: int, dv: int) -> None:
    s0, q, k, v, beta, ld = _inputs(3, t, hk, hv, dk, dv, seed=t + dk)
    o, u, decay = gdn_step(s0, q, k, v, beta, ld)
    oc, kk, uc, g = _gdn_chunk(s0, per_value_head(q, hv).transpose(1, 2), per_value_head(k, hv).transpose(1, 2),
                               v.transpose(1, 2), beta.transpose(1, 2), ld.transpose(1, 2))
    torch.testing.assert_close(o, oc.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u, uc.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decay, ld.exp(), rtol=1e-6, atol=0)
    n = torch.tensor([0, t // 2, t])
    s = s0.clone()
    gdn_advance(s, k, u, decay, n)
    torch.testing.assert_close(s, _gdn_state_at(s0, kk, uc, g, n), rtol=1e-5, atol=1e-5)


def test_step_then_advance_is_bitwise_single_steps() -> None:
    """T = 8 then advance(n[b]) == n[b] one-position steps (each committing), outputs included;
    also a padded T = 8 step committing n directly, and every layer of a stacked advance at once."""
    b, t, hk, hv, dk, dv = 3, 8, 2, 4, 32, 16
    s0, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=1)
    o, u, decay = gdn_step(s0, q, k, v, beta, ld)
    n = torch.tensor([3, 0, 8])
    adv = s0.clone()
    gdn_advance(adv, k, u, decay, n)
    committed = s0.clone()
    o2, _, _ = gdn_step(committed, q, k, v, beta, ld, commit=committed, n=n)  # in place
    assert torch.equal(o2, o) and torch.equal(committed, adv)
    for r in range(b):
        st = s0[r:r + 1].clone()
        for i in range(int(n[r])):
            sl = slice(i, i + 1)
            oi, _, _ = gdn_step(st, q[r:r + 1, sl], k[r:r + 1, sl], v[r:r + 1, sl], beta[r:r + 1, sl],
                                ld[r:r + 1, sl], commit=st)
            assert torch.equal(oi[0, 0], o[r, i])
        assert torch.equal(st[0], adv[r])
    # stacked layers [L, B_root, ...] narrowed to the batch: per-layer blocks contiguous, layer stride free
    lay = 2
    s_all = torch.stack([s0, s0 * 0.5, s0]).contiguous()[:lay]
    k_all = torch.stack([k, k, k])[:lay]
    u_all, d_all = torch.stack([u, u, u])[:lay], torch.stack([decay, decay, decay])[:lay]
    root = torch.zeros(lay, b + 2, hv, dk, dv)
    view = root[:, :b]
    view.copy_(s_all)
    kr, ur, dr = (torch.zeros(lay, b + 2, *x.shape[2:]) for x in (k_all, u_all, d_all))
    kr[:, :b], ur[:, :b], dr[:, :b] = k_all, u_all, d_all
    gdn_advance(view, kr[:, :b], ur[:, :b], dr[:, :b], n)
    assert torch.equal(view[0], adv) and torch.equal(root[:, b:], torch.zeros(lay, 2, hv, dk, dv))
    one = (s0 * 0.5).clone()
    gdn_advance(one, k, u, decay, n)
    assert torch.equal(view[1], one)


def test_replaying_step_is_advance_then_step() -> None:
    """replay_n folds a deferred rollback into the next step: the state, outputs and the new terms
    equal advance(n) and then the plain step (the reference path; tests/test_gpu_gdn.py: the kernel)."""
    b, t, hk, hv, dk, dv = 3, 8, 2, 4, 32, 16
    s0, q0, k0, v0, beta0, ld0 = _inputs(b, t, hk, hv, dk, dv, seed=5)
    _, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=6)
    u_t, d_t, k_t = torch.empty(b, t, hv, dv), torch.empty(b, t, hv), torch.empty(b, t, hk, dk)
    gdn_step(s0, q0, k0, v0, beta0, ld0, u=u_t, decay=d_t, k_out=k_t)
    n = torch.tensor([8, 0, 3])
    ref = s0.clone()
    gdn_advance(ref, k_t, u_t, d_t, n)
    ro, ru, rd = gdn_step(ref, q, k, v, beta, ld)
    st = s0.clone()
    arrive = torch.zeros(b, hk, dtype=torch.int32)
    o, u, d = gdn_step(st, q, k, v, beta, ld, u=u_t, decay=d_t, k_out=k_t, replay_n=n, arrive=arrive)
    assert torch.equal(st, ref) and torch.equal(o, ro) and torch.equal(u, ru) and torch.equal(d, rd)
    assert torch.equal(k_t, k)
    with pytest.raises(GdnInputError, match="replay_n needs"):
        gdn_step(s0, q, k, v, beta, ld, replay_n=n)
    with pytest.raises(GdnInputError, match="replay_n and commit"):
        gdn_step(st, q, k, v, beta, ld, u=u_t, decay=d_t, k_out=k_t, replay_n=n, arrive=arrive, commit=st)


@pytest.mark.parametrize("fold", ["0", "1"])
def test_verify_rollback_equals_commit_bitwise(model: TargetModel, fold: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Armed 8-position forwards rolled back to n[b] (three rounds: the rollback deferred into the next
    round's steps, or advanced at once with DFLASHGEN_GDN_FOLD=0) leave exactly the logits and GDN
    state (recurrent and conv) of the same forwards committing n[b] positions (num_new): one update
    expression. Reading ssm_all settles a pending replay."""
    monkeypatch.setenv("DFLASHGEN_GDN_FOLD", fold)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, CFG.vocab_size, (3, 6), generator=g)
    a, b = model.new_state(3, 48), model.new_state(3, 48)
    for st in (a, b):
        model(prompt, st)
    for n in (torch.tensor([1, 5, 8]), torch.tensor([8, 0, 2]), torch.tensor([3, 8, 1])):
        block = torch.randint(0, CFG.vocab_size, (3, 8), generator=g)
        la = model(block, a, num_new=n)
        b.checkpoint(8)
        lb = model(block, b)
        b.rollback(b.lengths - 8 + n)
        assert torch.equal(la, lb)
    assert torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.conv_all, b.conv_all) and torch.equal(a.ssm_all, b.ssm_all)
    if fold == "1":
        assert not b.buffer("gdn_replay").any()  # reading ssm_all applied the last round's replay
        # a rollback deferred, then the fold switched off: the next armed forward still starts from it
        block = torch.randint(0, CFG.vocab_size, (3, 8), generator=g)
        n = torch.tensor([2, 7, 4])
        b.checkpoint(8)
        model(block, b)
        b.rollback(b.lengths - 8 + n)
        model(block, a, num_new=n)
        monkeypatch.setenv("DFLASHGEN_GDN_FOLD", "0")
        block = torch.randint(0, CFG.vocab_size, (3, 8), generator=g)
        b.checkpoint(8)
        assert torch.equal(model(block, a, num_new=n), model(block, b))


def test_request_bits_do_not_depend_on_the_batch() -> None:
    s0, q, k, v, beta, ld = _inputs(4, 8, 2, 4, 32, 16, seed=2)
    o, u, _ = reference_step(s0, q, k, v, beta, ld)
    o1, u1, _ = reference_step(s0[2:3], q[2:3], k[2:3], v[2:3], beta[2:3], ld[2:3])
    assert torch.equal(o1[0], o[2]) and torch.equal(u1[0], u[2])


def test_prefill_is_bitwise_one_position_steps() -> None:
    """gdn_prefill over T = 40 (the torch reference on CPU: what the kernel mirrors) committing n[b]
    in place (0, ragged, all T) == n[b] one-position committed steps bitwise, outputs at every position
    included; and equal to the chunk (matrix) form within FP32 rounding."""
    b, t, hk, hv, dk, dv = 4, 40, 2, 4, 32, 16
    s0, q, k, v, beta, ld = _inputs(b, t, hk, hv, dk, dv, seed=7)
    n = torch.tensor([0, 17, 40, 5])
    s = s0.clone()
    o = gdn_prefill(s, q, k, v, beta, ld, n=n)
    assert o.shape == (b, t, hv, dv) and torch.equal(s[0], s0[0])  # n = 0: untouched
    for r in range(b):
        st = s0[r:r + 1].clone()
        for i in range(t):
            sl = slice(i, i + 1)
            oi, _, _ = gdn_step(st, q[r:r + 1, sl], k[r:r + 1, sl], v[r:r + 1, sl], beta[r:r + 1, sl],
                                ld[r:r + 1, sl], commit=st)
            assert torch.equal(oi[0, 0], o[r, i]), (r, i)
            if i + 1 == int(n[r]):
                assert torch.equal(st[0], s[r]), r
    full = s0.clone()
    out = torch.empty_like(o)
    assert gdn_prefill(full, q, k, v, beta, ld, o=out) is out and torch.equal(out, o)  # n = None: all T
    oc, kk, uc, g = _gdn_chunk(s0, per_value_head(q, hv).transpose(1, 2), per_value_head(k, hv).transpose(1, 2),
                               v.transpose(1, 2), beta.transpose(1, 2), ld.transpose(1, 2))
    torch.testing.assert_close(o, oc.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full, _gdn_state_at(s0, kk, uc, g, torch.full((b,), t)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, _gdn_state_at(s0, kk, uc, g, n), rtol=1e-5, atol=1e-5)
    with pytest.raises(GdnInputError, match="n must be"):
        gdn_prefill(s, q, k, v, beta, ld, n=n.int())


def test_bad_inputs_are_named() -> None:
    s0, q, k, v, beta, ld = _inputs(2, 8, 2, 4, 32, 16, seed=3)
    with pytest.raises(GdnInputError, match="1..16"):
        big = _inputs(2, 17, 2, 4, 32, 16, seed=3)
        gdn_step(*big)
    with pytest.raises(GdnInputError, match="log_decay"):
        gdn_step(s0, q, k, v, beta, ld.double())
    with pytest.raises(GdnInputError, match="multiple of 4"):
        gdn_step(s0[..., :6].contiguous(), q, k, v[..., :6], beta, ld)
    with pytest.raises(GdnInputError, match="key heads"):
        gdn_step(s0[:, :3].contiguous(), q, k, v[:, :, :3], beta[..., :3].contiguous(), ld[..., :3].contiguous())
    with pytest.raises(GdnInputError, match="contiguous"):
        gdn_step(s0, q.transpose(0, 1).contiguous().transpose(0, 1), k, v, beta, ld)
    with pytest.raises(GdnInputError, match="n must be"):
        gdn_step(s0, q, k, v, beta, ld, commit=s0, n=torch.tensor([1, 2], dtype=torch.int32))
    o, u, d = gdn_step(s0, q, k, v, beta, ld)
    with pytest.raises(GdnInputError, match="advance takes"):
        gdn_advance(s0, k, u, d[0], torch.tensor([1, 2]))


# --------------------------------------------------------------------------- in the target model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    return tiny_fp32_target(tmp_path_factory.mktemp("tiny-hybrid-gdn"), CFG)


def test_prefill_of_a_short_prompt_is_one_token_steps(model: TargetModel) -> None:
    """T <= 16 takes the sequential step: its state equals token-by-token forwards within FP32
    rounding of the projections (the recurrence itself is exact, see above)."""
    toks = torch.randint(0, CFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    a, b = model.new_state(1, 16), model.new_state(1, 16)
    model(toks, a)
    for i in range(12):
        model(toks[:, i:i + 1], b)
    torch.testing.assert_close(a.ssm_all, b.ssm_all, rtol=1e-5, atol=1e-5)


def test_sequential_prefill_matches_the_chunk_form(model: TargetModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA prefill path forced on CPU (gdn_prefill's torch reference): a ragged 40-token prefill
    (num_new) takes it for every GDN layer and leaves states / logits within FP32 rounding of the
    chunk form; an armed (checkpoint) long forward still takes the chunk form."""
    g = torch.Generator().manual_seed(8)
    toks = torch.randint(0, CFG.vocab_size, (3, 40), generator=g)
    n = torch.tensor([40, 23, 17])
    chunk = model.new_state(3, 48)
    ref = model(toks, chunk, num_new=n)
    calls = spy_on_prefill(monkeypatch)
    monkeypatch.setattr(target_mod, "_prefill_form", lambda device, dk: "sequential")
    seq = model.new_state(3, 48)
    got = model(toks, seq, num_new=n)
    assert calls == [40] * len(seq.gdn_index)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seq.ssm_all, chunk.ssm_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seq.conv_all, chunk.conv_all, rtol=1e-4, atol=1e-4)  # later layers' inputs round
    assert torch.equal(seq.conv_all[0], chunk.conv_all[0]) and torch.equal(seq.lengths, chunk.lengths)
    calls.clear()
    armed = model.new_state(3, 48)
    armed.checkpoint(40)
    model(toks, armed)
    armed.rollback(armed.lengths - 40 + n)
    assert calls == []  # keep=True, T > 16: chunk terms for the rollback
    torch.testing.assert_close(armed.ssm_all, chunk.ssm_all, rtol=1e-4, atol=1e-4)


def test_prefill_form_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """$DFLASHGEN_GDN_PREFILL picks the prefill's GDN form; a form without a kernel on this device (CPU)
    falls back to the torch chunk form; an unknown value is an error, not a silent default."""
    cpu = torch.device("cpu")
    for form in ("", "sequential", "chunked", "torch"):
        monkeypatch.setenv("DFLASHGEN_GDN_PREFILL", form)
        assert target_mod._prefill_form(cpu, 128) == "torch"
    monkeypatch.setattr(target_mod, "prefill_available", lambda device, dk: True)
    monkeypatch.setattr(target_mod, "chunk_available", lambda device, dk: True)
    for form, want in (("", "sequential"), ("sequential", "sequential"), ("chunked", "chunked"), ("torch", "torch")):
        monkeypatch.setenv("DFLASHGEN_GDN_PREFILL", form)
        assert target_mod._prefill_form(cpu, 128) == want, form
    monkeypatch.setenv("DFLASHGEN_GDN_PREFILL", "chunk")
    with pytest.raises(ValueError, match="sequential, chunked, torch"):
        target_mod._prefill_form(cpu, 128)


def test_sequential_prefill_keeps_greedy_identity(model: TargetModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the sequential prefill forced (CPU reference), speculative greedy decoding still equals plain
    greedy decoding for prompts that prefill more than 16 tokens, batched and per request."""
    monkeypatch.setattr(target_mod, "_prefill_form", lambda device, dk: "sequential")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, CFG.vocab_size, (m,), generator=g).tolist() for m in (30, 18, 3, 25)]
    oracle = [plain_greedy(model, p, 8) for p in prompts]
    for invariant in (False, True):
        monkeypatch.setattr(model, "batch_invariant", invariant)
        out = SpecDecoder(model, NgramDrafter(), max_batch=4, max_len=48).generate(prompts, SamplingParams(0.0), 8)
        assert out == oracle, invariant


def test_plain_greedy_prefills_all_but_the_last_token(model: TargetModel, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, ...]] = []
    real = TargetModel.forward

    def spy(self: TargetModel, tokens: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(tuple(tokens.shape))
        return real(self, tokens, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "forward", spy)
    plain_greedy(model, list(range(7)), 3)
    assert seen == [(1, 6), (1, 1), (1, 1), (1, 1)]
    seen.clear()
    plain_greedy(model, [3], 2)
    assert seen == [(1, 1), (1, 1)]


def test_invariant_target_prefills_each_request_alone(model: TargetModel, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (9, 1, 20, 4)]
    oracle = [plain_greedy(model, p, 10) for p in prompts]
    shapes: list[tuple[int, ...]] = []
    real = TargetModel.forward_steps  # what a prefill runs (SpecDecoder._prefill_steps)

    def spy(self: TargetModel, tokens: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("logits") is False:
            shapes.append(tuple(tokens.shape))
        return real(self, tokens, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "forward_steps", spy)
    assert model.batch_invariant is False
    out = SpecDecoder(model, NgramDrafter(), max_batch=4, max_len=48).generate(prompts, SamplingParams(0.0), 10)
    assert out == oracle and shapes == [(4, 19)]  # one right-padded batch
    shapes.clear()
    monkeypatch.setattr(model, "batch_invariant", True)
    out = SpecDecoder(model, NgramDrafter(), max_batch=4, max_len=48).generate(prompts, SamplingParams(0.0), 10)
    assert out == oracle and shapes == [(1, 8), (1, 19), (1, 3)]  # alone, unpadded (the 1-token prompt: none)


def test_readme_documents_the_family() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "templates/include/dflashgen/gdn.cuh" in readme and "`gdn_kernel.py`" in readme


def _f32_nearest(x: Fraction) -> float:
    """x rounded once to FP32 (nearest, ties to even), by exact comparison with its FP32 neighbours."""
    f = struct.unpack("f", struct.pack("f", float(x)))[0]  # within an ulp of the answer
    bits = struct.unpack("I", struct.pack("f", f))[0]
    cands = [f]
    for step in (-1, 1):  # the two FP32 neighbours (finite, nonzero test values: bit steps suffice)
        nb = bits + step if f > 0 else bits - step
        cands.append(struct.unpack("f", struct.pack("I", nb))[0])
    return min(cands, key=lambda c: (abs(Fraction(c) - x), struct.unpack("I", struct.pack("f", c))[0] & 1))


def test_fma32_rounds_once() -> None:
    """fma32 (the reference's stand-in for the kernel's __fmaf_rn) equals a * b + c rounded once to
    FP32, checked exactly in rationals, including near-total cancellation (where a product and an add
    rounded separately, or a sum rounded to FP64 and then to FP32, differ)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3000, generator=g) * torch.exp(torch.randn(3000, generator=g) * 4)
    b = torch.randn(3000, generator=g)
    c = torch.where(torch.arange(3000) % 2 == 0, -(a * b) * (1 + 1e-6 * torch.randn(3000, generator=g)),
                    torch.randn(3000, generator=g))
    got = fma32(a, b, c)
    want = [_f32_nearest(Fraction(x) * Fraction(y) + Fraction(z))
            for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)]
    assert got.tolist() == want
    separate = (a * b + c).tolist()  # two roundings: must differ somewhere, or the test proves nothing
    assert separate != want


def test_chunk_scan_heads_per_cta() -> None:
    """The tensor-core chunk scan's CTA holds value heads of one key head: the largest divisor of the
    GQA group within the cap (shared memory / launch bounds); one head without GQA or when none fits."""
    from dflashgen.runtime.gdn_kernel import chunk_heads_per_cta

    assert [chunk_heads_per_cta(rep, 3) for rep in (1, 2, 3, 4, 5, 6, 8, 9)] == [1, 2, 3, 2, 1, 3, 2, 3]
    assert chunk_heads_per_cta(3, 2) == 1 and chunk_heads_per_cta(4, 1) == 1

