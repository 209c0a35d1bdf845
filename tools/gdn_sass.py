"""SASS instruction counts of built "gdn" step / advance kernels (evidence without a GPU: the step is
issue-bound). Per function: total instructions, those before the first barrier (the staging), the
loops there (body sizes: a trip runs its body once), and the position loop (the one with the FMULs):
its body and its body without the commit-store block (the last forward branch inside it), which is
what every position but the committed one runs. Needs cuobjdump (cu13 wheel: sm_80 / sm_90).

    python tools/gdn_sass.py [--cache DIR] [--arch 90] [--cuobjdump PATH] REGEX
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
from pathlib import Path

from sass_count import built_kernels  # tools/ is the script's folder

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
RES = re.compile(r"Function (\S+):\s+REG:(\d+).*?SHARED:(\d+)", re.S)


def functions(cuobjdump: str, cubin: Path) -> dict[str, list[tuple[int, str, str]]]:
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    out: dict[str, list[tuple[int, str, str]]] = {}
    cur = None
    for line in text.splitlines():
        if "Function :" in line:
            cur = line.split("Function :")[1].strip()
            out[cur] = []
            continue
        m = LINE.search(line)
        if m and cur is not None and m.group(3) != "NOP":
            out[cur].append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def _target(args: str) -> int:
    return int(args.strip().split()[-1], 16)


def analyse(ins: list[tuple[int, str, str]]) -> dict[str, object]:
    end = max(a for a, op, _ in ins if op == "EXIT")
    ins = [i for i in ins if i[0] <= end]
    bar = min((a for a, op, _ in ins if op.startswith("BAR")), default=end)
    loops = [(_target(args), a) for a, op, args in ins if op == "BRA" and _target(args) < a]
    bodies = [[i for i in ins if lo <= i[0] <= hi] for lo, hi in loops]
    main = [b for b in bodies if any(i[1].startswith("FMUL") for i in b)][-1]
    fwd = [(a, _target(args)) for a, op, args in main if op == "BRA" and _target(args) > a]
    skipped = sum(1 for i in main if fwd[-1][0] < i[0] < fwd[-1][1]) if len(fwd) > 1 else 0
    return {
        "instructions": len(ins),
        "before_barrier": sum(1 for i in ins if i[0] < bar),
        "staging_loops": [len(b) for b, (lo, hi) in zip(bodies, loops, strict=True) if hi < bar],
        "position_loop": len(main),
        "position_loop_without_commit": len(main) - skipped,
        "position_ops": dict(collections.Counter(i[1].split(".")[0] for i in main).most_common(10)),
    }


def main() -> None:
    a, build, rec = built_kernels(argparse.ArgumentParser())
    for name in rec:
        cubin = build / rec[name]["cubin"]
        res = subprocess.run([a.cuobjdump, "-res-usage", str(cubin)], check=True, capture_output=True,
                             text=True).stdout
        usage = {m.group(1).rstrip(":"): (int(m.group(2)), int(m.group(3))) for m in RES.finditer(res)}
        for fn, ins in functions(a.cuobjdump, cubin).items():
            regs, smem = usage.get(fn, (-1, -1))
            print(f"{fn}: {regs} regs, {smem} B static shared", json.dumps(analyse(ins)))


if __name__ == "__main__":
    main()
