"""Tensor-parallel target + speculative decoding over torch.distributed (gloo on CPU, two ranks).

TP2 :class:`TargetModel` logits == TP1 (FP32 projection inputs: ``act_dtype=float32``, the CPU
fallback dequantizes exactly, so only FP32 summation order differs: rel L2 < 1e-5), for KV heads split
across ranks and replicated (KV heads < TP). TP2 greedy speculative decoding in lockstep == TP1
``plain_greedy`` (n-gram and replay drafters, different prompt lengths, an early EOS, different
max tokens), identical on both ranks and across two calls. Run as a script, this file is one TP rank;
the ranks are subprocesses with a deadline (a desynchronised collective would hang, not fail).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import launch_ranks
from dflashgen.runtime.parallel import init_tp
from dflashgen.runtime.sampling import SamplingParams
from dflashgen.runtime.spec_decode import NgramDrafter, ReplayDrafter, SpecDecoder, plain_greedy
from dflashgen.runtime.synthetic import write_synthetic_checkpoint
from dflashgen.runtime.target import TargetModel

from dflashgen.deployment import load_deployment
from dflashgen.model import parse_model_config
from dflashgen.weights import rel_l2

# The tiny 4-layer hybrid of tests/test_target.py with a vocab divisible by the TP degree.
BASE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attn_output_gate": True,
    "partial_rotary_factor": 0.25, "rope_theta": 1e7, "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 96,
}
CFGS = {"kv2": parse_model_config(BASE),  # TP2: one KV head per rank
        "kv1": parse_model_config({**BASE, "num_key_value_heads": 1})}  # TP2: the KV head replicated
DEP = "mixed"  # channel-FP8 attention / GDN, NVFP4 MLP (fused SiLU), FP16 lm_head
TP, TOL, SEED, MAX_LEN, TIMEOUT = 2, 1e-5, 5, 40, 50.0
GREEDY = SamplingParams(temperature=0.0)
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PROMPTS = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1, 6, 13)]
MAX_NEW = [11, 7, 12]


def _model(ckpt: str | Path, cfg_name: str, ctx: object = None) -> TargetModel:
    return TargetModel.from_checkpoint(ckpt, CFGS[cfg_name], load_deployment(DEP), seed=SEED,
                                       act_dtype=torch.float32, ctx=ctx)  # type: ignore[arg-type]


@torch.no_grad()
def _logits(model: TargetModel) -> list[torch.Tensor]:
    """Logits of a padded 2-request prefill, a checkpointed verify chunk rolled back, one decode step."""
    g = torch.Generator().manual_seed(11)
    st = model.new_state(2, 32)
    out = [model(torch.randint(0, 96, (2, 9), generator=g), st, num_new=torch.tensor([9, 5]))]
    st.checkpoint(4)
    out.append(model(torch.randint(0, 96, (2, 4), generator=g), st))
    st.rollback(st.lengths - torch.tensor([1, 3]))
    out.append(model(torch.randint(0, 96, (2, 1), generator=g), st))
    return out


class _SkewedDrafter(NgramDrafter):
    """Proposes different drafts on every rank but the first (as a drafter fed per-rank hidden states
    could): lockstep must still hold, because every rank verifies the first rank's drafts."""

    def __init__(self, rank: int) -> None:
        super().__init__(n=2, num_draft=4)
        self.rank = rank

    def propose(self, contexts):  # type: ignore[no-untyped-def]
        return (super().propose(contexts) + 17 * self.rank) % 96


def _worker(ckpts: str, job: str, out: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    ctx = init_tp("gloo")
    try:
        paths, spec = json.loads(ckpts), json.loads(Path(job).read_text())
        res: dict[str, object] = {"logits": {n: _logits(_model(paths[n], n, ctx)) for n in CFGS}}
        model = _model(paths["kv2"], "kv2", ctx)
        for name, drafter in (("ngram", NgramDrafter(n=2, num_draft=4)),
                              ("replay", ReplayDrafter(spec["oracle"], 0.6, num_draft=4, seed=3)),
                              ("skewed", _SkewedDrafter(ctx.rank))):
            dec = SpecDecoder(model, drafter, max_batch=2, max_len=MAX_LEN, num_draft=4)
            res[name] = [dec.generate(PROMPTS, GREEDY, MAX_NEW, eos=spec["eos"]) for _ in range(2)]
            res[name + "_lengths"] = dec.state.lengths.tolist()
        torch.save(res, out)
    finally:
        ctx.close()


# --------------------------------------------------------------------------- parent side


@pytest.fixture(scope="module", autouse=True)
def _one_thread():  # type: ignore[no-untyped-def]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, cfg in CFGS.items():
        d = tmp_path_factory.mktemp(f"tp-decode-{name}")
        write_synthetic_checkpoint(d, cfg, load_deployment(DEP), "modelopt", seed=3)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def oracle(ckpts: dict[str, Path]) -> list[list[int]]:
    """TP1 plain greedy, long enough for every request's max tokens."""
    model = _model(ckpts["kv2"], "kv2")
    return [plain_greedy(model, p, max(MAX_NEW)) for p in PROMPTS]


@pytest.fixture(scope="module")
def eos(oracle: list[list[int]]) -> int:
    # Request 1 stops at its 4th token (EOS) instead of its max of 7, unless EOS came earlier.
    return oracle[1][3]


def _expected(oracle: list[list[int]], eos: int) -> list[list[int]]:
    out = []
    for o, m in zip(oracle, MAX_NEW, strict=True):
        o = o[:m]
        out.append(o[:o.index(eos) + 1] if eos in o else o)
    return out


@pytest.fixture(scope="module")
def ranks(ckpts: dict[str, Path], oracle: list[list[int]], eos: int,
          tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both ranks' results of one TP2 launch (killed past TIMEOUT: a hang fails, it does not block)."""
    out = tmp_path_factory.mktemp("tp-decode-run")
    job = out / "job.json"
    job.write_text(json.dumps({"oracle": oracle, "eos": eos}))
    paths = json.dumps({n: str(p) for n, p in ckpts.items()})
    launch_ranks([__file__, paths, str(job), "{result}"], out, TP, TIMEOUT, drop_env=ENV_KEYS)
    return [torch.load(out / f"rank{r}.pt") for r in range(TP)]


@pytest.mark.parametrize("cfg_name", list(CFGS))
def test_tp2_logits_match_tp1(ckpts: dict[str, Path], ranks: list[dict], cfg_name: str) -> None:
    want = _logits(_model(ckpts[cfg_name], cfg_name))
    for r, res in enumerate(ranks):
        got = res["logits"][cfg_name]
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape and g.dtype == torch.float32
            assert rel_l2(g, w) < TOL, (cfg_name, r, step, rel_l2(g, w))
            assert torch.equal(g, ranks[0]["logits"][cfg_name][step]), "gathered logits differ between ranks"


@pytest.mark.parametrize("drafter", ["ngram", "replay", "skewed"])
def test_tp2_spec_decode_equals_tp1_greedy(ranks: list[dict], oracle: list[list[int]], eos: int,
                                           drafter: str) -> None:
    want = _expected(oracle, eos)
    assert len(want[1]) < MAX_NEW[1]  # the EOS cut is exercised
    assert len({len(w) for w in want}) == 3  # three different output lengths
    for res in ranks:
        first, second = res[drafter]
        assert first == want
        assert second == first  # a second generate call on the same decoder: identical
        assert res[drafter + "_lengths"] == [0, 0]  # every slot freed, in lockstep
    assert ranks[1][drafter] == ranks[0][drafter]


def test_tp_requires_a_context(ckpts: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="needs a TPContext"):
        TargetModel.from_checkpoint(ckpts["kv2"], CFGS["kv2"], load_deployment(DEP), tp=2, rank=0)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
