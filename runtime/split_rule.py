"""The verify-attention split rule shared by the kernel family (rendered as constants), the launcher
(grid size) and the FP32 reference (the same algorithm on the CPU). Torch-free: `dflashgen generate`
imports it.

A request's split size is a fixed function of its OWN length: the first tier ``(max_len, split)`` with
``length <= max_len``, else the long split. Splits start at multiples of that size from position 0,
so a request's split boundaries, and hence its output bits, never depend on the batch; short requests
get small splits (more CTAs, fewer serial tiles each), long ones keep the long split (fewer partials).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["SplitRule"]


@dataclass(frozen=True)
class SplitRule:
    split: int  # tokens per split past the last tier
    tiers: tuple[tuple[int, int], ...] = ()  # (max length, split), ascending lengths

    def __post_init__(self) -> None:
        ok = isinstance(self.split, int) and self.split > 0
        last_len, last_split = 0, 0
        for t in self.tiers:
            if not (len(t) == 2 and all(isinstance(x, int) and x > 0 for x in t)):
                ok = False
                break
            length, sp = t
            # Ascending lengths and split sizes up to the long split: the kernel stages a split's page
            # ids in a buffer sized for the long split.
            ok = ok and length > last_len and last_split <= sp < self.split
            last_len, last_split = length, sp
        if not ok:
            raise ValueError(f"bad split rule: split {self.split!r}, tiers {self.tiers!r} (want positive ints, "
                             "ascending lengths, non-decreasing tier splits below the long split)")

    @classmethod
    def of(cls, split: int, tiers: Iterable[Iterable[int]] = ()) -> SplitRule:
        return cls(int(split), tuple((int(a), int(b)) for a, b in tiers))

    def __call__(self, length: int) -> int:
        """Split size for a request of ``length`` tokens."""
        for max_len, sp in self.tiers:
            if length <= max_len:
                return sp
        return self.split

    def splits(self, length: int) -> int:
        """Number of splits of a request of ``length`` tokens."""
        return -(-length // self(length))

    def max_splits(self, capacity: int) -> int:
        """Most splits any length in [1, capacity] has: the launch grid and workspace size."""
        best = -(-capacity // self.split) if not self.tiers or capacity > self.tiers[-1][0] else 1
        for max_len, sp in self.tiers:
            best = max(best, -(-min(max_len, capacity) // sp))
        return best

    @property
    def tag(self) -> str:
        """Name suffix: ``sp512`` or ``sp512_le2048s64_le8192s128`` (names encode every parameter)."""
        return f"sp{self.split}" + "".join(f"_le{a}s{b}" for a, b in self.tiers)
