"""Model config parsing and projection derivation, checked against the Qwen3.8-27B reference table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflashgen.model import (
    ModelConfig,
    ModelConfigError,
    Projection,
    Segment,
    derive_projections,
    load_model_config,
)

# Oracle: /work/shared/reference/qwen38-27b.md, "Linear projections" table.
# name: (layer_type, parallel, N tp1, K tp1, N tp4, K tp4, count)
REFERENCE = {
    "qkv_proj": ("full_attention", "column", 14336, 5120, 3584, 5120, 16),
    "o_proj": ("full_attention", "row", 5120, 6144, 5120, 1536, 16),
    # in_proj_qkvz (16384 / 4096) and in_proj_ba (96 / 24) share their input: one fused projection
    "in_proj_qkvzba": ("linear_attention", "column", 16480, 5120, 4120, 5120, 48),
    "out_proj": ("linear_attention", "row", 5120, 6144, 5120, 1536, 48),
    "gate_up_proj": ("mlp", "column", 34816, 5120, 8704, 5120, 64),
    "down_proj": ("mlp", "row", 5120, 17408, 5120, 4352, 64),
    "lm_head": ("lm_head", "vocab", 248320, 5120, 62080, 5120, 1),
}
# TP1 segments from the same table.
REFERENCE_SEGMENTS_TP1 = {
    "qkv_proj": (12288, 1024, 1024),
    "in_proj_qkvzba": (2048, 2048, 6144, 6144, 48, 48),
    "gate_up_proj": (17408, 17408),
}

DENSE_QWEN3: dict[str, Any] = {  # Qwen3-8B-like
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
}

TINY_HYBRID: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "layer_types": ["linear_attention", "full_attention"] * 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "attn_output_gate": True,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 48,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 1024,
}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def by_name(ps: list[Projection]) -> dict[str, Projection]:
    return {p.name: p for p in ps}


@pytest.fixture(scope="module")
def qwen() -> ModelConfig:
    return load_model_config()


def test_builtin_config_facts(qwen: ModelConfig) -> None:
    assert qwen == load_model_config("qwen3.8-27b")
    assert qwen.family == "qwen3_hybrid"
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_hidden_layers) == (5120, 17408, 64)
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim) == (24, 4, 256)
    assert qwen.attn_output_gate and not qwen.tie_word_embeddings
    assert qwen.num_full_attention_layers == 16 and qwen.num_linear_attention_layers == 48
    assert qwen.full_attention_layer_indices == tuple(range(3, 64, 4))
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads) == (16, 48)
    assert (qwen.linear_key_head_dim, qwen.linear_value_head_dim) == (128, 128)
    assert qwen.linear_conv_kernel_dim == 4
    assert (qwen.partial_rotary_factor, qwen.rope_theta, qwen.rms_norm_eps) == (0.25, 1e7, 1e-6)
    assert qwen.vocab_size == 248320


@pytest.mark.parametrize("tp", [1, 4])
def test_reference_table(qwen: ModelConfig, tp: int) -> None:
    ps = derive_projections(qwen, tp)
    assert [p.name for p in ps] == list(REFERENCE)
    for p in ps:
        layer_type, parallel, n1, k1, n4, k4, count = REFERENCE[p.name]
        assert (p.layer_type, p.parallel, p.count, p.tp) == (layer_type, parallel, count, tp), p.name
        assert (p.n, p.k) == ((n1, k1) if tp == 1 else (n4, k4)), p.name


def test_reference_segments(qwen: ModelConfig) -> None:
    tp1, tp4 = by_name(derive_projections(qwen, 1)), by_name(derive_projections(qwen, 4))
    for name, segs in REFERENCE_SEGMENTS_TP1.items():
        assert tuple(s.n for s in tp1[name].segments) == segs
        assert tuple(s.n for s in tp4[name].segments) == tuple(n // 4 for n in segs)
        assert tp1[name].fused
    assert tp4["in_proj_qkvzba"].segments == (
        Segment("q", 512),
        Segment("k", 512),
        Segment("v", 1536),
        Segment("z", 1536),
        Segment("b", 12),
        Segment("a", 12),
    )
    assert [s.name for s in tp1["qkv_proj"].segments] == ["q", "k", "v"]
    assert [s.name for s in tp1["gate_up_proj"].segments] == ["gate", "up"]
    assert not tp1["o_proj"].fused and not tp1["lm_head"].fused


def test_reference_totals(qwen: ModelConfig) -> None:
    # NVFP4 (4.5 bits/weight) bytes of all linears but lm_head: 13.7 GB at TP1, 3.42 GB per TP4 rank.
    for tp, gb in ((1, 13.7), (4, 3.42)):
        ps = [p for p in derive_projections(qwen, tp) if p.name != "lm_head"]
        # The reference's 496 counts unfused checkpoint modules (q, k, v, o / in_proj_qkv, z, b, a, out_proj /
        # gate, up, down); fused that is 16 x 2 + 48 x 2 + 64 x 2 = 256 GEMMs per forward.
        assert sum(p.count for p in ps) == 256
        assert 16 * 4 + 48 * 5 + 64 * 3 == 496
        assert sum(p.weight_bytes(4.5) * p.count for p in ps) / 1e9 == pytest.approx(gb, abs=0.01)
    odd = Projection("x", "mlp", "row", 3, 5, (Segment("x", 3),), 1, 1)
    assert odd.weight_bytes(4.5) == 9  # ceil(8.4375)


@pytest.mark.parametrize("tp", [2, 8])
def test_tp2_tp8_divide(qwen: ModelConfig, tp: int) -> None:
    ps = by_name(derive_projections(qwen, tp))
    for name, (_, parallel, n1, k1, *_rest) in REFERENCE.items():
        p = ps[name]
        if parallel == "row":
            assert (p.n, p.k) == (n1, k1 // tp)
        elif name == "qkv_proj":
            # 4 KV heads: at TP8 each rank holds one replicated KV head.
            kv = max(1, 4 // tp) * 256
            assert [s.n for s in p.segments] == [12288 // tp, kv, kv]
        else:
            assert (p.n, p.k) == (n1 // tp, k1)
            if p.fused:
                assert [s.n for s in p.segments] == [n // tp for n in REFERENCE_SEGMENTS_TP1[name]]
    assert ps["qkv_proj"].n == (7168 if tp == 2 else 2048)
    assert ps["in_proj_qkvzba"].n == (16384 + 96) // tp


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_file_round_trip(qwen: ModelConfig, tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"model{suffix}"
    d = qwen.to_dict()
    path.write_text(json.dumps(d) if suffix == ".json" else yaml.safe_dump(d))
    cfg = load_model_config(path)
    assert cfg == qwen and cfg.source == str(path)
    assert load_model_config(str(path)) == qwen
    assert derive_projections(cfg, 4) == derive_projections(qwen, 4)


def test_yaml_exponent_without_dot(tmp_path: Path) -> None:
    # YAML 1.1 reads 1e-6 as a string; it must still parse as a float.
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(DENSE_QWEN3).replace("1.0e-06", "1e-6"))
    assert "1e-6" in path.read_text()
    assert load_model_config(path).rms_norm_eps == 1e-6


def test_text_config_and_rope_parameters(qwen: ModelConfig) -> None:
    inner = qwen.to_dict()
    inner.pop("tie_word_embeddings")
    theta, factor = inner.pop("rope_theta"), inner.pop("partial_rotary_factor")
    inner["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
    wrapped = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": inner}
    assert load_model_config(wrapped) == qwen


def test_dense_qwen3() -> None:
    cfg = load_model_config(DENSE_QWEN3)
    assert cfg.family == "qwen3_dense" and not cfg.attn_output_gate
    assert cfg.layer_types == ("full_attention",) * 36 and cfg.linear_num_key_heads is None
    ps = by_name(derive_projections(cfg, 1))
    assert list(ps) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    assert [s.n for s in ps["qkv_proj"].segments] == [4096, 1024, 1024]
    assert (ps["o_proj"].n, ps["o_proj"].k) == (4096, 4096)
    assert ps["qkv_proj"].count == ps["down_proj"].count == 36
    ps8 = by_name(derive_projections(cfg, 8))
    assert [s.n for s in ps8["qkv_proj"].segments] == [512, 128, 128]
    assert ps8["lm_head"].n == 151936 // 8
    # Explicit all-full layer_types (newer transformers emit them) is still dense.
    assert load_model_config({**DENSE_QWEN3, "layer_types": ["full_attention"] * 36}) == cfg
    # head_dim defaults to hidden / heads; kv heads default to heads.
    small = {k: v for k, v in DENSE_QWEN3.items() if k not in ("head_dim", "num_key_value_heads")}
    c2 = load_model_config(small)
    assert (c2.head_dim, c2.num_key_value_heads) == (128, 32)


def test_tiny_hybrid() -> None:
    cfg = load_model_config(TINY_HYBRID)
    assert cfg.family == "qwen3_hybrid"
    ps = by_name(derive_projections(cfg, 2))
    assert [s.n for s in ps["qkv_proj"].segments] == [2 * 64 * 2, 64, 64]  # gate packed into q
    assert ps["o_proj"].k == 128
    assert [s.n for s in ps["in_proj_qkvzba"].segments] == [32, 32, 96, 96, 2, 2]
    assert ps["out_proj"].k == 96
    assert [s.n for s in ps["gate_up_proj"].segments] == [256, 256]
    assert ps["qkv_proj"].count == ps["in_proj_qkvzba"].count == 3 and ps["down_proj"].count == 6
    # Same model by interval; no output gate when disabled.
    by_interval = {**_without(TINY_HYBRID, "layer_types"), "full_attention_interval": 2}
    assert load_model_config(by_interval) == cfg
    nogate = by_name(derive_projections(load_model_config({**TINY_HYBRID, "attn_output_gate": False}), 1))
    assert [s.n for s in nogate["qkv_proj"].segments] == [256, 128, 128]
    # Hybrid without an explicit gate key defaults to gated (vLLM's default).
    assert load_model_config(_without(TINY_HYBRID, "attn_output_gate")).attn_output_gate


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (_without(DENSE_QWEN3, "hidden_size"), "hidden_size"),
        (_without(DENSE_QWEN3, "vocab_size"), "vocab_size"),
        (_without(DENSE_QWEN3, "intermediate_size"), "intermediate_size"),
        ({**DENSE_QWEN3, "num_key_value_heads": 5}, "num_key_value_heads"),
        ({**DENSE_QWEN3, "hidden_size": 0}, "hidden_size"),
        ({**DENSE_QWEN3, "num_hidden_layers": -1}, "num_hidden_layers"),
        ({**DENSE_QWEN3, "vocab_size": "big"}, "vocab_size"),
        ({**DENSE_QWEN3, "head_dim": True}, "head_dim"),
        ({**_without(DENSE_QWEN3, "head_dim"), "hidden_size": 4100}, "head_dim"),
        ({**DENSE_QWEN3, "tie_word_embeddings": "no"}, "tie_word_embeddings"),
        ({**DENSE_QWEN3, "rms_norm_eps": "tiny"}, "rms_norm_eps"),
        ({**DENSE_QWEN3, "rope_theta": -1.0}, "rope_theta"),
        ({**DENSE_QWEN3, "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({**DENSE_QWEN3, "layer_types": ["full_attention"] * 35}, "layer_types"),
        ({**DENSE_QWEN3, "layer_types": ["full_attention"] * 35 + ["sliding_attention"]}, "layer_types"),
        ({**DENSE_QWEN3, "layer_types": "full_attention"}, "layer_types"),
        ({**DENSE_QWEN3, "layer_types": ["linear_attention"] * 36}, "layer_types"),
        ({**DENSE_QWEN3, "full_attention_interval": 4}, "full_attention_interval"),
        (_without(TINY_HYBRID, "linear_value_head_dim"), "linear_value_head_dim"),
        (_without(TINY_HYBRID, "layer_types"), "layer_types"),
        ({**TINY_HYBRID, "full_attention_interval": 3}, "layer_types"),
        ({**TINY_HYBRID, "full_attention_interval": 0}, "full_attention_interval"),
        ({**TINY_HYBRID, "linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({**TINY_HYBRID, "attn_output_gate": 1}, "attn_output_gate"),
        ({"text_config": 5}, "text_config"),
    ],
)
def test_invalid_config(raw: dict[str, Any], field: str, tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=f"'{field}'"):
        load_model_config(raw)
    # Loaded from a file, the message names the file too.
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=f"bad.json: field '{field}'"):
        load_model_config(path)


def test_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="no such file"):
        load_model_config(tmp_path / "missing.json")
    with pytest.raises(ModelConfigError, match="no such file and not a built-in"):
        load_model_config("qwen9")
    txt = tmp_path / "m.txt"
    txt.write_text("{}")
    with pytest.raises(ModelConfigError, match="unsupported file type"):
        load_model_config(txt)
    broken = tmp_path / "m.json"
    broken.write_text("{not json")
    with pytest.raises(ModelConfigError, match="m.json: cannot parse"):
        load_model_config(broken)
    lst = tmp_path / "m.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ModelConfigError, match="m.yaml: expected a mapping"):
        load_model_config(lst)


@pytest.mark.parametrize("tp", [0, 3, 6, 16])
def test_bad_tp(qwen: ModelConfig, tp: int) -> None:
    with pytest.raises(ModelConfigError, match=f"tp={tp} not supported"):
        derive_projections(qwen, tp)


@pytest.mark.parametrize(
    ("change", "tp", "proj"),
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64}, 4, "qkv_proj"),
        ({"num_attention_heads": 24, "num_key_value_heads": 3, "head_dim": 64}, 8, "qkv_proj"),
        ({"linear_num_key_heads": 1, "linear_num_value_heads": 2}, 2, "in_proj_qkvzba"),
        ({"linear_num_key_heads": 2, "linear_num_value_heads": 6}, 4, "in_proj_qkvzba"),
        ({"intermediate_size": 511}, 2, "gate_up_proj"),
        ({"vocab_size": 1023}, 2, "lm_head"),
    ],
)
def test_indivisible_tp(change: dict[str, Any], tp: int, proj: str) -> None:
    cfg = load_model_config({**TINY_HYBRID, **change})
    with pytest.raises(ModelConfigError, match=f"{proj}: .*tp={tp}"):
        derive_projections(cfg, tp)


def test_projection_segments_must_sum() -> None:
    with pytest.raises(ValueError, match="do not add up"):
        Projection("x", "mlp", "column", 10, 4, (Segment("a", 4), Segment("b", 5)), 1, 1)
