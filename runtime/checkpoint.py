"""Load (and tensor-parallel shard) quantized projections from HF-style safetensors checkpoints.

Checkpoint names follow Qwen3 / Qwen3.5 / Qwen3.8 (see :data:`CHECKPOINT_NAMES`). A fused projection
is assembled from its checkpoint matrices keeping one NVFP4 global scale per matrix (never max()-ed
together). Each rank reads only its slices through ``safe_open(...).get_slice`` (rows for column- and
vocab-parallel layers, per segment; K columns for row-parallel ones), so a TP4 rank touches a quarter
of the bytes. Layout, dtypes and shapes are checked from the file headers before any data is read;
every error names the tensor and the file.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open

from dflashgen.checkpoint_io import INDEX_NAME, CheckpointError, MissingTensorError, _read_weight_map
from dflashgen.deployment import Deployment, WeightFormat
from dflashgen.model import FULL, LINEAR, ModelConfig, Projection, derive_projections
from dflashgen.quant import (
    Layout,
    concat_fp8,
    concat_segments,
    detect_layout,
    from_compressed_tensors_fp8,
    from_compressed_tensors_nvfp4,
    from_modelopt_nvfp4,
)
from dflashgen.weights import NVFP4_BLOCK, FP8ChannelWeight, NVFP4Weight, WeightError

from .library import KernelLibrary
from .linear import QuantLinear

__all__ = [
    "CHECKPOINT_NAMES",
    "CheckpointReader",
    "LoadedWeight",
    "MatrixShard",
    "ProjectionShard",
    "checkpoint_prefix",
    "detect_projection_layout",
    "layer_projections",
    "load_model_projections",
    "load_projection",
    "plan_shards",
]

# Projection -> checkpoint sub-name of each of its segments (in derive_projections' segment order).
# Consecutive repeats are ONE checkpoint matrix holding those segments back to back (q|k|v|z, b|a),
# so it has one global scale; distinct names are separate matrices with one global scale each.
# in_proj_qkvzba is the in-memory fusion of the checkpoint's in_proj_qkvz and in_proj_ba (each
# rank reads its rows of each of the six segments; NVFP4 keeps the two matrices' global scales).
# q_proj holds the attention output gate interleaved per head ([q | gate] x heads) when attn_output_gate.
CHECKPOINT_NAMES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "in_proj_qkvzba": ("linear_attn.in_proj_qkvz",) * 4 + ("linear_attn.in_proj_ba",) * 2,
    "out_proj": ("linear_attn.out_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
    "lm_head": ("lm_head",),
}
LAYER_PREFIX = "model.layers"
_LAYER_PROJECTIONS = {FULL: ("qkv_proj", "o_proj"), LINEAR: ("in_proj_qkvzba", "out_proj")}
_MLP_PROJECTIONS = ("gate_up_proj", "down_proj")

LoadedWeight = NVFP4Weight | FP8ChannelWeight | torch.Tensor  # a plain tensor for fp16 layers
Range = tuple[int, int]

_F8, _U8, _F32 = torch.float8_e4m3fn, torch.uint8, torch.float32
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_ST_DTYPES = {
    "F8_E4M3": _F8, "F8_E5M2": torch.float8_e5m2, "U8": _U8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": _F32,
    "F64": torch.float64, "BOOL": torch.bool,
}
_FORMAT_OF: dict[str, WeightFormat] = {
    "modelopt_nvfp4": WeightFormat.NVFP4, "ct_nvfp4": WeightFormat.NVFP4,
    "ct_fp8_channel": WeightFormat.FP8_CHANNEL, "fp16": WeightFormat.FP16,
}


# --------------------------------------------------------------------------- slicing reader


class CheckpointReader:
    """Header-level access and row/column slicing over a checkpoint directory (sharded or single
    file) or an in-memory ``{name: tensor}`` dict. Only the requested slices are read from disk."""

    def __init__(self, source: str | os.PathLike[str] | Mapping[str, torch.Tensor]) -> None:
        self._stack = ExitStack()
        self._files: dict[str, tuple[Any, set[str]]] = {}  # shard -> (open handle, its tensor names)
        self.bytes_read = 0
        if isinstance(source, Mapping):
            self.directory: Path | None = None
            self._tensors: Mapping[str, torch.Tensor] | None = source
            self._map = dict.fromkeys(source, "<tensors>")
        else:
            self.directory = Path(source)
            self._tensors = None
            self._map = _read_weight_map(self.directory)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._files.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._map

    def names(self) -> list[str]:
        return list(self._map)

    @property
    def where_index(self) -> str:
        return "<tensors>" if self.directory is None else str(self.directory / INDEX_NAME)

    def where(self, name: str) -> str:
        """The file holding ``name`` (for error messages)."""
        fname = self._map.get(name)
        if fname is None:
            return self.where_index
        return fname if self.directory is None else str(self.directory / fname)

    def _slice(self, name: str) -> Any:
        return self._handle(name).get_slice(name)

    def _handle(self, name: str) -> Any:
        if name not in self._map:
            raise MissingTensorError(f"missing tensor {name!r} in {self.where_index}")
        fname = self._map[name]
        path = self.directory / fname  # type: ignore[operator]
        if fname not in self._files:
            if not path.is_file():
                raise CheckpointError(f"shard {path} (holding {name!r}) does not exist")
            try:
                f = self._stack.enter_context(safe_open(str(path), framework="pt"))
                self._files[fname] = (f, set(f.keys()))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"corrupt safetensors shard {path}: {e}") from e
        f, keys = self._files[fname]
        if name not in keys:
            raise MissingTensorError(f"tensor {name!r} is indexed in {path} but not stored there")
        return f

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape from the file header (no data read)."""
        if self._tensors is not None:
            if name not in self._tensors:
                raise MissingTensorError(f"missing tensor {name!r} in {self.where_index}")
            t = self._tensors[name]
            return t.dtype, tuple(t.shape)
        sl = self._slice(name)
        st = sl.get_dtype()
        if st not in _ST_DTYPES:
            raise CheckpointError(f"{name}: unsupported safetensors dtype {st} (in {self.where(name)})")
        return _ST_DTYPES[st], tuple(sl.get_shape())

    def read(self, name: str, rows: Sequence[Range] | None = None, cols: Range | None = None) -> torch.Tensor:
        """``name[rows, cols]``: the row ranges concatenated, then the column range (2-D only)."""
        _, shape = self.meta(name)
        if len(shape) < 2 and cols is not None or len(shape) == 0 and rows is not None:
            raise CheckpointError(f"{name}: cannot slice a {len(shape)}-D tensor by {rows=} {cols=}")
        c = slice(*cols) if cols is not None else slice(None)
        try:
            if self._tensors is not None:
                src: Any = self._tensors[name]
            elif not shape:  # safetensors cannot slice 0-d tensors
                src = self._handle(name).get_tensor(name)
            else:
                src = self._slice(name)
            if not shape:
                parts = [src[()]]
            else:
                spans = rows if rows is not None else [(0, shape[0])]
                parts = [src[a:b, c] if len(shape) == 2 else src[a:b] for a, b in spans]
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{name}: cannot read from {self.where(name)}: {e}") from e
        t = (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()
        self.bytes_read += t.numel() * t.element_size()
        return t

    def meta_view(self) -> Mapping[str, torch.Tensor]:
        """A mapping of meta-device tensors (dtype + shape only), for :func:`quant.detect_layout`."""
        return _MetaView(self)

    def missing(self, name: str, prefix: str) -> MissingTensorError:
        """A missing-tensor error listing what *is* stored under ``prefix`` (catches misnaming)."""
        under = sorted(n for n in self._map if n.startswith(prefix + "."))
        if under:
            hint = f"; stored under {prefix!r}: {under} (in {self.where(under[0])})"
        else:
            close = difflib.get_close_matches(name, self._map, n=3, cutoff=0.8)
            hint = f"; similar names: {close}" if close else ""
        return MissingTensorError(f"missing tensor {name!r} in {self.where_index}{hint}")


class _MetaView(Mapping[str, torch.Tensor]):
    def __init__(self, reader: CheckpointReader) -> None:
        self._r = reader

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._r:
            raise KeyError(name)
        dtype, shape = self._r.meta(name)
        return torch.empty(shape, dtype=dtype, device="meta")

    def __iter__(self) -> Iterator[str]:
        return iter(self._r.names())

    def __len__(self) -> int:
        return len(self._r.names())


# --------------------------------------------------------------------------- one projection

_Spec = tuple[str, tuple[torch.dtype, ...], list[tuple[int, ...]], str]


def _tensor_specs(layout: Layout, n: int, k: int) -> list[_Spec]:
    """(suffix, dtypes, allowed full shapes, shape description) of every tensor a layout needs."""
    scalar: list[tuple[int, ...]] = [(), (1,)]
    if layout in ("modelopt_nvfp4", "ct_nvfp4"):
        codes, glob = ("weight", "weight_scale_2") if layout == "modelopt_nvfp4" else (
            "weight_packed", "weight_global_scale")
        return [(codes, (_U8,), [(n, k // 2)], "[N, K/2]"),
                ("weight_scale", (_F8,), [(n, k // NVFP4_BLOCK)], "[N, K/16]"),
                (glob, (_F32,), scalar, "scalar")]
    if layout == "ct_fp8_channel":
        return [("weight", (_F8,), [(n, k)], "[N, K]"), ("weight_scale", _FLOATS, [(n, 1), (n,)], "[N, 1]")]
    return [("weight", _FLOATS, [(n, k)], "[N, K]")]


def _detect(reader: CheckpointReader, prefix: str) -> Layout:
    try:
        return detect_layout(reader.meta_view(), prefix)
    except MissingTensorError:
        raise reader.missing(f"{prefix}.weight", prefix) from None
    except CheckpointError as e:
        raise CheckpointError(f"{e} (in {reader.where(prefix + '.weight')})") from e


def detect_projection_layout(reader: CheckpointReader, prefixes: Sequence[str]) -> Layout:
    """The one layout all of a fused projection's matrices use (mixing them is an error)."""
    found = {p: _detect(reader, p) for p in prefixes}
    if len(set(found.values())) > 1:
        desc = ", ".join(f"{p} is {lay} ({reader.where(p + '.weight')})" for p, lay in found.items())
        raise CheckpointError(f"mixed layouts in one fused projection: {desc}")
    return next(iter(found.values()))


def _check_range(name: str, what: str, r: Range, size: int, align: int = 1) -> None:
    a, b = r
    if not (0 <= a < b <= size) or a % align or b % align:
        extra = f" and multiples of {align} (the NVFP4 block)" if align > 1 else ""
        raise CheckpointError(f"{name}: {what} range [{a}, {b}) must lie within [0, {size}){extra}")


def _load_matrix(reader: CheckpointReader, prefix: str, layout: Layout, rows: Sequence[Range] | None,
                 cols: Range | None, shape: tuple[int, int] | None) -> LoadedWeight:
    nvfp4 = layout in ("modelopt_nvfp4", "ct_nvfp4")
    specs = _tensor_specs(layout, 0, 0)
    main = f"{prefix}.{specs[0][0]}"
    if main not in reader:
        raise reader.missing(main, prefix)
    dtype, mshape = reader.meta(main)
    if len(mshape) != 2:
        raise CheckpointError(f"{main}: expected a 2-D tensor, got shape {list(mshape)} "
                              f"(in {reader.where(main)})")
    n, k = shape if shape is not None else (mshape[0], mshape[1] * (2 if nvfp4 else 1))
    if nvfp4 and k % NVFP4_BLOCK:
        raise CheckpointError(f"{main}: K={k} is not a multiple of {NVFP4_BLOCK} (in {reader.where(main)})")
    # Header checks first: nothing is read from a matrix whose names, dtypes or shapes are wrong.
    for suffix, dtypes, shapes, desc in _tensor_specs(layout, n, k):
        name = f"{prefix}.{suffix}"
        if name not in reader:
            raise reader.missing(name, prefix)
        dt, sh = reader.meta(name)
        where = reader.where(name)
        if dt not in dtypes:
            exp = " or ".join(str(d) for d in dtypes)
            raise CheckpointError(f"{name}: expected dtype {exp}, got {dt} (in {where})")
        if sh not in shapes:
            raise CheckpointError(f"{name}: expected shape {desc} = {list(shapes[0])} for N={n}, K={k}, "
                                  f"got {list(sh)} (in {where})")
    for r in rows or ():
        _check_range(main, "row", r, n)
    if cols is not None:
        _check_range(main, "K", cols, k, NVFP4_BLOCK if nvfp4 else 1)

    def cut(suffix: str, div: int = 1) -> torch.Tensor:
        # div: K elements per stored column (2 for packed codes, 16 for block scales; 0: no K axis).
        c = None if cols is None or not div else (cols[0] // div, cols[1] // div)
        return reader.read(f"{prefix}.{suffix}", rows, c)

    files = sorted({reader.where(f"{prefix}.{s[0]}") for s in specs})
    try:
        if layout == "fp16":
            return cut("weight")
        if layout == "ct_fp8_channel":
            sub = {f"{prefix}.weight": cut("weight"), f"{prefix}.weight_scale": cut("weight_scale", 0)}
            return from_compressed_tensors_fp8(sub, prefix)
        sub = {f"{prefix}.{specs[0][0]}": cut(specs[0][0], 2),
               f"{prefix}.weight_scale": cut("weight_scale", NVFP4_BLOCK),
               f"{prefix}.{specs[2][0]}": reader.read(f"{prefix}.{specs[2][0]}")}
        reader_fn = from_modelopt_nvfp4 if layout == "modelopt_nvfp4" else from_compressed_tensors_nvfp4
        return reader_fn(sub, prefix)
    except CheckpointError as e:
        raise type(e)(f"{e} (in {', '.join(files)})") from e


def load_projection(
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor] | CheckpointReader,
    prefixes: Sequence[str],
    *,
    rows: Sequence[Sequence[Range] | None] | None = None,
    cols: Range | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
    layout: Layout | Literal["auto"] = "auto",
) -> LoadedWeight:
    """Assemble one (fused) projection from the checkpoint matrices ``prefixes``, in N order.

    rows: per prefix, the row ranges to take (a column-parallel rank's part of each segment); None
      takes all rows. cols: the K range to take (a row-parallel rank's part). shapes: the full
      [N, K] each matrix must have (from the model config); None accepts what the file holds.
    layout: "auto" detects it per matrix (all must agree), or the layout the caller requires.
    Returns an NVFP4Weight with one segment (and global scale) per matrix, an FP8ChannelWeight,
    or for unquantized weights a plain tensor.
    """
    if not prefixes:
        raise ValueError("load_projection needs at least one checkpoint prefix")
    for what, seq in (("rows", rows), ("shapes", shapes)):
        if seq is not None and len(seq) != len(prefixes):
            raise ValueError(f"{what} has {len(seq)} entries for {len(prefixes)} prefixes")
    own = not isinstance(source, CheckpointReader)
    reader = CheckpointReader(source) if own else source  # type: ignore[arg-type]
    try:
        found = detect_projection_layout(reader, prefixes)
        if layout != "auto" and found != layout:
            raise CheckpointError(f"{prefixes[0]}: expected layout {layout}, the checkpoint holds {found} "
                                  f"(in {reader.where(prefixes[0] + '.weight')})")
        parts = [_load_matrix(reader, p, found, rows[i] if rows else None, cols,
                              shapes[i] if shapes else None) for i, p in enumerate(prefixes)]
    finally:
        if own:
            reader.close()
    if found in ("modelopt_nvfp4", "ct_nvfp4"):
        return concat_segments(parts)  # type: ignore[arg-type]
    if found == "ct_fp8_channel":
        return concat_fp8(parts)  # type: ignore[arg-type]
    return torch.cat(parts)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- tensor-parallel plan


@dataclass(frozen=True)
class MatrixShard:
    prefix: str  # full checkpoint prefix, e.g. "model.layers.3.self_attn.q_proj"
    n: int  # rows of the whole checkpoint matrix
    rows: tuple[Range, ...]  # the rows this rank reads


@dataclass(frozen=True)
class ProjectionShard:
    key: str  # "layers.{i}.{projection}" or "lm_head"
    projection: Projection  # the per-rank shape
    matrices: tuple[MatrixShard, ...]
    k: int  # full K of the checkpoint matrices
    cols: Range | None  # the K range this rank reads (row-parallel)


def checkpoint_prefix(cfg: ModelConfig, projection: str, sub: str, layer: int | None) -> str:
    if projection == "lm_head":
        return "model.embed_tokens" if cfg.tie_word_embeddings else sub
    return f"{LAYER_PREFIX}.{layer}.{sub}"


def layer_projections(cfg: ModelConfig) -> list[tuple[str, int | None, str]]:
    """(key, layer, projection name) of every linear layer in forward order, lm_head last."""
    out: list[tuple[str, int | None, str]] = []
    for i, lt in enumerate(cfg.layer_types):
        for name in _LAYER_PROJECTIONS[lt] + _MLP_PROJECTIONS:
            out.append((f"layers.{i}.{name}", i, name))
    out.append(("lm_head", None, "lm_head"))
    return out


def plan_shards(cfg: ModelConfig, tp: int = 1, rank: int = 0) -> list[ProjectionShard]:
    """What rank ``rank`` of ``tp`` reads for every projection. Column-parallel: each segment's
    rows [r*n/tp, (r+1)*n/tp); KV heads fewer than tp are replicated (rank r reads KV head
    r*kv//tp, as vLLM does). Row-parallel: K columns [r*K/tp, (r+1)*K/tp). lm_head: vocab rows."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside 0..{tp - 1}")
    full = {p.name: p for p in derive_projections(cfg, 1)}
    local = {p.name: p for p in derive_projections(cfg, tp)}
    plans = []
    for key, layer, name in layer_projections(cfg):
        p1, pr = full[name], local[name]
        subs = CHECKPOINT_NAMES[name]
        assert len(subs) == len(p1.segments) == len(pr.segments), name
        cols = None
        mats: list[tuple[str, int, list[Range]]] = []  # (sub, rows, ranges)
        for sub, s1, sr in zip(subs, p1.segments, pr.segments, strict=True):
            if not mats or mats[-1][0] != sub:
                mats.append((sub, 0, []))
            sub_, off, ranges = mats[-1]
            if pr.parallel == "row":
                cols = (rank * pr.k, (rank + 1) * pr.k)
                ranges.append((off, off + s1.n))
            else:
                idx = rank * (s1.n // sr.n) // tp  # == rank unless replicated (KV heads < tp)
                ranges.append((off + idx * sr.n, off + (idx + 1) * sr.n))
            mats[-1] = (sub_, off + s1.n, ranges)
        matrices = tuple(MatrixShard(checkpoint_prefix(cfg, name, sub, layer), n, tuple(r))
                         for sub, n, r in mats)
        plans.append(ProjectionShard(key, pr, matrices, p1.k, cols))
    return plans


# --------------------------------------------------------------------------- whole model


def _context(e: Exception, key: str) -> Exception:
    err = type(e)(f"{key}: {e}")
    err.__cause__ = e
    return err


def load_model_projections(
    directory: str | os.PathLike[str],
    cfg: ModelConfig,
    deployment: Deployment,
    tp: int = 1,
    rank: int = 0,
    library: KernelLibrary | None = None,
    arch: int | None = None,
) -> dict[str, torch.nn.Module]:
    """Every projection of rank ``rank`` as a module, keyed ``layers.{i}.{projection}`` and
    ``lm_head``: a :class:`QuantLinear` for NVFP4 / channel-FP8 (gate_up_proj with the fused SiLU
    epilogue when ``deployment.fuse_silu``), a bias-free FP16 ``torch.nn.Linear`` otherwise.

    The deployment's format per projection must be what the checkpoint holds. With a library the
    modules are moved to its device. On any error nothing is returned (no half-loaded model).
    """
    plans = plan_shards(cfg, tp, rank)
    out: dict[str, torch.nn.Module] = {}
    with CheckpointReader(directory) as reader:
        for plan in plans:
            fmt = deployment.format_for(plan.projection)
            prefixes = [m.prefix for m in plan.matrices]
            try:
                layout = detect_projection_layout(reader, prefixes)
                if _FORMAT_OF[layout] is not fmt:
                    raise CheckpointError(
                        f"deployment {deployment.name!r} wants {fmt.value}, but the checkpoint holds "
                        f"{layout} ({prefixes[0]} in {reader.where(prefixes[0] + '.weight')})")
                w = load_projection(reader, prefixes, rows=[m.rows for m in plan.matrices], cols=plan.cols,
                                    shapes=[(m.n, plan.k) for m in plan.matrices], layout=layout)
                out[plan.key] = _module(w, plan, deployment, library, arch)
            except WeightError as e:
                raise _context(e, plan.key) from e
    return out


def _module(w: LoadedWeight, plan: ProjectionShard, deployment: Deployment, library: KernelLibrary | None,
            arch: int | None) -> torch.nn.Module:
    p = plan.projection
    shape = tuple(w.shape) if isinstance(w, torch.Tensor) else (w.n, w.k)
    if shape != (p.n, p.k):
        raise CheckpointError(f"assembled weight does not match the per-rank shape {p.n}x{p.k}")
    if isinstance(w, torch.Tensor):
        lin = torch.nn.Linear(p.k, p.n, bias=False, device="meta")
        # fp16 because activations are fp16 everywhere (sm_70 has no bf16).
        lin.weight = torch.nn.Parameter(w.to(torch.float16), requires_grad=False)
        mod: torch.nn.Module = lin
    else:
        silu = p.name == "gate_up_proj" and deployment.fuse_silu
        mod = QuantLinear(w, plan.key, silu=silu, library=library, arch=arch)
    return mod.to(library.device) if library is not None else mod
