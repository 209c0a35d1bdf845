"""The compact rejection-sampling kernel (generated family ``rejection``) behind the dense API.

:func:`compact_verify` takes exactly :func:`~dflashgen.runtime.sampling.verify`'s arguments and
returns a :class:`~dflashgen.runtime.sampling.VerifyResult` from up to three launches on torch's
current stream (``prefilter``: grid ``(chunks, D + 1, B)``, only when a row takes the candidate path:
greedy or ``0 < top_k <= CAP``, known on the host from ``params``; ``describe``: grid ``(D + 1, B)``;
``decide``: grid ``B``), consuming the same uniforms, so
both paths give the same accepted lengths and tokens (up to a uniform landing within float32
rounding of a probability or CDF boundary). No host sync: CUDA-graph capturable.

Kernel choice: the variant specialised for (vocab, drafts) when the manifest has it (the configured
model's vocabulary, q7 / q3), else the generic one; ``arch`` picks the image (default: the GPU's own
arch, whose cubin is loaded; ``arch=70`` loads the compute_70 PTX and the driver JIT-compiles it).
Inputs are validated for shape / dtype / device only (values are trusted: no host sync).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from .driver import current_stream
from .driver import ptr_arg as _ptr
from .host import tensor_on, to_device
from .images import family_entries, load_module, serving_arch
from .sampling import SamplingParams, Uniforms, VerifyResult

__all__ = ["DESC_BYTES", "CompactSampler", "compact_verify"]

Tensor = torch.Tensor
DESC_BYTES = 32  # struct Desc in rejection.cuh: float, float, u64, int, float (+ padding)
_SAMPLERS: dict[tuple[int, int], CompactSampler] = {}


def pick_entry(entries: dict[str, dict[str, Any]], arch: int, vocab: int, drafts: int) -> dict[str, Any]:
    """The manifest entry for (arch, vocab, drafts): specialised if generated, else generic."""
    from dflashgen.rejection import GENERIC_ID_BITS, kernel_name

    special = entries.get(kernel_name(arch, vocab, drafts))
    if special is not None:
        return special
    if vocab > 1 << GENERIC_ID_BITS:
        raise ValueError(f"vocab {vocab} is above the generic rejection kernel's 2^{GENERIC_ID_BITS}")
    generic = entries.get(kernel_name(arch))
    if generic is None:
        raise ValueError(f"no rejection kernel for sm_{arch} in the generated manifest")
    return generic


class CompactSampler:
    """The loaded kernel pair for one (device, arch); launches for any (B, D, V) it serves."""

    def __init__(self, device: torch.device, arch: int | None = None) -> None:
        self.device = device
        idx = device.index if device.index is not None else torch.cuda.current_device()
        self.device_index = idx
        self.arch = serving_arch(idx, arch, "DFLASHGEN_REJECTION_ARCH", ValueError)  # e.g. sm_86 -> the sm_80 build
        self.entries = {n: e for n, e in family_entries("rejection").items() if e["arch"] == self.arch}
        self._fns: dict[str, tuple[Any, Any, Any]] = {}

    def functions(self, vocab: int, drafts: int) -> tuple[Any, Any, Any, str]:
        """(prefilter, describe, decide, name) of the kernel serving (vocab, drafts)."""
        entry = pick_entry(self.entries, self.arch, vocab, drafts)
        name = entry["name"]
        if name not in self._fns:
            mod = load_module(entry, self.device_index)
            self._fns[name] = (mod.function(name + "_prefilter"), mod.function(name), mod.function(name + "_decide"))
        return (*self._fns[name], name)

    def __call__(self, drafts: Tensor, logits: Tensor, params: Sequence[SamplingParams], u: Uniforms,
                 draft_probs: Tensor | None = None, *, accept_override: Tensor | None = None) -> VerifyResult:
        b, d = drafts.shape
        dev = logits.device
        if logits.dim() != 3 or logits.shape[:2] != (b, d + 1):
            raise ValueError(f"logits must be [B, D+1, V] = [{b}, {d + 1}, V], got {tuple(logits.shape)}")
        if len(params) != b:
            raise ValueError(f"params must hold one SamplingParams per request (B = {b}), got {len(params)}")
        v = logits.shape[-1]
        for name, t, shape, dtype in (("drafts", drafts, (b, d), torch.long), ("uniforms.accept", u.accept, (b, d),
                                      torch.float32), ("uniforms.sample", u.sample, (b, d + 1), torch.float32)):
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != dev:
                raise ValueError(f"{name} must be {dtype} {list(shape)} on {dev}, got {t.dtype} "
                                 f"{list(t.shape)} on {t.device}")
        if draft_probs is not None and (tuple(draft_probs.shape) != (b, d, v) or draft_probs.device != dev):
            raise ValueError(f"draft_probs must be [B, D, V] = {[b, d, v]} on {dev}")
        if accept_override is not None and (tuple(accept_override.shape) != (b, d) or accept_override.device != dev):
            raise ValueError(f"accept_override must be [B, D] = {[b, d]} on {dev}")
        from dflashgen.rejection import uses_candidates

        lg = logits.float().contiguous()
        q = draft_probs.float().contiguous() if draft_probs is not None else None
        ov = accept_override.to(torch.uint8).contiguous() if accept_override is not None else None
        host = torch.tensor([[sp.temperature, sp.top_p] for sp in params], dtype=torch.float32)
        temp, top_p = to_device(host, dev).unbind(1)
        top_k = tensor_on([sp.top_k for sp in params], dev, torch.int32)
        candidates = any(uses_candidates(sp.temperature, sp.top_k) for sp in params)
        accepted, tokens = self.launch(drafts.contiguous(), lg, q, temp.contiguous(), top_k, top_p.contiguous(),
                                       u.accept.contiguous(), u.sample.contiguous(), ov, candidates)
        return VerifyResult(accepted=accepted, tokens=tokens, emitted=accepted + 1)

    def launch(self, drafts: Tensor, logits: Tensor, draft_probs: Tensor | None, temperature: Tensor,
               top_k: Tensor, top_p: Tensor, u_accept: Tensor, u_sample: Tensor, override: Tensor | None,
               candidates: bool) -> tuple[Tensor, Tensor]:
        """The launches alone on contiguous device tensors (float32 logits / q / temperature / top_p,
        int32 top_k, uint8 override), unchecked, CUDA-graph capturable: (accepted [B], tokens [B, D+1]).
        ``candidates``: some row takes the candidate path (``uses_candidates``); the prefilter runs only
        then, and its CTAs of the other rows return at once."""
        from dflashgen.rejection import CAP, num_chunks

        b, d = drafts.shape
        v = logits.shape[-1]
        dev = logits.device
        prefilter, describe, decide, _ = self.functions(v, d)
        desc = torch.empty(b * (d + 1) * DESC_BYTES, dtype=torch.uint8, device=dev)
        accepted = torch.empty(b, dtype=torch.long, device=dev)
        tokens = torch.empty(b, d + 1, dtype=torch.long, device=dev)
        stream = current_stream(dev.index if dev.index is not None else torch.cuda.current_device())
        lg, dr, temp, tk, tp = _ptr(logits), _ptr(drafts), _ptr(temperature), _ptr(top_k), _ptr(top_p)
        cand = None  # [B, D+1, CAP, chunks] keys; only candidate-path rows are written and read
        if candidates:
            chunks = num_chunks(v)
            cand = torch.empty(b * (d + 1) * CAP * chunks, dtype=torch.int64, device=dev)
            prefilter.launch((chunks, d + 1, b), (256, 1, 1), [lg, temp, tk, ctypes.c_int(v), ctypes.c_int(d),
                                                                _ptr(cand)], stream)
        threads = (512, 1, 1)
        describe.launch((d + 1, b, 1), threads, [lg, dr, temp, tk, tp, ctypes.c_int(v), ctypes.c_int(d), _ptr(cand),
                                                  _ptr(desc)], stream)
        decide.launch((b, 1, 1), threads, [lg, dr, _ptr(draft_probs), temp, tk, _ptr(u_accept), _ptr(u_sample),
                                           _ptr(override), ctypes.c_int(v), ctypes.c_int(d), _ptr(cand), _ptr(desc),
                                           _ptr(accepted), _ptr(tokens)], stream)
        return accepted, tokens


def compact_verify(drafts: Tensor, logits: Tensor, params: Sequence[SamplingParams], u: Uniforms,
                   draft_probs: Tensor | None = None, *, accept_override: Tensor | None = None,
                   arch: int | None = None) -> VerifyResult:
    """:func:`~dflashgen.runtime.sampling.verify` through the generated kernel (CUDA tensors only)."""
    if logits.device.type != "cuda":
        raise ValueError("the compact rejection kernel needs CUDA tensors (use sampling.verify on CPU)")
    key = (logits.device.index if logits.device.index is not None else torch.cuda.current_device(), arch or 0)
    sampler = _SAMPLERS.get(key)
    if sampler is None:
        sampler = _SAMPLERS[key] = CompactSampler(logits.device, arch)
    return sampler(drafts, logits, params, u, draft_probs, accept_override=accept_override)
