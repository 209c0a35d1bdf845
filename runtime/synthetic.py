"""Synthetic quantized checkpoints: random FP16 projections (std 0.02, like a real init) quantized by
:mod:`dflashgen.quant` into the exact tensor names of the ModelOpt or compressed-tensors layout, with
``config.json`` and the layout's quantization config. Only the linear projections are written (no
embeddings, norms or GDN conv/state parameters): enough to load, shard and run every GEMM.

Tensors are generated one projection at a time and written shard by shard (the shard plan comes
from header-only meta tensors), so a full Qwen3.8-27B checkpoint needs about one projection of RAM.
``dflashgen synth-checkpoint OUT_DIR`` is the command line (:func:`add_synth_parser`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from dflashgen.checkpoint_io import INDEX_NAME, _plan_shards, _storable, shard_name
from dflashgen.deployment import Deployment, WeightFormat, load_deployment
from dflashgen.model import ModelConfig, load_model_config
from dflashgen.quant import (
    quantize_fp8_channel,
    quantize_nvfp4,
    to_compressed_tensors_fp8,
    to_compressed_tensors_nvfp4,
    to_modelopt_nvfp4,
)
from dflashgen.weights import NVFP4_BLOCK, FP8ChannelWeight, NVFP4Weight

from .checkpoint import plan_shards

__all__ = [
    "INIT_STD",
    "SynthLayout",
    "add_synth_parser",
    "main_synth",
    "synthetic_tensor_specs",
    "synthetic_weight",
    "truncate_config",
    "write_synthetic_checkpoint",
]

SynthLayout = Literal["modelopt", "compressed-tensors"]
LAYOUTS: tuple[str, ...] = ("modelopt", "compressed-tensors")
INIT_STD = 0.02
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' default "5GB"
_BLOCK_ROWS = 4096  # rows per generator block: bounded fp32 temporaries, order-independent values
_F8 = torch.float8_e4m3fn


def synthetic_weight(prefix: str, n: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The FP16 [n, k] matrix the writer draws for ``prefix``: N(0, INIT_STD^2), a pure function of
    (prefix, shape, seed, device type), so tests can regenerate any projection without the others.
    On a CUDA device the values come from the CUDA generator (different numbers, same distribution):
    the fast path for full-size checkpoints."""
    base = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(prefix.encode())) % (1 << 62)
    dev = torch.device(device)
    out = torch.empty((n, k), dtype=torch.float16, device=dev)
    for b, r in enumerate(range(0, n, _BLOCK_ROWS)):
        g = torch.Generator(device=dev).manual_seed(base + b)
        rows = min(_BLOCK_ROWS, n - r)
        out[r:r + rows] = (torch.randn((rows, k), generator=g, device=dev) * INIT_STD).to(torch.float16)
    return out


def truncate_config(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    """The first ``layers`` layers of ``cfg`` (a tiny version of a big config for tests)."""
    if layers is None:
        return cfg
    if not 1 <= layers <= cfg.num_hidden_layers:
        raise ValueError(f"layers must be in 1..{cfg.num_hidden_layers}, got {layers}")
    return dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])


def _encode(prefix: str, q: NVFP4Weight | FP8ChannelWeight | torch.Tensor, layout: SynthLayout
            ) -> dict[str, torch.Tensor]:
    if isinstance(q, NVFP4Weight):
        writer = to_modelopt_nvfp4 if layout == "modelopt" else to_compressed_tensors_nvfp4
        return writer(q, prefix)
    if isinstance(q, FP8ChannelWeight):
        # ModelOpt's FP8_PER_CHANNEL_PER_TOKEN uses the same names: weight + weight_scale [N, 1].
        return to_compressed_tensors_fp8(q, prefix)
    return {f"{prefix}.weight": q}


def _meta(n: int, k: int, fmt: WeightFormat) -> NVFP4Weight | FP8ChannelWeight | torch.Tensor:
    """A stand-in with the real weight's dtypes and shapes: meta tensors for the big parts, small real
    scales (the writers compute on those; meta math would pull in torch's slow-to-import refs)."""
    def e(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    if fmt is WeightFormat.NVFP4:
        return NVFP4Weight(e((n, k // 2), torch.uint8), e((n, k // NVFP4_BLOCK), _F8),
                           torch.ones(1), (n,))
    if fmt is WeightFormat.FP8_CHANNEL:
        return FP8ChannelWeight(e((n, k), _F8), torch.ones(n))
    return e((n, k), torch.float16)


def _matrices(cfg: ModelConfig, dep: Deployment) -> Iterator[tuple[str, int, int, WeightFormat]]:
    """(prefix, N, K, format) of every checkpoint matrix in file order (layer by layer)."""
    for plan in plan_shards(cfg, 1, 0):
        fmt = dep.format_for(plan.projection)
        for m in plan.matrices:
            yield m.prefix, m.n, plan.k, fmt


def synthetic_tensor_specs(cfg: ModelConfig, deployment: Deployment, layout: SynthLayout
                           ) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint will hold, in file order, as stand-ins with the real dtypes and
    shapes (big parts on the meta device): the shard plan and size estimates need no data."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    meta: dict[str, torch.Tensor] = {}
    for prefix, n, k, fmt in _matrices(cfg, deployment):
        meta.update(_encode(prefix, _meta(n, k, fmt), layout))
    return meta


def _quant_config(mats: Sequence[tuple[str, int, int, WeightFormat]], layout: SynthLayout) -> dict[str, Any]:
    by_fmt: dict[WeightFormat, list[str]] = {}
    for prefix, _, _, fmt in mats:
        by_fmt.setdefault(fmt, []).append(prefix)
    fp16 = by_fmt.pop(WeightFormat.FP16, [])
    if layout == "modelopt":
        def algo(f: WeightFormat) -> dict[str, Any]:
            if f is WeightFormat.NVFP4:
                return {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK}
            return {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}

        q: dict[str, Any] = {"kv_cache_quant_algo": None, "exclude_modules": fp16}
        if len(by_fmt) == 1:
            q.update(algo(next(iter(by_fmt))))
        else:
            q["quant_algo"] = "MIXED_PRECISION"
            q["quantized_layers"] = {p: algo(f) for f, ps in by_fmt.items() for p in ps}
        return {"producer": {"name": "dflashgen-synthetic", "version": "0"}, "quantization": q}
    groups: dict[str, Any] = {}
    for i, (fmt, prefixes) in enumerate(by_fmt.items()):
        if fmt is WeightFormat.NVFP4:
            scheme = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_BLOCK,
                      "symmetric": True, "dynamic": False}
            # The writer stores input_global_scale, so declare the W4A4 activation scheme too.
            groups[f"group_{i}"] = {"targets": prefixes, "weights": scheme, "format": "nvfp4-pack-quantized",
                                    "input_activations": {**scheme, "dynamic": "local"}}
        else:
            scheme = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                      "dynamic": False}
            groups[f"group_{i}"] = {"targets": prefixes, "weights": scheme, "format": "float-quantized",
                                    "input_activations": None}
    formats = {g["format"] for g in groups.values()}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "config_groups": groups, "ignore": fp16}


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def write_synthetic_checkpoint(
    directory: str | os.PathLike[str],
    cfg: ModelConfig,
    deployment: Deployment,
    layout: SynthLayout = "modelopt",
    seed: int = 0,
    layers: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
    device: torch.device | str = "cpu",
) -> ModelConfig:
    """Write the checkpoint; returns the config written (``cfg`` cut to ``layers`` layers).

    device: where weights are drawn and quantized (``cuda``: the CUDA generator and GPU quantizers,
    seconds for a full 27B checkpoint instead of CPU minutes; other values than on CPU, see
    :func:`synthetic_weight`); tensors are moved to the CPU only to be written.

    NVFP4 matrices carry one global scale each (q, k, v, gate, up separately; in_proj_qkvz and
    in_proj_ba are single fused matrices, as in HF checkpoints: the loader fuses the two into the
    one in-memory projection in_proj_qkvzba), FP8 matrices per-channel scales, FP16 ones a plain weight.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    cfg = truncate_config(cfg, layers)
    mats = list(_matrices(cfg, deployment))
    meta = synthetic_tensor_specs(cfg, deployment, layout)
    plan = _plan_shards(meta, max_shard_bytes)
    shard_of = {name: i for i, names in enumerate(plan) for name in names}
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    pending: list[dict[str, torch.Tensor]] = [{} for _ in plan]
    weight_map: dict[str, str] = {}
    total = 0
    for prefix, n, k, fmt in mats:
        w = synthetic_weight(prefix, n, k, seed, device)
        q = quantize_nvfp4(w) if fmt is WeightFormat.NVFP4 else (
            quantize_fp8_channel(w) if fmt is WeightFormat.FP8_CHANNEL else w)
        tensors = {name: t.cpu() for name, t in _encode(prefix, q, layout).items()}
        touched = sorted({shard_of[name] for name in tensors})
        for name, t in tensors.items():
            pending[shard_of[name]][name] = t
        del w, q, tensors
        for i in touched:
            if len(pending[i]) < len(plan[i]):
                continue
            # The plan follows file order, so a shard is complete once its last projection is in.
            seen: set[int] = set()
            shard = {name: _storable(pending[i][name], seen) for name in plan[i]}
            fname = shard_name(i + 1, len(plan))
            tmp = out / (fname + ".tmp")
            save_file(shard, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, out / fname)
            total += sum(t.numel() * t.element_size() for t in shard.values())
            weight_map.update(dict.fromkeys(plan[i], fname))
            pending[i] = {}
            if progress:
                progress(f"wrote {fname} ({len(shard)} tensors)")
    assert len(weight_map) == len(meta), "every planned tensor is written"
    config = {**cfg.to_dict(), "torch_dtype": "float16",
              "model_type": "qwen3_5_text" if cfg.family == "qwen3_hybrid" else "qwen3"}
    qcfg = _quant_config(mats, layout)
    if layout == "compressed-tensors":
        config["quantization_config"] = qcfg
    else:
        _write_json(out / "hf_quant_config.json", qcfg)
    _write_json(out / "config.json", config)
    # The index goes last: an interrupted write never leaves an index pointing at missing shards.
    _write_json(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return cfg


# --------------------------------------------------------------------------- command line


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="output folder (created)")
    p.add_argument("--model", default=None, help="built-in name or config .json/.yaml (default qwen3.8-27b)")
    p.add_argument("--deployment", default=None, help="nvfp4 | fp8 | mixed | a deployment file")
    p.add_argument("--layout", choices=LAYOUTS, default="modelopt")
    p.add_argument("--layers", type=int, default=None, help="write only the first N layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)


def _run(args: argparse.Namespace) -> int:
    cfg = load_model_config(args.model)
    dep = load_deployment(args.deployment)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    written = write_synthetic_checkpoint(args.out_dir, cfg, dep, args.layout, args.seed, args.layers,
                                         args.max_shard_bytes, progress=log)
    print(f"{args.out_dir}: {written.num_hidden_layers}-layer {cfg.source} checkpoint, "
          f"deployment={dep.name}, layout={args.layout}, seed={args.seed}")
    return 0


def add_synth_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``synth-checkpoint`` on an ``ArgumentParser.add_subparsers()`` object."""
    p = subparsers.add_parser("synth-checkpoint",
                              help="write a random quantized checkpoint (for tests and demos)")
    _add_args(p)
    p.set_defaults(fn=_run)
    return p


def main_synth(argv: Sequence[str] | None = None) -> int:
    """``dflashgen synth-checkpoint OUT_DIR [...]``; ``argv`` may start with the subcommand name."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["synth-checkpoint"]:
        args = args[1:]
    p = argparse.ArgumentParser(prog="dflashgen synth-checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    return _run(p.parse_args(args))
