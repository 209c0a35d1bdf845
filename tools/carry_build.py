"""Trim a build folder to what a GPU machine without this arch's toolchain needs (the H200 has no
CUDA 12, so it cannot compile sm_70): the arch's build record and the files it lists for the
manifest's current kernels. Everything else (older fingerprints, sources, other archs) goes, and
what is left is packed into <cache>/build.tar.gz (PTX and cubins: ~31 MB -> ~5 MB; the device tool
carries at most 64 MB with the working tree), which tools/gpu_env.sh unpacks on the GPU machine.

  DFLASHGEN_CACHE=$PWD/.build dflashgen build --arch 70 -j 2 -q && python tools/carry_build.py .build
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path

from dflashgen.render import load_manifest


def main(cache: str = ".build", arch: int = 70) -> None:
    build = Path(cache) / "build"
    record = build / f"sm_{arch}" / "record.json"
    if not record.exists():
        packed = " (already packed: rebuild to repack)" if (Path(cache) / "build.tar.gz").exists() else ""
        sys.exit(f"no {record}{packed}: run `dflashgen build --arch {arch}` with DFLASHGEN_CACHE={cache} first")
    kernels = json.loads(record.read_text())["kernels"]
    current = {e["name"]: e["source_sha256"] for e in _entries(arch)}
    stale = sorted(n for n in current if kernels.get(n, {}).get("source_sha256") != current[n])
    if stale:
        sys.exit(f"{len(stale)} kernels missing or stale in {record} (e.g. {stale[0]}): rebuild first")
    keep = {record} | {build / r[f] for n, r in kernels.items() if n in current for f in ("ptx", "cubin", "log")}
    keep_dirs = {p.parent for p in keep}
    for p in sorted(build.iterdir()):
        if p.is_dir() and p.name != f"sm_{arch}":
            shutil.rmtree(p)
    for d in sorted((build / f"sm_{arch}").iterdir()):
        if d.is_dir() and d not in keep_dirs:
            shutil.rmtree(d)
        elif d.is_dir():
            for f in d.iterdir():
                if f not in keep:
                    f.unlink()
    # the record keeps only what is carried, so it never lists a file that is gone
    record.write_text(json.dumps({**json.loads(record.read_text()),
                                  "kernels": {n: r for n, r in kernels.items() if n in current}}, indent=1,
                                 sort_keys=True))
    packed = Path(cache) / "build.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(build, arcname="build")
    shutil.rmtree(build)
    size = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file())
    print(f"{len(current)} sm_{arch} kernels kept in {packed} ({size / 2**20:.0f} MiB in {cache})")


def _entries(arch: int) -> list[dict]:
    from dflashgen.build import all_entries

    return [e for e in all_entries(load_manifest()) if e["arch"] == arch]


if __name__ == "__main__":
    main(*sys.argv[1:2])
