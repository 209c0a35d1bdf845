"""Another commit's ``runtime/`` importable next to this worktree's, for before / after A/Bs in one
process (tools/cpu_overhead_ab.py, tools/prefill_glue.py)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def old_runtime(ref: str) -> str:
    """``ref``'s runtime/ as the importable package ``oldruntime`` (git archive into a temp dir on
    sys.path); returns the package name."""
    tmp = Path(tempfile.mkdtemp())
    (tmp / "oldruntime").mkdir()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "runtime"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp / "oldruntime"), "--strip-components=1"], input=tar, check=True)
    sys.path.insert(0, str(tmp))
    return "oldruntime"
