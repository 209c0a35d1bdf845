"""Synthetic checkpoints, projection loading, tensor-parallel sharding and checkpoint errors (CPU)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dflashgen.runtime.checkpoint import (
    CHECKPOINT_NAMES,
    CheckpointReader,
    ProjectionShard,
    layer_projections,
    load_model_projections,
    load_projection,
    plan_shards,
)
from dflashgen.runtime.linear import QuantLinear
from dflashgen.runtime.synthetic import (
    add_synth_parser,
    main_synth,
    synthetic_tensor_specs,
    synthetic_weight,
    write_synthetic_checkpoint,
)

from dflashgen.checkpoint_io import (
    CheckpointError,
    MissingTensorError,
    load_safetensors_dir,
    save_safetensors_sharded,
)
from dflashgen.deployment import load_deployment
from dflashgen.model import load_model_config, parse_model_config
from dflashgen.quant import quantize_fp8_channel, quantize_nvfp4, to_compressed_tensors_nvfp4
from dflashgen.weights import NVFP4Weight, rel_l2

# 2-layer hybrid: GDN layer then gated full attention; 2 KV heads so TP4 replicates them.
RAW = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "attn_output_gate": True,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "vocab_size": 512,
}
CFG = parse_model_config(RAW)
SEED = 7
LAYOUTS = ("modelopt", "compressed-tensors")
CASES = [("modelopt", "nvfp4"), ("compressed-tensors", "nvfp4"), ("compressed-tensors", "mixed"),
         ("modelopt", "fp8")]
QKV = [f"model.layers.1.self_attn.{s}_proj" for s in "qkv"]
DOWN = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    made: dict[tuple[str, str], Path] = {}

    def get(layout: str, dep: str) -> Path:
        if (layout, dep) not in made:
            out = tmp_path_factory.mktemp(f"{layout}-{dep}")
            # small shards so projections span several files
            write_synthetic_checkpoint(out, CFG, load_deployment(dep), layout, SEED,  # type: ignore[arg-type]
                                       max_shard_bytes=150_000)
            made[(layout, dep)] = out
        return made[(layout, dep)]

    return get


def _expected(prefix: str, n: int, k: int, fmt: str) -> torch.Tensor:
    w = synthetic_weight(prefix, n, k, SEED)
    if fmt == "nvfp4":
        return quantize_nvfp4(w).dequantize()
    if fmt == "fp8_channel":
        return quantize_fp8_channel(w).dequantize()
    return w.float()


def _weight(m: torch.nn.Module) -> torch.Tensor:
    return m.dequantize() if isinstance(m, QuantLinear) else m.weight.float()


def _run(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x) if isinstance(m, QuantLinear) else F.linear(x, m.weight.float())


def _copy_with(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = load_safetensors_dir(src)
    edit(tensors)
    save_safetensors_sharded(tensors, dst, max_shard_bytes=150_000)
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("layout,dep", CASES)
def test_synthetic_round_trip(ckpt: Callable[[str, str], Path], layout: str, dep: str) -> None:
    d = ckpt(layout, dep)
    deployment = load_deployment(dep)
    config = json.loads((d / "config.json").read_text())
    assert parse_model_config(config) == CFG
    if layout == "modelopt":
        q = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
        assert q["quant_algo"] == {"nvfp4": "NVFP4", "fp8": "FP8_PER_CHANNEL_PER_TOKEN"}.get(dep, "MIXED_PRECISION")
        assert q["exclude_modules"] == ["lm_head"]
    else:
        q = config["quantization_config"]
        assert q["quant_method"] == "compressed-tensors" and q["ignore"] == ["lm_head"]
        formats = {g["format"] for g in q["config_groups"].values()}
        assert formats == ({"nvfp4-pack-quantized"} if dep == "nvfp4"
                           else {"nvfp4-pack-quantized", "float-quantized"})
    assert len(list(d.glob("model-*.safetensors"))) > 3

    mods = load_model_projections(d, CFG, deployment)
    assert list(mods) == [key for key, _, _ in layer_projections(CFG)]
    for plan in plan_shards(CFG):
        fmt = deployment.format_for(plan.projection).value
        m = mods[plan.key]
        assert isinstance(m, QuantLinear) == (fmt != "fp16")
        want = torch.cat([_expected(mx.prefix, mx.n, plan.k, fmt) for mx in plan.matrices])
        assert torch.equal(_weight(m), want), plan.key  # bit-exact: same codes and scales
        if isinstance(m, QuantLinear):
            assert m.silu == (plan.projection.name == "gate_up_proj")
        if fmt == "nvfp4":
            assert m.segments == tuple(mx.n for mx in plan.matrices)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_projection_keeps_a_global_scale_per_segment(ckpt: Callable[[str, str], Path], layout: str) -> None:
    d = ckpt(layout, "nvfp4")
    shapes = [(512, 256), (128, 256), (128, 256)]  # q+gate (4 heads x 64 x 2), k, v
    w = load_projection(d, QKV, shapes=shapes)
    assert isinstance(w, NVFP4Weight) and w.segments == (512, 128, 128)
    parts = [quantize_nvfp4(synthetic_weight(p, n, k, SEED)) for p, (n, k) in zip(QKV, shapes, strict=True)]
    assert torch.equal(w.global_scale, torch.cat([p.global_scale for p in parts]))
    assert len(set(w.global_scale.tolist())) == 3  # not collapsed with max()
    mods = load_model_projections(d, CFG, load_deployment("nvfp4"))
    qkv = mods["layers.1.qkv_proj"]
    assert torch.equal(qkv.col_scale, w.column_scale() * qkv.layout.decode_scale)  # type: ignore[union-attr]
    # in_proj_qkvz / in_proj_ba are single checkpoint matrices: one global scale each.
    z = load_projection(d, ["model.layers.0.linear_attn.in_proj_qkvz"])
    assert isinstance(z, NVFP4Weight) and z.segments == (768,) and z.global_scale.numel() == 1


def test_load_projection_sources_and_partial_reads(ckpt: Callable[[str, str], Path]) -> None:
    d = ckpt("modelopt", "nvfp4")
    full = load_projection(d, [DOWN])
    with CheckpointReader(d) as reader:
        half = load_projection(reader, [DOWN], cols=(0, 256))
        # a row-parallel rank reads its half of codes and block scales (+ the fp32 global scale)
        assert reader.bytes_read == (256 * 512 // 2 + 256 * 512 // 16) // 2 + 4
    assert isinstance(half, NVFP4Weight) and isinstance(full, NVFP4Weight)
    assert torch.equal(half.dequantize(), full.dequantize()[:, :256])
    mem = load_safetensors_dir(d, [f"{DOWN}.{s}" for s in ("weight", "weight_scale", "weight_scale_2")])
    rows = load_projection(mem, [DOWN], rows=[[(0, 8), (100, 110)]])
    assert torch.equal(rows.dequantize(), full.dequantize()[list(range(8)) + list(range(100, 110))])  # type: ignore[union-attr]
    with pytest.raises(CheckpointError, match="multiples of 16"):
        load_projection(d, [DOWN], cols=(0, 40))
    with pytest.raises(CheckpointError, match="expected layout ct_nvfp4"):
        load_projection(d, [DOWN], layout="ct_nvfp4")


# --------------------------------------------------------------------------- tensor parallel


def _assemble(parts: list[torch.Tensor], plans: list[ProjectionShard], dim: int) -> torch.Tensor:
    """The TP1 layout from column-parallel rank parts: per segment, the ranks' slices in row order,
    one per distinct slice (ranks holding a replicated KV head read the same rows)."""
    segs = plans[0].projection.segments
    out = []
    for s, seg in enumerate(segs):
        off = sum(x.n for x in segs[:s])
        taken: dict[tuple[int, int], torch.Tensor] = {}
        for part, plan in zip(parts, plans, strict=True):
            rows = [r for m in plan.matrices for r in m.rows][s]  # the checkpoint rows behind segment s
            taken.setdefault(rows, part.narrow(dim, off, seg.n))
        out += [taken[r] for r in sorted(taken)]
    return torch.cat(out, dim)


@pytest.mark.parametrize("layout,dep,tp", [
    ("modelopt", "nvfp4", 2), ("modelopt", "nvfp4", 4), ("compressed-tensors", "nvfp4", 4),
    ("compressed-tensors", "mixed", 2), ("modelopt", "fp8", 4)])
def test_tp_shards_reassemble_tp1(ckpt: Callable[[str, str], Path], layout: str, dep: str, tp: int) -> None:
    d = ckpt(layout, dep)
    deployment = load_deployment(dep)
    one = load_model_projections(d, CFG, deployment)
    ranks = [load_model_projections(d, CFG, deployment, tp=tp, rank=r) for r in range(tp)]
    plans = [{p.key: p for p in plan_shards(CFG, tp, r)} for r in range(tp)]
    g = torch.Generator().manual_seed(0)
    for key, m1 in one.items():
        pr = [plans[r][key] for r in range(tp)]
        style = pr[0].projection.parallel
        w1 = _weight(m1)
        ws = [_weight(ranks[r][key]) for r in range(tp)]
        x = torch.randn(8, pr[0].k, generator=g).half().float()  # fp32 input: fp32 tolerance checks
        y1 = _run(m1, x)
        if style == "row":
            assert torch.equal(torch.cat(ws, 1), w1), key
            cols = [pr[r].cols for r in range(tp)]
            ysum = sum(_run(ranks[r][key], x[:, a:b]) for r, (a, b) in enumerate(cols))
            assert rel_l2(ysum, y1) < 1e-5, key
            continue
        assert torch.equal(_assemble(ws, pr, 0), w1), key
        ys = [_run(ranks[r][key], x) for r in range(tp)]
        if isinstance(m1, QuantLinear) and m1.silu:  # SiLU(gate_r) * up_r: plain concatenation
            assert rel_l2(torch.cat(ys, 1), y1) < 1e-5, key
        else:
            assert rel_l2(_assemble(ys, pr, 1), y1) < 1e-5, key


def test_shard_plan_full_size_model() -> None:
    cfg = load_model_config("qwen3.8-27b")
    plans = {p.key: p for p in plan_shards(cfg, 8, 3)}
    qkv = plans["layers.3.qkv_proj"]
    assert [m.prefix for m in qkv.matrices] == [f"model.layers.3.self_attn.{s}_proj" for s in "qkv"]
    assert qkv.projection.n == 3 * 512 + 256 + 256
    # 4 KV heads over 8 ranks: rank 3 holds a replica of KV head 1 (rows 256..512).
    assert qkv.matrices[1].rows == ((256, 512),) and qkv.matrices[2].rows == ((256, 512),)
    z = plans["layers.0.in_proj_qkvzba"].matrices  # the fused projection reads two checkpoint matrices
    assert [m.prefix for m in z] == [f"model.layers.0.linear_attn.in_proj_{s}" for s in ("qkvz", "ba")]
    assert z[0].n == 16384  # q 2048 | k 2048 | v 6144 | z 6144, each sharded
    assert z[0].rows == ((768, 1024), (2048 + 768, 2048 + 1024), (4096 + 2304, 4096 + 3072),
                         (10240 + 2304, 10240 + 3072))
    assert z[1].n == 96 and z[1].rows == ((18, 24), (48 + 18, 48 + 24))  # b 48 | a 48
    assert plans["layers.0.in_proj_qkvzba"].projection.n == (16384 + 96) // 8
    down = plans["layers.0.down_proj"]
    assert down.cols == (3 * 2176, 4 * 2176) and down.matrices[0].rows == ((0, 5120),)
    assert plans["lm_head"].matrices[0].rows == ((3 * 31040, 4 * 31040),)
    assert set(CHECKPOINT_NAMES) == {p.projection.name for p in plans.values()}
    # the full NVFP4 checkpoint matches the reference's 13.7 GB of projection weights (+ fp16 lm_head)
    spec = synthetic_tensor_specs(cfg, load_deployment("nvfp4"), "modelopt")
    total = sum(t.numel() * t.element_size() for t in spec.values()) - 248320 * 5120 * 2
    assert 13.6e9 < total < 13.8e9


# --------------------------------------------------------------------------- errors


def test_missing_and_misnamed_tensors(ckpt: Callable[[str, str], Path], tmp_path: Path) -> None:
    src = ckpt("modelopt", "nvfp4")
    dep = load_deployment("nvfp4")

    def drop_scale(t: dict[str, torch.Tensor]) -> None:
        del t[f"{DOWN}.weight_scale"]

    d = _copy_with(src, tmp_path / "a", drop_scale)
    with pytest.raises(MissingTensorError) as e:
        load_model_projections(d, CFG, dep)
    msg = str(e.value)
    assert f"'{DOWN}.weight_scale'" in msg and "model.safetensors.index.json" in msg
    assert "layers.1.down_proj" in msg and ".safetensors)" in msg  # names the shard holding the rest

    def drop_matrix(t: dict[str, torch.Tensor]) -> None:
        for k in [k for k in t if k.startswith("model.layers.0.mlp.up_proj.")]:
            del t[k]

    d = _copy_with(src, tmp_path / "b", drop_matrix)
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*index\.json"):
        load_model_projections(d, CFG, dep)

    def rename(t: dict[str, torch.Tensor]) -> None:
        t[f"{QKV[1]}.weight_scale2"] = t.pop(f"{QKV[1]}.weight_scale_2")

    d = _copy_with(src, tmp_path / "c", rename)
    with pytest.raises(CheckpointError) as e:
        load_model_projections(d, CFG, dep)
    assert "weight_scale_2" in str(e.value) and "model-0000" in str(e.value)

    def drop_lm_head(t: dict[str, torch.Tensor]) -> None:
        del t["lm_head.weight"]

    d = _copy_with(src, tmp_path / "d", drop_lm_head)
    with pytest.raises(MissingTensorError, match="^lm_head: missing tensor 'lm_head.weight'"):
        load_model_projections(d, CFG, dep)  # the last projection fails: nothing is returned


def test_wrong_dtype_and_shape(ckpt: Callable[[str, str], Path], tmp_path: Path) -> None:
    src = ckpt("modelopt", "nvfp4")
    dep = load_deployment("nvfp4")

    def f32_scales(t: dict[str, torch.Tensor]) -> None:
        t[f"{QKV[0]}.weight_scale"] = t[f"{QKV[0]}.weight_scale"].float()

    d = _copy_with(src, tmp_path / "a", f32_scales)
    with pytest.raises(CheckpointError, match=rf"{QKV[0]}\.weight_scale: expected dtype torch\.float8_e4m3fn, "
                                              r"got torch\.float32 \(in .*model-\d+-of-\d+\.safetensors\)"):
        load_model_projections(d, CFG, dep)

    def short_v(t: dict[str, torch.Tensor]) -> None:
        for s in ("weight", "weight_scale"):
            t[f"{QKV[2]}.{s}"] = t[f"{QKV[2]}.{s}"][:64].clone()

    d = _copy_with(src, tmp_path / "b", short_v)
    with pytest.raises(CheckpointError, match=rf"{QKV[2]}\.weight: expected shape \[N, K/2\] = \[128, 128\] .*"
                                              r"got \[64, 128\] \(in .*\.safetensors\)"):
        load_model_projections(d, CFG, dep)

    def bf16_codes(t: dict[str, torch.Tensor]) -> None:
        t[f"{DOWN}.weight"] = t[f"{DOWN}.weight"].to(torch.bfloat16)

    d = _copy_with(src, tmp_path / "c", bf16_codes)  # a float weight with NVFP4 scales: fp16 layout
    with pytest.raises(CheckpointError, match="wants nvfp4, but the checkpoint holds fp16"):
        load_model_projections(d, CFG, dep)


def test_mixed_layouts_in_one_fused_projection(ckpt: Callable[[str, str], Path], tmp_path: Path) -> None:
    src = ckpt("modelopt", "nvfp4")

    def ct_k(t: dict[str, torch.Tensor]) -> None:
        for s in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            del t[f"{QKV[1]}.{s}"]
        t.update(to_compressed_tensors_nvfp4(quantize_nvfp4(synthetic_weight(QKV[1], 128, 256, 1)), QKV[1]))

    d = _copy_with(src, tmp_path / "a", ct_k)
    with pytest.raises(CheckpointError) as e:
        load_model_projections(d, CFG, load_deployment("nvfp4"))
    msg = str(e.value)
    assert msg.startswith("layers.1.qkv_proj: mixed layouts in one fused projection")
    assert f"{QKV[0]} is modelopt_nvfp4" in msg and f"{QKV[1]} is ct_nvfp4" in msg and ".safetensors" in msg


def test_deployment_format_mismatch(ckpt: Callable[[str, str], Path]) -> None:
    with pytest.raises(CheckpointError, match=r"layers\.0\.in_proj_qkvzba: deployment 'nvfp4' wants nvfp4, but "
                                              r"the checkpoint holds ct_fp8_channel"):
        load_model_projections(ckpt("modelopt", "fp8"), CFG, load_deployment("nvfp4"))
    with pytest.raises(CheckpointError, match="wants fp8_channel, but the checkpoint holds modelopt_nvfp4"):
        load_model_projections(ckpt("modelopt", "nvfp4"), CFG, load_deployment("fp8"))


# --------------------------------------------------------------------------- fused GDN input projection

GDN_KEY = "layers.0.in_proj_qkvzba"
GDN_MATS = [f"model.layers.0.linear_attn.in_proj_{s}" for s in ("qkvz", "ba")]


@pytest.mark.parametrize("layout,dep", [("modelopt", "nvfp4"), ("compressed-tensors", "nvfp4"),
                                        ("modelopt", "fp8"), ("compressed-tensors", "fp8")])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_gdn_projection_is_the_two_checkpoint_projections(
        ckpt: Callable[[str, str], Path], layout: str, dep: str, tp: int) -> None:
    """in_proj_qkvzba (in memory) == in_proj_qkvz and in_proj_ba (on disk) loaded and run apart, their
    outputs concatenated; per TP rank: [q_r | k_r | v_r | z_r | b_r | a_r], each segment's rank slice."""
    d = ckpt(layout, dep)
    deployment = load_deployment(dep)
    nq, nv = 4 * 32, 8 * 32  # TP1 segments q, k (4 key heads x 32), v, z (8 value heads x 32), b, a (8)
    segs1 = [nq, nq, nv, nv, 8, 8]
    full = _weight(load_model_projections(d, CFG, deployment)[GDN_KEY])
    assert full.shape == (sum(segs1), 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(tp)).half().float()
    for r in range(tp):
        fused = load_model_projections(d, CFG, deployment, tp=tp, rank=r)[GDN_KEY]
        assert isinstance(fused, QuantLinear) and fused.fmt == deployment.default.value
        plan = {p.key: p for p in plan_shards(CFG, tp, r)}[GDN_KEY]
        assert [m.prefix for m in plan.matrices] == GDN_MATS
        apart = [load_projection(d, [m.prefix], rows=[m.rows], shapes=[(m.n, plan.k)]) for m in plan.matrices]
        mods = [QuantLinear(w, f"apart{i}") for i, w in enumerate(apart)]  # type: ignore[arg-type]
        w = _weight(fused)
        assert torch.equal(w, torch.cat([m.dequantize() for m in mods])), r  # bit-exact: same codes, scales
        if dep == "nvfp4":  # one global scale per checkpoint matrix, never max()-ed together
            assert fused.segments == ((2 * nq + 2 * nv) // tp, 16 // tp)
            gs = torch.cat([a.global_scale for a in apart])  # type: ignore[union-attr]
            assert gs.numel() == 2 and gs[0] != gs[1]
            assert torch.equal(fused.col_scale, torch.cat([m.col_scale for m in mods]))
        # the rank's rows of each TP1 segment, in segment order
        rows = [o + r * n // tp + i for o, n in zip([sum(segs1[:j]) for j in range(6)], segs1, strict=True)
                for i in range(n // tp)]
        assert torch.equal(w, full[rows]), r
        y = fused(x)
        assert y.shape == (5, sum(segs1) // tp)
        assert rel_l2(y, torch.cat([m(x) for m in mods], dim=-1)) < 1e-6, r


@pytest.mark.parametrize("layout,dep,what", [("modelopt", "nvfp4", "matrix"), ("modelopt", "nvfp4", "weight_scale"),
                                             ("compressed-tensors", "nvfp4", "matrix"),
                                             ("modelopt", "fp8", "matrix")])
def test_missing_in_proj_ba_names_the_tensor(ckpt: Callable[[str, str], Path], tmp_path: Path, layout: str,
                                             dep: str, what: str) -> None:
    ba = GDN_MATS[1]

    def drop(t: dict[str, torch.Tensor]) -> None:
        for k in [k for k in t if k.startswith(ba + ".") and (what == "matrix" or k == f"{ba}.{what}")]:
            del t[k]

    d = _copy_with(ckpt(layout, dep), tmp_path / "a", drop)
    with pytest.raises(MissingTensorError) as e:
        load_model_projections(d, CFG, load_deployment(dep), tp=2, rank=1)
    msg = str(e.value)
    name = f"{ba}.weight_scale" if what == "weight_scale" else f"{ba}.weight"
    assert msg.startswith(f"{GDN_KEY}: ") and f"missing tensor '{name}'" in msg, msg


@pytest.mark.parametrize("how", ["header", "truncated"])
def test_corrupt_shard(ckpt: Callable[[str, str], Path], tmp_path: Path, how: str) -> None:
    d = tmp_path / "ck"
    shutil.copytree(ckpt("compressed-tensors", "nvfp4"), d)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(b"\xff" * 64 + data[64:] if how == "header" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"corrupt safetensors shard .*{shard.name}"):
        load_model_projections(d, CFG, load_deployment("nvfp4"))


def test_bad_rank_and_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank 4"):
        plan_shards(CFG, 4, 4)
    with pytest.raises(CheckpointError, match="neither"):
        load_model_projections(tmp_path, CFG, load_deployment("nvfp4"))
    with pytest.raises(ValueError, match="layers must be in"):
        write_synthetic_checkpoint(tmp_path, CFG, load_deployment("nvfp4"), layers=3)


# --------------------------------------------------------------------------- command line


def test_cli_writes_a_truncated_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({**RAW, "num_hidden_layers": 4, "layer_types": RAW["layer_types"] * 2}))
    out = tmp_path / "out"
    assert main_synth(["synth-checkpoint", str(out), "--model", str(model), "--layers", "2",
                       "--layout", "compressed-tensors", "--deployment", "mixed", "--seed", str(SEED)]) == 0
    assert "2-layer" in capsys.readouterr().out
    cfg = parse_model_config(json.loads((out / "config.json").read_text()))
    assert cfg.num_hidden_layers == 2 and cfg.layer_types == CFG.layer_types
    mods = load_model_projections(out, cfg, load_deployment("mixed"))
    assert mods["layers.1.o_proj"].fmt == "fp8_channel"  # type: ignore[union-attr]
    want = quantize_nvfp4(synthetic_weight(DOWN, 256, 512, SEED)).dequantize()
    assert torch.equal(mods["layers.1.down_proj"].dequantize(), want)  # type: ignore[operator]

    import argparse

    ap = argparse.ArgumentParser()
    add_synth_parser(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["synth-checkpoint", str(tmp_path / "o2"), "--layers", "1"])
    assert args.fn.__name__ == "_run" and args.layers == 1 and args.layout == "modelopt"
