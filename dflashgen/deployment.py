"""Deployment: which weight format each projection uses (mixed checkpoints are common)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from dflashgen.model import (
    CONFIG_DIR,
    LAYER_TYPES,
    LEGACY_PROJECTION_NAMES,
    PROJECTION_NAMES,
    Projection,
    read_mapping,
)

DEFAULT_DEPLOYMENT = "nvfp4"
BUILTIN_DEPLOYMENTS = ("nvfp4", "fp8", "mixed")
_KEYS = ("name", "default", "overrides", "fuse_silu")


class DeploymentError(ValueError):
    """A deployment file or dict is invalid."""


class WeightFormat(str, Enum):
    NVFP4 = "nvfp4"
    FP8_CHANNEL = "fp8_channel"
    FP16 = "fp16"  # left unquantized: served by cuBLAS, no generated kernel


@dataclass(frozen=True)
class Deployment:
    name: str
    default: WeightFormat
    # Keys are projection names or layer types; a projection name beats its layer type.
    overrides: tuple[tuple[str, WeightFormat], ...] = ()
    # gate_up_proj also gets the fused SiLU(gate) * up epilogue variant.
    fuse_silu: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.default, WeightFormat):
            raise DeploymentError(f"{self.name}: default: {self.default!r} is not a WeightFormat")
        for key, fmt in self.overrides:
            _check_key(key, self.name)
            if not isinstance(fmt, WeightFormat):
                raise DeploymentError(f"{self.name}: overrides.{key}: {fmt!r} is not a WeightFormat")
        object.__setattr__(self, "overrides", _canonical(self.overrides, self.name))

    def format_for(self, p: Projection) -> WeightFormat:
        table = dict(self.overrides)
        for key in (p.name, p.layer_type):
            if key in table:
                return table[key]
        return self.default

    def quantized(self, projections: Iterable[Projection]) -> list[tuple[Projection, WeightFormat]]:
        """The projections that need a generated kernel (not FP16), with their format."""
        pairs = [(p, self.format_for(p)) for p in projections]
        return [(p, f) for p, f in pairs if f is not WeightFormat.FP16]


def _canonical(overrides: tuple[tuple[str, WeightFormat], ...], src: str) -> tuple[tuple[str, WeightFormat], ...]:
    """Legacy projection names (in_proj_qkvz, in_proj_ba) -> the fused projection they are now part
    of; both named with different formats cannot be served by one fused weight."""
    out: dict[str, tuple[str, WeightFormat]] = {}
    for key, fmt in overrides:
        new = LEGACY_PROJECTION_NAMES.get(key, key)
        if new in out and out[new][1] is not fmt:
            raise DeploymentError(
                f"{src}: overrides: {out[new][0]}={out[new][1].value} and {key}={fmt.value} disagree, but both "
                f"are the fused projection {new!r} now (one weight, one format)")
        out.setdefault(new, (key, fmt))
    return tuple((new, fmt) for new, (_, fmt) in out.items())


def _check_key(key: Any, src: str) -> str:
    if key not in PROJECTION_NAMES and key not in LAYER_TYPES and key not in LEGACY_PROJECTION_NAMES:
        raise DeploymentError(
            f"{src}: overrides: unknown key {key!r}; expected a projection {PROJECTION_NAMES} "
            f"or a layer type {LAYER_TYPES}"
        )
    return key


def _format(value: Any, src: str, where: str) -> WeightFormat:
    try:
        return WeightFormat(value)
    except ValueError:
        allowed = [f.value for f in WeightFormat]
        raise DeploymentError(f"{src}: {where}: unknown format {value!r}; expected {allowed}") from None


def parse_deployment(raw: Any, source: str = "<dict>", name: str = "") -> Deployment:
    """Validate `{name, default, overrides, fuse_silu}`; `name` falls back to the given one (file stem)."""
    if not isinstance(raw, Mapping):
        raise DeploymentError(f"{source}: expected a mapping at top level, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in _KEYS]
    if unknown:
        raise DeploymentError(f"{source}: unknown key {unknown[0]!r}; expected keys {_KEYS}")
    if "default" not in raw:
        raise DeploymentError(f"{source}: default: missing required key")
    dep_name = raw.get("name", name or source)
    if not isinstance(dep_name, str) or not dep_name:
        raise DeploymentError(f"{source}: name: expected a non-empty string, got {dep_name!r}")
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, Mapping):
        raise DeploymentError(f"{source}: overrides: expected a mapping, got {type(overrides).__name__}")
    fuse = raw.get("fuse_silu", True)
    if not isinstance(fuse, bool):
        raise DeploymentError(f"{source}: fuse_silu: expected true/false, got {fuse!r}")
    return Deployment(
        name=dep_name,
        default=_format(raw["default"], source, "default"),
        overrides=tuple(
            (_check_key(k, source), _format(v, source, f"overrides.{k}")) for k, v in overrides.items()
        ),
        fuse_silu=fuse,
    )


def load_deployment(spec: str | Path | Mapping[str, Any] | None = None) -> Deployment:
    """None -> "nvfp4"; a built-in short name ("nvfp4", "fp8", "mixed"); a YAML/JSON path; or a dict."""
    if spec is None:
        spec = DEFAULT_DEPLOYMENT
    if isinstance(spec, Mapping):
        return parse_deployment(spec)
    if isinstance(spec, str) and spec in BUILTIN_DEPLOYMENTS:
        path = CONFIG_DIR / f"deploy-{spec}.yaml"
    else:
        path = Path(spec)
        if not path.is_file():
            raise DeploymentError(f"{path}: no such file and not a built-in deployment {BUILTIN_DEPLOYMENTS}")
    return parse_deployment(read_mapping(path, DeploymentError), str(path), path.stem)
