"""The compact rejection-sampling kernel family: rendering, manifest entries, kernel choice, the
kernel's algorithm mirrored in Python against the dense reference (CPU), and the
sm_70 (NVRTC + ptxas 12.9) and sm_90 (nvcc, when present) compiles without spills. The kernel's
exactness against the dense reference runs on a GPU (tests/test_gpu_decode.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from dflashgen.runtime.rejection import pick_entry
from dflashgen.runtime.sampling import SamplingParams, Uniforms, target_probs, verify

from dflashgen import rejection
from dflashgen.build import build
from dflashgen.render import FAMILY_MODULES, family_kernels, generated_dir, load_manifest
from dflashgen.toolchain import parse_ptxas_log

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
        assert f"{k.name}(" in k.source and f"{k.name}_decide(" in k.source
    spec = next(k for k in ks if k.name == f"dfg_sm90_rejection_v{QWEN_VOCAB}_d7")
    assert f"{QWEN_VOCAB}, 7, desc);" in spec.source  # vocab and drafts are compile-time constants
    generic = next(k for k in ks if k.name == "dfg_sm90_rejection_generic")
    assert "vocab, num_drafts, desc);" in generic.source


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
    if arch != 70 and shutil.which("nvcc") is None:
        pytest.skip("no nvcc for sm_90 (NVRTC 12.9 builds sm_70 only here)")
    res = build([arch], only="_rejection_", progress=False)
    assert len(res.resources()) == 3
    for a in res.artifacts.values():
        entries = parse_ptxas_log(a.log.read_text())  # both kernels of the pair, not just the main one
        assert set(entries) == {a.name, a.name + "_decide"}
        assert not [n for n, r in entries.items() if r["spill_stores"] or r["spill_loads"]], entries
        ptx = a.ptx.read_text()
        assert f".entry {a.name}(" in ptx and f".entry {a.name}_decide(" in ptx
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
        pick = 0
        for b in range(255, -1, -1):
            h = int(hist[b])
            if (float(above + h) >= target) if by_weight else (above + h > rank):
                pick = b
                break
            above += h
        prefix |= pick << shift
        mask |= 255 << shift
    return prefix


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
        n = 0
        while n < d:
            cut, z, wd, argmax, _, _ = desc[n]
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
