"""Sharded safetensors save/load in the Hugging Face layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflashgen.checkpoint_io import (
    INDEX_NAME,
    CheckpointError,
    MissingTensorError,
    load_safetensors_dir,
    save_safetensors_sharded,
)
from dflashgen.quant import quantize_nvfp4, to_compressed_tensors_nvfp4


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(12, 16, generator=g)
    return {
        "a.weight": torch.randn(8, 16, generator=g).half(),  # 256 B
        "a.bias": torch.randn(8, generator=g).bfloat16(),  # 16 B
        "b.weight": torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn),  # 256 B
        "b.packed": torch.randint(0, 255, (16, 8), generator=g, dtype=torch.uint8),  # 128 B
        "big": torch.randn(300, generator=g),  # 1200 B: larger than a shard
        "c.q": fused[:4],  # views sharing storage with c.k and with each other
        "c.k": fused[4:],
        "scalar": torch.tensor(0.5),
    }


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_bits = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a.dtype == b.dtype and a.shape == b.shape and same_bits


def test_sharded_round_trip(tmp_path: Path) -> None:
    tensors = _tensors()
    paths = save_safetensors_sharded(tensors, tmp_path / "ckpt", max_shard_bytes=400)
    n = len(paths)
    assert n >= 4
    assert [p.name for p in paths] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "ckpt" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == {p.name for p in paths}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    members: dict[str, list[str]] = {p.name: [] for p in paths}
    for name, fname in index["weight_map"].items():
        members[fname].append(name)
    for names in members.values():  # only a single oversized tensor may break the limit
        assert len(names) == 1 or sum(tensors[k].numel() * tensors[k].element_size() for k in names) <= 400
    assert members[index["weight_map"]["big"]] == ["big"]
    loaded = load_safetensors_dir(tmp_path / "ckpt")
    assert list(loaded) == list(tensors)
    assert all(_equal(loaded[k], v) for k, v in tensors.items())
    assert not list((tmp_path / "ckpt").glob("*.tmp"))


def test_load_subset_in_requested_order(tmp_path: Path) -> None:
    tensors = _tensors()
    save_safetensors_sharded(tensors, tmp_path, max_shard_bytes=300)
    # Corrupting a shard that holds none of the requested names must not matter: it is never opened.
    index = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    (tmp_path / index["big"]).write_bytes(b"junk")
    got = load_safetensors_dir(tmp_path, ["c.k", "a.bias", "c.k"])
    assert list(got) == ["c.k", "a.bias"]
    assert _equal(got["c.k"], tensors["c.k"]) and _equal(got["a.bias"], tensors["a.bias"])


def test_quantized_checkpoint_round_trip(tmp_path: Path) -> None:
    q = quantize_nvfp4(torch.randn(32, 64), (16, 16))
    tensors: dict[str, torch.Tensor] = {}
    from dflashgen.quant import from_compressed_tensors_nvfp4, split_segments

    for name, part in zip(("q_proj", "k_proj"), split_segments(q), strict=True):
        tensors.update(to_compressed_tensors_nvfp4(part, name))
    save_safetensors_sharded(tensors, tmp_path, max_shard_bytes=1 << 20)
    back = from_compressed_tensors_nvfp4(load_safetensors_dir(tmp_path), "k_proj")
    assert torch.equal(back.dequantize(), q.dequantize()[16:])


def test_missing_index_entry(tmp_path: Path) -> None:
    save_safetensors_sharded(_tensors(), tmp_path, max_shard_bytes=400)
    with pytest.raises(MissingTensorError, match="'nope.weight'") as ei:
        load_safetensors_dir(tmp_path, ["a.weight", "nope.weight"])
    assert isinstance(ei.value, KeyError)


def test_indexed_but_absent_from_shard(tmp_path: Path) -> None:
    save_safetensors_sharded(_tensors(), tmp_path, max_shard_bytes=400)
    path = tmp_path / INDEX_NAME
    index = json.loads(path.read_text())
    index["weight_map"]["ghost"] = index["weight_map"]["a.weight"]
    path.write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match="'ghost' is indexed in model-00001.* but not stored"):
        load_safetensors_dir(tmp_path, ["ghost"])


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_shard_names_the_file(tmp_path: Path, damage: str) -> None:
    save_safetensors_sharded(_tensors(), tmp_path, max_shard_bytes=400)
    shard = tmp_path / json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]["a.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 40] if damage == "truncate" else b"\x00" * 64)
    with pytest.raises(CheckpointError, match=f"corrupt safetensors shard .*{shard.name}"):
        load_safetensors_dir(tmp_path, ["a.weight"])


def test_missing_shard_file(tmp_path: Path) -> None:
    save_safetensors_sharded(_tensors(), tmp_path, max_shard_bytes=400)
    shard = tmp_path / json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]["b.weight"]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} .*'b.weight'.* does not exist"):
        load_safetensors_dir(tmp_path)


@pytest.mark.parametrize(
    ("index_text", "match"),
    [
        ("{not json", "unreadable index"),
        ('{"metadata": {}}', "unreadable index"),
        ('{"weight_map": {"a": 3}}', "weight_map must map"),
        ('{"weight_map": {"a": "../evil.safetensors"}}', "not a plain file name"),
    ],
)
def test_bad_index(tmp_path: Path, index_text: str, match: str) -> None:
    (tmp_path / INDEX_NAME).write_text(index_text)
    with pytest.raises(CheckpointError, match=match):
        load_safetensors_dir(tmp_path)


def test_single_file_fallback_and_empty_dir(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither"):
        load_safetensors_dir(tmp_path)
    save_file({"x": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    assert torch.equal(load_safetensors_dir(tmp_path)["x"], torch.arange(4.0))
    with pytest.raises(MissingTensorError, match="'y'"):
        load_safetensors_dir(tmp_path, ["y"])
    (tmp_path / "model.safetensors").write_bytes(b"bad")
    with pytest.raises(CheckpointError, match="corrupt safetensors file"):
        load_safetensors_dir(tmp_path)


def test_save_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_safetensors_sharded({"a": torch.zeros(2)}, tmp_path, 0)
    with pytest.raises(ValueError, match="no tensors"):
        save_safetensors_sharded({}, tmp_path, 100)
    with pytest.raises(TypeError):
        save_safetensors_sharded({"a": [1, 2]}, tmp_path, 100)  # type: ignore[dict-item]
