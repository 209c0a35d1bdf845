"""Copy the CUTLASS/CuTe headers our kernels include (the transitive closure of every
``#include <cute/...>`` / ``<cutlass/...>`` reachable from templates/include, conditionals ignored,
so a superset) from the nvidia-cutlass wheel into DIR (default .build/include). The GPU machine has
no such wheel: carry .build and tools/gpu_env.sh points DFLASHGEN_CUTLASS_INCLUDE there.

    python tools/cutlass_subset.py [DIR]
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from dflashgen.toolchain import include_dirs

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]((?:cute|cutlass)/[^>"]+)[>"]', re.M)


def closure(roots: list[Path], src: Path) -> set[str]:
    seen: set[str] = set()
    todo = [p.read_text(errors="replace") for r in roots for p in r.rglob("*.cuh")]
    while todo:
        for rel in INCLUDE.findall(todo.pop()):
            if rel not in seen and (src / rel).exists():
                seen.add(rel)
                todo.append((src / rel).read_text(errors="replace"))
    return seen


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".build/include")
    ours, src = include_dirs(nvcc=True)
    here = Path("templates/include")  # this checkout's headers (the installed package may be another)
    files = closure([here if here.is_dir() else ours], src)
    if out.exists():
        shutil.rmtree(out)
    for rel in sorted(files):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, out / rel)
    size = sum((out / f).stat().st_size for f in files)
    print(f"{len(files)} CUTLASS headers ({size / 2**20:.1f} MiB) -> {out}")


if __name__ == "__main__":
    main()
