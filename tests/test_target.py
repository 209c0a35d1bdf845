"""The torch target model (runtime/target.py) on a tiny synthetic hybrid checkpoint, CPU only:
prefill == token-by-token, exact verify-round rollback, batch invariance, greedy determinism."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dflashgen.runtime.decode_bench import TINY
from dflashgen.runtime.library import mul_to, silu_mul
from dflashgen.runtime.linear import QuantLinear
from dflashgen.runtime.norm_kernel import rope_
from dflashgen.runtime.synthetic import write_synthetic_checkpoint
from dflashgen.runtime.target import DecodeState, NonLinearWeights, TargetModel, nonlinear_shapes

from dflashgen.deployment import load_deployment
from dflashgen.model import FULL, parse_model_config
from dflashgen.weights import rel_l2

# 4 layers (GDN, full, GDN, full); 2 key / 4 value GDN heads; 4 query / 2 KV heads with the output gate.
RAW = TINY  # the runtime's tiny 4-layer hybrid (GDN, full, GDN, full)
CFG = parse_model_config(RAW)
MAX_LEN = 64
VERIFY = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-hybrid")
    write_synthetic_checkpoint(out, CFG, load_deployment("nvfp4"), "modelopt", seed=3)
    return out


@pytest.fixture(scope="module")
def model(ckpt: Path) -> TargetModel:
    return TargetModel.from_checkpoint(ckpt, CFG, load_deployment("nvfp4"), seed=5)


def _tokens(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


def _state_tensors(st: DecodeState, r: int) -> list[torch.Tensor]:
    """Request r's state: KV up to its length, GDN recurrent and conv states."""
    n = int(st.lengths[r])
    kv = [c[r, :n] for i in st.k for c in (st.k[i], st.v[i])]
    return kv + [st.ssm[i][r] for i in st.ssm] + [st.conv[i][r] for i in st.conv]


def _max_state_diff(a: DecodeState, ra: int, b: DecodeState, rb: int) -> float:
    """Largest difference between request ra of a and rb of b, relative to each tensor's largest
    magnitude (when above 1): FP32 rounding differences scale with the values."""
    assert int(a.lengths[ra]) == int(b.lengths[rb])
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1.0)) if y.numel() else 0.0
               for x, y in zip(_state_tensors(a, ra), _state_tensors(b, rb), strict=True))


def test_model_is_built_from_loaded_projections(model: TargetModel, ckpt: Path) -> None:
    assert isinstance(model.proj[0]["in_proj_qkvzba"], QuantLinear)  # in_proj_qkvz + in_proj_ba, one GEMM
    assert "in_proj_qkvz" not in model.proj[0] and "in_proj_ba" not in model.proj[0]
    assert isinstance(model.proj[1]["qkv_proj"], QuantLinear)
    assert model.proj[0]["gate_up_proj"].silu  # fused SiLU epilogue (deployment.fuse_silu)
    w = NonLinearWeights.from_checkpoint(ckpt, CFG, seed=5)
    assert set(w.missing) == set(nonlinear_shapes(CFG))  # synthetic checkpoints hold projections only
    ref = NonLinearWeights.random(CFG, seed=5)
    assert all(torch.equal(w.tensors[n], ref.tensors[n]) for n in ref.tensors)


def test_nonlinear_weights_read_by_hf_name() -> None:
    name = "model.layers.0.linear_attn.A_log"
    given = {name: torch.arange(4, dtype=torch.bfloat16),
             "model.layers.0.linear_attn.conv1d.weight": torch.ones(2 * 32 + 64, 4)}  # [C, W] accepted
    w = NonLinearWeights.from_checkpoint(given, CFG)
    assert name not in w.missing and "model.embed_tokens.weight" in w.missing
    assert torch.equal(w.tensors[name], torch.arange(4.0))
    assert w.tensors["model.layers.0.linear_attn.conv1d.weight"].shape == (128, 1, 4)
    with pytest.raises(ValueError, match="A_log"):
        NonLinearWeights.from_checkpoint({name: torch.zeros(5)}, CFG)


@pytest.mark.parametrize("act_dtype, tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_prefill_matches_token_by_token(ckpt: Path, act_dtype: torch.dtype, tol: float) -> None:
    m = TargetModel.from_checkpoint(ckpt, CFG, load_deployment("nvfp4"), seed=5, act_dtype=act_dtype)
    toks = _tokens(11, seed=1)
    s1, s2 = m.new_state(1, MAX_LEN), m.new_state(1, MAX_LEN)
    full = m(toks, s1)
    steps = torch.cat([m(toks[:, j:j + 1], s2) for j in range(toks.shape[1])], dim=1)
    assert full.dtype == torch.float32 and full.shape == (1, 11, CFG.vocab_size)
    assert float(rel_l2(steps, full)) < tol
    # fp16 projection inputs round differently at M=11 and M=1; fp32 agrees to rounding.
    assert _max_state_diff(s1, 0, s2, 0) < (1e-5 if act_dtype == torch.float32 else 1e-2)


def test_prefill_chunking_is_exact(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill longer than a GDN chunk (several chunks, a ragged last one, per-request lengths inside
    different chunks) equals one whole-prompt chunk."""
    import dflashgen.runtime.target as target_mod

    m = TargetModel.from_checkpoint(ckpt, CFG, load_deployment("nvfp4"), seed=5, act_dtype=torch.float32)
    toks = _tokens(40, seed=3, batch=2)
    n_new = torch.tensor([40, 23])
    outs, states = [], []
    for chunk in (64, 17):  # 40 <= 64: one chunk; 17: chunks of 17, 17, 6
        monkeypatch.setattr(target_mod, "_CHUNK", chunk)
        st = m.new_state(2, MAX_LEN)
        outs.append(m(toks, st, num_new=n_new))
        states.append(st)
    assert float(rel_l2(outs[1][0], outs[0][0])) < 1e-5 and float(rel_l2(outs[1][1, :23], outs[0][1, :23])) < 1e-5
    for r in (0, 1):
        assert _max_state_diff(states[0], r, states[1], r) < 1e-5


@pytest.mark.parametrize("accepted", range(VERIFY + 1))
def test_rollback_equals_plain_run(model: TargetModel, accepted: int) -> None:
    # Two requests with different prompt lengths accept `accepted` and VERIFY - accepted positions.
    prompts = [_tokens(5, seed=2), _tokens(3, seed=3)]
    draft = _tokens(VERIFY, seed=4, batch=2)
    keep = torch.tensor([accepted, VERIFY - accepted])
    after = _tokens(3, seed=5, batch=2)

    def prefilled() -> DecodeState:
        st = model.new_state(2, MAX_LEN)
        pad = torch.zeros(2, 5, dtype=torch.long)
        pad[0], pad[1, :3] = prompts[0][0], prompts[1][0]
        model(pad, st, num_new=torch.tensor([5, 3]))
        return st

    st = prefilled()
    st.checkpoint(VERIFY)
    model(draft, st)
    assert st.lengths.tolist() == [5 + VERIFY, 3 + VERIFY]
    st.rollback(torch.tensor([5, 3]) + keep)
    # Exact: the same verify forward committing only `keep` positions (no snapshots) is bit-identical.
    same = prefilled()
    model(draft, same, num_new=keep)
    for r in range(2):
        assert all(torch.equal(x, y) for x, y in zip(_state_tensors(st, r), _state_tensors(same, r), strict=True))
    cont = model(after, st)  # continue after the rollback
    assert torch.equal(cont, model(after, same))

    # Close: a plain run that only ever fed the accepted tokens (its GEMMs have other M, so FP32
    # rounding differs, and the matrix-form GDN chunk rounds per chunk split; 4e-6 relative to each
    # state tensor's scale).
    for r in range(2):
        ref = model.new_state(1, MAX_LEN)
        model(prompts[r], ref)
        if keep[r]:
            model(draft[r:r + 1, :int(keep[r])], ref)
        ref_cont = model(after[r:r + 1], ref)
        assert _max_state_diff(st, r, ref, 0) <= 4e-6
        assert float(rel_l2(cont[r:r + 1], ref_cont)) < 1e-5


def test_rollback_range_is_checked(model: TargetModel) -> None:
    st = model.new_state(1, MAX_LEN)
    with pytest.raises(RuntimeError, match="checkpoint"):
        st.rollback(torch.tensor([0]))
    model(_tokens(4, seed=6), st)
    st.checkpoint(VERIFY)
    with pytest.raises(ValueError, match="armed"):
        model(_tokens(VERIFY + 1, seed=7), st)
    model(_tokens(VERIFY, seed=7), st)
    with pytest.raises(ValueError, match="outside"):
        st.rollback(torch.tensor([3]))
    with pytest.raises(ValueError, match="outside"):
        st.rollback(torch.tensor([4 + VERIFY + 1]))
    st.rollback(torch.tensor([6]))
    with pytest.raises(RuntimeError, match="checkpoint"):  # once per armed forward
        st.rollback(torch.tensor([4 + VERIFY]))
    assert st.lengths.tolist() == [6]
    with pytest.raises(ValueError, match="max_len"):
        model(_tokens(MAX_LEN, seed=8), st)


def _greedy(model: TargetModel, prompts: list[torch.Tensor], steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Batched right-padded prefill + greedy decoding; per request: prompt logits, decode logits."""
    b, n = len(prompts), max(p.shape[1] for p in prompts)
    pad = torch.zeros(b, n, dtype=torch.long)
    for r, p in enumerate(prompts):
        pad[r, :p.shape[1]] = p[0]
    st = model.new_state(b, MAX_LEN)
    lens = torch.tensor([p.shape[1] for p in prompts])
    logits = model(pad, st, num_new=lens)
    prompt_logits = [logits[r, :p.shape[1]] for r, p in enumerate(prompts)]
    nxt = logits[torch.arange(b), lens - 1].argmax(-1)
    dec = []
    for _ in range(steps):
        step = model(nxt[:, None], st)[:, 0]
        dec.append(step)
        nxt = step.argmax(-1)
    return prompt_logits, torch.stack(dec, dim=1)


def test_batch_matches_single_requests(model: TargetModel) -> None:
    prompts = [_tokens(3, seed=10), _tokens(9, seed=11), _tokens(6, seed=12)]
    batch_prompt, batch_dec = _greedy(model, prompts, steps=4)
    for r, p in enumerate(prompts):
        alone_prompt, alone_dec = _greedy(model, [p], steps=4)
        # Not bitwise: the projections run at M = B*T vs T rows and the CPU GEMM rounds per shape.
        torch.testing.assert_close(batch_prompt[r], alone_prompt[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batch_dec[r], alone_dec[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(batch_dec[r].argmax(-1), alone_dec[0].argmax(-1))


def test_greedy_decoding_is_deterministic(model: TargetModel) -> None:
    prompts = [_tokens(7, seed=20), _tokens(4, seed=21)]
    _, a = _greedy(model, prompts, steps=5)
    _, b = _greedy(model, prompts, steps=5)
    assert torch.equal(a, b) and torch.isfinite(a).all()
    assert a.shape == (2, 5, CFG.vocab_size)


def test_reset_slot_starts_a_new_request(model: TargetModel) -> None:
    st = model.new_state(2, MAX_LEN)
    model(_tokens(5, seed=30, batch=2), st)
    st.reset(1)
    fresh = _tokens(3, seed=31)
    two = torch.cat([_tokens(3, seed=32), fresh])
    out = model(two, st)
    ref = model.new_state(1, MAX_LEN)
    torch.testing.assert_close(out[1:], model(fresh, ref), rtol=1e-5, atol=1e-6)
    assert st.lengths.tolist() == [8, 3] and FULL in CFG.layer_types


def test_unfused_mlp_and_other_formats(ckpt: Path, model: TargetModel, tmp_path: Path) -> None:
    toks = _tokens(6, seed=40)
    ref = model(toks, model.new_state(1, MAX_LEN))
    nofuse = load_deployment({"name": "nofuse", "default": "nvfp4", "overrides": {"lm_head": "fp16"},
                              "fuse_silu": False})
    m = TargetModel.from_checkpoint(ckpt, CFG, nofuse, seed=5)
    assert not m.proj[0]["gate_up_proj"].silu
    assert float(rel_l2(m(toks, m.new_state(1, MAX_LEN)), ref)) < 1e-5  # split SiLU * up == fused epilogue
    dep = load_deployment("mixed")  # channel-FP8 attention / GDN projections, NVFP4 MLP
    write_synthetic_checkpoint(tmp_path, CFG, dep, "compressed-tensors", seed=3)
    m = TargetModel.from_checkpoint(tmp_path, CFG, dep, seed=5)
    full = m(toks, m.new_state(1, MAX_LEN))
    st = m.new_state(1, MAX_LEN)
    steps = torch.cat([m(toks[:, j:j + 1], st) for j in range(toks.shape[1])], dim=1)
    assert float(rel_l2(steps, full)) < 1e-4


class _Apart(torch.nn.Module):
    """in_proj_qkvz and in_proj_ba as two projections, outputs concatenated (the pre-fusion forward)."""

    def __init__(self, *mods: torch.nn.Module) -> None:
        super().__init__()
        self.mods = torch.nn.ModuleList(mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.mods], dim=-1)


@pytest.mark.parametrize("act_dtype", [torch.float32, torch.float16])
def test_fused_gdn_projection_matches_the_two_projections(ckpt: Path, act_dtype: torch.dtype) -> None:
    from dflashgen.runtime.checkpoint import load_projection

    m = TargetModel.from_checkpoint(ckpt, CFG, load_deployment("nvfp4"), seed=5, act_dtype=act_dtype)
    toks = _tokens(10, seed=41, batch=2)
    fused = m(toks, m.new_state(2, MAX_LEN))
    for i, lt in enumerate(CFG.layer_types):
        if lt != FULL:
            p = f"model.layers.{i}.linear_attn.in_proj_"
            m.proj[i]["in_proj_qkvzba"] = _Apart(*(QuantLinear(load_projection(ckpt, [p + s]), s)  # type: ignore[arg-type]
                                                  for s in ("qkvz", "ba")))
    apart = m(toks, m.new_state(2, MAX_LEN))
    # the same weights and sums; CPU GEMMs of another N may round (FP32) differently, which FP16
    # outputs mostly absorb (on this repo's CI machine: the same bits)
    assert float(rel_l2(fused, apart)) < (1e-3 if act_dtype == torch.float16 else 1e-6)


def test_state_caches_hold_whole_kernel_pages(model: TargetModel) -> None:
    # The decoder asks for max_len + num_draft positions (e.g. 1536 + 7): the caches must still be
    # whole 16-token pages, or every full-attention layer would fall back to the FP32 reference.
    st = model.new_state(2, 1543)
    assert st.max_len == 1552
    assert all(k.shape[1] % 16 == 0 for k in st.k.values()) and st.k


def test_glue_fusions_round_as_the_fp32_formulas() -> None:
    """The prefill's fused glue (runtime/library.py) is bitwise the FP32 formulation it replaced:
    products of FP16 / strided operands computed in FP32 and rounded once on the store."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 7, 64, generator=g).half()  # a [gate | up] projection output
    gate, up = y.chunk(2, dim=-1)
    for dtype in (torch.float16, torch.float32):
        ref = (F.silu(gate.float()) * up.float()).to(dtype)
        assert torch.equal(silu_mul(gate, up, dtype), ref)
        assert torch.equal(silu_mul(gate.float(), up.float(), dtype), ref)
    a = torch.randn(2, 3, 4, 8, generator=g).transpose(1, 2)  # strided, as _attend's output
    b = torch.randn(4, 1, 16, generator=g)[..., ::2]  # strided, broadcast
    out = mul_to(a, b, torch.float16)
    assert out.is_contiguous() and torch.equal(out, (a * b).half())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def test_rope_in_place_is_the_rotate_half_formula(model: TargetModel) -> None:
    g = torch.Generator().manual_seed(1)
    rd, d = model.rotary_dim, CFG.head_dim
    assert 0 < rd < d  # partial rotary: the other channels pass through
    x = torch.randn(2, 5, 3, d, generator=g)
    ang = torch.randn(2, 5, 1, rd // 2, generator=g)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    r = x[..., :rd]
    ref = torch.cat((r * cos + _rotate_half(r) * sin, x[..., rd:]), dim=-1)
    y = x.clone()
    assert rope_(y, cos, sin, rd) is y and torch.equal(y, ref)


@pytest.mark.parametrize("d", [64, 32])  # scale 1/8 (folded into q) and 1/sqrt(32) (after the matmul)
def test_attend_matches_the_reference_formula(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    b, t, h, hkv, length = 2, 6, 4, 2, 16
    q = torch.randn(b, t, h, d, generator=g)
    kc, vc = torch.randn(b, length, hkv, d, generator=g), torch.randn(b, length, hkv, d, generator=g)
    pos = torch.tensor([[0], [7]]) + torch.arange(t)
    qb = q.view(b, t, hkv, h // hkv, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, -1, d)
    s = (qb @ kc.permute(0, 2, 3, 1)) * d**-0.5
    visible = torch.arange(length) <= pos[:, :, None]
    s = s.view(b, hkv, h // hkv, t, length).masked_fill(~visible[:, None, None], float("-inf"))
    o = s.softmax(-1).view(b, hkv, -1, length) @ vc.permute(0, 2, 1, 3)
    ref = o.view(b, hkv, h // hkv, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h, d)
    assert torch.equal(TargetModel._attend(q, kc, vc, pos), ref)


def test_glue_kernel_wiring_on_cpu_is_the_unfused_path(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused-glue branches of the forward (norm sites, GDN io, attention q / k norm + RoPE) with
    every launcher on its CPU formulation: the same logits and state bits as the unfused torch ops
    (FP16 projections and KV cache, as on a GPU). Checks the wiring -- which tensors, views and shapes
    reach the launchers -- that the GPU tests then run on the kernels."""
    from dflashgen.runtime import target as target_mod

    seen: dict[str, int] = {}

    def counted(name: str, f: Any) -> Any:
        def spy(*a: Any, **k: Any) -> Any:
            seen[name] = seen.get(name, 0) + 1
            return f(*a, **k)
        return spy

    names = ("add_rmsnorm", "gdn_inputs", "gdn_prefill_inputs", "gdn_split_inputs", "gdn_gate", "qk_norm_rope")
    for name in names:
        monkeypatch.setattr(target_mod, name, counted(name, getattr(target_mod, name)))
    m = TargetModel.from_checkpoint(ckpt, CFG, load_deployment("nvfp4"), seed=5, act_dtype=torch.float16)
    toks = _tokens(12, seed=3, batch=2)
    out = {}
    # the armed verify forward's inputs: torch's cat + the inputs launcher ("io"), or the launcher that
    # reads the conv state and the FP16 rows and writes the cat itself ("split")
    launched = {"torch": set(), "io": set(names) - {"gdn_split_inputs"}, "split": set(names) - {"gdn_inputs"}}
    for glue, want in launched.items():
        seen.clear()
        m.fused_norm = m.gdn_io = m.gdn_prefill_io = m.fused_qk = glue != "torch"
        m.gdn_split_io = glue == "split"
        st = DecodeState(CFG, 2, 32, "cpu", torch.float16)  # an FP16 cache, as on a GPU
        # an unarmed ragged prefill (the prefill inputs launcher: conv state moved to num_new)
        logits = m(toks[:, :9], st, num_new=torch.tensor([9, 6]))
        st.checkpoint(3)
        logits2 = m(toks[:, 9:], st)  # an armed 3-position verify forward
        st.rollback(torch.tensor([10, 8]))  # from the conv inputs the verify forward kept
        out[glue] = (logits, logits2, _state_tensors(st, 0) + _state_tensors(st, 1))
        assert set(seen) == want, (glue, seen)
    for glue in ("io", "split"):
        assert all(torch.equal(a, b) for a, b in zip(out["torch"][:2], out[glue][:2], strict=True)), glue
        assert all(torch.equal(a, b) for a, b in zip(out["torch"][2], out[glue][2], strict=True)), glue


def test_grouped_heads_go_native_only_where_cudnn_attention_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused prefill attention passes grouped K / V heads as they are only on sm_90+ with cuDNN
    attention enabled; a V100 (sm_70), an A100 and a CPU repeat them (enable_gqa would fall back to
    the unfused math path there)."""
    from dflashgen.runtime import target as target_mod

    for cap, cudnn, want in (((9, 0), True, True), ((9, 0), False, False), ((8, 0), True, False),
                             ((7, 0), True, False)):
        target_mod._native_gqa.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=cap: c)
        monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda c=cudnn: c)
        assert target_mod._native_gqa(torch.device("cuda", 0)) is want, (cap, cudnn)
    target_mod._native_gqa.cache_clear()
    assert target_mod._native_gqa(torch.device("cpu")) is False
    target_mod._native_gqa.cache_clear()


def test_fused_prefill_attention_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill attention runs fused only on CUDA (any query dtype), and the environment switch
    restores the FP32 reference; on CPU the reference always runs (the CPU suite's prefills)."""
    from types import SimpleNamespace

    from dflashgen.runtime.target import _fused_prefill_attention

    def fake(device: str, dtype: torch.dtype) -> Any:
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    monkeypatch.delenv("DFLASHGEN_PREFILL_ATTENTION", raising=False)
    assert _fused_prefill_attention(fake("cuda", torch.float16))
    assert _fused_prefill_attention(fake("cuda", torch.bfloat16))
    assert _fused_prefill_attention(fake("cuda", torch.float32))  # the target's q (FP32)
    assert not _fused_prefill_attention(fake("cpu", torch.float16))
    monkeypatch.setenv("DFLASHGEN_PREFILL_ATTENTION", "reference")
    assert not _fused_prefill_attention(fake("cuda", torch.float16))


@pytest.mark.parametrize("kv_len", [25, None])
def test_fused_prefill_attention_contract_on_cpu(kv_len: int | None) -> None:
    """_attend_fused keeps _attend's contract (causal per request position, grouped KV heads, stale
    cache entries past a request's length ignored, only the first kv_len keys read): in FP32 on the
    CPU (SDPA's math path) it equals the reference to rounding."""
    g = torch.Generator().manual_seed(3)
    b, t, h, hkv, d, cap = 2, 20, 6, 2, 32, 64
    kc, vc = torch.randn(b, cap, hkv, d, generator=g), torch.randn(b, cap, hkv, d, generator=g)
    q = torch.randn(b, t, h, d, generator=g)
    pos = torch.tensor([0, 5])[:, None] + torch.arange(t)
    ref = TargetModel._attend(q, kc, vc, pos)
    got = TargetModel._attend_fused(q, kc, vc, pos, kv_len)
    assert got.shape == ref.shape
    assert rel_l2(got, ref) <= 1e-5
    if kv_len is not None:  # keys past kv_len rounded up to 16 (32) are never read
        kc[:, 32:], vc[:, 32:] = float("nan"), float("nan")
        assert rel_l2(TargetModel._attend_fused(q, kc, vc, pos, kv_len), ref) <= 1e-5
