"""Deployments: per-projection weight formats, precedence and the built-in files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflashgen.deployment import Deployment, DeploymentError, WeightFormat, load_deployment, parse_deployment
from dflashgen.model import Projection, derive_projections, load_model_config

NV, FP8, FP16 = WeightFormat.NVFP4, WeightFormat.FP8_CHANNEL, WeightFormat.FP16
ATTN = ("qkv_proj", "o_proj", "in_proj_qkvzba", "out_proj")


@pytest.fixture(scope="module")
def projections() -> list[Projection]:
    return derive_projections(load_model_config(), 4)


def formats(dep: Deployment, ps: list[Projection]) -> dict[str, WeightFormat]:
    return {p.name: dep.format_for(p) for p in ps}


def test_weight_format_values() -> None:
    assert [f.value for f in WeightFormat] == ["nvfp4", "fp8_channel", "fp16"]
    assert WeightFormat("fp8_channel") is FP8 and FP8 == "fp8_channel"


def test_builtin_nvfp4(projections: list[Projection]) -> None:
    dep = load_deployment()
    assert dep == load_deployment("nvfp4") and dep.name == "nvfp4" and dep.fuse_silu
    assert formats(dep, projections) == {p.name: NV for p in projections} | {"lm_head": FP16}


def test_builtin_fp8(projections: list[Projection]) -> None:
    dep = load_deployment("fp8")
    assert dep.name == "fp8" and dep.default is FP8
    assert formats(dep, projections) == {p.name: FP8 for p in projections} | {"lm_head": FP16}


def test_builtin_mixed(projections: list[Projection]) -> None:
    dep = load_deployment("mixed")
    f = formats(dep, projections)
    assert all(f[n] is FP8 for n in ATTN)
    assert f["gate_up_proj"] is NV and f["down_proj"] is NV and f["lm_head"] is FP16
    # The quantized set: everything but lm_head, each with its format.
    q = dep.quantized(projections)
    assert [p.name for p, _ in q] == [p.name for p in projections if p.name != "lm_head"]
    assert sum(p.count for p, _ in q) == 256  # fused GEMMs per forward, whatever the TP degree


def test_precedence(projections: list[Projection]) -> None:
    dep = parse_deployment(
        {
            "default": "fp16",
            "overrides": {"mlp": "fp8_channel", "down_proj": "nvfp4", "linear_attention": "nvfp4"},
        },
        name="custom",
    )
    f = formats(dep, projections)
    assert f["down_proj"] is NV  # projection name beats layer type
    assert f["gate_up_proj"] is FP8  # layer type beats default
    assert f["in_proj_qkvzba"] is NV and f["out_proj"] is NV
    assert f["qkv_proj"] is FP16 and f["lm_head"] is FP16  # default
    assert dep.name == "custom" and dep.fuse_silu
    assert [p.name for p, _ in dep.quantized(projections)] == [
        "in_proj_qkvzba",
        "out_proj",
        "gate_up_proj",
        "down_proj",
    ]


def test_legacy_gdn_projection_names(projections: list[Projection]) -> None:
    # in_proj_qkvz / in_proj_ba are one fused projection now; their old names still select it
    for key in ("in_proj_qkvz", "in_proj_ba"):
        dep = parse_deployment({"default": "nvfp4", "overrides": {key: "fp8_channel"}})
        assert dep.overrides == (("in_proj_qkvzba", FP8),)
        assert formats(dep, projections)["in_proj_qkvzba"] is FP8
    same = parse_deployment({"default": "nvfp4", "overrides": {"in_proj_qkvz": "fp16", "in_proj_ba": "fp16"}})
    assert same.overrides == (("in_proj_qkvzba", FP16),)
    assert Deployment("d", NV, (("in_proj_ba", FP8),)).overrides == (("in_proj_qkvzba", FP8),)
    with pytest.raises(DeploymentError, match="in_proj_qkvz=nvfp4 and in_proj_ba=fp16 disagree.*in_proj_qkvzba"):
        parse_deployment({"default": "nvfp4", "overrides": {"in_proj_qkvz": "nvfp4", "in_proj_ba": "fp16"}})


def test_direct_construction() -> None:
    dep = Deployment("d", NV, (("lm_head", FP16),), fuse_silu=False)
    assert not dep.fuse_silu
    with pytest.raises(DeploymentError, match="unknown key 'attn'"):
        Deployment("d", NV, (("attn", FP16),))
    with pytest.raises(DeploymentError, match="not a WeightFormat"):
        Deployment("d", "nvfp4", ())  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_file_round_trip(tmp_path: Path, suffix: str, projections: list[Projection]) -> None:
    raw: dict[str, Any] = {
        "default": "fp8_channel",
        "overrides": {"gate_up_proj": "nvfp4", "lm_head": "fp16"},
        "fuse_silu": False,
    }
    path = tmp_path / f"my-deploy{suffix}"
    path.write_text(json.dumps(raw) if suffix == ".json" else yaml.safe_dump(raw))
    dep = load_deployment(path)
    assert dep.name == "my-deploy"  # file stem when the file has no name
    assert dep == load_deployment(str(path)) and not dep.fuse_silu
    assert dep.overrides == (("gate_up_proj", NV), ("lm_head", FP16))
    assert formats(dep, projections)["gate_up_proj"] is NV


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"default": "int4"}, "default: unknown format 'int4'"),
        ({"default": "nvfp4", "overrides": {"mlp": "fp4"}}, "overrides.mlp: unknown format 'fp4'"),
        ({"default": "nvfp4", "overrides": {"attention": "fp16"}}, "unknown key 'attention'"),
        ({"default": "nvfp4", "overrides": ["mlp"]}, "overrides: expected a mapping"),
        ({"default": "nvfp4", "fuse": True}, "unknown key 'fuse'"),
        ({"default": "nvfp4", "fuse_silu": "yes"}, "fuse_silu: expected true/false"),
        ({"default": "nvfp4", "name": 3}, "name: expected a non-empty string"),
        ({"overrides": {}}, "default: missing"),
        (["nvfp4"], "expected a mapping"),
    ],
)
def test_invalid(raw: Any, match: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(DeploymentError, match=f"bad.yaml: .*{match}"):
        load_deployment(path)


def test_invalid_spec(tmp_path: Path) -> None:
    with pytest.raises(DeploymentError, match="not a built-in deployment"):
        load_deployment("int8")
    txt = tmp_path / "d.toml"
    txt.write_text("")
    with pytest.raises(DeploymentError, match="unsupported file type"):
        load_deployment(txt)
    assert issubclass(DeploymentError, ValueError)
