"""Host-to-device copies that never stall the host.

A copy from pageable host memory may make ``cudaMemcpyAsync`` wait until the stream has drained, so
the host stops queueing work while the GPU runs dry: in the decode loop each such copy (uniforms,
drafts, rollback lengths, slot indices) left the GPU idle for the host's next few launches. Staging
through pinned memory makes the copy truly asynchronous; torch's caching host allocator keeps the
pinned block alive until the copy on the stream has run."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensor_on", "to_device"]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t.to(device)``; from CPU to a CUDA device through pinned memory, asynchronously."""
    dev = torch.device(device)
    if dev.type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def tensor_on(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` without a host stall."""
    return to_device(torch.tensor(data, dtype=dtype), device)
