"""SASS instructions per K group of built kernels (the kernels are issue-bound: instructions are time).

Finds the main loop (the backward branch whose body holds the MMAs: HMMA, or HGMMA in the wgmma
kernels), counts its instructions and divides by the groups one trip covers (MMAs in the body / MMAs
per group). Needs cuobjdump and the nvdisasm beside it (`pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`: found in the wheels' bin folder; or pass --cuobjdump, or put it on PATH).

    python tools/sass_count.py [--cache DIR] [--arch 90] [--ops] REGEX
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
NAME = re.compile(r"_(nvfp4|fp8)_.*_kg(\d+)_r(\d+)_nt(\d+)_")


def find_cuobjdump() -> str:
    """cuobjdump on PATH, else the one the `nvidia-cuda-cuobjdump` wheel installs (nvidia/*/bin)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            hits = sorted(Path(root).glob("*/bin/cuobjdump"))
            if hits:
                return str(hits[-1])
    except ImportError:
        pass
    return "cuobjdump"


def disassemble(cuobjdump: str, cubin: Path, kernel: str) -> list[tuple[int, str, str]]:
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    out, cur = [], None
    for line in text.splitlines():
        if "Function :" in line:
            cur = line.split("Function :")[1].strip()
            continue
        m = LINE.search(line)
        if m and cur == kernel:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def main_loop(ins: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    best: list[tuple[int, str, str]] = []
    for addr, op, args in ins:
        if op == "BRA":
            tgt = int(args.strip().split()[-1].rstrip(";"), 16)
            if tgt < addr:
                body = [i for i in ins if tgt <= i[0] <= addr]
                if sum(map(is_mma, body)) > sum(map(is_mma, best)):
                    best = body
    return best


def is_mma(ins: tuple[int, str, str]) -> bool:
    return ins[1].startswith(("HMMA", "HGMMA"))


def mma_per_group(kernel: str) -> int:
    fmt, kg, rows, nt = NAME.search(kernel).groups()
    if "_wc1" in kernel or "_wg1_" in kernel:  # wgmma: one m64nROWSk16 per 16 K per warp(group)
        return int(kg) // 16
    return int(kg) // 16 * int(nt) * int(rows) // 8  # m16n8k16: one HMMA per 16 K, 8 rows, warp tile


def built_kernels(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, Path, dict[str, dict]]:
    """Parse the SASS tools' common arguments (REGEX, --cache, --arch, --cuobjdump, plus what ``ap``
    adds): (the arguments, the build folder, its build record's entries whose name matches REGEX)."""
    ap.add_argument("regex")
    ap.add_argument("--cache", default=os.environ.get("DFLASHGEN_CACHE", str(Path.home() / ".cache/dflashgen")))
    ap.add_argument("--arch", default="90")
    ap.add_argument("--cuobjdump", default=find_cuobjdump())
    a = ap.parse_args()
    build = Path(a.cache) / "build"
    rec = json.loads((build / f"sm_{a.arch}" / "record.json").read_text())["kernels"]
    return a, build, {n: rec[n] for n in sorted(rec) if re.search(a.regex, n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", action="store_true", help="opcode histogram per group")
    a, build, rec = built_kernels(ap)
    for name in rec:
        r = rec[name]
        body = main_loop(disassemble(a.cuobjdump, build / r["cubin"], name))
        body = [i for i in body if i[1] != "NOP"]
        groups = sum(map(is_mma, body)) / mma_per_group(name)
        if not groups:
            print(f"{name}: no MMA loop found in its SASS")
            continue
        res = r["resources"]
        print(f"{name}: {len(body) / groups:6.1f} instr/group ({len(body)} in loop, {groups:g} groups), "
              f"{res['registers']} regs, spills {res['spill_stores']}/{res['spill_loads']}")
        if a.ops:
            hist = collections.Counter(i[1].split(".")[0] for i in body)
            print("   ", ", ".join(f"{k} {v / groups:.1f}" for k, v in hist.most_common()))


if __name__ == "__main__":
    main()
