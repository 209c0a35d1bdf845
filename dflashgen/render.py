"""Render kernel specs into CUDA sources (Jinja2) and keep generated/ in sync.

generated/ layout: ``sm_XX/<kernel name>.cu`` (the skinny GEMMs) and ``<family>/sm_XX/<name>.cu``
(other kernel families, see ``FAMILY_MODULES``), plus ``manifest.json`` (per kernel: what it
serves, arch, schedule, source hash). Output is byte-for-byte deterministic; files no longer
produced are deleted; ``check`` reports what differs without writing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import import_module, resources
from pathlib import Path
from typing import Any

import jinja2
import yaml

from . import __version__
from .deployment import Deployment, WeightFormat, load_deployment
from .model import Projection, derive_projections, load_model_config
from .schedule import KernelSpec, candidates
from .toolchain import headers_dir

GENERATED_SUFFIXES = (".cu",)
MANIFEST = "manifest.json"
# Kernel families beside the skinny GEMMs: family name -> module exposing
# ``family_kernels() -> list[FamilyKernel]``. Their entries land in manifest["families"][name]
# and are built by `dflashgen build` like any kernel; verify/tune of the GEMMs never see them.
FAMILY_MODULES: dict[str, str] = {"attention": "dflashgen.attention_family", "dequant": "dflashgen.dequant_family",
                                  "gdn": "dflashgen.gdn_family", "norm": "dflashgen.norm_family",
                                  "rejection": "dflashgen.rejection"}
MMA_NAME = {"sm70": "mma.sync.m8n8k4 / HMMA.884", "sm80": "mma.sync.m16n8k16 / HMMA.16816"}
WGMMA_NAME = "wgmma.m64nNk16, A from registers, B from shared memory / HGMMA; sm_90a"


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    root = resources.files("dflashgen.templates")
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)), undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True, trim_blocks=False, lstrip_blocks=False, autoescape=False,
    )


def render_kernel(spec: KernelSpec) -> str:
    lay = spec.layout
    # producer tiles: their own template and header (skinny_gemm_pw.cu.j2; in the library hash once a
    # manifest kernel uses them)
    return _env().get_template(gemm_template(spec.tile.producer)).render(
        version=__version__, name=spec.name, serves=sorted(spec.serves) or ["(ad hoc)"], arch=spec.arch,
        mma=WGMMA_NAME if spec.kplan.wgmma or spec.tile.wgc else MMA_NAME[spec.fam], wgmma=spec.kplan.wgmma,
        fmt=spec.fmt, epilogue=spec.epilogue, n=spec.n, n_pad=lay.n_pad, k=spec.k,
        n_out=spec.n_out, split_k=spec.kplan.split_k, warps_k=spec.kplan.warps_k, kg=spec.kplan.k_group,
        rows=spec.tile.rows, warp_nt=spec.tile.warp_nt, warps_n=spec.tile.warps_n, stages=spec.tile.stages,
        x_ahead=spec.tile.x_ahead, x_smem=spec.tile.x_smem, wsplit=spec.tile.wsplit, ctas_k=spec.ctas_k,
        w_async=spec.tile.w_async, l2_ahead=spec.tile.l2_ahead, serial=spec.tile.serial,
        producer=spec.tile.producer, wgc=spec.tile.wgc, x_ring=spec.tile.x_ring,
        w_warps=spec.tile.w_warps, z_split=spec.tile.z_split, w_self=spec.tile.w_self, persist=spec.tile.persist,
        pair=spec.tile.pair,
        pw_min_blocks=max(1, spec.launch_min_blocks),
        traits="Sm80Traits" if spec.fam == "sm80" else "Sm70Traits",
        format_enum="NVFP4" if spec.fmt == "nvfp4" else "FP8",
        epilogue_enum="SiluMul" if spec.silu else "Store", threads=spec.threads,
        min_blocks=_min_blocks_arg(spec), smem_dynamic=spec.smem_dynamic, smem_bytes=spec.smem_bytes(),
    )


def _min_blocks_arg(spec: KernelSpec) -> str:
    """The __launch_bounds__ min-blocks argument (KernelSpec.launch_min_blocks; none when 0)."""
    return f", {spec.launch_min_blocks}" if spec.launch_min_blocks else ""


@dataclass(frozen=True)
class Target:
    model: str
    tp: int
    deployment: Deployment
    arch: int


def load_targets(path: Path | None = None) -> list[Target]:
    text = path.read_text() if path else (resources.files("dflashgen.schedules") / "targets.yaml").read_text()
    raw = yaml.safe_load(text)
    out = []
    for t in raw["targets"]:
        for tp in t["tp"]:
            for dep in t["deployments"]:
                for arch in t["archs"]:
                    out.append(Target(str(t["model"]), int(tp), load_deployment(dep), int(arch)))
    return out


def problems(model: str | Path | None, tp: int, deployment: Deployment) -> list[tuple[Projection, str, bool]]:
    """(projection, format, fused-SiLU) triples that need kernels."""
    cfg = load_model_config(model)
    out: list[tuple[Projection, str, bool]] = []
    for proj, fmt in deployment.quantized(derive_projections(cfg, tp)):
        out.append((proj, fmt.value, False))
        if deployment.fuse_silu and proj.name == "gate_up_proj" and fmt is not WeightFormat.FP16:
            out.append((proj, fmt.value, True))
    return out


def specs_for(targets: Iterable[Target]) -> list[KernelSpec]:
    """All kernels for the targets, deduplicated by name with the projections each serves."""
    by_name: dict[str, KernelSpec] = {}
    for t in targets:
        for proj, fmt, silu in problems(t.model, t.tp, t.deployment):
            tag = f"{t.model}/tp{t.tp}/{proj.name}" + ("+silu" if silu else "")
            for spec in candidates(t.arch, fmt, proj.n, proj.k, silu):
                prev = by_name.get(spec.name)
                serves = set(prev.serves if prev else ()) | {tag}
                by_name[spec.name] = replace(spec, serves=tuple(sorted(serves)))
    return [by_name[n] for n in sorted(by_name)]


def sha256(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FamilyKernel:
    """One rendered kernel of a non-GEMM family. ``meta`` is copied into its manifest entry."""

    name: str
    arch: int
    source: str
    meta: dict[str, Any] = field(default_factory=dict)


def family_kernels(family: str) -> list[FamilyKernel]:
    return list(import_module(FAMILY_MODULES[family]).family_kernels())


@dataclass
class Plan:
    """What generated/ should contain: relative path -> text."""

    files: dict[str, str] = field(default_factory=dict)
    specs: list[KernelSpec] = field(default_factory=list)


def plan(targets: Iterable[Target]) -> Plan:
    p = Plan()
    kernels: list[dict[str, Any]] = []
    for spec in specs_for(targets):
        rel = f"sm_{spec.arch}/{spec.name}.cu"
        src = render_kernel(spec)
        p.files[rel] = src
        p.specs.append(spec)
        kernels.append({**spec.to_dict(), "file": rel, "source_sha256": sha256(src)})
    families: dict[str, list[dict[str, Any]]] = {}
    for fam in sorted(FAMILY_MODULES):
        entries = families.setdefault(fam, [])
        for fk in sorted(family_kernels(fam), key=lambda f: (f.arch, f.name)):
            rel = f"{fam}/sm_{fk.arch}/{fk.name}.cu"
            if rel in p.files:
                raise ValueError(f"family {fam}: kernel {fk.name} (sm_{fk.arch}) rendered twice")
            p.files[rel] = fk.source
            entries.append({**fk.meta, "name": fk.name, "arch": fk.arch, "family": fam, "file": rel,
                            "source_sha256": sha256(fk.source)})
    manifest = {
        "generated_by": f"dflashgen {__version__}",
        "note": "generated, do not edit: run `dflashgen generate`",
        "template_sha256": template_hash(),
        "kernels": kernels,
        "families": families,
    }
    p.files[MANIFEST] = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    return p


def template_hash() -> str:
    """Hash of every template and header: part of every build fingerprint."""
    root = resources.files("dflashgen.templates")
    h = hashlib.sha256()
    for rel in sorted(_template_files()):
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()


_INCLUDE = re.compile(r'#include\s*[<"](?:dflashgen/)?([\w.]+\.cuh)[>"]')


def header_hash(source: str) -> str:
    """Hash of the dflashgen headers ``source`` includes, transitively: with the source itself, all
    a kernel's build depends on among our files (a change to another family's header rebuilds
    nothing here)."""
    inc = headers_dir() / "dflashgen"
    seen: list[str] = []
    todo = _INCLUDE.findall(source)
    while todo:
        name = todo.pop()
        if name in seen or not (inc / name).is_file():
            continue
        seen.append(name)
        todo += _INCLUDE.findall((inc / name).read_text())
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode())
        h.update((inc / name).read_bytes())
    return h.hexdigest()


GEMM_TEMPLATES = ("skinny_gemm.cu.j2", "skinny_gemm_pw.cu.j2")  # the register/x_smem path; producer tiles


def gemm_template(producer: int) -> str:
    """The template a GEMM kernel is rendered from: producer tiles (skinny_gemm_pw.cuh) have their own."""
    return GEMM_TEMPLATES[1] if producer else GEMM_TEMPLATES[0]


def gemm_source_hash(templates: Iterable[str] = GEMM_TEMPLATES) -> str:
    """Hash of what GEMM kernels are rendered and built from besides their manifest entries: the given
    templates and the header closure they include (the wgmma header too: skinny_gemm.cuh includes it;
    the producer header and mbarrier.cuh through skinny_gemm_pw.cu.j2). The kernel-library hash passes
    the templates its manifest's kernels use, so a switched-off tile family's header is outside it."""
    root = Path(str(resources.files("dflashgen.templates")))
    h = hashlib.sha256()
    for name in sorted(set(templates)):
        template = (root / name).read_text()
        h.update((template + header_hash(template)).encode())
    return h.hexdigest()


def _template_files() -> list[str]:
    root = Path(str(resources.files("dflashgen.templates")))
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in (".j2", ".cuh")]


def _existing(out_dir: Path) -> set[str]:
    found = {str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.suffix in GENERATED_SUFFIXES
             and p.relative_to(out_dir).parts[0] != "bin"}
    if (out_dir / MANIFEST).exists():
        found.add(MANIFEST)
    return found


@dataclass
class Diff:
    missing: list[str]
    changed: list[str]
    stale: list[str]

    @property
    def clean(self) -> bool:
        return not (self.missing or self.changed or self.stale)

    def summary(self, limit: int = 10) -> str:
        lines = []
        for label, items in (("missing", self.missing), ("changed (hand-edited or stale template)", self.changed),
                             ("stale (no longer generated)", self.stale)):
            if items:
                lines.append(f"{len(items)} {label}:")
                lines += [f"  {x}" for x in items[:limit]]
                if len(items) > limit:
                    lines.append(f"  ... and {len(items) - limit} more")
        return "\n".join(lines) if lines else "generated/ is up to date"


def diff(p: Plan, out_dir: Path) -> Diff:
    existing = _existing(out_dir)
    missing, changed = [], []
    for rel, text in sorted(p.files.items()):
        f = out_dir / rel
        if rel not in existing:
            missing.append(rel)
        elif f.read_text() != text:
            changed.append(rel)
    stale = sorted(existing - set(p.files))
    return Diff(missing, changed, stale)


def write(p: Plan, out_dir: Path) -> Diff:
    """Bring out_dir to exactly the plan: write what differs, delete stale files."""
    d = diff(p, out_dir)
    for rel in d.missing + d.changed:
        f = out_dir / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(p.files[rel])
    for rel in d.stale:
        (out_dir / rel).unlink()
    for sub in sorted((d for d in out_dir.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        if not any(sub.iterdir()) and sub.name != "__pycache__":
            sub.rmdir()
    return d


def generated_dir() -> Path:
    return Path(str(resources.files("dflashgen.generated")))


def load_manifest(out_dir: Path | None = None) -> dict[str, Any]:
    path = (out_dir or generated_dir()) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run `dflashgen generate`")
    return json.loads(path.read_text())


def all_entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every buildable kernel: the GEMMs and each family's."""
    out = list(manifest["kernels"])
    for entries in manifest.get("families", {}).values():
        out += entries
    return out
