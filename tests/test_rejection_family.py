"""The compact rejection-sampling kernel family: rendering, manifest entries, kernel choice, the
kernel's algorithm (full-vocabulary and candidate paths) mirrored in Python against the dense
reference (CPU), and the
sm_70 (NVRTC + ptxas 12.9) and sm_90 (nvcc, when present) compiles without spills. The kernel's
exactness against the dense reference runs on a GPU (tests/test_gpu_decode.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import built_family
from dflashgen.runtime.rejection import pick_entry
from dflashgen.runtime.sampling import SamplingParams, Uniforms, target_probs, verify

from dflashgen import rejection
from dflashgen.render import FAMILY_MODULES, family_kernels, generated_dir, load_manifest

QWEN_VOCAB = 248320


def test_family_renders_specialised_and_generic_kernels() -> None:
    assert FAMILY_MODULES["rejection"] == "dflashgen.rejection"
    ks = family_kernels("rejection")
    names = {k.name for k in ks}
    for arch in (70, 80, 90):
        assert {f"dfg_sm{arch}_rejection_v{QWEN_VOCAB}_d7", f"dfg_sm{arch}_rejection_v{QWEN_VOCAB}_d3",
                f"dfg_sm{arch}_rejection_generic"} <= names
    again = {k.name: k.source for k in family_kernels("rejection")}
    for k in ks:
        assert again[k.name] == k.source  # deterministic
        assert "DO NOT EDIT" in k.source.splitlines()[0] and "#include <dflashgen/rejection.cuh>" in k.source
        assert all(f"{k.name}{s}(" in k.source for s in ("", "_decide", "_prefilter"))
        assert f"CAP == {rejection.CAP} && dflashgen::rejection::CHUNK == {rejection.CHUNK}" in k.source
    spec = next(k for k in ks if k.name == f"dfg_sm90_rejection_v{QWEN_VOCAB}_d7")
    assert f"{QWEN_VOCAB}, 7, cand, desc);" in spec.source  # vocab and drafts are compile-time constants
    assert f"{QWEN_VOCAB}, 7, cand);" in spec.source  # the prefilter
    generic = next(k for k in ks if k.name == "dfg_sm90_rejection_generic")
    assert "vocab, num_drafts, cand, desc);" in generic.source


def test_key_plan() -> None:
    assert rejection.key_plan(QWEN_VOCAB) == (18, 6, 7)  # 32 + 18 = 50 key bits -> 7 digits of 8
    assert rejection.key_plan(256) == (8, 0, 5)
    assert rejection.key_plan(None) == (24, 0, 7)
    with pytest.raises(ValueError, match="2\\^24"):
        rejection.key_plan((1 << 24) + 1)


def test_manifest_lists_the_family_and_files_exist() -> None:
    entries = load_manifest()["families"]["rejection"]
    assert len(entries) == 9
    for e in entries:
        assert (generated_dir() / e["file"]).is_file() and e["family"] == "rejection" and e["threads"] == 512
    by_name = {e["name"]: e for e in entries}
    assert pick_entry(by_name, 90, QWEN_VOCAB, 7)["name"] == f"dfg_sm90_rejection_v{QWEN_VOCAB}_d7"
    assert pick_entry(by_name, 90, QWEN_VOCAB, 5)["name"] == "dfg_sm90_rejection_generic"
    assert pick_entry(by_name, 70, 97, 7)["name"] == "dfg_sm70_rejection_generic"
    with pytest.raises(ValueError, match="above"):
        pick_entry(by_name, 90, (1 << 24) + 1, 7)


@pytest.mark.parametrize("arch", [70, 90])
def test_family_compiles_without_spills(arch: int) -> None:
    for a, entries in built_family(arch, "_rejection_", 3):  # no spills in any of the three kernels
        assert set(entries) == {a.name, a.name + "_decide", a.name + "_prefilter"}
        ptx = a.ptx.read_text()
        assert all(f".entry {a.name}{s}(" in ptx for s in ("", "_decide", "_prefilter"))
        assert a.cubin.stat().st_size > 0


# --------------------------------------------------------------------------- the algorithm, mirrored


def _keys(x: torch.Tensor, id_bits: int, pad: int) -> torch.Tensor:
    """rejection.cuh make_key: (order-preserving float bits, V-1-id) as int64 (<= 56 bits)."""
    v = x.shape[-1]
    bits = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    ordered = torch.where(bits >= 0x80000000, (~bits) & 0xFFFFFFFF, bits | 0x80000000)
    return ((ordered << id_bits) | (v - 1 - torch.arange(v))) << pad


def _radix(keys: torch.Tensor, w: torch.Tensor, lo: int, rank: int, target: float, by_weight: bool,
           digits: int) -> int:
    prefix = mask = above = 0
    for d in reversed(range(digits)):
        shift = 8 * d
        part = (keys >= lo) & ((keys & mask) == prefix)
        bins = (keys[part] >> shift) & 255
        hist = torch.zeros(256, dtype=torch.long).index_add_(0, bins, w[part] if by_weight else torch.ones_like(bins))
        desc = hist.flip(0)  # bins descending
        incl = above + desc.cumsum(0)
        hit = ((incl.double() >= target) if by_weight else (incl > rank)).nonzero()
        pick, above = 0, int(incl[-1])  # no bin reaches: the kernel's default (cannot happen)
        if hit.numel():
            i = int(hit[0, 0])
            pick, above = 255 - i, int(incl[i] - desc[i])
        prefix |= pick << shift
        mask |= 255 << shift
    return prefix


def _accepted(desc: list, drafts, u, b: int, d: int, greedy: bool, override, q) -> int:
    """Accepted drafts of request b from its per-position (cut, z, w_draft, argmax, ...) tuples: the
    kernels' test, in integer weights (``u * z < w`` without draft probs, else ``u * q * z <= w``)."""
    n = 0
    while n < d:
        _, z, wd, argmax = desc[n][:4]
        xi, ua = int(drafts[b, n]), float(u.accept[b, n])
        if greedy:
            ok = xi == argmax
        elif override is not None:
            ok = bool(override[b, n])
        elif q is None:
            ok = ua * z < wd
        else:
            ok = wd > 0 and ua * float(q[b, n, xi]) * z <= wd
        if not ok:
            break
        n += 1
    return n


def _mirror(drafts, logits, params, u, q=None, override=None, vocab_spec: int | None = None):
    """A line-by-line Python port of describe + decide (no sorting, radix selects, integer weights)."""
    b_n, d = drafts.shape
    v = logits.shape[-1]
    id_bits, pad, digits = rejection.key_plan(vocab_spec)
    accepted, tokens = [], []
    for b in range(b_n):
        sp = params[b]
        greedy = sp.temperature == 0
        div = torch.tensor(1.0 if greedy else sp.temperature, dtype=torch.float32)
        desc = []
        for pos in range(d + 1):
            x = logits[b, pos].float() / div
            keys = _keys(x, id_bits, pad)
            kmax = int(keys.max())
            argmax = v - 1 - ((kmax >> pad) & ((1 << id_bits) - 1))
            w = (torch.exp(x - x[argmax]) * 4294967296.0).floor().long()
            cut, z = kmax, 1
            if not greedy:
                cut = 0
                if 0 < sp.top_k < v:
                    cut = _radix(keys, w, 0, sp.top_k - 1, 0.0, False, digits)
                p32 = float(torch.tensor(sp.top_p, dtype=torch.float32))
                if p32 < 1.0:
                    cut = _radix(keys, w, cut, 0, p32 * float(int(w[keys >= cut].sum())), True, digits)
                z = int(w[keys >= cut].sum())
            wd = 0
            if pos < d:
                xi = int(drafts[b, pos])
                if int(keys[xi]) >= cut:
                    wd = 1 if greedy else int(w[xi])
            desc.append((cut, z, wd, argmax, keys, w))
        n = _accepted(desc, drafts, u, b, d, greedy, override, q)
        cut, z, _, argmax, keys, w = desc[n]
        token = argmax
        if not greedy:
            wk = torch.where(keys >= cut, w, 0)
            res = wk
            if n < d:
                res = (wk - (q[b, n].double() * z).floor().long()).clamp_min(0) if q is not None else \
                    wk.scatter(0, drafts[b, n:n + 1], 0)
                if int(res.sum()) == 0:
                    res = wk
            thr = int(float(u.sample[b, n]) * float(int(res.sum())) // 1)
            token = int(torch.searchsorted(res.cumsum(0), torch.tensor([thr]), right=True)[0])
        accepted.append(n)
        tokens.append([int(drafts[b, i]) if i < n else (token if i == n else -1) for i in range(d + 1)])
    return torch.tensor(accepted), torch.tensor(tokens)


@pytest.mark.parametrize("vocab, spec", [(97, None), (1000, 1000), (5003, None)])
@pytest.mark.parametrize("with_q", [False, True])
def test_kernel_algorithm_equals_dense_reference(vocab: int, spec: int | None, with_q: bool) -> None:
    """The kernel's algorithm (mirrored in Python on the CPU) gives the dense path's accepted lengths
    and tokens: fp16-rounded logits (ties), top-k, top-p, greedy rows, draft probabilities, override."""
    g = torch.Generator().manual_seed(vocab + with_q)
    b, d = 6, 7
    logits = (torch.randn(b, d + 1, vocab, generator=g) * 3).half().float()
    params = [SamplingParams(temperature=0.6, top_p=0.95), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.95), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.6, top_k=50, top_p=0.8)]
    p = target_probs(logits, params)
    for trial in range(3):
        drafts = torch.multinomial(p[:, :d].reshape(-1, vocab), 1, generator=g).view(b, d)
        drafts[:, ::3] = p[:, :d:3].argmax(-1)
        q = torch.softmax(logits[:, :d] * 0.5 + torch.randn(b, d, vocab, generator=g), -1) if with_q else None
        u = Uniforms.draw(b, d, g)
        override = (torch.rand(b, d, generator=g) < 0.8) if trial == 2 else None
        ref = verify(drafts, logits, params, u, q, accept_override=override)
        acc, tok = _mirror(drafts, logits, params, u, q, override, spec)
        assert acc.tolist() == ref.accepted.tolist()
        assert tok.tolist() == ref.tokens.tolist()


# --------------------------------------------------------------------------- the candidate path, mirrored


def _select_rank(keys: torch.Tensor, rank: int, digits: int) -> int:
    """rejection.cuh prefilter / select_candidates: the key of descending rank `rank` among `keys`
    (count radix select, 8-bit digits, early exit once the keys >= prefix are exactly rank + 1)."""
    prefix = mask = above = 0
    for d in reversed(range(digits)):
        shift = 8 * d
        part = keys[(keys & mask) == prefix]
        desc = torch.bincount((part >> shift) & 255, minlength=256).flip(0)  # bins descending
        incl = above + desc.cumsum(0)
        i = int((incl > rank).nonzero()[0, 0])
        prefix |= (255 - i) << shift
        mask |= 255 << shift
        above = int(incl[i] - desc[i])
        if int(incl[i]) == rank + 1:
            break
    return prefix


def _low_bound(kc: torch.Tensor, k: int, threads: int = 256) -> int:
    """prefilter's bound for k <= 32: thread t holds ids t, t + threads, ...; per warp the k-th largest
    of the lanes' maxima (0 when the warp has too few non-empty lanes); the largest over the warps."""
    if k > 32:
        return 1
    pad = torch.zeros(-(-kc.numel() // threads) * threads, dtype=kc.dtype)
    pad[:kc.numel()] = kc
    lanes = pad.view(-1, threads).amax(0).view(threads // 32, 32).sort(-1, descending=True).values
    return max(1, int(lanes[:, k - 1].max()))


def _candidates(keys: torch.Tensor, k: int, chunk: int, digits: int) -> torch.Tensor:
    """prefilter: every chunk's k largest keys (all of a chunk with at most k tokens)."""
    out = []
    for c0 in range(0, keys.numel(), chunk):
        kc = keys[c0:c0 + chunk]
        cut = low = 1
        if kc.numel() > k:
            low = _low_bound(kc, k)
            assert int((kc >= low).sum()) >= k  # the bound never loses a top-k key
            cut = _select_rank(kc[kc >= low], k - 1, digits)
        got = kc[(kc >= cut) & (kc >= low)]
        assert got.numel() == min(k, kc.numel())
        out.append(got)
    return torch.cat(out)


def _mirror_candidates(drafts, logits, params, u, q=None, override=None, vocab_spec: int | None = None,
                       chunk: int = rejection.CHUNK):
    """describe + decide of the candidate path (rows with 0 < top_k <= CAP or greedy); other rows as
    ``_mirror`` (the full path). Returns accepted, tokens and how many rows took the candidate path."""
    b_n, d = drafts.shape
    v = logits.shape[-1]
    id_bits, pad, digits = rejection.key_plan(vocab_spec)
    accepted, tokens, n_cand = [], [], 0
    for b in range(b_n):
        sp = params[b]
        if not rejection.uses_candidates(sp.temperature, sp.top_k):
            acc, tok = _mirror(drafts[b:b + 1], logits[b:b + 1], [sp],
                               type(u)(u.accept[b:b + 1], u.sample[b:b + 1]),
                               None if q is None else q[b:b + 1], None if override is None else override[b:b + 1],
                               vocab_spec)
            accepted.append(int(acc[0]))
            tokens.append(tok[0].tolist())
            continue
        n_cand += 1
        greedy = sp.temperature == 0
        kk = 1 if greedy else sp.top_k
        div = torch.tensor(1.0 if greedy else sp.temperature, dtype=torch.float32)
        desc = []
        for pos in range(d + 1):
            x = logits[b, pos].float() / div
            keys = _keys(x, id_bits, pad)
            cand = _candidates(keys, kk, chunk, digits)
            top = keys.sort(descending=True).values[:kk]
            assert bool(torch.isin(top, cand).all())  # the superset property
            kmax = int(cand.max())
            argmax = v - 1 - ((kmax >> pad) & ((1 << id_bits) - 1))
            vmax = x[argmax]
            cut, z = kmax, 1
            if not greedy:
                cut = _select_rank(cand, kk - 1, digits) if kk < v else 1
                kept = cand[cand >= cut].sort(descending=True).values
                cut = int(kept[-1])  # the exact k-th key (tokens outside the candidates may pass the prefix)
                ids = v - 1 - ((kept >> pad) & ((1 << id_bits) - 1))
                w = (torch.exp(x[ids] - vmax) * 4294967296.0).floor().long()
                incl = w.cumsum(0)
                z = int(incl[-1])
                p32 = float(torch.tensor(sp.top_p, dtype=torch.float32))
                if p32 < 1.0:
                    i = int((incl.double() >= p32 * float(z)).nonzero()[0, 0])
                    cut, z = int(kept[i]), int(incl[i])
            wd = 0
            if pos < d:
                xi = int(drafts[b, pos])
                if int(keys[xi]) >= cut:
                    wd = 1 if greedy else int((torch.exp(x[xi] - vmax) * 4294967296.0).floor())
            desc.append((cut, z, wd, argmax, x, vmax, cand))
        n = _accepted(desc, drafts, u, b, d, greedy, override, q)
        cut, z, _, argmax, x, vmax, cand = desc[n]
        token = argmax
        if not greedy:
            kept = cand[cand >= cut]
            ids = (v - 1 - ((kept >> pad) & ((1 << id_bits) - 1))).sort().values  # ids ascending
            wp = (torch.exp(x[ids] - vmax) * 4294967296.0).floor().long()
            w = wp
            if n < d:
                w = (wp - (q[b, n, ids].double() * z).floor().long()).clamp_min(0) if q is not None else \
                    torch.where(ids == drafts[b, n], 0, wp)
                if int(w.sum()) == 0:
                    w = wp
            thr = int(float(u.sample[b, n]) * float(int(w.sum())) // 1)
            token = int(ids[int(torch.searchsorted(w.cumsum(0), torch.tensor([thr]), right=True)[0])])
        accepted.append(n)
        tokens.append([int(drafts[b, i]) if i < n else (token if i == n else -1) for i in range(d + 1)])
    return torch.tensor(accepted), torch.tensor(tokens), n_cand


def test_uses_candidates() -> None:
    cap = rejection.CAP
    assert rejection.uses_candidates(0.0, 0) and rejection.uses_candidates(0.0, cap + 5)  # greedy
    assert rejection.uses_candidates(1.0, 1) and rejection.uses_candidates(0.6, cap)
    assert not rejection.uses_candidates(1.0, 0) and not rejection.uses_candidates(1.0, cap + 1)
    assert rejection.uses_candidates(1e-50, 20) and rejection.uses_candidates(1e-50, 0)  # float32 0: greedy
    assert not rejection.uses_candidates(1e300, 0)
    assert rejection.num_chunks(248320) == 61 and rejection.num_chunks(97) == 1 and rejection.num_chunks(4096) == 1


@pytest.mark.parametrize("vocab, spec, chunk", [(97, None, rejection.CHUNK), (1000, 1000, 64), (5003, None, 700),
                                                (9000, None, rejection.CHUNK)])
@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_candidate_algorithm_equals_dense_reference(vocab: int, spec: int | None, chunk: int, with_q: bool,
                                                    ties: bool) -> None:
    """The candidate path (prefilter chunks' top-k, describe and decide on the candidates), mirrored
    on the CPU, gives the dense path's accepted lengths and tokens: top_k around CAP (CAP on the
    candidate path, CAP + 1 and 0 on the full path), greedy rows, top_k >= vocab, heavy logit ties
    (radix digits down to the ids), chunks shorter than k, with and without draft probabilities."""
    cap = rejection.CAP
    g = torch.Generator().manual_seed(vocab + 7 * with_q + 3 * ties + chunk)
    b, d = 8, 7
    if ties:  # a few distinct values: long runs of equal keys up to the id digits
        logits = torch.randint(0, 6, (b, d + 1, vocab), generator=g).float() * 0.75
    else:
        logits = (torch.randn(b, d + 1, vocab, generator=g) * 3).half().float()
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.95), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.6, top_k=cap, top_p=0.95), SamplingParams(temperature=1.0, top_k=cap + 1),
              SamplingParams(temperature=1.0, top_k=0, top_p=0.9), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.6, top_k=min(cap, vocab + 3)),  # >= vocab for the tiny vocab
              SamplingParams(temperature=1.0, top_k=cap, top_p=1.0)]
    p = target_probs(logits, params)
    for trial in range(2):
        drafts = torch.multinomial(p[:, :d].reshape(-1, vocab), 1, generator=g).view(b, d)
        drafts[:, ::3] = p[:, :d:3].argmax(-1)
        q = torch.softmax(logits[:, :d] * 0.5 + torch.randn(b, d, vocab, generator=g), -1) if with_q else None
        u = Uniforms.draw(b, d, g)
        override = (torch.rand(b, d, generator=g) < 0.8) if trial == 1 else None
        ref = verify(drafts, logits, params, u, q, accept_override=override)
        acc, tok, n_cand = _mirror_candidates(drafts, logits, params, u, q, override, spec, chunk)
        assert n_cand == 6  # all but top_k = CAP + 1 and top_k = 0
        assert acc.tolist() == ref.accepted.tolist()
        assert tok.tolist() == ref.tokens.tolist()


def _adversarial(vocab: int, k: int, chunk: int, d: int, b: int, g: torch.Generator):
    """Logits whose top-k sits in one chunk, followed there by equal-logit tokens at higher ids (keys
    that differ from the k-th only in the id digits) and near misses; drafts are exactly the tokens
    just outside the kept set, the k-th and the top-p boundary."""
    logits = torch.randn(b, d + 1, vocab, generator=g) - 8.0
    base = chunk + 5 if vocab > 2 * chunk else 0
    top = torch.arange(k + 4) + base
    vals = torch.linspace(4.0, 3.0, k).tolist() + [3.0, 3.0, 2.9990234375, 3.0]  # k-th value repeated
    logits[..., top] = torch.tensor(vals)
    drafts = top[torch.randint(k - 2, k + 4, (b, d), generator=g)]
    return logits, drafts


@pytest.mark.parametrize("k, chunk", [(3, 64), (20, 700), (rejection.CAP, rejection.CHUNK)])
def test_candidate_cut_is_exact_for_tokens_outside_the_candidates(k: int, chunk: int) -> None:
    """A token outside the candidates whose key lies between describe's early-exit radix prefix and
    the k-th key must not count as kept (w_draft compares every token with the cut)."""
    g = torch.Generator().manual_seed(k)
    vocab, b, d = max(3 * chunk, 1000), 3, 7
    logits, drafts = _adversarial(vocab, k, chunk, d, b, g)
    params = [SamplingParams(temperature=1.0, top_k=k), SamplingParams(temperature=1.0, top_k=k, top_p=0.9),
              SamplingParams(temperature=0.6, top_k=k, top_p=0.5)]
    for trial in range(4):
        u = Uniforms(torch.rand(b, d, generator=g) * (0.05 if trial < 2 else 1.0), torch.rand(b, d + 1, generator=g))
        ref = verify(drafts, logits, params, u)
        acc, tok, n_cand = _mirror_candidates(drafts, logits, params, u, None, None, vocab, chunk)
        assert n_cand == b
        assert acc.tolist() == ref.accepted.tolist() and tok.tolist() == ref.tokens.tolist()
