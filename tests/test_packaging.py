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


@pytest.mark.slow
def test_non_editable_install_finds_package_data(tmp_path: Path) -> None:
    # Install from a copy of what a clean clone holds: an in-tree build/ folder left by an earlier
    # build could otherwise smuggle stale kernels into the wheel.
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    out = subprocess.run([sys.executable, "-c", PROBE, str(target)], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
