"""Honest GPU timing shared by `bench` and `tune`.

- Weights rotate through enough copies that the working set is >= 3x the L2, so every call reads
  its weights from DRAM (as in a real forward, where 496 projections stream past the cache).
- The rotation loop is captured in a CUDA graph and timed with CUDA events over many replays;
  launch gaps shrink to what a graph-captured forward sees.
- Each measurement is repeated; we report the median and a noise estimate (half the IQR).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    us: float  # median time per call
    noise_us: float  # half the inter-quartile range of the per-call time

    def beats(self, other: Timing) -> bool:
        """Faster than ``other`` by more than the combined noise."""
        return self.us + self.noise_us + other.noise_us < other.us


def l2_bytes(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or getattr(props, "l2_cache_size", 0) or 64 << 20)


def copies_for(bytes_per_copy: int, device: torch.device, factor: float = 3.0, cap: int = 64) -> int:
    """How many weight copies put the working set at >= factor x L2."""
    need = int(factor * l2_bytes(device) / max(1, bytes_per_copy)) + 1
    return max(2, min(cap, need))


def graph_time(step: Callable[[int], None], copies: int, replays: int = 10, repeats: int = 7) -> Timing:
    """Time ``step(i)`` (one call using weight copy i) as a CUDA graph looping over all copies."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up outside capture: module loads, allocator, JIT
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    return replay_time(graph, copies, replays, repeats)


def replay_time(graph: torch.cuda.CUDAGraph, calls: int = 1, replays: int = 10, repeats: int = 7) -> Timing:
    """Per call (us) of a captured graph holding ``calls`` calls: CUDA events around ``replays``
    back-to-back replays, median and half-IQR over ``repeats`` such samples."""
    samples = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            graph.replay()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) * 1e3 / (replays * calls))
    q = statistics.quantiles(samples, n=4) if len(samples) >= 4 else [min(samples), 0, max(samples)]
    return Timing(statistics.median(samples), (q[2] - q[0]) / 2)


def read_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Measured DRAM read bandwidth in GB/s (a reduction over a buffer far larger than L2)."""
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    out = torch.empty((), dtype=torch.float32, device=device)

    def step(_: int) -> None:
        torch.sum(x, dim=0, dtype=torch.float32, out=out)

    t = graph_time(step, copies=1, replays=5, repeats=5)
    return nbytes / (t.us * 1e-6) / 1e9


def tensor_tflops(device: torch.device, size: int = 8192) -> float:
    """Measured dense FP16 tensor-core rate in TFLOP/s (FP32 accumulation): cuBLAS on a square GEMM
    large enough to run at its peak. The MMA floor of a projection at M rows is 2 M N K over this."""
    a = torch.randn(size, size, dtype=torch.float16, device=device)
    b = torch.randn(size, size, dtype=torch.float16, device=device)
    c = torch.empty(size, size, dtype=torch.float16, device=device)

    def step(_: int) -> None:
        torch.mm(a, b, out=c)

    t = graph_time(step, copies=1, replays=3, repeats=5)
    return 2 * size**3 / (t.us * 1e-6) / 1e12
