"""CPU evidence for the prefill's torch glue: every aten op a target prefill dispatches, counted by kind
(casts, copies, elementwise / reductions, matmuls) with the bytes each moves, for another commit's
runtime (``REF``, default ``main``) and this worktree's, in one process; then both runtimes' prefill
and decode / verify results compared (bitwise flags, max abs / rel differences).

GPU-like setup on the CPU: FP16 projection inputs and KV cache (``--act fp16``), every projection served
as the CUDA library serves a prefill's M (a cached FP16 dequantized weight + matmul:
``KernelLibrary._fallback``), and the GDN recurrence through ``gdn_prefill`` (the CUDA path; its
torch reference is counted as the one kernel launch it is on a GPU). Bytes per op: its tensor inputs
(broadcast dims once) + outputs -- the DRAM traffic of the CUDA kernel it becomes. Views are not
counted (no kernel).

    python tools/prefill_glue.py [--ref main] [--config medium|tiny|qwen3.8] [--layers 4] [--tokens 255]
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from ref_runtime import old_runtime  # tools/ (run as a script)
from torch.utils._python_dispatch import TorchDispatchMode

from dflashgen.deployment import load_deployment
from dflashgen.model import ModelConfig, load_model_config, parse_model_config

ROOT = Path(__file__).resolve().parent.parent
TINY_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
# Qwen3.8-27B's structure (GQA 6:1, head_dim 256, partial RoPE, GDN 16:48 heads of 128) at CPU size.
MEDIUM: dict[str, Any] = {
    "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 256, "attn_output_gate": True,
    "partial_rotary_factor": 0.25, "rope_theta": 1e7, "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 1000,
}
# bytes / second of the glue kernels in bench/h200-2026-11-30-s7/final/decode/profile-prefill.txt, from this
# tool's byte counts for that run (--meta --config qwen3.8 --tokens 1023 --ref 43ce811): mul 2.9, add 4.1,
# silu 2.6, rms_norm 2.1, copy_ (casts + copies) 2.8 TB/s
H200_GLUE_BW = 2.9e12
GEMMS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_linear"}
# views and allocations: no kernel, no traffic
VIEWS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
         torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default}
COPIES = {"copy_", "clone", "cat", "index_put_", "index_put", "_index_put_impl_", "gather", "stack",
          "_unsafe_index_put", "contiguous", "index", "index_select"}


def _bytes(t: torch.Tensor) -> int:
    # a broadcast (stride-0) dim is read once
    return math.prod(s for s, st in zip(t.shape, t.stride(), strict=True) if st != 0) * t.element_size()


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


class OpCounter(TorchDispatchMode):
    """Counts non-view aten ops by (kind, name) with calls and bytes moved; ``paused()`` hides a region."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.active = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        rets = func._schema.returns
        if (not self.active or not rets or func in VIEWS
                or (rets[0].alias_info is not None and not rets[0].alias_info.is_write)):
            return out  # a view (or an op without results): no kernel
        name = func.__name__.split(".")[0]
        ins = list(_tensors(list(args) + list((kwargs or {}).values())))
        outs = [] if rets[0].alias_info is not None else list(_tensors(out))  # in place: self is in ins
        kind = "elementwise/reduction"
        if name in GEMMS:
            kind = "matmul"
        elif name == "_to_copy" or (name == "copy_" and ins[0].dtype != ins[1].dtype):
            kind = "cast"
        elif name in COPIES:
            kind = "copy"
        if name in ("index", "gather", "index_select"):  # reads the rows it gathers (+ the indices)
            moved = 2 * sum(_bytes(t) for t in outs) + sum(_bytes(t) for t in ins[1:])
        elif name in ("copy_", "index_put_", "_index_put_impl_") and ins:
            ins = ins[1:] + [ins[0]]  # the destination is written, not read: counted once below
            moved = sum(_bytes(t) for t in ins)
        else:
            moved = sum(_bytes(t) for t in ins) + sum(_bytes(t) for t in outs)
            if rets[0].alias_info is not None and "out" not in (kwargs or {}):  # in place: self read, written
                moved += _bytes(ins[0])  # (an out= tensor is in ins: written once)
        rec = self.ops[(kind, name)]
        rec[0] += 1
        rec[1] += moved
        return out

    @contextmanager
    def paused(self, kind: str, label: str, moved: int = 0) -> Iterator[None]:
        """Count the region as one kernel of ``kind`` moving ``moved`` bytes, not the ops in it."""
        rec = self.ops[(kind, label)]
        rec[0] += 1
        rec[1] += moved
        self.active = False
        try:
            yield
        finally:
            self.active = True


class LibraryFallback(torch.nn.Module):
    """A QuantLinear as the CUDA KernelLibrary serves an M without a tuned kernel: the FP16 dequantized
    weight ``w16`` made once (kept by the ``dequant_cache``) and ``fallback_gemm`` of the runtime under test."""

    def __init__(self, w16: torch.Tensor, packed: Any, fallback: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.w16, self.packed, self.fallback, self.silu = w16, packed, fallback, packed.layout.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        y = self.fallback(x.reshape(-1, k).contiguous(), self.packed, self.w16)  # QuantLinear: [M, K]
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _meta_target(rt: dict[str, ModuleType], cfg: ModelConfig, act: torch.dtype) -> Any:
    """A shape-only target on the meta device (any size: no weights, no arithmetic)."""
    from dflashgen.runtime.checkpoint import layer_projections

    from dflashgen.model import derive_projections

    shapes = {p.name: p for p in derive_projections(cfg, 1)}
    projs = {}
    for key, _, name in layer_projections(cfg):
        layout = SimpleNamespace(silu=name == "gate_up_proj")  # the deployment's fused SiLU epilogue
        w16 = torch.empty(shapes[name].n, shapes[name].k, dtype=act, device="meta")
        projs[key] = LibraryFallback(w16, SimpleNamespace(layout=layout), rt["library"].fallback_gemm)
    weights = rt["target"].NonLinearWeights(
        {n: torch.empty(shape, device="meta") for n, shape in rt["target"].nonlinear_shapes(cfg).items()})
    return rt["target"].TargetModel(cfg, projs, weights, device="meta", act_dtype=act)


def build(pkg: str, ckpt: Path | None, cfg: ModelConfig, act: torch.dtype, counter: OpCounter | None,
          sequential: bool = True) -> Any:
    """``pkg``'s target on the CPU as on a GPU (module docstring); ``sequential=False``: the GDN chunk
    form. ``ckpt=None``: on the meta device (op counts only)."""
    rt = {m: importlib.import_module(f"{pkg}.{m}") for m in ("target", "library", "linear")}
    if ckpt is None:
        target = _meta_target(rt, cfg, act)
    else:
        target = rt["target"].TargetModel.from_checkpoint(ckpt, cfg, load_deployment("nvfp4"), seed=5,
                                                          act_dtype=act)
        for md in target.proj:
            for name, m in list(md.items()):
                if isinstance(m, rt["linear"].QuantLinear):
                    md[name] = LibraryFallback(m.dequantize().to(act), m.packed(), rt["library"].fallback_gemm)
        if isinstance(target.lm_head, rt["linear"].QuantLinear):
            m = target.lm_head
            target.lm_head = LibraryFallback(m.dequantize().to(act), m.packed(), rt["library"].fallback_gemm)
    tmod: ModuleType = rt["target"]
    # the CUDA prefill path (gdn_prefill) or the torch chunk form; both hooks, so older REFs follow too
    tmod._prefill_form = lambda device, dk: "sequential" if sequential else "torch"
    tmod._sequential_prefill = lambda device, dk: sequential
    real = tmod.__dict__.setdefault("_real_gdn_prefill", tmod.gdn_prefill)

    def gdn_prefill(*a: Any, **kw: Any) -> torch.Tensor:
        if counter is None:
            return real(*a, **kw)
        with counter.paused("gdn kernel", "gdn_prefill"):
            v = a[3]
            return v.new_empty(v.shape) if v.is_meta else real(*a, **kw)  # o [B, T, Hv, dv]

    tmod.gdn_prefill = gdn_prefill
    real_norm = tmod.__dict__.setdefault("_real_rms_norm", tmod._rms_norm)

    def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        if counter is None or not counter.active:
            return real_norm(x, w, eps)
        # one fused kernel on CUDA (its CPU decomposition is five); a strided input is copied first
        moved = 2 * x.numel() * x.element_size() + (0 if x.is_contiguous() else 2 * _bytes(x))
        with counter.paused("elementwise/reduction", "rms_norm (fused on CUDA)", moved):
            return real_norm(x, w, eps)

    tmod._rms_norm = rms_norm
    return target


def state_of(target: Any, batch: int, max_len: int, act: torch.dtype) -> Any:
    tmod = sys.modules[type(target).__module__]
    max_len = -(-max_len // 16) * 16  # whole pages, as TargetModel.new_state
    return tmod.DecodeState(target.cfg, batch, max_len, target.device, act)  # FP16 KV as on a GPU


def snapshot(st: Any) -> list[torch.Tensor]:
    return ([st.lengths] + [c for i in st.k for c in (st.k[i], st.v[i])] + [st.ssm_all, st.conv_all])


def run_case(target: Any, tokens: torch.Tensor, act: torch.dtype) -> list[torch.Tensor]:
    """A prefill (logits and state), then a verify round (armed, 8 positions, rolled back to 5) and a
    one-token step: what every result tensor was after each."""
    b, t = tokens.shape
    st = state_of(target, b, t + 16, act)
    out = [target(tokens, st, num_new=t - 1 - 4 * torch.arange(b))]  # right-padded prompts, as the decoder
    out += snapshot(st)
    gen = torch.Generator().manual_seed(1)
    st.checkpoint(8)
    out.append(target(torch.randint(0, target.cfg.vocab_size, (b, 8), generator=gen), st))
    st.rollback(st.lengths - 3)
    out += snapshot(st)
    out.append(target(torch.randint(0, target.cfg.vocab_size, (b, 1), generator=gen), st))
    return out + snapshot(st)


def compare(label: str, old: list[torch.Tensor], new: list[torch.Tensor]) -> None:
    diffs = []
    for a, b in zip(old, new, strict=True):
        a, b = a.double(), b.double()
        d = (a - b).abs().max().item() if a.numel() else 0.0
        diffs.append((torch.equal(a, b), d, d / max(a.abs().max().item(), 1e-30) if a.numel() else 0.0))
    pre = diffs[:len(diffs) // 3]
    print(f"  {label}: prefill bitwise {all(e for e, _, _ in pre)} (max abs {max(d for _, d, _ in pre):.3g}, "
          f"max rel {max(r for _, _, r in pre):.3g}); verify + rollback + step bitwise "
          f"{all(e for e, _, _ in diffs[len(pre):])} (max abs {max(d for _, d, _ in diffs[len(pre):]):.3g})")


def table(ops: dict[tuple[str, str], list[int]], title: str) -> dict[str, tuple[int, int]]:
    print(f"## {title}")
    kinds: dict[str, tuple[int, int]] = {}
    for (kind, name), (n, moved) in sorted(ops.items(), key=lambda kv: (kv[0][0], -kv[1][1])):
        c, m = kinds.get(kind, (0, 0))
        kinds[kind] = (c + n, m + moved)
        print(f"  {kind:<22} {name:<28} {n:5d} calls {moved / 2**20:10.2f} MiB")
    for kind, (n, moved) in kinds.items():
        print(f"  TOTAL {kind:<22} {n:5d} calls {moved / 2**20:10.2f} MiB")
    return kinds


def config(name: str, layers: int | None) -> ModelConfig:
    from dflashgen.runtime.synthetic import truncate_config

    if name == "qwen3.8":
        return truncate_config(load_model_config(None), layers or 4)
    raw = dict(MEDIUM)
    if name == "tiny":
        from dflashgen.runtime.decode_bench import TINY
        raw = dict(TINY)
    return parse_model_config(raw, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="main", help="the commit whose runtime/ is 'before' (default: main)")
    ap.add_argument("--config", choices=("medium", "tiny", "qwen3.8"), default="medium")
    ap.add_argument("--layers", type=int, default=None, help="qwen3.8: layers kept (default 4: 3 GDN + 1 full)")
    ap.add_argument("--tokens", type=int, default=255)
    ap.add_argument("--no-check", action="store_true", help="skip the old-vs-new result comparison")
    ap.add_argument("--meta", action="store_true",
                    help="count on the meta device (shapes only: any size, e.g. --config qwen3.8 --tokens 1023); "
                         "implies --no-check")
    a = ap.parse_args()
    from dflashgen.runtime.synthetic import write_synthetic_checkpoint

    torch.manual_seed(0)
    old = old_runtime(a.ref)
    cfg = config(a.config, a.layers)
    ckpt = None
    if not a.meta:
        ckpt = Path(tempfile.mkdtemp())
        write_synthetic_checkpoint(ckpt, cfg, load_deployment("nvfp4"), seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, a.tokens), generator=torch.Generator().manual_seed(2))
    print(f"# {a.config}: {cfg.num_hidden_layers} layers {cfg.layer_types}, hidden {cfg.hidden_size}, "
          f"T = {a.tokens}, FP16 activations, prefill (logits=False), ref {a.ref}")
    kinds = {}
    for pkg, title in ((old, f"before ({a.ref})"), ("dflashgen.runtime", "after (this worktree)")):
        counter = OpCounter()
        target = build(pkg, ckpt, cfg, torch.float16, counter)
        st = state_of(target, 1, a.tokens, torch.float16)  # as SpecDecoder._prefill's scratch state
        with counter:
            target(tokens[:1].to(target.device), st, num_new=torch.tensor([a.tokens]), logits=False,
                   check=not a.meta)
        kinds[title] = table(counter.ops, title)
    print("## summary (calls, MiB): " + "; ".join(
        f"{k}: {' -> '.join(f'{v[k][0]} / {v[k][1] / 2**20:.1f}' for v in kinds.values() if k in v)}"
        for k in sorted({k for v in kinds.values() for k in v})))
    glue = [[(n, m) for k, (n, m) in v.items() if k not in ("matmul", "gdn kernel")] for v in kinds.values()]
    (n0, m0), (n1, m1) = ((sum(n for n, _ in g), sum(m for _, m in g)) for g in glue)
    print(f"## glue (casts, copies, elementwise): {n0} -> {n1} ops, {m0 / 2**20:.1f} -> {m1 / 2**20:.1f} MiB "
          f"moved; at the ~{H200_GLUE_BW / 1e12:.1f} TB/s these kernels reach on an H200 (bench/h200-2026-11-30-s7 "
          f"profile-prefill) {m0 / H200_GLUE_BW * 1e3:.3f} -> {m1 / H200_GLUE_BW * 1e3:.3f} ms")
    if a.no_check or a.meta:
        return
    print("## old vs new results (2 requests: prefill at T, then a verify round + rollback and a step)")
    for act in (torch.float16, torch.float32):
        for seq in (True, False):
            res = []
            for pkg in (old, "dflashgen.runtime"):
                res.append(run_case(build(pkg, ckpt, cfg, act, None, seq), tokens, act))
            compare(f"{str(act)[6:]} activations, GDN {'sequential (CUDA path)' if seq else 'chunk form'}",
                    *res)


if __name__ == "__main__":
    main()
