"""DFlash2 block drafter (runtime/drafter.py) and its spec-decode tap hook, on the tiny hybrid target
of tests/test_spec_decode.py, CPU only: shapes, block non-causality, context cache append/crop,
lossless greedy decoding with real drafts, the sampled (draft probs) path, config validation."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest
import torch
from conftest import single_thread, tiny_fp32_target
from dflashgen.runtime.decode_bench import TINY
from dflashgen.runtime.drafter import BlockDrafter, DFlashDrafter, DrafterConfig, block_drafter_cost
from dflashgen.runtime.sampling import SamplingParams
from dflashgen.runtime.spec_decode import ReplayDrafter, RequestContext, SpecDecoder, TapDrafter, plain_greedy
from dflashgen.runtime.target import TargetModel

from dflashgen.model import parse_model_config

RAW = TINY  # the runtime's tiny 4-layer hybrid (GDN, full, GDN, full)
CFG = parse_model_config(RAW)
DCFG = DrafterConfig.tiny(64, mask_token_id=96, target_layers=(0, 2, 3))
GREEDY = SamplingParams(temperature=0.0)
MAX_LEN = 40
N_NEW = 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    """The synthetic NVFP4 checkpoint dequantized into FP32 nn.Linear (fast, deterministic on CPU)."""
    return tiny_fp32_target(tmp_path_factory.mktemp("tiny-hybrid-drafter"), CFG)


@pytest.fixture(scope="module")
def block(model: TargetModel) -> BlockDrafter:
    return BlockDrafter.for_target(model, DCFG, seed=7)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(1, 1), _prompt(6, 2), _prompt(13, 3)]


@pytest.fixture(scope="module")
def oracle(model: TargetModel) -> list[list[int]]:
    return [plain_greedy(model, p, N_NEW) for p in PROMPTS]


def _taps(model: TargetModel, tokens: Sequence[int]) -> torch.Tensor:
    """Concatenated tapped hidden states [T, len(taps) * H] of a from-scratch prefill."""
    _, hid = model(torch.tensor([list(tokens)]), model.new_state(1, len(tokens)), taps=DCFG.target_layers)
    return torch.cat([hid[i][0] for i in DCFG.target_layers], -1)


def _ctx(tokens: Sequence[int], rid: int = 0, params: SamplingParams = GREEDY) -> RequestContext:
    return RequestContext(rid, tuple(tokens), 1, params)


# --------------------------------------------------------------------------- target taps


def test_target_taps_are_layer_outputs(model: TargetModel) -> None:
    toks = torch.tensor([_prompt(9, 4)])
    plain = model(toks, model.new_state(1, 9))
    logits, hid = model(toks, model.new_state(1, 9), taps=[3, 0])
    assert list(hid) == [3, 0] and hid[0].shape == (1, 9, CFG.hidden_size)
    assert torch.equal(logits, plain)  # opt-in taps change nothing
    w = model.w["model.norm.weight"]
    last = hid[3] * torch.rsqrt(hid[3].pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * w
    torch.testing.assert_close(model.lm_head(last), logits)  # tap 3 = output of the last layer
    with pytest.raises(ValueError, match=r"taps \[4\]"):
        model(toks, model.new_state(1, 9), taps=[4])


# --------------------------------------------------------------------------- block drafter


def test_shapes_names_and_shared_modules(model: TargetModel, block: BlockDrafter) -> None:
    sd = block.state_dict()
    assert sd["fc.weight"].shape == (64, 3 * 64)
    assert sd["layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert sd["layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert not any("embed" in n or "lm_head" in n for n in sd)  # the target's, not copied
    assert block._shared[1] is model.lm_head and block._shared[0] is model.w["model.embed_tokens.weight"]
    again = BlockDrafter.for_target(model, DCFG, seed=7)
    assert all(torch.equal(sd[n], t) for n, t in again.state_dict().items())  # seed-deterministic
    again.load_state_dict(sd)  # the names load back

    hidden = _taps(model, _prompt(10, 5))
    kv = block.context_kv(hidden, torch.arange(10))
    assert len(kv) == DCFG.num_layers and kv[0][0].shape == kv[0][1].shape == (10, 2, 16)
    toks = torch.tensor([[5] + [DCFG.mask_token_id] * 7] * 2)
    logits = block(toks, [10, 4], [kv, [(k[:4], v[:4]) for k, v in kv]])
    assert logits.shape == (2, 7, CFG.vocab_size) and torch.isfinite(logits).all()


def test_block_attention_is_not_causal(block: BlockDrafter, model: TargetModel) -> None:
    kv = block.context_kv(_taps(model, _prompt(6, 6)), torch.arange(6))
    x = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(0))
    base = block.forward_embeds(x, [6], [kv])
    y = x.clone()
    y[0, 6] += 1.0  # perturb a later block position
    pert = block.forward_embeds(y, [6], [kv])
    assert (pert[0, 1] - base[0, 1]).abs().max() > 1e-4  # position 1 sees position 6
    assert (pert[0, 0] - base[0, 0]).abs().max() > 1e-4
    # ...and the context matters too
    other = block.forward_embeds(x, [6], [[(k, v + 1.0) for k, v in kv]])
    assert (other - base).abs().max() > 1e-4


def test_context_cache_append_and_crop(block: BlockDrafter, model: TargetModel) -> None:
    toks = _prompt(16, 7)
    h = _taps(model, toks)
    alt = h.flip(0)  # "rejected drafts": different hidden states at the overshooting positions
    a = DFlashDrafter(block)
    a.observe(0, 0, h[:9])
    a.observe(0, 9, torch.cat((h[9:11], alt[11:16])))  # a verify round's 7 positions...
    a.crop(0, 11)  # ...rolled back to 11
    a.observe(0, 11, h[11:13])  # the accepted ones appended
    a.observe(0, 13, h[13:14])
    fresh = DFlashDrafter(block)
    fresh.observe(0, 0, h[:14])
    assert a.context_len(0) == fresh.context_len(0) == 14
    ctx = [_ctx(toks[:15])]
    torch.testing.assert_close(a.draft_logits(ctx), fresh.draft_logits(ctx), rtol=1e-5, atol=1e-5)
    assert torch.equal(a.propose(ctx)[0], fresh.propose(ctx)[0])
    # observe() crops to its start: re-observing from 0 restarts the request (rid reuse)
    a.observe(0, 0, h[:3])
    assert a.context_len(0) == 3
    with pytest.raises(RuntimeError, match="holds 3 context positions, needs 14"):
        a.propose(ctx)
    with pytest.raises(ValueError, match="crop to 5"):
        a.crop(0, 5)
    a.release(0)
    assert a.context_len(0) == 0


# --------------------------------------------------------------------------- end to end


class _CheckedDrafter(DFlashDrafter):
    """Checks every round that the cache built through the decoder's hook equals the context K/V of
    a from-scratch target prefill of the request's history."""

    rounds = 0

    def propose(self, contexts: Sequence[RequestContext]) -> tuple[torch.Tensor, torch.Tensor | None]:
        for c in contexts:
            n = len(c.tokens) - 1
            if n:
                ref = self.model.context_kv(_taps(self.target, c.tokens[:-1]), torch.arange(n))
                got = self._cache[c.rid].kv
                for (rk, rv), (gk, gv) in zip(ref, got, strict=True):
                    torch.testing.assert_close(gk[:n], rk, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(gv[:n], rv, rtol=1e-4, atol=1e-4)
        self.rounds += 1
        return super().propose(contexts)


def test_greedy_with_dflash_drafter_is_lossless(model: TargetModel, block: BlockDrafter,
                                                oracle: list[list[int]]) -> None:
    d = _CheckedDrafter(block)
    d.target = model  # type: ignore[attr-defined]
    assert isinstance(d, TapDrafter)
    dec = SpecDecoder(model, d, max_batch=2, max_len=MAX_LEN)  # 3 requests: one queues, a slot is reused
    assert dec.generate(PROMPTS, GREEDY, N_NEW) == oracle
    assert d.rounds > 0 and not d._cache  # every finished request was released
    assert dec.generate([PROMPTS[0]], GREEDY, N_NEW) == [oracle[0]]  # reused; a lone 1-token prompt
    assert dec.stats.summary()["drafter"].startswith("dflash2")


def test_drafts_are_the_argmax_unless_sampled(model: TargetModel, block: BlockDrafter) -> None:
    """Default (DFlash's practice): argmax drafts for sampled requests too, no q (verification
    without draft probabilities); the label says which."""
    d = DFlashDrafter(block, seed=1)
    d.observe(3, 0, _taps(model, PROMPTS[2][:-1]))
    sp = SamplingParams(temperature=0.8, top_k=20)
    toks, q = d.propose([_ctx(PROMPTS[2], 3, sp), _ctx(PROMPTS[2], 3, GREEDY)])
    assert q is None and torch.equal(toks, d.draft_logits([_ctx(PROMPTS[2], 3)] * 2).argmax(-1))
    assert "sampled" not in d.label and "sampled drafts" in DFlashDrafter(block, sampled=True).label


def test_sampled_drafts_return_probs_and_decode(model: TargetModel, block: BlockDrafter) -> None:
    d = DFlashDrafter(block, seed=1, sampled=True)
    h = _taps(model, PROMPTS[2][:-1])
    d.observe(3, 0, h)
    sp = SamplingParams(temperature=0.8, top_k=20)
    toks, q = d.propose([_ctx(PROMPTS[2], 3, sp), _ctx(PROMPTS[2], 3, GREEDY)])
    assert toks.shape == (2, 7) and q is not None and q.shape == (2, 7, CFG.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 7))
    assert bool((q[0].gather(-1, toks[0, :, None]) > 0).all())  # sampled from q
    assert torch.equal(toks[1], d.draft_logits([_ctx(PROMPTS[2], 3)])[0].argmax(-1))

    dec = SpecDecoder(model, DFlashDrafter(block, seed=2, sampled=True), max_batch=2, max_len=MAX_LEN)
    out = dec.generate(PROMPTS, [sp, SamplingParams(temperature=1.0, seed=9), GREEDY], N_NEW, seed=4)
    assert [len(o) for o in out] == [N_NEW] * 3
    assert all(0 <= t < CFG.vocab_size for o in out for t in o)


def test_replay_pays_block_drafter_cost(model: TargetModel, block: BlockDrafter,
                                        oracle: list[list[int]]) -> None:
    dd = DFlashDrafter(block)
    calls: list[int] = []
    cost = block_drafter_cost(dd)

    def counted(ctx: Sequence[RequestContext]) -> None:
        calls.append(len(ctx))
        cost(ctx)
        assert all(dd.context_len(c.rid) == len(c.tokens) - 1 for c in ctx)

    dec = SpecDecoder(model, ReplayDrafter(oracle, 1.0, cost_model=counted), max_batch=2, max_len=MAX_LEN)
    assert dec.generate(PROMPTS, GREEDY, N_NEW) == oracle
    assert calls and sum(calls) == sum(r.batch for r in dec.stats.rounds)
    block_drafter_cost(block)([_ctx(PROMPTS[1])])  # a bare BlockDrafter works too


# --------------------------------------------------------------------------- config


def test_config_defaults_and_from_dict() -> None:
    c = DrafterConfig()
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.block_size, c.mask_token_id, c.target_layers, c.num_draft) == (
        5, 5120, 32, 8, 128, 17408, 8, 248070, (5, 19, 33, 47, 61), 7)
    hf = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "intermediate_size": 128, "target_hidden_size": 64, "block_size": 4,
          "dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, 3]}, "vocab_size": 97}
    with pytest.raises(ValueError, match=r"unknown keys \['vocab_size'\]"):
        DrafterConfig.from_dict(hf)
    d = DrafterConfig.from_dict(hf, strict=False)
    assert d.target_layers == (0, 3) and d.num_draft == 3 and d.mask_token_id == 96


@pytest.mark.parametrize(("bad", "field"), [
    ({"num_kv_heads": 3}, "num_heads"),
    ({"block_size": 1}, "block_size"),
    ({"mask_token_id": -1}, "mask_token_id"),
    ({"target_layers": []}, "target_layers"),
    ({"target_layers": [1, 1]}, "target_layers"),
    ({"head_dim": 15}, "head_dim"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"num_layers": "5"}, "num_layers"),
    ({"target_layers": 3}, "target_layers"),
])
def test_config_validation_names_the_field(bad: dict, field: str) -> None:
    raw = {**DrafterConfig.tiny().__dict__, **bad}
    with pytest.raises(ValueError, match=f"DrafterConfig.{field}"):
        DrafterConfig.from_dict(raw)


def test_config_checked_against_target(model: TargetModel) -> None:
    for kw, field in (({"target_layers": (1, 4)}, "target_layers"), ({"mask_token_id": 97}, "mask_token_id"),
                      ({"target_hidden_size": 32}, "target_hidden_size")):
        with pytest.raises(ValueError, match=f"DrafterConfig.{field}"):
            BlockDrafter.for_target(model, replace(DrafterConfig.tiny(64), **kw))
    with pytest.raises(ValueError, match="width 64"):
        BlockDrafter.for_target(model, DrafterConfig.tiny(64, hidden_size=32))


def test_fused_projections_share_the_named_weights(model: TargetModel) -> None:
    """q|k|v and gate|up run as one GEMM each over weights that stay the checkpoint-named parameters
    (row blocks of one tensor): loading a state dict in place keeps the sharing, the fused forward
    equals the one-by-one forward to FP32 rounding, and moved modules fall back to one GEMM each."""
    from dflashgen.runtime.drafter import _rows_of

    block = BlockDrafter.for_target(model, DCFG, seed=3)
    la = block.layers[0]
    att, mlp = la.self_attn, la.mlp
    assert _rows_of(block._fused[0][0], (att.q_proj, att.k_proj, att.v_proj))
    assert _rows_of(block._fused[0][1], (mlp.gate_proj, mlp.up_proj))
    block.load_state_dict(BlockDrafter.for_target(model, DCFG, seed=4).state_dict())  # in place
    assert _rows_of(block._fused[1][0], (block.layers[1].self_attn.q_proj, block.layers[1].self_attn.k_proj,
                                         block.layers[1].self_attn.v_proj))
    assert torch.equal(block._fused[0][1][:DCFG.intermediate_size], mlp.gate_proj.weight)
    hidden = _taps(model, _prompt(10, 5))
    x = block.embed(torch.tensor([[3, 96, 96, 96, 96, 96, 96, 96]]))
    outs = []
    for fused in (True, False):
        block.fused_projections = fused
        kv = block.context_kv(hidden, torch.arange(10))
        outs.append((kv, block.forward_embeds(x, [10], [kv])))
    block.fused_projections = True
    for (k1, v1), (k2, v2) in zip(outs[0][0], outs[1][0], strict=True):
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    moved = block.to(torch.float64)  # new parameter tensors: the shared weights no longer back them
    assert not _rows_of(moved._fused[0][0], (att.q_proj, att.k_proj, att.v_proj))
    kv = moved.context_kv(hidden.double(), torch.arange(10))  # one GEMM each, in the modules' dtype
    torch.testing.assert_close(kv[0][1].float(), outs[1][0][0][1], rtol=1e-5, atol=1e-5)


def test_static_drafter_is_lossless_and_tracks_contexts(model: TargetModel, block: BlockDrafter) -> None:
    """The static-slot drafter (CUDA-graph form, eager here): greedy decoding stays identical to plain
    decoding, each slot's context length follows its request, and its drafts match the per-request
    DFlashDrafter's (same math up to FP32 summation order)."""
    from dflashgen.runtime.drafter import StaticDFlashDrafter

    prompts = [_prompt(5, 40), _prompt(9, 41), _prompt(1, 42)]
    oracle = [plain_greedy(model, p, 10) for p in prompts]
    static = StaticDFlashDrafter(block, max_batch=2, max_len=32)
    dec = SpecDecoder(model, static, max_batch=2, max_len=32, num_draft=static.num_draft)
    assert dec.generate(prompts, GREEDY, 10) == oracle
    assert not static.slot_of  # every request released
    eager = DFlashDrafter(block)
    dec_e = SpecDecoder(model, eager, max_batch=2, max_len=32, num_draft=eager.num_draft)
    assert dec_e.generate(prompts, GREEDY, 10) == oracle
    st = [r for r in dec.stats.rounds]
    assert [r.accepted for r in st] == [r.accepted for r in dec_e.stats.rounds]  # the same drafts accepted


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_static_drafter_at_the_length_limit(model: TargetModel, block: BlockDrafter, pipeline: bool) -> None:
    """Requests that run to max_len exactly, one stopping while the other goes on: a pipelined round's
    staged positions reach past max_len (the verify overshoot the target's state holds until the host
    rolls the finished request back), and the block forward writes its own K / V after them, so the
    drafter's cache holds max_len + T + block positions (an index past it raises here, asserts on a GPU)."""
    from dflashgen.runtime.drafter import StaticDFlashDrafter

    prompts = [_prompt(4, 70), _prompt(14, 71)]  # no waiter: one request stops while the other goes on
    max_len = 24
    lengths = [max_len - len(p) for p in prompts]
    static = StaticDFlashDrafter(block, max_batch=2, max_len=max_len)
    drafter = ReplayDrafter([plain_greedy(model, p, n + 8) for p, n in zip(prompts, lengths, strict=True)], 1.0,
                            cost_model=static)
    dec = SpecDecoder(model, drafter, max_batch=2, max_len=max_len, num_draft=static.num_draft, pipeline=pipeline)
    assert dec.generate(prompts, GREEDY, lengths) == [plain_greedy(model, p, n) for p, n in
                                                      zip(prompts, lengths, strict=True)]


def test_static_drafter_with_idle_slots(model: TargetModel, block: BlockDrafter) -> None:
    """Requests of different lengths drain unevenly, so rounds run with slot 1 busy and slot 0 idle
    (the drafter picks the busy slots' rows of its batch-2 logits): greedy decoding still equals plain
    decoding for every request."""
    from dflashgen.runtime.drafter import StaticDFlashDrafter

    prompts = [_prompt(5, 40), _prompt(9, 41), _prompt(1, 42)]
    lengths = [10, 4, 13]
    static = StaticDFlashDrafter(block, max_batch=2, max_len=32)
    dec = SpecDecoder(model, static, max_batch=2, max_len=32, num_draft=static.num_draft)
    assert dec.generate(prompts, GREEDY, lengths) == [plain_greedy(model, p, n) for p, n in
                                                      zip(prompts, lengths, strict=True)]
    assert any(r.batch == 1 for r in dec.stats.rounds) and dec.slot_log[-1][1] == 1  # the last joiner: slot 1


class _Counting:
    """Counts a static drafter's prelaunches and cancels (the pipelined decoder's hooks)."""

    def __init__(self, static) -> None:  # noqa: ANN001
        self.prelaunches = self.cancels = 0
        pre, cancel = static.prelaunch, static.cancel

        def prelaunch(pending: torch.Tensor) -> None:
            self.prelaunches += 1
            pre(pending)

        def counted_cancel() -> None:
            self.cancels += static._pre is not None  # a prelaunched pass discarded
            cancel()

        static.prelaunch, static.cancel = prelaunch, counted_cancel


def _pipelined_pair(model: TargetModel, block: BlockDrafter, make, prompts, params, max_new, eos=None):  # noqa: ANN001
    """The same requests decoded with serial and pipelined rounds: (outputs, accepted per request) each,
    and the pipelined run's prelaunch counter."""
    from dflashgen.runtime.drafter import StaticDFlashDrafter

    runs, counter = [], None
    for pipeline in (False, True):
        static = StaticDFlashDrafter(block, max_batch=2, max_len=40)
        counter = _Counting(static) if pipeline else counter
        drafter = make(static)
        dec = SpecDecoder(model, drafter, max_batch=2, max_len=40, num_draft=static.num_draft, pipeline=pipeline)
        assert dec.pipeline is pipeline
        out = dec.generate(prompts, params, max_new, eos=eos, seed=5)
        runs.append((out, sorted((r.rids[i], a) for r in dec.stats.rounds for i, a in enumerate(r.accepted))))
        assert not static.slot_of and static._pre is None  # every request released, no prelaunch left over
        # the rounds that drafted from a prelaunch: every prelaunch not discarded
        used = counter.prelaunches - counter.cancels if pipeline else 0
        assert dec.stats.summary()["prelaunched_rounds"] == used
    return runs, counter


@pytest.mark.parametrize("replay", [False, True], ids=["dflash", "replay"])
def test_pipelined_rounds_equal_serial_rounds(model: TargetModel, block: BlockDrafter, replay: bool) -> None:
    """pipeline=True launches the next round's draft pass from the device-side outcome before the
    host reads it: the drafter sees the same pending tokens and contexts, so greedy outputs equal plain
    decoding and the drafts accepted per request equal the serial rounds' (requests of different
    lengths: rounds with an idle slot, joins skipped around finishes); seeded sampled requests emit the
    same tokens."""
    prompts = [_prompt(5, 40), _prompt(9, 41), _prompt(1, 42)]
    lengths = [14, 4, 17]
    oracle = [plain_greedy(model, p, n + 7) for p, n in zip(prompts, lengths, strict=True)]

    def make(static):  # noqa: ANN001, ANN202
        return ReplayDrafter(oracle, 0.6, cost_model=static) if replay else static

    runs, counter = _pipelined_pair(model, block, make, prompts, GREEDY, lengths)
    assert runs[0] == runs[1]
    assert runs[1][0] == [o[:n] for o, n in zip(oracle, lengths, strict=True)]
    assert counter.prelaunches > 0
    sampled = [SamplingParams(temperature=0.9, top_k=20, seed=3 + i) for i in range(3)]
    runs, _ = _pipelined_pair(model, block, make, prompts, sampled, lengths)
    assert runs[0] == runs[1]


def test_pipelined_rounds_cancel_a_prelaunch_when_eos_admits_a_joiner(model: TargetModel, block: BlockDrafter) -> None:
    """A request stopping at EOS (not foreseeable from token counts) frees its slot after its next
    draft pass was prelaunched: the joiner's admission cancels it and the round drafts afresh, with the
    same outputs as serial rounds."""
    prompts = [_prompt(5, 40), _prompt(9, 41), _prompt(1, 42), _prompt(4, 43)]
    first = plain_greedy(model, prompts[0], 20)
    eos = first[9]  # request 0 stops there (the others wherever that token comes up, or at 20)
    runs, counter = _pipelined_pair(model, block, lambda s: s, prompts, GREEDY, 20, eos=eos)
    assert runs[0] == runs[1]
    assert runs[1][0][0] == first[:first.index(eos) + 1]
    assert counter.prelaunches > 0 and counter.cancels > 0
    runs, counter = _pipelined_pair(model, block, lambda s: s, prompts, GREEDY, 20)  # no EOS: all foreseen
    assert runs[0] == runs[1] and counter.prelaunches > 0 and counter.cancels == 0


def test_pipeline_needs_a_prelaunching_drafter(model: TargetModel, block: BlockDrafter) -> None:
    from dflashgen.runtime.drafter import StaticDFlashDrafter
    from dflashgen.runtime.spec_decode import NgramDrafter

    with pytest.raises(ValueError, match="prelaunch"):
        SpecDecoder(model, NgramDrafter(), max_batch=2, max_len=40, pipeline=True)
    static = StaticDFlashDrafter(block, max_batch=2, max_len=40)
    with pytest.raises(ValueError, match="exclude each other"):
        SpecDecoder(model, static, max_batch=2, max_len=40, num_draft=static.num_draft, pipeline=True,
                    overlap_prefill=True)
    # the default: on for CUDA targets only (nothing to overlap with on the CPU)
    assert SpecDecoder(model, static, max_batch=2, max_len=40, num_draft=static.num_draft).pipeline is False


def test_static_drafter_keeps_its_context_in_the_weight_dtype(model: TargetModel) -> None:
    """An FP16 drafter (what the CUDA benchmark runs) keeps its static context K/V in FP16 and scores the
    context with FP16 products: decoding stays lossless (greedy == plain decoding), and its drafts are
    the FP32 drafter's where the rounding does not flip an argmax (most rounds here)."""
    from dflashgen.runtime.drafter import StaticDFlashDrafter

    prompts = [_prompt(5, 60), _prompt(9, 61)]
    oracle = [plain_greedy(model, p, 10) for p in prompts]
    accepted = []
    for dtype in (torch.float16, torch.float32):
        block = BlockDrafter.for_target(model, DCFG, seed=7, dtype=dtype)
        static = StaticDFlashDrafter(block, max_batch=2, max_len=32)
        assert all(k.dtype == dtype and v.dtype == dtype for k, v in zip(static.k, static.v, strict=True))
        dec = SpecDecoder(model, static, max_batch=2, max_len=32, num_draft=static.num_draft)
        assert dec.generate(prompts, GREEDY, 10) == oracle
        accepted.append([r.accepted for r in dec.stats.rounds])
    same = sum(a == b for a, b in zip(*accepted, strict=False))
    assert same >= 0.7 * max(len(a) for a in accepted), accepted


def test_replay_with_static_drafter_cost_sees_real_taps(model: TargetModel, block: BlockDrafter) -> None:
    """The CUDA benchmark's replay drafter: its cost model is a StaticDFlashDrafter fed the target's real
    taps through the replay drafter's hooks; every propose runs the block forward on contexts that
    match each request's history."""
    from dflashgen.runtime.drafter import StaticDFlashDrafter

    prompts = [_prompt(6, 50), _prompt(3, 51), _prompt(8, 52)]
    oracle = [plain_greedy(model, p, 12 + 7) for p in prompts]
    static = StaticDFlashDrafter(block, max_batch=2, max_len=40)
    seen: list[bool] = []
    original = static.propose

    def checked(contexts):  # after the step's append: context == history - 1 (pending token = block position 0)
        out = original(contexts)
        seen.extend(static.context_len(c.rid) == len(c.tokens) - 1 for c in contexts)
        return out

    static.propose = checked  # type: ignore[method-assign]
    d = ReplayDrafter(oracle, 0.7, cost_model=static)
    assert d.needs_taps and d.taps == static.taps and d.observe_round == static.observe_round
    dec = SpecDecoder(model, d, max_batch=2, max_len=40)
    assert dec.generate(prompts, GREEDY, 12) == [o[:12] for o in oracle]
    assert seen and all(seen)


def test_static_block_forward_reads_the_head_major_cache_in_place(block: BlockDrafter) -> None:
    """forward_embeds_static over a head-major [B, Hkv, capacity, D] cache (stale rows past each
    slot's length) equals the per-request forward_embeds over exactly those contexts, to FP32
    summation order; a position past ctx_len never matters (the block's own K / V are written at
    ctx_len.., the rest stay masked)."""
    cfg = block.cfg
    g = torch.Generator().manual_seed(7)
    lens, cap, s = [5, 0, 11], 24, cfg.block_size
    x = torch.randn(len(lens), s, cfg.hidden_size, generator=g)
    per_request = [[(torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g),
                     torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)) for _ in range(cfg.num_layers)]
                   for n in lens]
    static = []
    for li in range(cfg.num_layers):
        kc = torch.randn(len(lens), cfg.num_kv_heads, cap, cfg.head_dim, generator=g) * 1e3  # stale
        vc = torch.randn(len(lens), cfg.num_kv_heads, cap, cfg.head_dim, generator=g) * 1e3
        for r, n in enumerate(lens):
            kc[r, :, :n] = per_request[r][li][0].transpose(0, 1)
            vc[r, :, :n] = per_request[r][li][1].transpose(0, 1)
        static.append((kc, vc))

    def past_block() -> list[torch.Tensor]:  # every slot's rows past its block
        return [kv[r, :, n + s:].clone() for pair in static for kv in pair for r, n in enumerate(lens)]

    before = past_block()
    want = block.forward_embeds(x, lens, per_request)
    got = block.forward_embeds_static(x, torch.tensor(lens), static)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # only the block's positions were written: the rows past them are as they were
    assert all(torch.equal(a, b) for a, b in zip(before, past_block(), strict=True))


def test_static_block_and_context_append_through_the_qk_kernel_path(block: BlockDrafter, model: TargetModel,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The static drafter's kernel route (q / k norms, RoPE, scaled grouped q and head-major cache writes
    through ``qk_norm_rope``; the context append with no q heads) against its torch route: the same
    values to FP32 rounding, the same cache rows written. On CPU ``qk_norm_rope`` runs torch's ops, so
    this pins the plumbing -- views, rope tables, positions, layouts -- the GPU tests then pin the kernel."""
    cfg = block.cfg
    g = torch.Generator().manual_seed(3)
    b, t, cap = 2, cfg.block_size, 40
    hidden = torch.randn(b, t, len(cfg.target_layers) * cfg.target_hidden_size, generator=g)
    pos = torch.tensor([[0], [9]]) + torch.arange(t)
    x = torch.randn(b, t, cfg.hidden_size, generator=g)
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(BlockDrafter, "_fused_qk", lambda self, device, dtype, f=fused: f)
        kv = [tuple(torch.full((b, cfg.num_kv_heads, cap, cfg.head_dim), 7.0) for _ in range(2))
              for _ in range(cfg.num_layers)]
        block.append_context_static(hidden, pos, kv)
        snap = [(k.clone(), v.clone()) for k, v in kv]
        h = block.forward_embeds_static(x, pos[:, -1] + 1, kv)
        out[fused] = (snap, kv, h)
    for (k1, v1), (k0, v0) in zip(out[True][0], out[False][0], strict=True):  # the append: V is the GEMM's
        assert torch.equal(v1, v0) and torch.equal(k1 == 7.0, k0 == 7.0) and torch.allclose(k1, k0, atol=1e-5)
    for (k1, v1), (k0, v0) in zip(out[True][1], out[False][1], strict=True):  # + the block (later layers'
        assert torch.equal(k1 == 7.0, k0 == 7.0) and torch.equal(v1 == 7.0, v0 == 7.0)  # inputs differ
        assert torch.allclose(k1, k0, atol=1e-4) and torch.allclose(v1, v0, atol=1e-4)  # by FP32 rounding)
    assert torch.allclose(out[True][2], out[False][2], rtol=1e-4, atol=1e-5)
