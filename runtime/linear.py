"""``QuantLinear``: an NVFP4 / channel-FP8 projection as a torch module, behind an opaque custom op.

The packed operands are prepacked once at construction and live as buffers (so ``.to(device)``,
``state_dict`` and CUDA graphs see them). ``forward`` calls ``torch.ops.dflashgen.quant_linear``,
whose signature is tensors + one int handle: torch.compile traces it as a single opaque node (a
fake impl gives the output shape) and never looks inside the driver-level kernel launch. The handle
indexes a process-local registry holding what cannot be a tensor (the ``KernelLibrary`` and the
``Layout``); the op rebuilds the ``PackedWeight`` from the buffers it is given, so moved or
reloaded buffers are always the ones used.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from dflashgen.prepack import Layout, PackedWeight, prepack
from dflashgen.weights import FP8ChannelWeight, NVFP4Weight, WeightError

from .dequant_kernel import dequantize_packed
from .kernels import GemmLaunch, overlaps
from .library import KernelLibrary, fallback_gemm

__all__ = ["DEFAULT_ARCH", "QuantLinear", "quant_linear"]

DEFAULT_ARCH = 90

_is_compiling = torch.compiler.is_compiling  # bound once: the eager path asks on every call

# Launches are prepared automatically for decode / verify shapes only (M <= 64 rows: 8 x requests),
# at most this many input shapes per module: a prefill's varying lengths must not pile them up.
PREPARE_MAX_M = 64
PREPARE_MAX_SHAPES = 32


@dataclass(frozen=True)
class _Entry:
    library: KernelLibrary | None
    layout: Layout


_REGISTRY: dict[int, _Entry] = {}
_IDS = itertools.count(1)


def _register(library: KernelLibrary | None, layout: Layout, owner: object) -> int:
    handle = next(_IDS)
    _REGISTRY[handle] = _Entry(library, layout)
    weakref.finalize(owner, _REGISTRY.pop, handle, None)  # the entry dies with its module
    return handle


def _entry(handle: int) -> _Entry:
    try:
        return _REGISTRY[handle]
    except KeyError:
        raise RuntimeError(f"dflashgen::quant_linear: unknown handle {handle} "
                           "(its QuantLinear was garbage-collected)") from None


@torch.library.custom_op(
    "dflashgen::quant_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor weights, Tensor? scales, Tensor col_scale, int handle) -> Tensor",
)
def quant_linear(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor | None,
                 col_scale: torch.Tensor, handle: int) -> torch.Tensor:
    """y = x W^T (or SiLU(gate) * up) for x [M, K]: the generated kernel through the attached
    library when x is on CUDA, else dequantize + matmul (any device, any float dtype)."""
    e = _entry(handle)
    packed = PackedWeight(e.layout, weights, scales, col_scale)
    if x.is_cuda and e.library is not None:
        return e.library.gemm(x, packed)
    return fallback_gemm(x, packed)


@quant_linear.register_fake
def _(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor | None, col_scale: torch.Tensor,
      handle: int) -> torch.Tensor:
    lay = _entry(handle).layout
    return x.new_empty((x.shape[0], lay.n // 2 if lay.silu else lay.n))


class _Operands:
    """A QuantLinear's buffers as they were when this was made, as a PackedWeight, and the
    prepared launches for them, with y's shape, by input shape (None: M takes the fallback)."""

    __slots__ = ("weights", "scales", "bits", "packed", "launches")

    def __init__(self, layout: Layout, weights: torch.Tensor, scales: torch.Tensor | None,
                 bits: torch.Tensor) -> None:
        self.weights, self.scales, self.bits = weights, scales, bits
        self.packed = PackedWeight(layout, weights, scales, bits.view(torch.float32))
        self.launches: dict[tuple[int, ...], tuple[GemmLaunch, tuple[int, ...]] | None] = {}  # y's shape


def _to(w: NVFP4Weight | FP8ChannelWeight, device: torch.device) -> NVFP4Weight | FP8ChannelWeight:
    if isinstance(w, NVFP4Weight):
        return NVFP4Weight(w.packed.to(device), w.block_scale.to(device), w.global_scale.to(device), w.segments)
    return FP8ChannelWeight(w.weight.to(device), w.scale.to(device))


class QuantLinear(torch.nn.Module):
    """A quantized projection y = x W^T (no bias). ``silu=True`` is the fused gate|up variant that
    returns SiLU(gate) * up, of width N/2."""

    weights: torch.Tensor
    scales: torch.Tensor | None
    col_scale_bits: torch.Tensor

    def __init__(self, weight: NVFP4Weight | FP8ChannelWeight, name: str = "", *, silu: bool = False,
                 library: KernelLibrary | None = None, arch: int | None = None,
                 device: torch.device | str | None = None) -> None:
        """arch: the prepack layout's target (default: the library's, else sm_90). device: where to
        prepack and keep the buffers (default: the library's device, else the weight's)."""
        super().__init__()
        if not isinstance(weight, (NVFP4Weight, FP8ChannelWeight)):
            raise TypeError(f"{name}: QuantLinear needs an NVFP4Weight or FP8ChannelWeight, "
                            f"got {type(weight).__name__}")
        if library is not None and arch is not None and arch != library.arch:
            raise ValueError(f"{name}: arch sm_{arch} disagrees with the library's sm_{library.arch}")
        arch = library.arch if library is not None else (arch or DEFAULT_ARCH)
        fmt = "nvfp4" if isinstance(weight, NVFP4Weight) else "fp8_channel"
        self.name = name
        self.layout = Layout(arch, fmt, weight.n, weight.k, silu)
        self.segments: tuple[int, ...] = getattr(weight, "segments", (weight.n,))
        device = device if device is not None else (library.device if library is not None else None)
        if device is not None:  # prepack where the buffers will live (fast on a GPU, no extra copy)
            weight = _to(weight, torch.device(device))
        try:
            packed = prepack(weight, self.layout)
        except WeightError as e:
            raise type(e)(f"{name}: {e}") from e
        self.register_buffer("weights", packed.weights)
        self.register_buffer("scales", packed.scales)
        # Stored as int32 bits so module.half() / .to(dtype) cannot round the fp32 scales.
        self.register_buffer("col_scale_bits", packed.col_scale.view(torch.int32))
        self._library = library
        self._ops: _Operands | None = None
        self._handle = _register(library, self.layout, self)

    @property
    def fmt(self) -> str:
        return self.layout.fmt

    @property
    def silu(self) -> bool:
        return self.layout.silu

    @property
    def in_features(self) -> int:
        return self.layout.k

    @property
    def out_features(self) -> int:
        return self.layout.n // 2 if self.layout.silu else self.layout.n

    @property
    def col_scale(self) -> torch.Tensor:
        return self.col_scale_bits.view(torch.float32)

    @property
    def library(self) -> KernelLibrary | None:
        return self._library

    def _operands(self) -> _Operands:
        """The buffers as a PackedWeight and its prepared launches; rebuilt when a buffer is
        replaced (``.to()``, ``load_state_dict(assign=True)``, assignment), so kernels validate the
        new buffers and the launches take their addresses."""
        b = self._buffers  # direct: nn.Module attribute lookup of buffers is slow on the hot path
        o = self._ops
        if (o is None or o.weights is not b["weights"] or o.scales is not b["scales"]
                or o.bits is not b["col_scale_bits"]):
            o = self._ops = _Operands(self.layout, b["weights"], b["scales"], b["col_scale_bits"])
        return o

    def packed(self) -> PackedWeight:
        """The module's operands as a PackedWeight; the same object while the buffers are the same."""
        return self._operands().packed

    def prepare(self, *lead: int) -> GemmLaunch | None:
        """The kernel launch for inputs [*lead, K] (M = prod(lead) rows) with its arguments
        written, kept for the eager fast path; the first validated call at each input shape makes
        it. None where M takes the fallback."""
        entry = self._prepare((*lead, self.layout.k))
        return None if entry is None else entry[0]

    def _prepare(self, shape: tuple[int, ...]) -> tuple[GemmLaunch, tuple[int, ...]] | None:
        o = self._operands()
        if shape not in o.launches:
            lead = shape[:-1]
            launch = None if self._library is None else self._library.prepare(o.packed, math.prod(lead))
            o.launches[shape] = None if launch is None else (launch, (*lead, self.out_features))
        return o.launches[shape]

    def dequantize(self) -> torch.Tensor:
        """Exact FP32 weights [N, K] in logical row order (gate rows first for the silu variant)."""
        return dequantize_packed(self.packed())

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T for x [..., K]: y [..., N_out] in x's dtype. ``out``: write y there (a
        contiguous tensor of y's shape and dtype on x's device, not overlapping x) instead of
        allocating it -- the cheapest eager call, for callers that own their buffers."""
        if type(x) is torch.Tensor and not _is_compiling():
            # Eager fast path, the decode loop's call: a launch prepared for this input shape (the
            # key; [..., K], M rows in all) checks x's (and out's) dtype, device and layout,
            # allocates y in [..., N] directly unless out is given, writes two pointers and
            # launches. Anything else (and the first call at each shape) takes the validated path
            # below. torch.compile, export and tensor subclasses see the custom op.
            entry = self._operands().launches.get(x.shape)
            if entry is not None and (y := entry[0](x, entry[1], out)) is not None:
                return y
        return self._forward(x, out)

    def _forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        lib, k = self._library, self.layout.k
        if x.shape[-1] != k or not x.is_floating_point():
            raise ValueError(f"{self.name}: expected a float input [..., {k}], "
                             f"got {x.dtype} {tuple(x.shape)}")
        if out is not None:
            self._check_out(x, out)
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()  # kernels: [M, K]
        if lib is not None and type(x) is torch.Tensor and x.is_cuda and not _is_compiling():
            # the launch the op would make, minus the dispatcher round trip (tens of us)
            y = lib.gemm(x2, self.packed(), None if out is None else out.view(x2.shape[0], self.out_features))
            if (x.dtype is torch.float16 and x.is_contiguous() and x2.shape[0] <= PREPARE_MAX_M
                    and len(self._operands().launches) < PREPARE_MAX_SHAPES):
                self._prepare(tuple(x.shape))  # validated: the next call at this shape is a fast one
        else:
            y = quant_linear(x2, self.weights, self.scales, self.col_scale, self._handle)
            if out is not None:
                return out.copy_(y.view(out.shape))
        if out is not None:
            return out
        return y if x2 is x else y.reshape(*x.shape[:-1], self.out_features)

    def _check_out(self, x: torch.Tensor, out: torch.Tensor) -> None:
        shape = (*x.shape[:-1], self.out_features)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{self.name}: out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"{self.name}: out must be {x.dtype} {shape} on {x.device} (y's shape, dtype "
                             f"and device), got {out.dtype} {tuple(out.shape)} on {out.device}")
        if not out.is_contiguous():
            raise ValueError(f"{self.name}: out must be contiguous (strides {out.stride()})")
        if overlaps(x.data_ptr(), x.element_size() * x.numel(), out.data_ptr(), out.element_size() * out.numel()):
            raise ValueError(f"{self.name}: out overlaps x (the projection reads x while it writes out)")

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        self._ops = None  # .to() / .cuda() / .half() replace the buffers: drop the old ones now
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, format={self.fmt}, N={self.layout.n}, K={self.layout.k}, "
                f"silu={self.silu}, arch=sm_{self.layout.arch}, segments={self.segments}, "
                f"path={'library' if self._library is not None else 'fallback'}")

    def __getstate__(self) -> dict[str, Any]:
        # prepared launches (locks, ctypes storage) belong to this module's buffers and process
        return {**self.__dict__, "_ops": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # deepcopy / unpickle: the copy gets its own handle (the original's dies with it).
        super().__setstate__(state)
        self._ops = None
        self._handle = _register(self._library, self.layout, self)
