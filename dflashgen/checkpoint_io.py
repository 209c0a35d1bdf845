"""Sharded safetensors checkpoints in the Hugging Face layout
(``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``), and the checkpoint errors
shared with :mod:`dflashgen.quant`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflashgen.weights import WeightError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(WeightError):
    """A checkpoint tensor or file is missing, malformed or has the wrong dtype/shape."""


class MissingTensorError(CheckpointError, KeyError):
    """A required tensor is absent. Also a KeyError so ``except KeyError`` lookups keep working."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _plan_shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    # Greedy in insertion order; a tensor bigger than the limit gets a shard of its own.
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _storable(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    # safetensors refuses tensors that share storage (e.g. slices of one fused matrix): copy those.
    t = t.detach().cpu().contiguous()
    storage = t.untyped_storage()
    if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
        t = t.clone()
    seen.add(t.untyped_storage().data_ptr())
    return t


def save_safetensors_sharded(
    tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike, max_shard_bytes: int
) -> list[Path]:
    """Write ``tensors`` as HF-style shards plus index; returns the shard paths.

    Files are written to a temporary name and renamed, and the index goes last, so an interrupted
    save never leaves an index that points at a partial shard.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not tensors:
        raise ValueError("no tensors to save")
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"expected str -> Tensor, got {type(name).__name__} -> {type(t).__name__}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    plan = _plan_shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    paths: list[Path] = []
    total = 0
    for i, names in enumerate(plan, start=1):
        fname = shard_name(i, len(plan))
        seen: set[int] = set()
        shard = {n: _storable(tensors[n], seen) for n in names}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        path = out / fname
        tmp = path.with_name(path.name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
        paths.append(path)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    tmp = out / (INDEX_NAME + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, out / INDEX_NAME)
    return paths


def _read_weight_map(directory: Path) -> dict[str, str]:
    index_path = directory / INDEX_NAME
    if not index_path.exists():
        single = directory / SINGLE_NAME
        if not single.exists():
            raise CheckpointError(f"{directory}: neither {INDEX_NAME} nor {SINGLE_NAME} exists")
        try:
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_NAME)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"corrupt safetensors file {single}: {e}") from e
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"unreadable index {index_path}: {e!r}") from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index_path}: weight_map must map tensor names to file names")
    for fname in set(weight_map.values()):
        # Shards live next to the index; refuse paths that would read elsewhere.
        if Path(fname).name != fname or fname in (".", ".."):
            raise CheckpointError(f"{index_path}: shard name {fname!r} is not a plain file name")
    return weight_map


def load_safetensors_dir(
    directory: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Load ``names`` (all tensors when None) from a sharded or single-file safetensors directory.

    Only the shards that hold requested tensors are opened, and only those tensors are read.
    """
    directory = Path(directory)
    weight_map = _read_weight_map(directory)
    wanted = list(weight_map) if names is None else list(dict.fromkeys(names))
    for name in wanted:
        if name not in weight_map:
            raise MissingTensorError(f"tensor {name!r} is not in the checkpoint index of {directory}")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(weight_map[name], []).append(name)
    result: dict[str, torch.Tensor] = {}
    for fname, fnames in by_file.items():
        path = directory / fname
        if not path.is_file():
            raise CheckpointError(f"shard {path} (holding {fnames[0]!r}) does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                for name in fnames:
                    if name not in keys:
                        raise MissingTensorError(f"tensor {name!r} is indexed in {fname} but not stored")
                    result[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"corrupt safetensors shard {path}: {e}") from e
    return {name: result[name] for name in wanted}
