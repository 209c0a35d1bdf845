"""CUDA graphs of a speculative round's target steps, one per batch size.

:class:`DecodeGraphs` owns static input buffers (verify tokens, rollback lengths) and, for every
batch size ``b`` in ``1..max_batch``, a view of the first ``b`` slots of the decode state
(:meth:`~.target.DecodeState.narrow`). Two steps per ``b``:

- ``verify(b, tokens)``: the armed target forward of ``T`` positions (logits + tapped hidden states);
- ``rollback(b, lengths)``: the state rollback to the accepted lengths.

Everything a step reads lives in preallocated tensors (tokens, lengths, KV caches, GDN states and
their rollback terms) and nothing inside syncs with the host, so each step is captured once and
replayed while sequence lengths and positions change. ``capture=False`` runs the very same step
functions eagerly on the same buffers and shapes, so eager and graph give bitwise-identical results
(and the bookkeeping is testable on a CPU).

Capture runs the steps a few times before recording (CUDA graph warmup); it must happen while the
state holds no requests, and the state is emptied afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from .target import DecodeState, TargetModel

__all__ = ["DecodeGraphs"]

Tensor = torch.Tensor
_WARMUP = 2
log = logging.getLogger("dflashgen")


class DecodeGraphs:
    def __init__(self, target: TargetModel, state: DecodeState, positions: int, max_batch: int,
                 taps: Sequence[int] | None = None, *, capture: bool = True) -> None:
        if not 1 <= max_batch <= state.batch:
            raise ValueError(f"max_batch={max_batch} must be in 1..{state.batch} (the decode state's requests)")
        if capture and state.lengths.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA decode state (capture=False runs eagerly)")
        self.target, self.state, self.positions, self.max_batch = target, state, positions, max_batch
        self.taps = tuple(taps) if taps is not None else None
        self.capture_enabled = capture
        dev = state.lengths.device
        self.tokens = torch.zeros(state.batch, positions, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(state.batch, dtype=torch.long, device=dev)
        self._subs = {b: state.narrow(b) for b in range(1, max_batch + 1)}
        self._graphs: dict[int, tuple[Any, Any, tuple[Tensor, dict[int, Tensor]]]] = {}
        self.pool: Any = None

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _check(self, b: int) -> None:
        if not 1 <= b <= self.max_batch:
            raise ValueError(f"batch of {b} requests is above the captured maximum of {self.max_batch} "
                             "(raise max_batch)" if b > self.max_batch else f"batch must be >= 1, got {b}")

    def _verify(self, b: int) -> tuple[Tensor, dict[int, Tensor]]:
        sub = self._subs[b]
        sub.checkpoint(self.positions)
        if self.taps is None:
            return self.target(self.tokens[:b], sub, check=False), {}
        return self.target(self.tokens[:b], sub, taps=self.taps, check=False)

    def _rollback(self, b: int) -> None:
        self._subs[b].rollback(self.lengths[:b], check=False)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture both steps for every batch size (no-op when disabled or done). Needs an empty state."""
        if not self.capture_enabled or self._graphs:
            return
        st = self.state
        if bool((st.lengths != 0).any()):
            raise RuntimeError("capture CUDA graphs before any request is admitted (the warmup runs the steps)")
        self.tokens.zero_()
        self.lengths.zero_()
        side = torch.cuda.Stream(device=st.lengths.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in range(1, self.max_batch + 1):
                for _ in range(_WARMUP):
                    self._verify(b)
                    self._rollback(b)  # lengths buffer = 0 = base: back to the empty state
        torch.cuda.current_stream().wait_stream(side)
        self.pool = torch.cuda.graph_pool_handle()
        try:
            for b in range(1, self.max_batch + 1):
                gv, gr = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(gv, pool=self.pool):
                    out = self._verify(b)
                with torch.cuda.graph(gr, pool=self.pool):
                    self._rollback(b)
                self._graphs[b] = (gv, gr, out)
        except RuntimeError as e:  # a step that cannot be captured: the same steps eagerly, said loudly
            log.warning("dflashgen: CUDA graph capture of the decode steps failed (%s); running them eagerly", e)
            self._graphs.clear()
            self.capture_enabled = False
            for sub in self._subs.values():
                sub._span = 0
        for s in range(st.batch):  # nothing ran during capture; the warmup left stale, masked entries
            st.reset(s)
        torch.cuda.synchronize(st.lengths.device)

    def verify(self, b: int, tokens: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """Logits ``[b, T, V]`` (and tapped hidden states) of slots ``[0, b)``; the outputs are static
        buffers, valid until the next ``verify`` of the same ``b``."""
        self._check(b)
        self.tokens[:b].copy_(tokens)
        if b in self._graphs:
            gv, _, out = self._graphs[b]
            gv.replay()
            self._subs[b]._span = self.positions  # what the captured forward left pending
            return out
        return self._verify(b)

    def rollback(self, b: int, lengths: Tensor) -> None:
        """Keep ``lengths[s]`` positions of slot ``s < b`` (within the last verify)."""
        self._check(b)
        self.lengths[:b].copy_(lengths)
        if b in self._graphs:
            self._graphs[b][1].replay()
            self._subs[b]._span = 0
            return
        self._rollback(b)
