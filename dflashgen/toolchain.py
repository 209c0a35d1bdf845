"""Compilers: NVRTC 12.9 + ptxas 12.9 from the pip wheels (no system CUDA needed, and the only way
to reach compute_70 once the system has CUDA 13), or the system nvcc for the archs it supports.

Also a tiny CLI used by the generated build.ninja: ``python -m dflashgen.toolchain nvrtc ...``.
Importing this module must stay cheap (no torch): ninja runs it once per kernel.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

CXX_FLAGS = ("-std=c++17", "-DNDEBUG")


class ToolchainError(RuntimeError):
    """A compiler is missing or failed."""


def _pkg_dir(mod: str) -> Path | None:
    spec = importlib.util.find_spec(mod)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _need(path: Path | None, what: str, wheel: str) -> Path:
    if path is None or not path.exists():
        raise ToolchainError(f"{what} not found; install it with `pip install {wheel}`")
    return path


@lru_cache(maxsize=1)
def nvrtc_lib() -> Path:
    d = _pkg_dir("nvidia.cuda_nvrtc")
    return _need(d / "lib" / "libnvrtc.so.12" if d else None, "NVRTC 12 (libnvrtc.so.12)",
                 "nvidia-cuda-nvrtc-cu12")


@lru_cache(maxsize=1)
def pip_ptxas() -> Path:
    d = _pkg_dir("nvidia.cuda_nvcc")
    return _need(d / "bin" / "ptxas" if d else None, "ptxas 12.x", "nvidia-cuda-nvcc-cu12")


def headers_dir() -> Path:
    """The kernel headers' include root (templates/include) of this install: the build hashes the
    headers found here and hands the same folder to the compiler (build.ninja --headers), so a
    fingerprint never names headers other than those compiled."""
    return Path(str(_pkg_dir("dflashgen.templates") or Path(__file__).parents[1] / "templates")) / "include"


@lru_cache(maxsize=4)
def include_dirs(nvcc: bool = False, headers: Path | None = None) -> tuple[Path, ...]:
    """Our kernel headers (``headers``: the build's choice, else this install's) and CUTLASS/CuTe;
    for NVRTC also libcu++ (cuda/std) and the CUDA runtime headers from the pip wheels (nvcc brings
    its own)."""
    here = headers or headers_dir()
    cutlass = _pkg_dir("cutlass_library")
    # DFLASHGEN_CUTLASS_INCLUDE: a CUTLASS checkout (or header subset) instead of the wheel's
    cutlass_inc = Path(os.environ["DFLASHGEN_CUTLASS_INCLUDE"]) if os.environ.get("DFLASHGEN_CUTLASS_INCLUDE") \
        else (cutlass / "source" / "include" if cutlass else None)
    ours = (here, _need(cutlass_inc, "CUTLASS headers", "nvidia-cutlass"))
    if nvcc:
        return ours
    rt, cccl = _pkg_dir("nvidia.cuda_runtime"), _pkg_dir("nvidia.cuda_cccl")
    return (
        *ours,
        _need(cccl / "include" if cccl else None, "libcu++ headers", "nvidia-cuda-cccl-cu12"),
        _need(rt / "include" if rt else None, "CUDA runtime headers", "nvidia-cuda-runtime-cu12"),
    )


@lru_cache(maxsize=1)
def system_nvcc() -> Path | None:
    for cand in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        p = Path(cand) / "bin" / "nvcc"
        if cand and p.exists():
            return p
    which = shutil.which("nvcc")
    return Path(which) if which else None


@cache
def _tool_version(tool: str) -> str:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as e:
        raise ToolchainError(f"cannot run {tool}: {e}") from e
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def nvrtc_version() -> str:
    lib = ctypes.CDLL(str(nvrtc_lib()))
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


@dataclass(frozen=True)
class Plan:
    """How one arch is compiled: frontend (C++ -> PTX) and ptxas (PTX -> cubin)."""

    arch: int
    frontend: str  # "nvrtc" | "nvcc"
    ptxas: str
    version: str  # toolchain identity for the build fingerprint

    def describe(self) -> str:
        return f"{self.frontend} + {self.ptxas} ({self.version})"


def nvcc_supports(arch: int) -> bool:
    nvcc = system_nvcc()
    if nvcc is None:
        return False
    major = int(_tool_version(str(nvcc)).split(".")[0])
    return not (arch < 75 and major >= 13)  # CUDA 13 dropped sm_70/sm_72


def plan_for(arch: int, prefer: str = "auto") -> Plan:
    """sm_70 always uses the pip CUDA 12.9 toolchain; newer archs use the system nvcc when it is
    there (prefer='auto'), else NVRTC."""
    if prefer == "prebuilt":  # AOT-only: never compile, use what the build folder already holds
        raise ToolchainError("compiling disabled (AOT-only)")
    use_nvcc = prefer == "nvcc" or (prefer == "auto" and arch >= 75 and nvcc_supports(arch))
    if use_nvcc:
        nvcc = system_nvcc()
        if nvcc is None or not nvcc_supports(arch):
            raise ToolchainError(f"system nvcc cannot build sm_{arch}")
        ptxas = nvcc.parent / "ptxas"
        return Plan(arch, "nvcc", str(ptxas), f"nvcc {_tool_version(str(nvcc))}")
    ptxas = pip_ptxas()
    return Plan(arch, "nvrtc", str(ptxas), f"nvrtc {nvrtc_version()} ptxas {_tool_version(str(ptxas))}")


def nvrtc_compile(src: Path, out: Path, arch: int | str, extra: tuple[str, ...] = (),
                  headers: Path | None = None) -> str:
    """CUDA C++ -> PTX for compute_<arch> with NVRTC (arch "90a": the arch-specific target, for
    wgmma). Returns the compiler log."""
    lib = ctypes.CDLL(str(nvrtc_lib()))
    prog = ctypes.c_void_p()
    code = src.read_bytes()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code, src.name.encode(), 0, None, None) != 0:
        raise ToolchainError(f"nvrtcCreateProgram failed for {src}")
    opts = [f"--gpu-architecture=compute_{arch}", "-default-device", *CXX_FLAGS, *extra]
    opts += [f"-I{d}" for d in include_dirs(headers=headers)]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if rc != 0:
        raise ToolchainError(f"NVRTC failed on {src}:\n{text}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    _atomic_write(out, ptx.value)
    return text


_FUNCTION = re.compile(r"^(?:\.(?:visible|weak|extern) )*\.(?:entry|func) ", re.M)
_ENTRY_NAME = re.compile(r"^(?:\.visible )?\.entry (\w+)\(")


def split_ptx(text: str) -> dict[str, str]:
    """A PTX module with several kernels (one build unit) -> one module per kernel: the module-scope
    text (version, target, declarations and any device functions) plus that kernel, its labels and
    local depot numbered as in a module of its own, so it equals a lone compile of the kernel up to
    the unit's internal-name hash."""
    cuts = [m.start() for m in _FUNCTION.finditer(text)]
    blocks = [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)], strict=True)]
    shared = text[:cuts[0]] if cuts else text
    shared += "".join(b for b in blocks if not _ENTRY_NAME.match(b))
    out = {}
    for b in blocks:
        if m := _ENTRY_NAME.match(b):
            b = b[:b.rindex("}") + 1] + "\n"  # what follows is the next kernel's `// .globl` comment
            b = re.sub(r"\$L__BB\d+_", "$L__BB0_", b)
            out[m.group(1)] = shared + re.sub(r"__local_depot\d+", "__local_depot0", b)
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def fingerprint(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


_RES = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")


def parse_ptxas_log(text: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {entry: {registers, spill_stores, spill_loads, smem}}."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            cur = m.group(1)
            out[cur] = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0}
        elif cur is None:
            continue
        elif m := _SPILL.search(line):
            out[cur]["spill_stores"], out[cur]["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif m := _RES.search(line):
            out[cur]["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                out[cur]["smem"] = int(s.group(1))
    return out


def _target(text: str) -> str:
    """A compute_/sm_ target suffix: digits, optionally with the arch-specific 'a' (90a)."""
    if not re.fullmatch(r"\d+a?", text):
        raise argparse.ArgumentTypeError(f"bad arch {text!r} (want e.g. 90 or 90a)")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflashgen.toolchain")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, what in (("nvrtc", "CUDA C++ -> PTX with NVRTC 12"), ("nvcc-ptx", "CUDA C++ -> PTX with the system nvcc")):
        p = sub.add_parser(cmd, help=what)
        p.add_argument("src", type=Path)
        p.add_argument("-o", "--out", type=Path, required=True)
        p.add_argument("--arch", type=_target, required=True)
        # the kernel headers the build hashed (build.ninja passes them; default: this install's)
        p.add_argument("--headers", type=Path, default=None)
    p = sub.add_parser("split-ptx", help="split a build unit's PTX into one module per kernel")
    p.add_argument("src", type=Path)
    p.add_argument("entries", nargs="+", help="NAME=OUT: where each kernel's module goes")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "split-ptx":
            mods = split_ptx(args.src.read_text())
            for spec in args.entries:
                name, _, out = spec.partition("=")
                if name not in mods:
                    raise ToolchainError(f"{args.src} has no kernel {name}")
                _atomic_write(Path(out), mods[name].encode())
            return 0
        if args.cmd == "nvrtc":
            log = nvrtc_compile(args.src, args.out, args.arch, headers=args.headers)
            log = "\n".join(x for x in log.splitlines() if "deprecated" not in x and x.strip())
            if log:
                print(log, file=sys.stderr)
        else:
            nvcc = system_nvcc()
            if nvcc is None:
                raise ToolchainError("no system nvcc")
            tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}.tmp")
            # arch-specific targets (90a) in the -gencode form: the `-arch=sm_90a` shorthand also ran
            # a plain sm_90 pass that rejected wgmma (nvcc 13.0, HOPPER.md)
            arch = (f"-gencode=arch=compute_{args.arch},code=compute_{args.arch}" if args.arch.endswith("a")
                    else f"-arch=compute_{args.arch}")
            cmd = [str(nvcc), "-ptx", arch, *CXX_FLAGS, "-o", str(tmp), str(args.src)]
            cmd += [f"-I{d}" for d in include_dirs(nvcc=True, headers=args.headers)]
            subprocess.run(cmd, check=True)
            os.replace(tmp, args.out)
    except (ToolchainError, subprocess.CalledProcessError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
