"""Wheel-time AOT kernels: with DFLASHGEN_AOT_ARCHS="70 80 90", building the wheel also compiles
every generated kernel for those archs (the ninja build, pip CUDA 12 toolchain) and packs cubin +
PTX into dflashgen/generated/bin, so a machine with only the NVIDIA driver loads them directly.
Without the variable (the default, and every editable install) kernels compile on first use."""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        archs = os.environ.get("DFLASHGEN_AOT_ARCHS", "").split()
        if not archs or self.editable_mode:
            return
        out = os.path.join(self.build_lib, "dflashgen", "generated", "bin")
        code = ("import sys; from pathlib import Path; from dflashgen.runtime.images import package_binaries; "
                "print(package_binaries([int(a) for a in sys.argv[2:]], Path(sys.argv[1])), 'kernels packaged')")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(self.build_lib)}
        subprocess.run([sys.executable, "-c", code, out, *archs], check=True, env=env)


setup(cmdclass={"build_py": BuildPyWithKernels})
