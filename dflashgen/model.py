"""Model description: parse an HF-style config and derive every linear projection's per-rank GEMM shape.

Shapes follow how vLLM shards Qwen3 dense and Qwen3.5/3.8 hybrid (Gated DeltaNet + gated full attention)
models: column-parallel layers shard each fused segment separately, row-parallel layers shard K, lm_head is
vocab-parallel. Weights are N x K and y[M, N] = x[M, K] W^T.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_MODEL = "qwen3.8-27b"
SUPPORTED_TP = (1, 2, 4, 8)
FULL, LINEAR, MLP, LM_HEAD = "full_attention", "linear_attention", "mlp", "lm_head"
LAYER_TYPES = (FULL, LINEAR, MLP, LM_HEAD)
# GDN's in_proj_qkvz and in_proj_ba (same input x) run as ONE fused projection, in_proj_qkvzba:
# one launch instead of two per GDN layer. The checkpoint keeps the two HF
# matrices; the names below are accepted as aliases of the fused one where a user names a projection.
GDN_IN_PROJ = "in_proj_qkvzba"
LEGACY_PROJECTION_NAMES = {"in_proj_qkvz": GDN_IN_PROJ, "in_proj_ba": GDN_IN_PROJ}
PROJECTION_NAMES = (
    "qkv_proj",
    "o_proj",
    "in_proj_qkvzba",
    "out_proj",
    "gate_up_proj",
    "down_proj",
    "lm_head",
)
# All of these must be present together: a half-specified GDN block cannot be sharded.
_HYBRID_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
_MISSING: Any = object()


class ModelConfigError(ValueError):
    """A model config is missing a field, has an invalid one, or cannot be sharded at the asked TP."""


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "qwen3_hybrid" | "qwen3_dense"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    attn_output_gate: bool
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Where it came from (file path, built-in name or "<dict>"): for error messages, not identity.
    source: str = field(default="<dict>", compare=False)

    @property
    def num_full_attention_layers(self) -> int:
        return self.layer_types.count(FULL)

    @property
    def num_linear_attention_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    @property
    def full_attention_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def to_dict(self) -> dict[str, Any]:
        """HF key names; `load_model_config(cfg.to_dict())` gives back an equal config."""
        d: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "layer_types": list(self.layer_types),
            "attn_output_gate": self.attn_output_gate,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
        }
        if self.family == "qwen3_hybrid":
            d.update({k: getattr(self, k) for k in _HYBRID_KEYS})
        return d


@dataclass(frozen=True)
class Segment:
    """One logical matrix inside a fused column-parallel weight (own global scale in NVFP4)."""

    name: str
    n: int


@dataclass(frozen=True)
class Projection:
    """One linear layer's per-rank GEMM shape and how often it runs per forward."""

    name: str
    layer_type: str  # full_attention | linear_attention | mlp | lm_head
    parallel: str  # column | row | vocab
    n: int
    k: int
    segments: tuple[Segment, ...]
    count: int
    tp: int

    def __post_init__(self) -> None:
        if sum(s.n for s in self.segments) != self.n:
            raise ValueError(f"{self.name}: segments {self.segments} do not add up to N={self.n}")

    @property
    def fused(self) -> bool:
        return len(self.segments) > 1

    def weight_bytes(self, bits_per_weight: float) -> int:
        """Bytes of one instance of this (per-rank) weight; e.g. 4.5 bits for NVFP4 incl. block scales."""
        return math.ceil(self.n * self.k * bits_per_weight / 8)


# --------------------------------------------------------------------------- parsing


def _err(src: str, key: str, msg: str) -> ModelConfigError:
    return ModelConfigError(f"{src}: field '{key}': {msg}")


def _get(d: Mapping[str, Any], key: str) -> Any:
    # Newer HF configs (transformers v5) move RoPE settings under rope_parameters.
    if key in d:
        return d[key]
    rope = d.get("rope_parameters")
    if isinstance(rope, Mapping) and key in rope:
        return rope[key]
    return _MISSING


def _int(d: Mapping[str, Any], key: str, src: str, default: Any = _MISSING) -> int:
    v = _get(d, key)
    if v is _MISSING:
        if default is _MISSING:
            raise _err(src, key, "missing required field")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise _err(src, key, f"expected a positive integer, got {v!r}")
    return v


def _float(d: Mapping[str, Any], key: str, src: str, default: float) -> float:
    v = _get(d, key)
    if v is _MISSING:
        return default
    try:
        # YAML 1.1 reads "1e-6" (no dot) as a string, so accept numeric strings.
        f = float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        f = math.nan
    if not math.isfinite(f) or f <= 0:
        raise _err(src, key, f"expected a positive number, got {v!r}")
    return f


def _bool(d: Mapping[str, Any], key: str, src: str, default: bool) -> bool:
    v = _get(d, key)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise _err(src, key, f"expected true/false, got {v!r}")
    return v


def _layer_types(d: Mapping[str, Any], n_layers: int, hybrid: bool, src: str) -> tuple[str, ...]:
    raw, interval = d.get("layer_types"), d.get("full_attention_interval")
    types: tuple[str, ...] | None = None
    if raw is not None:
        if not isinstance(raw, (list, tuple)):
            raise _err(src, "layer_types", f"expected a list, got {type(raw).__name__}")
        if len(raw) != n_layers:
            raise _err(src, "layer_types", f"has {len(raw)} entries, num_hidden_layers is {n_layers}")
        bad = sorted({str(t) for t in raw if t not in (FULL, LINEAR)})
        if bad:
            raise _err(src, "layer_types", f"unknown layer type(s) {bad}; expected {FULL!r} or {LINEAR!r}")
        types = tuple(raw)
    if interval is not None:
        if not hybrid:
            raise _err(src, "full_attention_interval", f"needs the linear-attention keys {_HYBRID_KEYS}")
        interval = _int(d, "full_attention_interval", src)
        # Interval k: every k-th layer (1-based) is full attention, e.g. 4 -> layers 3, 7, ..., 63.
        from_interval = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))
        if types is not None and types != from_interval:
            raise _err(src, "layer_types", f"disagrees with full_attention_interval={interval}")
        types = from_interval
    if types is None:
        if hybrid:
            raise _err(src, "layer_types", "hybrid config needs layer_types or full_attention_interval")
        types = (FULL,) * n_layers  # plain dense Qwen3
    if LINEAR in types and not hybrid:
        raise _err(src, "layer_types", f"has {LINEAR!r} layers but the config lacks {_HYBRID_KEYS}")
    return types


def parse_model_config(raw: Mapping[str, Any], source: str = "<dict>") -> ModelConfig:
    """Validate an HF-style config dict (optionally nested under text_config) into a ModelConfig."""
    src = source
    if not isinstance(raw, Mapping):
        raise ModelConfigError(f"{src}: expected a mapping at top level, got {type(raw).__name__}")
    d: Mapping[str, Any] = raw
    if "text_config" in raw:  # Qwen3.5 VL-style wrapper
        if not isinstance(raw["text_config"], Mapping):
            raise _err(src, "text_config", "expected a mapping")
        d = dict(raw["text_config"])
        if "tie_word_embeddings" not in d and "tie_word_embeddings" in raw:
            d = {**d, "tie_word_embeddings": raw["tie_word_embeddings"]}

    hidden = _int(d, "hidden_size", src)
    heads = _int(d, "num_attention_heads", src)
    kv = _int(d, "num_key_value_heads", src, heads)
    if heads % kv:
        raise _err(src, "num_key_value_heads", f"{kv} does not divide num_attention_heads={heads}")
    if "head_dim" not in d and hidden % heads:
        raise _err(src, "head_dim", f"missing and hidden_size={hidden} is not divisible by {heads} heads")
    head_dim = _int(d, "head_dim", src, hidden // heads)
    n_layers = _int(d, "num_hidden_layers", src)

    present = [k for k in _HYBRID_KEYS if k in d]
    hybrid = bool(present)
    if hybrid and len(present) != len(_HYBRID_KEYS):
        missing = next(k for k in _HYBRID_KEYS if k not in d)
        raise _err(src, missing, f"missing while other linear-attention keys {present} are present")
    lin = {k: _int(d, k, src) for k in present}
    if hybrid and lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
        raise _err(src, "linear_num_value_heads", "must be a multiple of linear_num_key_heads")

    rotary = _float(d, "partial_rotary_factor", src, 1.0)
    if rotary > 1:
        raise _err(src, "partial_rotary_factor", f"must be in (0, 1], got {rotary}")

    return ModelConfig(
        family="qwen3_hybrid" if hybrid else "qwen3_dense",
        hidden_size=hidden,
        intermediate_size=_int(d, "intermediate_size", src),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=_int(d, "vocab_size", src),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", src, False),
        layer_types=_layer_types(d, n_layers, hybrid, src),
        # vLLM's Qwen3-Next/3.5 attention defaults the output gate on; plain Qwen3 has none.
        attn_output_gate=_bool(d, "attn_output_gate", src, hybrid),
        partial_rotary_factor=rotary,
        rope_theta=_float(d, "rope_theta", src, 10000.0),
        rms_norm_eps=_float(d, "rms_norm_eps", src, 1e-6),
        source=src,
        **lin,
    )


def read_mapping(path: Path, error: type[ValueError]) -> Any:
    """Load a .json / .yaml / .yml file; any failure becomes `error` naming the file."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise error(f"{path}: unsupported file type {suffix!r} (expected .json, .yaml or .yml)")
    try:
        text = path.read_text()
        return json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except OSError as e:
        raise error(f"{path}: cannot read: {e}") from e
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise error(f"{path}: cannot parse: {e}") from e


def load_model_config(spec: str | Path | Mapping[str, Any] | None = None) -> ModelConfig:
    """None or a built-in name ("qwen3.8-27b"), a .json/.yaml path, or an HF-style dict."""
    if spec is None:
        spec = DEFAULT_MODEL
    if isinstance(spec, Mapping):
        return parse_model_config(spec)
    builtin = CONFIG_DIR / f"{str(spec).lower()}.json"
    if isinstance(spec, str) and "/" not in spec and builtin.is_file():
        return parse_model_config(read_mapping(builtin, ModelConfigError), str(builtin))
    path = Path(spec)
    if not path.is_file():
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise ModelConfigError(f"{path}: no such file and not a built-in model {names}")
    return parse_model_config(read_mapping(path, ModelConfigError), str(path))


# --------------------------------------------------------------------------- projections


def derive_projections(cfg: ModelConfig, tp: int) -> list[Projection]:
    """Per-rank GEMM shapes of every linear layer at tensor-parallel degree `tp`, with counts per forward."""
    if tp not in SUPPORTED_TP:
        raise ModelConfigError(f"{cfg.source}: tp={tp} not supported (expected one of {SUPPORTED_TP})")

    def split(proj: str, what: str, size: int) -> int:
        if size % tp:
            raise ModelConfigError(f"{cfg.source}: {proj}: {what}={size} is not divisible by tp={tp}")
        return size // tp

    def column(name: str, layer_type: str, count: int, segs: list[tuple[str, int]]) -> Projection:
        s = tuple(Segment(sn, n) for sn, n in segs)
        return Projection(name, layer_type, "column", sum(x.n for x in s), h, s, count, tp)

    def row(name: str, layer_type: str, count: int, k: int) -> Projection:
        return Projection(name, layer_type, "row", h, k, (Segment(name, h),), count, tp)

    h = cfg.hidden_size
    out: list[Projection] = []
    n_full, n_lin = cfg.num_full_attention_layers, cfg.num_linear_attention_layers

    if n_full:
        heads = split("qkv_proj", "num_attention_heads", cfg.num_attention_heads)
        kv = cfg.num_key_value_heads
        # Fewer KV heads than ranks: each rank holds a replica of one KV head (vLLM needs tp % kv == 0).
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ModelConfigError(
                f"{cfg.source}: qkv_proj: num_key_value_heads={kv} cannot split over tp={tp}"
            )
        kv_r = max(1, kv // tp)
        q = heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)  # gate packed per head into q
        kvd = kv_r * cfg.head_dim
        out.append(column("qkv_proj", FULL, n_full, [("q", q), ("k", kvd), ("v", kvd)]))
        out.append(row("o_proj", FULL, n_full, heads * cfg.head_dim))

    if n_lin:
        assert cfg.linear_num_key_heads and cfg.linear_num_value_heads  # guaranteed by parsing
        assert cfg.linear_key_head_dim and cfg.linear_value_head_dim
        # GDN shards whole heads; each of q, k, v, z, b, a is its own column segment. in_proj_qkvz and
        # in_proj_ba share their input: one fused projection [q | k | v | z | b | a] (per rank: its
        # shard of each segment), so a GDN layer launches one GEMM for both.
        nk = split(GDN_IN_PROJ, "linear_num_key_heads", cfg.linear_num_key_heads)
        nv = split(GDN_IN_PROJ, "linear_num_value_heads", cfg.linear_num_value_heads)
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        segs = [("q", nk * dk), ("k", nk * dk), ("v", nv * dv), ("z", nv * dv), ("b", nv), ("a", nv)]
        out.append(column(GDN_IN_PROJ, LINEAR, n_lin, segs))
        out.append(row("out_proj", LINEAR, n_lin, nv * dv))

    inter = split("gate_up_proj", "intermediate_size", cfg.intermediate_size)
    out.append(column("gate_up_proj", MLP, cfg.num_hidden_layers, [("gate", inter), ("up", inter)]))
    out.append(row("down_proj", MLP, cfg.num_hidden_layers, inter))

    vocab = split("lm_head", "vocab_size", cfg.vocab_size)
    out.append(Projection("lm_head", LM_HEAD, "vocab", vocab, h, (Segment("lm_head", vocab),), 1, tp))
    return out
