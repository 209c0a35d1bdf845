"""Record per-problem kernel hashes in a `dflashgen tune` measurements report made before the tuner
kept them (session 41), so `dflashgen tune --carry` can keep its unchanged problems.

The report's fingerprint names the whole kernel library it timed (kernel_library); MANIFEST must be
that library's manifest (e.g. `git show <commit>:generated/manifest.json`): checked against it with
today's GEMM sources, then each problem gets the hash of its own entries. A mismatch stops here: a
hash is only written where what was timed is known.

    python tools/journal_hashes.py REPORT.json[.gz] MANIFEST.json OUT.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from dflashgen.runtime.library import library_hash

from dflashgen.tune import problem_kernels_hash, read_measurements
from dflashgen.verify import manifest_problems


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("report", type=Path)
    ap.add_argument("manifest", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    rep = read_measurements(a.report)
    kernels = json.loads(a.manifest.read_text())["kernels"]
    want = rep["fingerprint"]["kernel_library"]
    if library_hash(kernels) != want:
        print(f"{a.manifest} hashes to {library_hash(kernels)}, the report timed {want}: not its manifest "
              "(or the GEMM sources changed since)", file=sys.stderr)
        return 1
    groups = manifest_problems(None, kernels)
    for key, prob in rep["problems"].items():
        prob["kernels"] = problem_kernels_hash(groups[key])
    a.out.write_bytes(gzip.compress(json.dumps(rep, indent=1, sort_keys=True).encode()))
    print(f"{len(rep['problems'])} problems hashed -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
