"""A normal (non-editable) `pip install .` carries templates, schedules, kernels and tuning tables."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from importlib import resources
import dflashgen
assert dflashgen.__file__.startswith(sys.argv[1]), dflashgen.__file__
assert str(resources.files("dflashgen.generated")).startswith(sys.argv[1])
t = resources.files("dflashgen.templates")
assert (t / "skinny_gemm.cu.j2").is_file()
assert (t / "include" / "dflashgen" / "skinny_gemm.cuh").is_file()
assert (resources.files("dflashgen.schedules") / "sm_70.yaml").is_file()
g = resources.files("dflashgen.generated")
m = json.loads((g / "manifest.json").read_text())
assert all((g / k["file"]).is_file() for k in m["kernels"])
assert resources.files("dflashgen.tuning").is_dir()
assert (resources.files("dflashgen.configs") / "qwen3.8-27b.json").is_file()
from dflashgen.render import diff, load_targets, plan
from dflashgen.render import generated_dir
assert diff(plan(load_targets()), generated_dir()).clean
import dflashgen.runtime.table
print("ok", len(m["kernels"]))
"""


def _clean_copy(src: Path) -> Path:
    """What a clean clone holds (tracked + untracked-not-ignored files), without build/ leftovers."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    return src


@pytest.mark.slow
def test_non_editable_install_finds_package_data(tmp_path: Path) -> None:
    # Install from a copy of a clean clone: an in-tree build/ folder left by an earlier build could
    # otherwise smuggle stale kernels into the wheel.
    src = _clean_copy(tmp_path / "src")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    out = subprocess.run([sys.executable, "-c", PROBE, str(target)], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


AOT_PROBE = """
import sys, re
from pathlib import Path
from dflashgen.render import load_manifest
from dflashgen.runtime.images import resolve
e = next(k for k in load_manifest()["kernels"] if k["arch"] == 70)
img = resolve(e, 70, build_dir=Path(sys.argv[1]))
assert img.source == "package" and img.path.exists(), img
print("ok", img.path.name)
"""


@pytest.mark.slow
def test_aot_wheel_ships_kernels_usable_without_a_compiler(tmp_path: Path) -> None:
    src = _clean_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    env = {**os.environ, "DFLASHGEN_AOT_ARCHS": "70"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(src)], check=True, cwd=tmp_path, env=env)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    *map(str, wheels.glob("*.whl"))], check=True, cwd=tmp_path)
    run_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_env.update(PYTHONPATH=str(target), DFLASHGEN_AOT_ONLY="1")
    out = subprocess.run([sys.executable, "-c", AOT_PROBE, str(tmp_path / "no-cache")], capture_output=True,
                         text=True, cwd=tmp_path, env=run_env)
    assert out.returncode == 0, out.stderr
