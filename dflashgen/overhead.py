"""`dflashgen overhead`: host cost of one projection call outside CUDA graphs, and its cost inside one.

Method: a projection whose kernel takes a few microseconds (GDN in_proj_qkvzba at TP4: N=4120,
K=5120, split-K; o_proj at TP4: N=5120, K=1536; one launch each: a split-K kernel sums its partials
itself since session 5, where it used to take a second, reduce launch) is called
200 times back to back and the host's wall time is taken before waiting for the GPU: with the launch
queue never full, that is the host overhead per call whatever the kernel's own time. Each layer of
the call stack is measured the same way (the bare driver launch, GemmKernel with validation,
KernelLibrary dispatch, the prepared launch alone, QuantLinear's eager call, and the torch custom op
that torch.compile sees), and so are torch's own peers on the same shapes: an empty nn.Module call,
an output allocation, an in-place elementwise op (torch's cheapest kernel launch), and
``F.linear`` on an FP16 weight (cuBLAS). Inside a CUDA graph the same calls are captured and
replayed; per call that must equal the kernel time (CUDA events). (Before the GDN input projections
were fused, the first projection was in_proj_ba: N=24.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def host_us(fn: Callable[[], Any], calls: int = 200, repeats: int = 7) -> float:
    """Host time per call: ``calls`` back-to-back calls timed without waiting for the GPU. Few
    enough to stay well inside the driver's launch queue (~1000 entries), so the host never blocks
    on a full queue and a kernel slower than the host cannot inflate the figure."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)  # min: the least-disturbed run
    return best


def graph_us(fn: Callable[[], Any], calls: int = 200) -> float:
    """Per-call time of ``calls`` back-to-back calls captured in one CUDA graph."""
    from .timing import graph_time

    return graph_time(lambda _: fn(), copies=calls, replays=5, repeats=3).us


def _projection(lib: Any, problem: str, n: int, k: int, segments: tuple[int, ...], m: int) -> dict[str, Any]:
    """A projection's stack: its M-bucket kernel, packed weight, module, activations, output."""
    from dflashgen.runtime import GemmKernel
    from dflashgen.runtime.linear import QuantLinear
    from dflashgen.verify import native_kernels, random_nvfp4

    dev = lib.device
    images, groups = native_kernels(lib.arch)
    entry = next(e for e in groups[f"sm{lib.arch}/nvfp4/store/{problem}"] if e["tile"]["rows"] == 8)
    w = random_nvfp4(n, k, segments, dev, torch.Generator(device=dev).manual_seed(0))
    return {
        "entry": entry, "packed": lib.pack(w), "mod": QuantLinear(w, problem, library=lib),
        "kern": GemmKernel(entry, images[entry["name"]][0], max_m=64, device=dev),
        "x": torch.randn(m, k, device=dev, dtype=torch.float16),
        "y": torch.empty(m, n, device=dev, dtype=torch.float16),
    }


def _raw_launch(p: dict[str, Any], m: int) -> Callable[[], None]:
    """The main kernel's launch alone, every argument in place (one ctypes call into the driver):
    the floor of any Python path."""
    launch = p["kern"].prepare(p["packed"], m)
    launch.launch(p["x"].data_ptr(), p["y"].data_ptr(), torch.cuda.current_stream().cuda_stream)
    return launch._main.launch


def _raw_launch_argtypes(p: dict[str, Any], m: int) -> Callable[[], None]:
    """The same launch through ``Function.launch_pack`` (ctypes converts the 11 Python-int
    arguments on each call): the floor the figures before the prepared launches were read against."""
    launch = p["kern"].prepare(p["packed"], m)
    launch.launch(p["x"].data_ptr(), p["y"].data_ptr(), torch.cuda.current_stream().cuda_stream)
    main = launch._main
    grid, block, stream = tuple(g.value for g in main.grid), (p["kern"].threads, 1, 1), main.stream.value or 0
    return lambda: main.fn.launch_pack(grid, block, main.pack, stream)


class _Empty(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


# (key, label) in table order; keys without a prefix are in_proj_qkvzba's, "o_proj_" + key o_proj's
TABLE = (
    ("raw_launch_us", "driver: bare cuLaunchKernel (ctypes, arguments in place)"),
    ("raw_launch_argtypes_us", "driver: cuLaunchKernel, ctypes converting 11 ints"),
    ("prepared_launch_us", "dflashgen: prepared launch (checks x, allocates y, launches)"),
    ("quant_linear_us", "dflashgen: QuantLinear eager call"),
    ("quant_linear_above_driver_us", "dflashgen: QuantLinear minus its bare launches"),
    ("quant_linear_out_us", "dflashgen: QuantLinear eager call, out= given (no allocation)"),
    ("quant_linear_out_above_driver_us", "dflashgen: QuantLinear out= minus its bare launches"),
    ("gemm_kernel_us", "dflashgen: GemmKernel (full validation, out given)"),
    ("library_dispatch_us", "dflashgen: KernelLibrary.gemm (out given)"),
    ("custom_op_us", "dflashgen: torch custom op (what torch.compile sees)"),
    ("torch_module_call_us", "torch: empty nn.Module call"),
    ("torch_empty_us", "torch: allocate y (x.new_empty)"),
    ("torch_add_us", "torch: x.add_(0) (an elementwise launch, no allocation)"),
    ("torch_linear_fp16_us", "torch: F.linear on an FP16 weight (cuBLAS + allocation)"),
    ("kernel_in_graph_us", "in a CUDA graph: per call (= kernel time)"),
    ("quant_linear_in_graph_us", "in a CUDA graph: QuantLinear per call"),
)


def markdown(res: dict[str, float]) -> str:
    """The figures as a Markdown table: one row per measurement, one column per projection."""
    rows = ["| host us per call | in_proj_qkvzba TP4 (split-K, 1 launch) | o_proj TP4 (1 launch) |",
            "|---|---:|---:|"]
    for key, label in TABLE:
        a, b = res.get(key), res.get(f"o_proj_{key}")
        if a is not None or b is not None:
            rows.append(f"| {label} | {'' if a is None else f'{a:.2f}'} | {'' if b is None else f'{b:.2f}'} |")
    return "\n".join(rows)


def run(out: Path | None = None, m: int = 8) -> dict[str, float]:
    """Per projection (in_proj_qkvzba at TP4, split-K; o_proj at TP4; one launch per call each):
    host us per call at each layer of the stack, the driver's bare launch, torch's peers, and
    ``*_above_driver_us``: QuantLinear's host cost minus the driver launch it must make (what
    dflashgen's Python adds)."""
    from dflashgen.runtime.library import KernelLibrary
    from dflashgen.runtime.linear import quant_linear

    dev = torch.device("cuda", torch.cuda.current_device())
    lib = KernelLibrary(device=dev, on_mismatch="fallback")
    res: dict[str, float] = {}
    empty = _Empty()
    # in_proj_qkvzba's TP4 rank shard: q, k (4 key heads x 128), v, z (12 value heads x 128), b, a
    for label, problem, n, k, segs in (("in_proj_qkvzba", "n4120/k5120", 4120, 5120, (4096, 24)),
                                       ("o_proj", "n5120/k1536", 5120, 1536, (5120,))):
        p = _projection(lib, problem, n, k, segs, m)
        kern, packed, mod, x, y = p["kern"], p["packed"], p["mod"], p["x"], p["y"]
        prepared = kern.prepare(packed, m)
        w16 = mod.dequantize().to(torch.float16)
        xa = x.clone()
        r = {
            "raw_launch_us": host_us(_raw_launch(p, m)),
            "raw_launch_argtypes_us": host_us(_raw_launch_argtypes(p, m)),
            "gemm_kernel_us": host_us(lambda kern=kern, x=x, packed=packed, y=y: kern(x, packed, y)),
            "library_dispatch_us": host_us(lambda x=x, packed=packed, y=y: lib.gemm(x, packed, y)),
            "prepared_launch_us": host_us(lambda prepared=prepared, x=x, shape=(m, n): prepared(x, shape)),
            "quant_linear_us": host_us(lambda mod=mod, x=x: mod(x)),  # eager: the module's prepared launch
            "quant_linear_out_us": host_us(lambda mod=mod, x=x, y=y: mod(x, out=y)),
            "custom_op_us": host_us(lambda mod=mod, x=x: quant_linear(x, mod.weights, mod.scales, mod.col_scale,
                                                                      mod._handle)),
            "torch_module_call_us": host_us(lambda x=x: empty(x)),
            "torch_empty_us": host_us(lambda x=x, shape=(m, n): x.new_empty(shape)),
            "torch_add_us": host_us(lambda xa=xa: xa.add_(0)),
            "torch_linear_fp16_us": host_us(lambda x=x, w16=w16: torch.nn.functional.linear(x, w16)),
            "kernel_in_graph_us": graph_us(lambda kern=kern, x=x, packed=packed, y=y: kern(x, packed, y)),
            "quant_linear_in_graph_us": graph_us(lambda mod=mod, x=x: mod(x)),
            "split_k": float(kern.split_k),  # split-K or not, one launch per call
            "quant_linear_on_kernel": float(mod.prepare(m) is not None),  # 0: the table sends M to cuBLAS
        }
        r["quant_linear_above_driver_us"] = r["quant_linear_us"] - r["raw_launch_us"]
        r["quant_linear_out_above_driver_us"] = r["quant_linear_out_us"] - r["raw_launch_us"]
        res.update({(k_ if label == "in_proj_qkvzba" else f"{label}_{k_}"): v for k_, v in r.items()})
    if out:
        out.write_text(json.dumps(res, indent=1))
    return res
