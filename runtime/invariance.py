"""Batch-invariant projections for greedy byte-identity on a GPU (``load_target(..., invariant=True)``).

A request's tokens are byte-identical alone, in any batch and under plain decoding only if every
projection computes each row the same way whatever M is. The generated kernels do (their K plan is
shared by every tile of a problem, so the reduction order never depends on M), cuBLAS does not (it
picks kernels and split-K per shape). Two tools:

- :func:`invariant_table`: a copy of a tuning table where every problem that has a kernel at some M
  dispatches a kernel at every M (fallback buckets take the nearest kernel below; one more bucket
  covers any M above the largest), so no row of it ever goes to cuBLAS. Slower where the tuner found
  cuBLAS faster (M >= 16..48) and far slower for long prefills: meant for correctness runs.
- :class:`FixedShapeLinear`: a plain (FP16) projection such as the lm_head run in slices of exactly
  ``rows`` rows (zero-padded): cuBLAS sees one shape, so each row's result depends on that row alone.
"""

from __future__ import annotations

import copy

import torch

from .table import TuningTable

__all__ = ["FixedShapeLinear", "invariant_table"]

ANY_M = 1 << 20  # the bucket that covers every larger M


def invariant_table(table: TuningTable) -> TuningTable:
    data = copy.deepcopy(table.data)
    for prob in data["problems"].values():
        buckets = sorted(prob["buckets"], key=lambda b: b["m"])
        kernels = [b for b in buckets if b["path"] == "kernel"]
        if not kernels:
            continue  # never a kernel: the fallback at every M (invariant only for a fixed shape)
        for b in buckets:
            if b["path"] != "kernel":
                below = [k for k in kernels if k["m"] <= b["m"]]
                src = below[-1] if below else kernels[0]
                b.update(path="kernel", kernel=src["kernel"], why=f"batch-invariant: {src['kernel']} at every M")
        if buckets[-1]["m"] < ANY_M:
            buckets.append({"m": ANY_M, "path": "kernel", "kernel": buckets[-1]["kernel"],
                            "why": "batch-invariant: any larger M"})
        prob["buckets"] = buckets
    return TuningTable(data, f"{table.source} (batch-invariant)")


class FixedShapeLinear(torch.nn.Module):
    """``linear(x)`` computed in zero-padded slices of exactly ``rows`` rows: one GEMM shape."""

    def __init__(self, linear: torch.nn.Linear, rows: int = 64) -> None:
        super().__init__()
        self.linear, self.rows = linear, rows

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        m = flat.shape[0]
        pad = -m % self.rows
        if pad:
            flat = torch.cat((flat, flat.new_zeros(pad, k)))
        out = torch.cat([self.linear(flat[i:i + self.rows]) for i in range(0, flat.shape[0], self.rows)])
        return out[:m].reshape(*lead, -1)
