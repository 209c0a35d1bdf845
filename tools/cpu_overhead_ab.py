"""CPU A/B of the host cost per projection call: another commit's runtime vs this worktree's, in one
process (no GPU needed). CUDA-ness is faked on CPU tensors and cuLaunchKernel is replaced by libc
``abs`` through ctypes with the same 11 arguments (so ctypes' marshalling is real); the figures are
per-call process time, min over interleaved rounds. Usage: python tools/cpu_overhead_ab.py [REF]
(default HEAD~1: the runtime before the last commit)."""

from __future__ import annotations

import ctypes
import importlib
import sys
import time
import timeit
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ref_runtime import old_runtime  # tools/ (run as a script)

from dflashgen.quant import quantize_nvfp4
from dflashgen.render import load_manifest

ROOT = Path(__file__).resolve().parent.parent


def _fake_cuda(pkgs: list[str]) -> None:
    torch.Tensor.is_cuda = property(lambda self: True)  # type: ignore[method-assign,assignment]
    torch.Tensor.get_device = lambda self: 0  # type: ignore[method-assign]
    torch._C._cuda_getCurrentRawStream = lambda i: 7  # type: ignore[attr-defined]
    typed = ctypes.PyDLL("libc.so.6").abs
    typed.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    typed.restype = ctypes.c_int
    untyped = ctypes.PyDLL("libc.so.6")["abs"]
    untyped.restype = ctypes.c_int
    for pkg in pkgs:
        drv, kmod, lmod = (importlib.import_module(f"{pkg}.{m}") for m in ("driver", "kernels", "library"))

        class Fn:
            launch_pack = drv.Function.launch_pack

            def __init__(self, name: str) -> None:
                self.name, self.handle, self._raw_handle = name, 0, 0

        drv._raw_launch = lambda: typed
        drv._untyped_launch = lambda: untyped
        if hasattr(drv, "stream_getter"):
            drv.stream_getter.cache_clear()
        # runtimes before session 5: main + split-K reduce functions; since: one function
        kmod.GemmKernel._functions = lambda self, Fn=Fn: (Fn(self.name), Fn(self.name) if self.split_k > 1 else None)
        kmod.GemmKernel._function = lambda self, Fn=Fn: Fn(self.name)
        kmod.GemmKernel._validate_weight = lambda self, w: None
        lmod.native_arch = lambda d: 90
        lmod.machine_fingerprint = lambda d: {}
        lmod.default_table_path = lambda d: Path("/nonexistent")


def _stack(pkg: str, entry: dict[str, Any], w: Any) -> tuple[Any, Any, Any, Any]:
    lmod, kmod, linmod = (importlib.import_module(f"{pkg}.{m}") for m in ("library", "kernels", "linear"))
    dev = torch.device("cuda", 0)
    lib = lmod.KernelLibrary(device=dev)
    lib.table = types.SimpleNamespace(lookup=lambda key, m: lmod.Choice("kernel", entry["name"], m, ""))
    kern = kmod.GemmKernel(entry, Path("/x"), max_m=1 << 16, device=dev)
    lib._kernels[entry["name"]] = kern
    ws = torch.empty(kern.split_k * 64 * kern.n_pad)
    # the stream's split-K scratch: partials (runtimes before session 5), or (partials, tickets)
    if hasattr(kern, "_tickets"):
        kern._workspaces[7] = (ws, torch.zeros(64, dtype=torch.int32))
        # spares made, so nothing asks torch.cuda about capture (`_spare`: now; `_spare_tickets`: session 5)
        kern._spare = (ws, torch.zeros(64, dtype=torch.int32))
        kern._spare_tickets = kern._spare[1]
    else:
        kern._workspaces[7] = ws
    mod = linmod.QuantLinear(w, "p", library=lib, device="cpu")
    packed = mod.packed()
    kern._last_weight = tuple(weakref.ref(t) for t in (packed.weights, packed.scales, packed.col_scale))
    return lib, kern, mod, packed


def _best(cases: dict[str, Callable[[], Any]], rounds: int = 40, number: int = 1000) -> dict[str, float]:
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, f in cases.items():
            t = timeit.Timer(f, timer=time.process_time).timeit(number=number)
            best[name] = min(best[name], t / number * 1e6)
    return best


def _compare(ref: str, old: str, entry: dict[str, Any]) -> dict[str, float]:
    n, k = entry["n"], entry["k"]
    w = quantize_nvfp4(torch.randn(n, k) * 0.02, (n,))
    x, x3, y = torch.randn(8, k).half(), torch.randn(2, 4, k).half(), torch.empty(8, n).half()
    lo, ko, mo, po = _stack(old, entry, w)
    ln, kn, mn, pn = _stack("dflashgen.runtime", entry, w)
    for mod in (mo, mn):
        for xx in (x, x, x3, x3):  # first call at each shape: validated (and prepared)
            mod(xx)
    identity = torch.nn.Identity()
    return _best({
        f"{ref} GemmKernel(x, w, out)": lambda: ko(x, po, y), "new GemmKernel(x, w, out)": lambda: kn(x, pn, y),
        f"{ref} KernelLibrary.gemm(x, w, out)": lambda: lo.gemm(x, po, y),
        "new KernelLibrary.gemm(x, w, out)": lambda: ln.gemm(x, pn, y),
        f"{ref} QuantLinear(x [8, K])": lambda: mo(x), "new QuantLinear(x [8, K])": lambda: mn(x),
        "new QuantLinear(x [8, K], out=y)": lambda: mn(x, out=y),
        f"{ref} QuantLinear(x [2, 4, K])": lambda: mo(x3), "new QuantLinear(x [2, 4, K])": lambda: mn(x3),
        "x.new_empty(y's shape)": lambda: x.new_empty((8, n)),
        "torch: empty nn.Module call": lambda: identity(x),
    })


def main(ref: str = "HEAD~1") -> None:
    import logging

    logging.getLogger("dflashgen").setLevel(logging.ERROR)
    old = old_runtime(ref)
    _fake_cuda([old, "dflashgen.runtime"])
    man = load_manifest()["kernels"]
    for label, n, k in (("in_proj_qkvzba", 4120, 5120), ("o_proj", 5120, 1536)):
        entry = next(e for e in man if e["arch"] == 90 and e["format"] == "nvfp4" and e["epilogue"] == "store"
                     and e["n"] == n and e["k"] == k and e["tile"]["rows"] == 8)
        print(f"## {label} (N={n}, K={k}, split_k={entry['kplan']['split_k']}): us per call")
        for name, v in _compare(ref, old, entry).items():
            print(f"  {name:<40} {v:6.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
