"""Launch one generated kernel a few times (for ncu) and print its SASS instruction mix. (Not named
profile.py: a script directory on sys.path would shadow the stdlib module torch imports.)

  ncu --clock-control none --section SpeedOfLight ... python3 tools/ncu_kernel.py NAME_REGEX M
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import torch
from dflashgen.runtime import GemmKernel

from dflashgen.prepack import Layout, prepack
from dflashgen.render import load_manifest
from dflashgen.verify import artifacts_for, random_fp8, random_nvfp4


def main() -> None:
    pat, m = re.compile(sys.argv[1]), int(sys.argv[2])
    e = next(k for k in load_manifest()["kernels"] if pat.search(k["name"]) and k["arch"] == 90)
    arts = artifacts_for([90], 90, f"^{e['name']}$")
    path = arts[e["name"]][1]
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    n, k = e["n"], e["k"]
    w = random_nvfp4(n, k, (n,), dev, g) if e["format"] == "nvfp4" else random_fp8(n, k, dev, g)
    packed = prepack(w, Layout(90, e["format"], e["n"], e["k"], silu=e.get("epilogue") == "silu"))
    kern = GemmKernel(e, path, 64, dev)
    x = torch.randn(m, e["k"], device=dev, dtype=torch.float16)
    for _ in range(3):
        kern(x, packed)
    torch.cuda.synchronize()
    if "--sass" in sys.argv:
        sass = subprocess.run(["cuobjdump", "-sass", str(path)], capture_output=True, text=True).stdout
        ops = Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass))
        print(e["name"], "SASS:", sum(ops.values()), "instructions")
        print(" ".join(f"{k}:{v}" for k, v in ops.most_common(30)))


if __name__ == "__main__":
    main()
