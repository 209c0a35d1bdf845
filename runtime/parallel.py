"""Tensor parallelism over the per-rank shards :func:`~.checkpoint.load_model_projections` returns.

One process per GPU (torchrun); ``torch.distributed`` with NCCL on GPUs, gloo on CPU. Megatron /
vLLM style: column-parallel layers produce their local output slice with no communication (the next
row-parallel layer consumes exactly that slice), row-parallel layers multiply their K slice and
all-reduce the partial sums, the vocab-parallel lm_head is column-parallel plus an all_gather.

Determinism: for a fixed world size, topology, library version, message size and ``NCCL_*``
environment, NCCL's tuner picks the same algorithm / protocol / channel count every run, and Ring
and Tree both reduce in a fixed order and then broadcast the result, so every rank gets the same
bits, run to run. Gloo's CPU all-reduce (ring / bcube chosen by size) is fixed-order too. We do NOT
force ``NCCL_ALGO=Ring``: it changes nothing about run-to-run determinism (the tuner's choice is
already a pure function of the above), it would override the operator's tuning for every other
collective in the process, and it would not protect against an NCCL upgrade either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dflashgen.model import SUPPORTED_TP, ModelConfig, derive_projections

from .checkpoint import layer_projections
from .linear import QuantLinear

__all__ = ["ColumnParallel", "RowParallel", "TPContext", "broadcast_from_first", "init_tp", "wrap_projections"]

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class TPContext:
    """This process's place in the tensor-parallel group. ``group`` is None without a process group
    (world size 1): the wrappers then never communicate."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None = None
    group: dist.ProcessGroup | None = None

    def close(self) -> None:
        if self.group is not None and dist.is_initialized():
            if self.backend == "gloo":
                # every rank past its last collective before any tears gloo down: a rank destroying
                # the group while its peer still used a connection aborted ("terminate called without
                # an active exception", once in CI on 2 cores)
                dist.barrier()
            dist.destroy_process_group()


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _read_env(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables; unset means a single process."""
    world = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local = _env_int(env, "LOCAL_RANK", rank)
    if world not in SUPPORTED_TP:  # derive_projections can only shard over these
        raise ValueError(f"WORLD_SIZE={world} is not a supported TP degree {SUPPORTED_TP}")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    if local < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local}")
    return rank, world, local


def init_tp(backend: str | None = None) -> TPContext:
    """Join (or reuse) the default process group from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT. backend: "nccl" (default with CUDA) or "gloo" (default without). Each rank uses
    ``cuda:LOCAL_RANK`` with NCCL, the CPU with gloo. WORLD_SIZE unset or 1 gives a TP1 context
    with no process group."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    if dist.is_initialized():  # the engine already set one up (any init method): use it
        rank, world = dist.get_rank(), dist.get_world_size()
        local = _env_int(os.environ, "LOCAL_RANK", rank)
        backend = str(dist.get_backend())
        if world not in SUPPORTED_TP:
            raise ValueError(f"the process group's world size {world} is not a supported TP degree {SUPPORTED_TP}")
    else:
        rank, world, local = _read_env(os.environ)
    if "nccl" in backend:
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)  # NCCL binds each communicator to the current device
    else:
        device = torch.device("cpu")
    if world == 1 and not dist.is_initialized():
        return TPContext(0, 1, local, device)
    if not dist.is_initialized():
        # NVLink SHARP (NVLS) multicast stays off: the lent GPU hosts forbid multicast objects, and
        # NCCL would try to create them at communicator init on NVSwitch systems (H100/H200).
        # Must be set before NCCL's first communicator; an explicit setting by the operator wins.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    return TPContext(rank, world, local, device, backend, dist.group.WORLD)


def _features(module: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a shard module (QuantLinear or a bias-free nn.Linear)."""
    if isinstance(module, (QuantLinear, nn.Linear)):
        return module.out_features, module.in_features
    raise TypeError(f"expected a QuantLinear or nn.Linear shard, got {type(module).__name__}")


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class ColumnParallel(nn.Module):
    """A column-parallel (or vocab-parallel) shard: y_local = x W_local^T, no communication.

    gather=True all_gathers the slices along the last dim in rank order. For a fused projection
    pass ``segments`` (this rank's width of each output segment, e.g. q, k, v) so the gathered
    result is in the unsharded layout [q | k | v], not [q0 k0 v0 | q1 k1 v1]; ``replicas`` (per
    segment, default 1) is how many consecutive ranks hold the same copy (KV heads fewer than the
    TP degree), of which the first is kept.
    """

    def __init__(self, module: nn.Module, *, gather: bool = False, segments: Sequence[int] | None = None,
                 replicas: Sequence[int] | None = None, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        out, _ = _features(module)
        if segments is not None and (sum(segments) != out or min(segments, default=0) <= 0):
            raise ValueError(f"segments {list(segments)} must be positive and add up to out_features={out}")
        if replicas is not None and (segments is None or len(replicas) != len(segments)
                                     or min(replicas, default=1) < 1):
            raise ValueError(f"replicas {list(replicas)} needs one count >= 1 per segment ({segments})")
        self.module = module
        self.gather = gather
        self.segments = tuple(segments) if segments is not None else None
        self.replicas = tuple(replicas) if replicas is not None else None
        self.group = group
        self.world_size = _group_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.module(x)
        if not self.gather or self.world_size == 1:
            return y
        y = y.contiguous()
        parts = [torch.empty_like(y) for _ in range(self.world_size)]
        dist.all_gather(parts, y, group=self.group)
        if self.segments is None:
            return torch.cat(parts, dim=-1)
        chunks = [p.split(self.segments, dim=-1) for p in parts]
        reps = self.replicas or (1,) * len(self.segments)
        if any(self.world_size % r for r in reps):
            raise ValueError(f"replicas {reps} must divide the world size {self.world_size}")
        return torch.cat([chunks[r][j] for j, rep in enumerate(reps) for r in range(0, self.world_size, rep)],
                         dim=-1)

    def extra_repr(self) -> str:
        return f"gather={self.gather}, segments={self.segments}, replicas={self.replicas}"


class RowParallel(nn.Module):
    """A row-parallel shard: takes this rank's K slice of the input (what the preceding
    column-parallel layer produced locally) and all-reduces (SUM) the partial outputs.

    fp32_reduce: the partial is cast to FP32, reduced, cast back, so the sum is rounded to FP16
    once; NCCL reducing FP16 directly rounds at every ring hop (error grows with the TP degree)
    and can overflow a partial sum. The cost is twice the bytes on the wire, which for decode /
    verify-sized activations (tens of tokens x hidden) is latency- not bandwidth-bound.
    """

    def __init__(self, module: nn.Module, reduce: bool = True, *, fp32_reduce: bool = True,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        _features(module)
        if isinstance(module, QuantLinear) and module.silu:
            # SiLU(gate) * up is not linear in x: partial outputs over K slices cannot be summed.
            raise ValueError(f"{module.name}: a fused SiLU projection cannot be row-parallel")
        self.module = module
        self.reduce = reduce
        self.fp32_reduce = fp32_reduce
        self.group = group
        self.world_size = _group_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.module(x)
        if not self.reduce or self.world_size == 1:
            return y
        buf = y.float() if self.fp32_reduce else y.contiguous()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf.to(y.dtype)

    def extra_repr(self) -> str:
        return f"reduce={self.reduce}, fp32_reduce={self.fp32_reduce}"


def wrap_projections(modules: Mapping[str, nn.Module], cfg: ModelConfig, ctx: TPContext, *,
                     gather: bool = False) -> dict[str, nn.Module]:
    """Wrap each rank shard (keys ``layers.{i}.{projection}`` and ``lm_head``, as the loader returns
    them) by its projection's parallel style: column -> :class:`ColumnParallel`, row ->
    :class:`RowParallel`, vocab (lm_head) -> ``ColumnParallel(gather=True)``. gather=True also
    gathers the column-parallel outputs into the unsharded layout (checks against TP1)."""
    names = {key: name for key, _, name in layer_projections(cfg)}
    local = {p.name: p for p in derive_projections(cfg, ctx.world_size)}
    full = {p.name: p for p in derive_projections(cfg, 1)}
    out: dict[str, nn.Module] = {}
    for key, module in modules.items():
        if key not in names:
            raise KeyError(f"{key!r} is not a projection of this model (expected keys like "
                           f"{next(iter(names))!r} or 'lm_head')")
        p = local[names[key]]
        silu = isinstance(module, QuantLinear) and module.silu
        want = (p.n // 2 if silu else p.n, p.k)
        got = _features(module)
        if got != want:
            raise ValueError(f"{key}: shard is {got[0]}x{got[1]} (out x in), but rank shards of the "
                             f"{p.parallel}-parallel {p.name} at TP{ctx.world_size} are {want[0]}x{want[1]} "
                             "(loaded for another TP degree?)")
        if p.parallel == "row":
            out[key] = RowParallel(module, group=ctx.group)
        elif p.parallel == "vocab":
            out[key] = ColumnParallel(module, gather=True, group=ctx.group)
        elif silu:  # SiLU(gate_r) * up_r is one slice of the unsharded SiLU output
            out[key] = ColumnParallel(module, gather=gather, group=ctx.group)
        else:
            segs = [s.n for s in p.segments]
            reps = [ctx.world_size * s.n // s1.n for s, s1 in zip(p.segments, full[p.name].segments, strict=True)]
            out[key] = ColumnParallel(module, gather=gather, segments=segs, replicas=reps, group=ctx.group)
    return out


def broadcast_from_first(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``t`` as the group's first rank holds it, on every rank (in place when contiguous); a no-op
    without a process group or in a group of one. Every rank of the group must call it."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    t = t.contiguous()
    dist.broadcast(t, group=group, group_src=0)
    return t
