"""Where a kernel's loadable image comes from, in order:

1. **package**: cubin/PTX shipped inside the installed package (``dflashgen/generated/bin``, made at
   wheel-build time by ``DFLASHGEN_AOT_ARCHS="70 80 90" pip wheel .``): no compiler on the machine;
2. **cache**: an earlier build in the content-keyed cache (``$DFLASHGEN_CACHE``);
3. **built**: compiled now, on first use, with a visible log line (NVRTC/ptxas from the pip
   wheels, or nvcc), into the cache under its file lock.

``DFLASHGEN_AOT_ONLY=1`` turns step 3 into an error. A packaged image is used only if its source
hash matches the kernel the manifest describes, so a stale binary is never loaded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

log = logging.getLogger("dflashgen")

BIN_INDEX = "index.json"


class KernelImageError(RuntimeError):
    """No loadable image for a kernel (AOT-only and not prebuilt, or the build failed)."""


@dataclass(frozen=True)
class Image:
    path: Path
    kind: str  # "cubin" | "ptx"
    source: str  # "package" | "cache" | "built"


def bin_root() -> Path:
    return Path(str(resources.files("dflashgen.generated"))) / "bin"


@lru_cache(maxsize=4)
def _index(root: Path) -> dict[str, Any]:
    path = root / BIN_INDEX
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())["kernels"]
    except (ValueError, KeyError) as e:
        raise KernelImageError(f"corrupt prebuilt kernel index {path}: {e}") from e


def aot_only() -> bool:
    return os.environ.get("DFLASHGEN_AOT_ONLY", "") not in ("", "0")


def resolve(entry: dict[str, Any], native_arch: int, root: Path | None = None,
            build_dir: Path | None = None) -> Image:
    """The image to load for ``entry`` on a GPU of ``native_arch``: its cubin when the kernel is
    for that arch, else its PTX (JIT-compiled by the driver)."""
    kind = "cubin" if entry["arch"] == native_arch else "ptx"
    root = root or bin_root()
    packaged = _index(root).get(entry["name"])
    if packaged is not None and packaged.get("source_sha256") == entry["source_sha256"]:
        path = root / packaged[kind]
        if path.exists():
            return Image(path, kind, "package")
    from dflashgen.build import build
    from dflashgen.toolchain import ToolchainError

    only = f"^{entry['name']}$"
    try:  # a cache hit never compiles; the "prebuilt" toolchain plan never does
        res = build([entry["arch"]], only=only, build_dir=build_dir, progress=False, prefer="prebuilt")
        return Image(getattr(res.artifacts[entry["name"]], kind), kind, "cache")
    except ToolchainError:
        pass
    if aot_only():
        raise KernelImageError(f"{entry['name']} (sm_{entry['arch']}) is not prebuilt in {root} or the build "
                               "cache, and DFLASHGEN_AOT_ONLY is set: install a wheel built with "
                               "DFLASHGEN_AOT_ARCHS, or unset DFLASHGEN_AOT_ONLY to compile it on first use")
    log.warning("dflashgen: compiling %s for sm_%s on first use (cached afterwards)", entry["name"], entry["arch"])
    try:
        res = build([entry["arch"]], only=only, build_dir=build_dir, progress=False)
    except ToolchainError as e:
        raise KernelImageError(f"cannot build {entry['name']}: {e}") from e
    return Image(getattr(res.artifacts[entry["name"]], kind), kind, "built")


def package_binaries(archs: list[int], out_root: Path, build_dir: Path | None = None) -> int:
    """Build every manifest kernel for ``archs`` and copy cubin + PTX under ``out_root`` with an
    index (used by the wheel build). Returns the number of kernels packaged."""
    import shutil

    from dflashgen.build import build
    from dflashgen.render import all_entries, load_manifest

    entries = {e["name"]: e for e in all_entries(load_manifest())}
    res = build(archs, build_dir=build_dir, progress=True)
    index: dict[str, Any] = {}
    for name, art in sorted(res.artifacts.items()):
        sub = out_root / f"sm_{art.arch}"
        sub.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(art.cubin, sub / f"{name}.cubin")
        shutil.copyfile(art.ptx, sub / f"{name}.ptx")
        index[name] = {"source_sha256": entries[name]["source_sha256"], "cubin": f"sm_{art.arch}/{name}.cubin",
                       "ptx": f"sm_{art.arch}/{name}.ptx", "toolchain": res.toolchains[art.arch]}
    (out_root / BIN_INDEX).write_text(json.dumps({"kernels": index}, indent=1, sort_keys=True))
    return len(index)


def family_entries(family: str) -> dict[str, dict[str, Any]]:
    """Manifest entries of a non-GEMM kernel family (see dflashgen.render.FAMILY_MODULES), by name."""
    from dflashgen.render import load_manifest

    fams = load_manifest().get("families", {})
    if family not in fams:
        raise KernelImageError(f"no kernel family {family!r} in the generated manifest "
                               f"(have: {sorted(fams) or 'none'}): run `dflashgen generate`")
    return {e["name"]: e for e in fams[family]}


_MODULES: dict[tuple[str, int], Any] = {}


def load_module(entry: dict[str, Any], device_index: int) -> Any:
    """The loaded driver module of a manifest entry on a GPU (cubin for its arch, else PTX), cached
    per (kernel, device). Any family's kernels load this way; torch supplies tensors and streams."""
    from .driver import Module, ensure_context

    key = (entry["name"], device_index)
    if key not in _MODULES:
        import torch

        ensure_context(device_index)
        major, minor = torch.cuda.get_device_capability(device_index)
        img = resolve(entry, major * 10 + minor)
        _MODULES[key] = Module(img.path.read_bytes(), str(img.path))
    return _MODULES[key]


def entry_here(device: Any, arch: int | None, env: str, error: type[Exception],
               pick: Callable[[int], dict[str, Any] | None]) -> dict[str, Any] | None:
    """The manifest entry ``pick(serving arch)`` gives for ``device``, or None where a family's kernel
    would not run there: not CUDA, no serving arch (``error``), no family in the manifest, no entry
    (``pick`` returns None or raises ``error``). Manifest only: nothing is compiled or loaded."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    try:
        return pick(serving_arch(dev, arch, env, error))
    except (error, RuntimeError):  # RuntimeError: KernelImageError (no family in the manifest)
        return None


def loaded_kernel(cache: dict[tuple[int, int], Any], device: Any, arch: int | None, env: str,
                  error: type[Exception], pick: Callable[[int], dict[str, Any] | None],
                  make: Callable[[dict[str, Any], int], Any], what: str) -> tuple[Any, int]:
    """A family's loaded kernel object for ``device``'s serving arch -- ``make(pick(arch), device
    index)``, made once per (arch, device) in ``cache`` -- and the device index. Raises ``error`` when
    the manifest has no such kernel (``what`` names it)."""
    import torch

    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    a = serving_arch(dev, arch, env, error)
    if (a, idx) not in cache:
        e = pick(a)
        if e is None:
            raise error(f"no sm_{a} {what} in the generated manifest: run `dflashgen generate`")
        cache[(a, idx)] = make(e, idx)
    return cache[(a, idx)], idx


def serving_arch(device: Any, arch: int | None, env: str, error: type[Exception]) -> int:
    """Which build of a kernel family serves this GPU: 90 / 80 / 70, or ``arch`` / ``$env`` when given
    (70 on a newer GPU: the compute_70 PTX through the driver's JIT, how sm_70 code is checked).
    Raises ``error`` for an arch the GPU cannot run or a GPU older than sm_70."""
    import torch

    if arch is None and os.environ.get(env):
        arch = int(os.environ[env])
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    if arch is not None:
        if arch > cc:
            raise error(f"sm_{arch} kernels cannot run on this sm_{cc} GPU")
        return arch
    if cc < 70:
        raise error(f"sm_{cc} GPUs are not supported (sm_70 or newer)")
    return 90 if cc >= 90 else 80 if cc >= 80 else 70
