"""Kernel images: packaged binaries first (only when their source hash matches), then the cache,
then a first-use build -- or a clear error when AOT-only."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from dflashgen.runtime.images import KernelImageError, _index, package_binaries, resolve

from dflashgen.build import build
from dflashgen.render import load_manifest

SMALL = "dfg_sm70_nvfp4_store_n4120_k5120_.*_r8_nt1_"


@pytest.fixture(scope="module")
def entry() -> dict:
    import re

    return next(e for e in load_manifest()["kernels"] if re.search(SMALL, e["name"]))


def test_packaged_image_wins_when_current(tmp_path: Path, entry: dict) -> None:
    res = build([70], only=f"^{entry['name']}$", build_dir=tmp_path / "b", progress=False)
    art = res.artifacts[entry["name"]]
    root = tmp_path / "bin"
    (root / "sm_70").mkdir(parents=True)
    shutil.copyfile(art.cubin, root / "sm_70" / "k.cubin")
    shutil.copyfile(art.ptx, root / "sm_70" / "k.ptx")
    index = {"kernels": {entry["name"]: {"source_sha256": entry["source_sha256"], "cubin": "sm_70/k.cubin",
                                          "ptx": "sm_70/k.ptx"}}}
    (root / "index.json").write_text(json.dumps(index))
    _index.cache_clear()
    img = resolve(entry, 70, root=root, build_dir=tmp_path / "empty")
    assert img.source == "package" and img.kind == "cubin" and img.path.name == "k.cubin"
    assert resolve(entry, 90, root=root, build_dir=tmp_path / "empty").kind == "ptx"
    # a stale packaged binary (other source) is never loaded
    index["kernels"][entry["name"]]["source_sha256"] = "0" * 64
    (root / "index.json").write_text(json.dumps(index))
    _index.cache_clear()
    img = resolve(entry, 70, root=root, build_dir=tmp_path / "b")
    assert img.source == "cache"


def test_first_use_build_logs_and_aot_only_refuses(tmp_path: Path, entry: dict, monkeypatch, caplog) -> None:
    _index.cache_clear()
    monkeypatch.setenv("DFLASHGEN_AOT_ONLY", "1")
    with pytest.raises(KernelImageError, match="AOT_ONLY"):
        resolve(entry, 70, root=tmp_path / "nobin", build_dir=tmp_path / "cache")
    monkeypatch.delenv("DFLASHGEN_AOT_ONLY")
    with caplog.at_level(logging.WARNING, logger="dflashgen"):
        img = resolve(entry, 70, root=tmp_path / "nobin", build_dir=tmp_path / "cache")
    assert img.source == "built" and "first use" in caplog.text
    assert resolve(entry, 70, root=tmp_path / "nobin", build_dir=tmp_path / "cache").source == "cache"


def test_corrupt_index_is_a_clear_error(tmp_path: Path, entry: dict) -> None:
    (tmp_path / "index.json").write_text("{oops")
    _index.cache_clear()
    with pytest.raises(KernelImageError, match="corrupt prebuilt kernel index"):
        resolve(entry, 70, root=tmp_path)
    _index.cache_clear()


def test_package_binaries_writes_index(tmp_path: Path, entry: dict, monkeypatch) -> None:
    import dflashgen.build as b

    real = b.build
    monkeypatch.setattr(b, "build", lambda archs, **kw: real(archs, only=f"^{entry['name']}$", **kw))
    n = package_binaries([70], tmp_path / "bin", build_dir=tmp_path / "b")
    idx = json.loads((tmp_path / "bin" / "index.json").read_text())["kernels"]
    assert n == 1 and (tmp_path / "bin" / idx[entry["name"]]["cubin"]).exists()


def test_loaded_kernel_makes_one_object_per_arch_and_device(monkeypatch) -> None:
    """runtime.images.loaded_kernel: the family's kernel object is made once per (serving arch, device
    index) and reused; a manifest without the kernel raises the family's error naming it."""
    from dflashgen.runtime import images

    class Missing(ValueError):
        pass

    monkeypatch.setattr(images, "serving_arch", lambda dev, arch, env, error: arch or 90)
    made: list[tuple[str, int]] = []

    def make(entry: dict, idx: int) -> tuple[str, int]:
        made.append((entry["name"], idx))
        return entry["name"], idx

    cache: dict = {}
    pick = {90: {"name": "k90"}, 70: {"name": "k70"}}.get
    dev = "cuda:1"  # an explicit index: no CUDA call needed to find it
    assert images.loaded_kernel(cache, dev, None, "X", Missing, pick, make, "test kernel") == (("k90", 1), 1)
    assert images.loaded_kernel(cache, dev, None, "X", Missing, pick, make, "test kernel") == (("k90", 1), 1)
    assert images.loaded_kernel(cache, dev, 70, "X", Missing, pick, make, "test kernel")[0] == ("k70", 1)
    assert made == [("k90", 1), ("k70", 1)]
    with pytest.raises(Missing, match="no sm_80 test kernel in the generated manifest"):
        images.loaded_kernel(cache, dev, 80, "X", Missing, pick, make, "test kernel")
