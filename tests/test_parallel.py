"""Tensor parallelism: TP2 shards gathered / all-reduced match TP1, bitwise-reproducibly (gloo on CPU;
the ``gpu`` test does the same over NCCL on two GPUs). Run as a script, this file is one TP rank."""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import launch_ranks
from dflashgen.runtime.checkpoint import layer_projections, load_model_projections
from dflashgen.runtime.parallel import ColumnParallel, RowParallel, TPContext, init_tp, wrap_projections
from dflashgen.runtime.synthetic import write_synthetic_checkpoint

from dflashgen.deployment import load_deployment
from dflashgen.model import derive_projections, parse_model_config
from dflashgen.weights import rel_l2

# Tiny hybrid, two layers so both attention kinds are sharded (layers=1 would keep only one).
# One KV head: TP2 replicates it, which exercises the gather's de-duplication.
RAW = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "layer_types": ["full_attention", "linear_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "attn_output_gate": True,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "vocab_size": 256,
}
CFG = parse_model_config(RAW)
DEP = "mixed"  # channel-FP8 attention/GDN, NVFP4 MLP (fused SiLU), FP16 lm_head: all three module kinds
TP, M, TOL = 2, 6, 1e-3
# Half of Qwen3.8-27B's heads and MLP width: its TP2 rank shapes are the full model's TP4 rank
# shapes, so each rank runs the committed, tuned generated kernels (GPU test below).
HALF = parse_model_config({**RAW, "hidden_size": 5120, "intermediate_size": 8704, "num_attention_heads": 12,
                           "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 8,
                           "linear_num_value_heads": 24, "linear_key_head_dim": 128,
                           "linear_value_head_dim": 128})
CONFIGS = {"tiny": (CFG, DEP, TOL), "half": (HALF, "nvfp4", 2e-3)}  # kernels vs FP32: FP16-output tolerance
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _inputs(cfg=CFG) -> dict[str, torch.Tensor]:
    """The same FP16 activation per projection in every process: [M, K of the unsharded layer]."""
    k1 = {p.name: p.k for p in derive_projections(cfg, 1)}
    out = {}
    for key, _, name in layer_projections(cfg):
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        out[key] = torch.randn((M, k1[name]), generator=g).to(torch.float16)
    return out


def _forward(mods: dict[str, torch.nn.Module], ctx: TPContext, cfg=CFG) -> dict[str, torch.Tensor]:
    out = {}
    for key, x in _inputs(cfg).items():
        m = mods[key]
        if isinstance(m, RowParallel):  # a row-parallel layer sees its rank's K slice
            k = m.module.in_features
            x = x[:, ctx.rank * k:(ctx.rank + 1) * k]
        out[key] = m(x.to(ctx.device)).cpu()
    return out


def _worker(ckpt: str, out: str, backend: str, which: str = "tiny") -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    cfg, dep, _ = CONFIGS[which]
    ctx = init_tp(backend)
    try:
        lib = None
        if which == "half":  # the generated kernels through the committed tuning table
            from dflashgen.runtime.library import KernelLibrary

            lib = KernelLibrary(device=ctx.device)
        mods = load_model_projections(ckpt, cfg, load_deployment(dep), ctx.world_size, ctx.rank, library=lib)
        mods = {k: m.to(ctx.device) for k, m in mods.items()}
        wrapped = wrap_projections(mods, cfg, ctx, gather=True)
        runs = [_forward(wrapped, ctx, cfg) for _ in range(2)]
        paths = {} if lib is None else {f"{k}|{m}|{p}": c for (k, m, p), c in lib.path_counts.items()}
        torch.save({"runs": runs, "nvls": os.environ.get("NCCL_NVLS_ENABLE"), "paths": paths}, out)
    finally:
        ctx.close()


# --------------------------------------------------------------------------- multi-process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tp-ckpt")
    write_synthetic_checkpoint(d, CFG, load_deployment(DEP), "modelopt", seed=3, layers=2)
    return d


@pytest.fixture(scope="module")
def tp1(ckpt: Path) -> dict[str, torch.nn.Module]:
    return load_model_projections(ckpt, CFG, load_deployment(DEP))


def _launch(ckpt: Path, out: Path, backend: str, which: str = "tiny", timeout: float = 180) -> list[dict]:
    """Run TP ranks of this file as subprocesses with torchrun's variables; each rank's result."""
    out.mkdir()
    launch_ranks([__file__, str(ckpt), "{result}", backend, which], out, TP, timeout,
                 drop_env=(*ENV_KEYS, "NCCL_NVLS_ENABLE"))
    return [torch.load(out / f"rank{r}.pt") for r in range(TP)]


def _check_tp(ckpt: Path, tp1: dict[str, torch.nn.Module], tmp: Path, backend: str,
              which: str = "tiny") -> list[list[dict]]:
    cfg, _, tol = CONFIGS[which]
    ref = {k: tp1[k](x) for k, x in _inputs(cfg).items()}
    launches = [_launch(ckpt, tmp / f"launch{i}", backend, which) for i in range(2)]
    first = launches[0][0]["runs"][0]
    assert set(first) == set(ref)
    for key, want in ref.items():
        got = first[key]
        assert got.shape == want.shape and got.dtype == torch.float16, key
        assert rel_l2(got, want) < tol, (key, rel_l2(got, want))
    for li, ranks in enumerate(launches):
        for r, res in enumerate(ranks):
            assert res["nvls"] == "0"  # init_tp turned NVLink multicast off
            for ri, run in enumerate(res["runs"]):
                for key, y in run.items():
                    # Bitwise: same across calls, launches and ranks (all outputs are gathered / reduced).
                    assert torch.equal(y, first[key]), f"{key}: launch {li} rank {r} call {ri} differs"
    return launches


def test_tp2_gloo_matches_tp1_bitwise_reproducible(ckpt: Path, tp1: dict[str, torch.nn.Module],
                                                   tmp_path: Path) -> None:
    _check_tp(ckpt, tp1, tmp_path, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")
def test_tp2_nccl_matches_tp1_bitwise_reproducible(ckpt: Path, tp1: dict[str, torch.nn.Module],
                                                   tmp_path: Path) -> None:
    _check_tp(ckpt, tp1, tmp_path, "nccl")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")
def test_tp2_nccl_generated_kernels_match_tp1(tmp_path: Path) -> None:
    """Each rank dispatches its shards (the full model's TP4 shapes) to the tuned generated kernels."""
    ckpt = tmp_path / "half"
    write_synthetic_checkpoint(ckpt, HALF, load_deployment("nvfp4"), "compressed-tensors", seed=5, layers=2)
    tp1 = load_model_projections(ckpt, HALF, load_deployment("nvfp4"))  # FP32 reference path on the CPU
    launches = _check_tp(ckpt, tp1, tmp_path, "nccl", "half")
    for r, res in enumerate(launches[0]):
        kernel_calls = sum(c for k, c in res["paths"].items() if k.endswith("|kernel"))
        assert kernel_calls > 0, f"rank {r} never used a generated kernel: {res['paths']}"


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("env,match", [
    ({"WORLD_SIZE": "3"}, "WORLD_SIZE=3 is not a supported TP degree"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"WORLD_SIZE": "two"}, "not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is outside 0..1"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
])
def test_init_tp_rejects_bad_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str) -> None:
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        init_tp("gloo")
    assert not dist.is_initialized()


def test_init_tp_backend_and_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="backend must be one of"):
        init_tp("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            init_tp("nccl")
    ctx = init_tp("gloo")  # no torchrun variables: TP1, no process group
    assert (ctx.rank, ctx.world_size, ctx.group, ctx.device) == (0, 1, None, torch.device("cpu"))
    assert not dist.is_initialized()


def test_wrapper_argument_errors(tp1: dict[str, torch.nn.Module]) -> None:
    gate_up = tp1["layers.0.gate_up_proj"]
    with pytest.raises(ValueError, match="SiLU projection cannot be row-parallel"):
        RowParallel(gate_up)
    with pytest.raises(TypeError, match="QuantLinear or nn.Linear"):
        ColumnParallel(torch.nn.ReLU())
    lin = torch.nn.Linear(32, 24, bias=False)
    with pytest.raises(ValueError, match="add up to out_features=24"):
        ColumnParallel(lin, segments=[8, 8])
    with pytest.raises(ValueError, match="one count >= 1 per segment"):
        ColumnParallel(lin, segments=[16, 8], replicas=[1])


def test_wrap_projections_checks_shards(tp1: dict[str, torch.nn.Module]) -> None:
    tp2 = TPContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"layers\.0\.qkv_proj: shard is 384x128.*column-parallel qkv_proj at TP2 "
                                         r"are 256x128"):
        wrap_projections(tp1, CFG, tp2)  # TP1 shards are not TP2 rank shards
    with pytest.raises(ValueError, match="row-parallel o_proj at TP2"):
        wrap_projections({"layers.0.o_proj": tp1["layers.0.o_proj"]}, CFG, tp2)
    with pytest.raises(KeyError, match="not a projection of this model"):
        wrap_projections({"layers.1.qkv_proj": tp1["layers.0.qkv_proj"]}, CFG, tp2)  # layer 1 is GDN

    # TP1: the right wrapper per style, and no communication (outputs equal the bare modules').
    ctx = TPContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    wrapped = wrap_projections(tp1, CFG, ctx, gather=True)
    assert isinstance(wrapped["layers.0.qkv_proj"], ColumnParallel)
    assert isinstance(wrapped["layers.1.out_proj"], RowParallel)
    assert isinstance(wrapped["lm_head"], ColumnParallel) and wrapped["lm_head"].gather
    for key, x in _inputs().items():
        assert torch.equal(wrapped[key](x), tp1[key](x)), key


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
