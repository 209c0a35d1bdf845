"""GPU: the decode loop's generated pieces on an H200 -- the compact rejection-sampling kernel vs
the dense reference (sm_90 cubin and compute_70 PTX JIT-compiled by the driver), CUDA-graph replay
== eager, greedy byte-identity across B1/B2/B4/B8 and vs plain decoding on the generated GEMM
and gdn kernels, a verify round + rollback bitwise equal to one-token steps, and bad inputs.
Skips cleanly without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import spy_on_prefill

pytestmark = pytest.mark.gpu

VOCAB = 248320  # Qwen3.8: the specialised rejection kernels


def _case(b: int, d: int, temp: float, top_p: float, seed: int, with_q: bool, top_ks: tuple[int, ...] = (0, 0, 20),
          greedy_row: bool = True):
    from dflashgen.runtime.sampling import SamplingParams, Uniforms, target_probs

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    # fp16-rounded logits: ties between ids, as the real lm_head output has them
    logits = (torch.randn(b, d + 1, VOCAB, device=dev, generator=g) * 3).half().float()
    params = [SamplingParams(temperature=temp, top_p=top_p, top_k=top_ks[r % len(top_ks)]) for r in range(b)]
    if b > 1 and greedy_row:
        params[1] = SamplingParams(temperature=0.0)  # a greedy row in the batch
    p = target_probs(logits, params)
    # drafts: mostly sampled from the target itself (so runs of acceptances happen), some argmax
    drafts = torch.multinomial(p[:, :d].reshape(-1, VOCAB), 1, generator=g).view(b, d)
    drafts[:, ::3] = p[:, :d:3].argmax(-1)
    q = None
    if with_q:
        q = torch.softmax(logits[:, :d] * 0.5 + torch.randn(b, d, VOCAB, device=dev, generator=g), -1)
    u = Uniforms.draw(b, d, torch.Generator().manual_seed(seed), dev)
    return drafts, logits, params, u, q


@pytest.mark.parametrize("arch", ["native", 70])
@pytest.mark.parametrize("b", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [3, 7])
@pytest.mark.parametrize("top_p", [1.0, 0.95])
@pytest.mark.parametrize("temp", [0.6, 1.0])
def test_compact_equals_dense(arch: str | int, b: int, d: int, top_p: float, temp: float) -> None:
    from dflashgen.runtime.rejection import compact_verify
    from dflashgen.runtime.sampling import verify

    for with_q in (False, True):
        seed = 1000 * b + 10 * d + int(100 * top_p)
        drafts, logits, params, u, q = _case(b, d, temp, top_p, seed, with_q)
        ref = verify(drafts, logits, params, u, q)
        got = compact_verify(drafts, logits, params, u, q, arch=None if arch == "native" else int(arch))
        torch.cuda.synchronize()
        assert torch.equal(got.accepted, ref.accepted), (with_q, got.accepted.tolist(), ref.accepted.tolist())
        assert torch.equal(got.tokens, ref.tokens), (with_q, got.tokens.tolist(), ref.tokens.tolist())


@pytest.mark.parametrize("arch", ["native", 70])
@pytest.mark.parametrize("b", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [3, 7])
@pytest.mark.parametrize("top_k", [1, 20, "cap", "cap+1", 0])
@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_compact_candidate_path_equals_dense(arch: str | int, b: int, d: int, top_k: int | str,
                                             top_p: float) -> None:
    """top_k around the candidate path's CAP (CAP: candidates; CAP + 1, 0: the full vocabulary), every
    row on it (the benchmark's case, greedy_row off) and mixed with a greedy and a full-path row,
    temperatures 1.0 / 0.6, with and without draft probabilities."""
    from dflashgen.runtime.rejection import compact_verify
    from dflashgen.runtime.sampling import verify

    from dflashgen.rejection import CAP

    k = {"cap": CAP, "cap+1": CAP + 1}[top_k] if isinstance(top_k, str) else top_k
    for with_q in (False, True):
        for temp, top_ks, greedy_row in ((1.0, (k,), False), (0.6, (k, k, CAP + 1), True)):
            seed = 7000 + 1000 * b + 10 * d + int(100 * top_p) + k
            drafts, logits, params, u, q = _case(b, d, temp, top_p, seed, with_q, top_ks, greedy_row)
            ref = verify(drafts, logits, params, u, q)
            got = compact_verify(drafts, logits, params, u, q, arch=None if arch == "native" else int(arch))
            torch.cuda.synchronize()
            assert torch.equal(got.accepted, ref.accepted), (with_q, temp, got.accepted.tolist(), ref.accepted.tolist())
            assert torch.equal(got.tokens, ref.tokens), (with_q, temp, got.tokens.tolist(), ref.tokens.tolist())


@pytest.mark.parametrize("vocab, d", [(VOCAB, 7), (VOCAB, 5), (1000, 7)])
@pytest.mark.parametrize("k", [2, 20, "cap"])
def test_compact_candidate_cut_adversarial(vocab: int, d: int, k: int | str) -> None:
    """The row's top-k inside one chunk, followed there by equal-logit tokens at higher ids (keys that
    differ from the k-th only in the id digits) and near misses; drafts are exactly the tokens around
    the kept set's edge, so a cut that is not the exact k-th key shows in the accept decisions."""
    from dflashgen.runtime.rejection import compact_verify
    from dflashgen.runtime.sampling import SamplingParams, Uniforms, verify

    from dflashgen.rejection import CAP, CHUNK

    k = CAP if k == "cap" else int(k)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(k + vocab)
    b = 4
    logits = torch.randn(b, d + 1, vocab, device=dev, generator=g) - 8.0
    base = CHUNK + 5 if vocab > 2 * CHUNK else 0
    top = torch.arange(k + 4, device=dev) + base
    vals = torch.linspace(4.0, 3.0, k).tolist() + [3.0, 3.0, 2.9990234375, 3.0]  # the k-th value repeated
    logits[..., top] = torch.tensor(vals, device=dev)
    drafts = top[torch.randint(max(k - 2, 0), k + 4, (b, d), device=dev, generator=g)]
    params = [SamplingParams(temperature=1.0, top_k=k), SamplingParams(temperature=1.0, top_k=k, top_p=0.9),
              SamplingParams(temperature=0.6, top_k=k, top_p=0.5), SamplingParams(temperature=0.0)]
    for trial in range(4):
        cpu = torch.Generator().manual_seed(trial)
        scale = 0.05 if trial < 2 else 1.0  # small uniforms: a wrongly kept draft would be accepted
        u = Uniforms((torch.rand(b, d, generator=cpu) * scale).to(dev), torch.rand(b, d + 1, generator=cpu).to(dev))
        ref = verify(drafts, logits, params, u)
        got = compact_verify(drafts, logits, params, u)
        assert torch.equal(got.accepted, ref.accepted), (trial, got.accepted.tolist(), ref.accepted.tolist())
        assert torch.equal(got.tokens, ref.tokens), (trial, got.tokens.tolist(), ref.tokens.tolist())


def test_compact_accept_override_and_generic_vocab() -> None:
    from dflashgen.runtime.rejection import compact_verify
    from dflashgen.runtime.sampling import SamplingParams, Uniforms, verify

    from dflashgen.rejection import CAP

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    # the generic kernel below Qwen's vocab and at it (d = 5), the specialised one (d = 7)
    for vocab, d in ((97, 7), (1000, 7), (VOCAB, 5), (VOCAB, 7)):
        for top_k in (20, CAP, CAP + 1, 0):  # CAP >= 97: top-k off on the candidate path
            for with_q in (False, True):
                b = 4
                logits = torch.randn(b, d + 1, vocab, device=dev, generator=g).half().float()
                drafts = torch.randint(0, vocab, (b, d), device=dev, generator=g)
                params = [SamplingParams(temperature=1.0, top_p=0.95, top_k=top_k)] * b
                u = Uniforms.draw(b, d, torch.Generator().manual_seed(vocab), dev)
                q = torch.softmax(logits[:, :d] + torch.randn(b, d, vocab, device=dev, generator=g), -1) \
                    if with_q else None
                forced = torch.rand(b, d, device=dev, generator=g) < 0.8
                for ov in (forced, None):
                    ref = verify(drafts, logits, params, u, q, accept_override=ov)
                    got = compact_verify(drafts, logits, params, u, q, accept_override=ov)
                    assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.tokens, ref.tokens), \
                        (vocab, d, top_k, with_q, ov is None)


# --------------------------------------------------------------------------- decode loop on the GPU


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    """The first 4 Qwen3.8-27B layers (3 GDN + 1 full attention) + the full vocab, NVFP4, through the
    kernel library in batch-invariant mode: generated kernels at every M, the FP16 lm_head at one GEMM
    shape (runtime/invariance.py)."""
    from dflashgen.runtime.decode_bench import load_target, write_synthetic

    out = tmp_path_factory.mktemp("qwen38-4l")
    write_synthetic(out, None, 4, "nvfp4", seed=0, device="cuda")
    return load_target(out, "nvfp4", device="cuda", invariant=True)  # batch-invariant projections


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def test_graphs_equal_eager_and_sampler_paths(target) -> None:
    from dflashgen.runtime.sampling import SamplingParams
    from dflashgen.runtime.spec_decode import NgramDrafter, SpecDecoder

    prompts = _prompts(6, 24, target.cfg.vocab_size)
    params = [SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=i) for i in range(6)]
    outs = {}
    for graphs in (True, False):
        for sampler in ("compact", "dense"):
            dec = SpecDecoder(target, NgramDrafter(), max_batch=4, max_len=96, graphs=graphs, sampler=sampler)
            outs[graphs, sampler] = dec.generate(prompts, params, 24)
            assert dec.steps.captured == graphs
    assert outs[True, "compact"] == outs[False, "compact"]  # graph replay == eager, bitwise
    assert outs[True, "dense"] == outs[False, "dense"]
    assert outs[True, "compact"] == outs[True, "dense"]  # same uniforms -> same tokens


def test_static_context_append_on_the_kernel_matches_torchs_ops(target, monkeypatch) -> None:
    """The FP16 drafter's per-round context append (the staged taps' K / V into the head-major slot
    caches) on the qk-norm-RoPE kernel against torch's ops ($DFLASHGEN_FUSED_QK=0): V bitwise, K within
    FP16 rounding (a different FP32 reduction order), only the staged positions written."""
    from dflashgen.runtime.decode_bench import _block_drafter

    block = _block_drafter(target, 5)
    cfg = block.cfg
    g = torch.Generator(device="cuda").manual_seed(6)
    b, t, cap = 3, 8, 64
    hidden = torch.randn(b, t, len(cfg.target_layers) * cfg.target_hidden_size, generator=g, device="cuda").half()
    pos = torch.tensor([[0], [17], [40]], device="cuda") + torch.arange(t, device="cuda")
    caches = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("DFLASHGEN_FUSED_QK", flag)
        assert block._fused_qk(hidden.device, torch.float16) == (flag == "1")
        kv = [tuple(torch.full((b, cfg.num_kv_heads, cap, cfg.head_dim), 7.0, device="cuda").half()
                    for _ in range(2)) for _ in range(cfg.num_layers)]
        block.append_context_static(hidden, pos, kv)
        caches[flag] = kv
    torch.cuda.synchronize()
    written = torch.zeros(b, cap, dtype=torch.bool, device="cuda")
    written[torch.arange(b, device="cuda")[:, None], pos] = True
    for (k1, v1), (k0, v0) in zip(caches["1"], caches["0"], strict=True):
        assert torch.equal(v1, v0)
        assert bool((k1.transpose(1, 2)[~written] == 7.0).all())  # the rest untouched
        rel = float((k1.float() - k0.float()).norm() / k0.float().norm())
        assert rel <= 1e-3, rel


def test_fp16_drafter_on_the_glue_kernels_tracks_the_fp32_reference(target) -> None:
    """The FP16 block drafter's static forward on CUDA -- add-RMSNorm, SiLU-mul and the q / k norm + RoPE
    (scaled grouped FP16 q, the block's K / V into the head-major FP16 cache) on the generated kernels,
    FP16 scores -- against the FP32 per-request
    reference forward with the same weights (relative L2 of the final hidden states, FP16 GEMM
    rounding), with the kernels seen to run; and the rows past each slot's block left as they were."""
    from unittest import mock

    from dflashgen.runtime import drafter as drafter_mod
    from dflashgen.runtime.decode_bench import _block_drafter

    block = _block_drafter(target, 3)
    cfg = block.cfg
    ref = drafter_mod.BlockDrafter.for_target(target, cfg, seed=3, dtype=torch.float32)
    ref.load_state_dict({k: v.float() for k, v in block.state_dict().items()})  # the same (FP16) weights
    g = torch.Generator(device="cuda").manual_seed(4)
    lens, cap, s = [37, 0, 90], 112, cfg.block_size
    x = torch.randn(len(lens), s, cfg.hidden_size, generator=g, device="cuda")
    per_request = [[(torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g, device="cuda"),
                     torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g, device="cuda"))
                    for _ in range(cfg.num_layers)] for n in lens]
    static = []
    for li in range(cfg.num_layers):
        kc = torch.randn(len(lens), cfg.num_kv_heads, cap, cfg.head_dim, generator=g, device="cuda").half()
        vc = torch.randn(len(lens), cfg.num_kv_heads, cap, cfg.head_dim, generator=g, device="cuda").half()
        for r, n in enumerate(lens):
            kc[r, :, :n] = per_request[r][li][0].transpose(0, 1).half()
            vc[r, :, :n] = per_request[r][li][1].transpose(0, 1).half()
        static.append((kc, vc))
    past = [kv[r, :, n + s:].clone() for pair in static for kv in pair for r, n in enumerate(lens)]
    calls = {"add_rmsnorm": 0, "silu_mul_cat": 0, "qk_norm_rope": 0}

    def counted(name):  # noqa: ANN001, ANN202
        f = getattr(drafter_mod, name)

        def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return f(*a, **k)
        return spy

    with mock.patch.object(drafter_mod, "add_rmsnorm", counted("add_rmsnorm")), \
            mock.patch.object(drafter_mod, "silu_mul_cat", counted("silu_mul_cat")), \
            mock.patch.object(drafter_mod, "qk_norm_rope", counted("qk_norm_rope")):
        got = block.forward_embeds_static(x, torch.tensor(lens, device="cuda"), static)
    want = ref.forward_embeds(x, lens, [[(k.half().float(), v.half().float()) for k, v in req] for req in per_request])
    torch.cuda.synchronize()
    assert got.dtype == torch.float16 and not got.isnan().any()
    assert calls == {"add_rmsnorm": 2 * cfg.num_layers + 1, "silu_mul_cat": cfg.num_layers,
                     "qk_norm_rope": cfg.num_layers}, calls
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel <= 1e-2, rel  # FP16 activations and scores (CPU, tiny drafter: ~6e-4)
    assert all(torch.equal(a, b) for a, b in zip(past, [kv[r, :, n + s:] for pair in static for kv in pair
                                                          for r, n in enumerate(lens)], strict=True))


def test_static_drafter_graphs_equal_eager(target) -> None:
    from dflashgen.runtime.decode_bench import _block_drafter
    from dflashgen.runtime.drafter import StaticDFlashDrafter
    from dflashgen.runtime.sampling import SamplingParams
    from dflashgen.runtime.spec_decode import SpecDecoder

    block = _block_drafter(target, 0)
    prompts = _prompts(5, 24, target.cfg.vocab_size)
    outs, accepted = [], []
    for graphs in (True, False):
        drafter = StaticDFlashDrafter(block, 4, 96, graphs=graphs)
        # stalling prefill: overlapped joiners enter when their side-stream prefill is done, so which
        # round they join in (compared below round by round) depends on timing
        dec = SpecDecoder(target, drafter, max_batch=4, max_len=96, graphs=graphs, overlap_prefill=False)
        outs.append(dec.generate(prompts, SamplingParams(temperature=0.0), 24))
        accepted.append([r.accepted for r in dec.stats.rounds])
        assert bool(drafter._graphs) == graphs
    assert outs[0] == outs[1] and accepted[0] == accepted[1]


def test_overlapped_prefill_equals_stalling(target) -> None:
    """Joiners prefilled on the low-priority side stream beside the rounds (CUDA graphs) give the
    tokens of the stalling prefill, bit for bit: greedy requests with the static-slot DFlash drafter
    (prompt taps observed when a joiner enters), and seeded sampled requests with the n-gram drafter.
    (Not sampled requests with ``sampled=True`` drafts: those draw one batch of uniforms per round, so
    their drafts depend on who is in the batch, which overlap changes.)"""
    from dflashgen.runtime.decode_bench import _block_drafter
    from dflashgen.runtime.drafter import StaticDFlashDrafter
    from dflashgen.runtime.sampling import SamplingParams
    from dflashgen.runtime.spec_decode import NgramDrafter, SpecDecoder

    block = _block_drafter(target, 0)
    prompts = _prompts(9, 40, target.cfg.vocab_size)
    greedy = [SamplingParams(temperature=0.0)] * 9
    mixed = [greedy[0] if i % 2 else SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(9)]
    max_new = [8, 30, 16, 24, 12, 30, 9, 20, 14]  # staggered finishes: joins while others decode
    for params, make in ((greedy, lambda: StaticDFlashDrafter(block, 4, 96)), (mixed, NgramDrafter)):
        outs, overlapped = [], []
        for overlap in (False, True):
            dec = SpecDecoder(target, make(), max_batch=4, max_len=96, overlap_prefill=overlap)
            outs.append(dec.generate(prompts, params, max_new, seed=3))
            overlapped.append(dec.stats.summary()["overlapped_prefills"])
        assert overlapped[0] == 0 and overlapped[1] > 0
        assert outs[0] == outs[1]


def test_pipelined_rounds_equal_serial(target) -> None:
    """pipeline=True (the CUDA default with a static-slot drafter) queues the next round's draft graph
    before the host reads the outcome: the same tokens as serial rounds, bit for bit, for greedy
    requests with the DFlash drafter and for the benchmark's replay drafter over it (sampled requests,
    synthetic acceptance: seeded uniforms per request step), with staggered finishes and joins."""
    from dflashgen.runtime.decode_bench import _block_drafter
    from dflashgen.runtime.drafter import StaticDFlashDrafter
    from dflashgen.runtime.sampling import SamplingParams
    from dflashgen.runtime.spec_decode import ReplayDrafter, SpecDecoder

    block = _block_drafter(target, 0)
    prompts = _prompts(9, 40, target.cfg.vocab_size)
    max_new = [8, 30, 16, 24, 12, 30, 9, 20, 14]
    g = torch.Generator().manual_seed(1)
    conts = [torch.randint(0, target.cfg.vocab_size, (40,), generator=g).tolist() for _ in prompts]
    sampled = [SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=i) for i in range(9)]
    cases = ((lambda s: s, [SamplingParams(temperature=0.0)] * 9),
             (lambda s: ReplayDrafter(conts, 0.8, cost_model=s, synthetic_acceptance=True), sampled))
    for make, params in cases:
        outs, prelaunches = [], []
        for pipeline in (None, False):
            static = StaticDFlashDrafter(block, 4, 96)
            count = [0]
            pre = static.prelaunch
            static.prelaunch = lambda p, pre=pre, count=count: (count.__setitem__(0, count[0] + 1), pre(p))[1]
            dec = SpecDecoder(target, make(static), max_batch=4, max_len=96, pipeline=pipeline)
            assert dec.pipeline is (pipeline is None)
            outs.append(dec.generate(prompts, params, max_new, seed=3))
            prelaunches.append(count[0])
            assert not static.slot_of and static._pre is None
        assert prelaunches[0] > 0 and prelaunches[1] == 0
        assert outs[0] == outs[1] and [len(o) for o in outs[0]] == max_new


def test_greedy_identical_across_batches_and_plain(target) -> None:
    from dflashgen.runtime import gdn_kernel
    from dflashgen.runtime.sampling import SamplingParams
    from dflashgen.runtime.spec_decode import NgramDrafter, SpecDecoder, plain_greedy

    assert target.batch_invariant  # joining requests prefill alone, as plain_greedy does
    # prompts of 20..41 tokens (prefill through the gdn prefill kernel) and 1..6 (no prefill, or the gdn step)
    prompts = _prompts(8, 20, target.cfg.vocab_size) + [p[:1 + i] for i, p in enumerate(_prompts(8, 20, 97)[:6])]
    n = 24
    plain = [plain_greedy(target, p, n) for p in prompts]
    for b in (1, 2, 4, 8):
        dec = SpecDecoder(target, NgramDrafter(), max_batch=b, max_len=96)  # prompts run to 2x41 tokens
        got = dec.generate(prompts, SamplingParams(temperature=0.0), n)
        same = sum(g == p for g, p in zip(got, plain, strict=True))
        assert same == len(prompts), f"B{b}: {same}/{len(prompts)} byte-identical to plain greedy decoding"
    assert gdn_kernel._KERNELS  # the GDN layers ran the generated kernel, not the torch reference


def test_prefill_is_bitwise_one_token_steps(target, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged 40-token prefill (num_new) runs the GDN layers on the prefill kernel and leaves, per
    request, exactly the GDN state (recurrent and conv) of its n[b] one-token forwards in every GDN
    layer before the first attention layer (batch-invariant projections: nothing else differs there);
    the generated chunk-form kernels and the torch chunk form (DFLASHGEN_GDN_PREFILL=chunked / torch)
    stay within FP32 / FP16 rounding of it."""

    from dflashgen.model import FULL

    calls = spy_on_prefill(monkeypatch)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    b, t = 3, 40
    toks = torch.randint(0, target.cfg.vocab_size, (b, t), generator=g).to(dev)
    n = torch.tensor([40, 23, 17], device=dev)
    pre = target.new_state(b, 64)
    target(toks, pre, num_new=n, logits=False)
    assert calls == [t] * len(pre.gdn_index)  # every GDN layer on the prefill kernel, not the chunk form
    first_full = target.cfg.layer_types.index(FULL) if FULL in target.cfg.layer_types else len(target.cfg.layer_types)
    early = [j for i, j in pre.gdn_index.items() if i < first_full]
    assert early
    for r in range(b):
        steps = target.new_state(1, 64)
        for i in range(int(n[r])):
            target(toks[r:r + 1, i:i + 1], steps, logits=False)
        for j in early:
            assert torch.equal(steps.ssm_all[j, 0], pre.ssm_all[j, r]), f"GDN state of request {r}, layer {j}"
            assert torch.equal(steps.conv_all[j, 0], pre.conv_all[j, r]), f"conv state of request {r}, layer {j}"
    for form in ("chunked", "torch"):
        monkeypatch.setenv("DFLASHGEN_GDN_PREFILL", form)
        chunk = target.new_state(b, 64)
        calls.clear()
        target(toks, chunk, num_new=n, logits=False)
        assert calls == []
        err = float((chunk.ssm_all - pre.ssm_all).norm() / pre.ssm_all.norm())
        assert err <= 1e-2, (form, err)
        print(f"prefill GDN state, {form} form vs the sequential kernel: rel {err:.2e}")


def test_verify_rollback_is_bitwise_one_token_steps(target) -> None:
    """One verify round (8 positions, armed) rolled back to n[b] leaves exactly the GDN state of n[b]
    one-token forwards, and its logits rows equal theirs: the whole layer stack is position-exact and
    batch-invariant (gdn kernel, batch-invariant projections, verify attention at any query count)."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    b, vocab = 4, target.cfg.vocab_size
    prompt = torch.randint(0, vocab, (b, 10), generator=g).to(dev)
    block = torch.randint(0, vocab, (b, 8), generator=g).to(dev)
    n = torch.tensor([8, 1, 3, 6], device=dev)
    verify = target.new_state(b, 32)
    for i in range(prompt.shape[1]):  # one token at a time: every forward stays on the verify-sized paths
        target(prompt[:, i:i + 1], verify)
    verify.checkpoint(8)
    logits = target(block, verify)
    verify.rollback(verify.lengths - 8 + n)
    rows = []
    for r in range(b):
        steps = target.new_state(1, 32)
        for i in range(prompt.shape[1]):
            target(prompt[r:r + 1, i:i + 1], steps)
        for i in range(int(n[r])):
            rows.append((r, i, torch.equal(target(block[r:r + 1, i:i + 1], steps)[0, 0], logits[r, i])))
        assert torch.equal(steps.ssm_all[:, 0], verify.ssm_all[:, r]), f"GDN state of request {r}"
        assert torch.equal(steps.conv_all[:, 0], verify.conv_all[:, r]), f"conv state of request {r}"
    assert all(ok for *_, ok in rows), f"logits rows differing (request, position): {[x[:2] for x in rows if not x[2]]}"


def test_bad_inputs_leave_others_unaffected(target) -> None:
    from dflashgen.runtime.sampling import SamplingParams
    from dflashgen.runtime.spec_decode import NgramDrafter, SpecDecoder

    with pytest.raises(ValueError, match="captured maximum"):
        SpecDecoder(target, NgramDrafter(), max_batch=9, max_len=64)
    dec = SpecDecoder(target, NgramDrafter(), max_batch=4, max_len=64)
    with pytest.raises(ValueError, match="captured maximum"):
        dec.steps.verify(5, torch.zeros(5, 8, dtype=torch.long, device="cuda"))
    good = _prompts(2, 16, target.cfg.vocab_size)
    greedy = SamplingParams(temperature=0.0)
    prompts = [good[0], [], list(range(70)), good[1], good[0]]
    params = [greedy, greedy, greedy, greedy, {"temperature": -1.0}]
    outs = dec.generate(prompts, params, 16, strict=False)
    assert set(dec.errors) == {1, 2, 4} and "empty prompt" in dec.errors[1] and "longer" in dec.errors[2]
    assert "temperature" in dec.errors[4]
    alone = SpecDecoder(target, NgramDrafter(), max_batch=4, max_len=64).generate(good, greedy, 16)
    assert [outs[0], outs[3]] == alone and outs[1] == outs[2] == outs[4] == []


def test_synthetic_writer_on_gpu_is_fast(tmp_path: Path) -> None:
    import time

    from dflashgen.runtime.decode_bench import write_synthetic

    t = time.perf_counter()
    write_synthetic(tmp_path, None, 2, "nvfp4", seed=0, device="cuda")  # 2 layers + embed-size lm_head
    assert time.perf_counter() - t < 60


def test_sampler_timing_report() -> None:
    """Not a gate: CUDA-event medians of one round's rejection sampling, compact kernel vs dense
    (printed; the script's pytest log keeps it)."""
    from dflashgen.runtime.rejection import compact_verify
    from dflashgen.runtime.sampling import verify

    for b in (1, 2, 4, 8):
        drafts, logits, params, u, _ = _case(b, 7, 1.0, 0.95, seed=b, with_q=False)
        times = {}
        for name, fn in (("compact", compact_verify), ("dense", verify)):
            fn(drafts, logits, params, u)
            ms = []
            for _ in range(10):
                a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(drafts, logits, params, u)
                z.record()
                torch.cuda.synchronize()
                ms.append(a.elapsed_time(z))
            times[name] = sorted(ms)[len(ms) // 2]
        print(f"rejection sampling B{b} q7 V={VOCAB}: compact {times['compact']:.3f} ms, dense {times['dense']:.3f} ms")


def _graph_ms(fn) -> float:
    """Median of 20 CUDA-graph replays of ``fn`` (CUDA events), captured after an eager warm-up."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # module loads and allocations outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = []
    for _ in range(20):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        z.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(z))
    return sorted(ms)[len(ms) // 2]


def test_compact_graph_timing_report() -> None:
    """Not a gate (the target is < 0.1 ms): the compact kernels alone, replayed from a CUDA graph, at
    the benchmark's sampling (temperature 1, top_k 20, top_p 0.95: the candidate path) and with
    top_k 0 (the full-vocabulary path), q7, V = 248320; the prefilter alone too. Printed."""
    import ctypes

    from dflashgen.runtime.driver import current_stream, ptr_arg
    from dflashgen.runtime.rejection import CompactSampler

    from dflashgen.rejection import CAP, num_chunks, uses_candidates

    sampler = CompactSampler(torch.device("cuda"))
    prefilter = sampler.functions(VOCAB, 7)[0]
    chunks = num_chunks(VOCAB)
    for b in (1, 2, 4, 8):
        for top_k in (20, 0):
            drafts, logits, params, u, _ = _case(b, 7, 1.0, 0.95, seed=b, with_q=False, top_ks=(top_k,),
                                                 greedy_row=False)
            dev = logits.device
            temp = torch.tensor([sp.temperature for sp in params], dtype=torch.float32, device=dev)
            top_p = torch.tensor([sp.top_p for sp in params], dtype=torch.float32, device=dev)
            tk = torch.tensor([sp.top_k for sp in params], dtype=torch.int32, device=dev)
            cand = any(uses_candidates(sp.temperature, sp.top_k) for sp in params)
            args = (drafts, logits, None, temp, tk, top_p, u.accept, u.sample, None, cand)
            buf = torch.empty(b * 8 * CAP * chunks, dtype=torch.int64, device=dev)
            pf_args = [ptr_arg(logits), ptr_arg(temp), ptr_arg(tk), ctypes.c_int(VOCAB), ctypes.c_int(7), ptr_arg(buf)]
            ms_all = _graph_ms(lambda args=args: sampler.launch(*args))
            line = f"compact rejection graph B{b} q7 V={VOCAB} top_k={top_k}: {ms_all:.4f} ms"
            if cand:
                ms_pf = _graph_ms(lambda a=pf_args, grid=(chunks, 8, b): prefilter.launch(
                    grid, (256, 1, 1), a, current_stream(torch.cuda.current_device())))
                line += f" (prefilter alone {ms_pf:.4f} ms)"
            ref = sampler(drafts, logits, params, u)
            got = sampler.launch(*args)
            torch.cuda.synchronize()
            assert torch.equal(got[0], ref.accepted) and torch.equal(got[1], ref.tokens)
            print(line)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_fused_prefill_attention_matches_the_reference(cache_dtype: torch.dtype) -> None:
    """The prefill forwards' fused attention (TargetModel._attend_fused: SDPA over the visible keys) vs
    the FP32 reference over the whole cache, at Qwen3.8 shapes (24 query / 4 KV heads, D = 256): a
    1023-token prompt from position 0 and a ragged pair (bases 0 and 37, stale cache entries past
    each request's length), relative L2 <= 2e-3 per request, no NaN; kv_len None (the whole cache)
    gives the same result within the same bound. Timing printed (not a gate)."""
    from dflashgen.runtime.target import TargetModel

    g = torch.Generator(device="cuda").manual_seed(7)
    h, hkv, d, cap = 24, 4, 256, 1600
    for b, t, bases in ((1, 1023, [0]), (2, 300, [0, 37])):
        kc = (torch.randn(b, cap, hkv, d, generator=g, device="cuda") * 2).to(cache_dtype)
        vc = torch.randn(b, cap, hkv, d, generator=g, device="cuda").to(cache_dtype)
        q = torch.randn(b, t, h, d, generator=g, device="cuda")  # FP32, as the target passes it
        base = torch.tensor(bases, device="cuda")
        pos = base[:, None] + torch.arange(t, device="cuda")
        kv_len = int(base.max()) + t
        ref = TargetModel._attend(q, kc, vc, pos)
        fused = TargetModel._attend_fused(q, kc, vc, pos, kv_len)
        whole = TargetModel._attend_fused(q, kc, vc, pos, None)
        assert fused.shape == ref.shape and not fused.isnan().any()
        for r in range(b):
            for got in (fused, whole):
                err = float((got[r].float() - ref[r]).norm() / ref[r].norm())
                assert err <= 2e-3, (b, t, r, err)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        TargetModel._attend(q, kc, vc, pos)
        ev[1].record()
        TargetModel._attend_fused(q, kc, vc, pos, kv_len)
        ev[2].record()
        torch.cuda.synchronize()
        print(f"prefill attention B={b} T={t} {cache_dtype}: reference {ev[0].elapsed_time(ev[1]):.3f} ms, "
              f"fused {ev[1].elapsed_time(ev[2]):.3f} ms")
