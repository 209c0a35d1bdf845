"""Which global loads each sm_90 GEMM issues before griddepcontrol.wait (SASS ACQBULK).

Under programmatic dependent launch a kernel may start while the previous one still writes its
inputs, so only the prepacked weight and scale streams may be read before the wait; activations
must come after it. ptxas schedules freely around the wait (it moved weight loads after it, and
hoisted ld.global.nc activation loads above it once the weights were pinned), so this reads the
SASS of built cubins and reports, per kernel, the loads ahead of the wait: weight stream loads
(LDG .NA.128, L1::no_allocate), block-scale loads (32-bit LDG .CONSTANT) and anything else --
which is an error.

    python tools/pdl_order.py --cache DIR [--cuobjdump PATH] [--only REGEX] [-v]

Exit status 1 when some kernel reads something other than weights or scales before the wait.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;")


def before_wait(sass: str) -> dict[str, list[str] | None]:
    """Per function: the load instructions scheduled before its first ACQBULK (None: no ACQBULK)."""
    out: dict[str, list[str] | None] = {}
    fn = None
    loads: list[str] = []
    done = False
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            if fn is not None:
                out[fn] = loads if done else None
            fn, loads, done = m.group(1), [], False
            continue
        ins = INSTR.search(line)
        if fn is None or done or not ins:
            continue
        op = ins.group(1)
        if "ACQBULK" in op:
            done = True
        elif re.search(r"\bLDG|\bLDGSTS|\bLD\.E", op):
            loads.append(op)
    if fn is not None:
        out[fn] = loads if done else None
    return out


def classify(op: str, w_async: bool = False) -> str:
    """w_async (kernels named `_wa1_`): the weight ring is filled by cp.async, so its 16-byte
    LDGSTS are weight words and its 4-byte ones block scales (and LDGDEPBAR closes each group); in
    any other kernel an LDGSTS is an activation copy."""
    if ".NA.128" in op:
        return "weight"
    if re.search(r"LDG\.E\.CONSTANT\b", op):  # 32-bit block scales (__ldg)
        return "scale"
    if w_async and op.startswith("LDGSTS"):
        return "weight" if ".128" in op else "scale"
    if w_async and op == "LDGDEPBAR":
        return "commit"
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True, help="a DFLASHGEN_CACHE with sm_90 builds")
    ap.add_argument("--cuobjdump", default="cuobjdump")
    ap.add_argument("--only", default=None, help="regex on kernel names")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    cubins = sorted(Path(a.cache, "build", "sm_90").glob("*/*.cubin"))
    if a.only:
        cubins = [c for c in cubins if re.search(a.only, c.stem)]
    bad = 0
    counts: dict[tuple[int, int], int] = {}
    for c in cubins:
        sass = subprocess.run([a.cuobjdump, "-sass", str(c)], capture_output=True, text=True, check=True).stdout
        for fn, loads in before_wait(sass).items():
            if loads is None:
                continue
            kinds = [classify(op, "_wa1_" in fn) for op in loads]
            other = [op for op, k in zip(loads, kinds, strict=True) if k == "other"]
            key = (kinds.count("weight"), kinds.count("scale"))
            counts[key] = counts.get(key, 0) + 1
            if other:
                bad += 1
                print(f"ERROR {fn}: reads before griddepcontrol.wait: {other}")
            elif a.verbose:
                print(f"{fn}: {key[0]} weight + {key[1]} scale loads before the wait")
    print(f"{len(cubins)} cubins; (weight, scale) loads ahead of the wait -> kernels: {dict(sorted(counts.items()))}; "
          f"{bad} kernel(s) read something else first")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
