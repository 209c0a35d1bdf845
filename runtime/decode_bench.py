"""Endpoint-style speculative-decoding benchmark and a CPU demo: ``dflashgen decode-bench`` / ``dflashgen demo``.

decode-bench mirrors the seed PR's endpoint table (shared/reference/seed-pr.md): P prompts of L random
token ids, O output tokens each (no EOS: every request runs full length), and for each B in (1, 2, 4, 8)
continuous batching with ``max_batch = B`` over all prompts, the client keeping B requests in flight
(so TTFT excludes queueing: it runs from a request's admission, prefill included, to its first
emitted token). Per B: output tok/s (all output tokens / wall time), ratio to B1, ideal efficiency
``tok/s(B) / (B * tok/s(B1))``, p50 TTFT, p50 TPOT (``(t_last - t_first) / (n - 1)`` per request,
vLLM's definition), mean accepted length (tokens per request-round incl. the bonus token), completed
requests, and the per-round phase medians from :class:`~dflashgen.runtime.spec_decode.Stats`.

Replay drafter (default): proposes the target's own greedy continuation with i.i.d. per-token
probability ``a``, else a wrong token; its cost is real (:func:`~dflashgen.runtime.drafter.block_drafter_cost`
runs a DFlash2 block drafter's forward every round). With q7 (D = 7 drafts) the accepted drafts A
satisfy P(A >= i) = a^i, so the expected accepted length (bonus token included) is

    E[len] = sum_{i=0..7} a^i = (1 - a^8) / (1 - a),

and a = 0.8109 (solved by bisection, :func:`acceptance_for_length`) gives 4.30, the seed PR's ~4.3.
Greedy verification realises this rate by itself. Under sampled verification a random target would
accept a replayed greedy token with its own probability p(x) (measured accepted length ~1), so by
default sampled replay runs in SYNTHETIC ACCEPTANCE mode (benchmark only): the accept/reject decision
of each draft is the replay drafter's seeded coin (probability a, per request and position, batch
independent), while the target forward, full-vocab sampling probabilities, recovered/bonus sampling
and state rollback run as in the real path, so their cost is real. Such reports carry
``synthetic_acceptance: true``, a "SYNTHETIC ACCEPTANCE" header line and the label;
``--no-synthetic-acceptance`` measures real sampled acceptance of the replayed tokens instead.
Every replay output carries the "replay drafter (synthetic acceptance ...)" label: the acceptance is
synthetic, not a property of any drafter model.

A/B runs: ``--policies overlap stall stall:2 --repeat 3`` keeps one loaded target and runs every B > 1
under each admission policy in turn (B1 once per run), the whole set three times, alternating, so
policies are compared on one machine and process (the host-side phases differ by up to ~1 ms per round
from process to process); rows gain ``policy`` / ``run``, each run's efficiencies are against its own
B1, and ``policy_summary`` holds the medians per (B, policy). A policy's ``+serial`` / ``+pipelined``
suffix sets SpecDecoder's round pipelining (``--policies default default+serial``); B1 then runs once
per setting and each row's efficiency is against the B1 of its own setting.

Tensor parallel: under torchrun (WORLD_SIZE > 1) every rank loads its shard of the target (``--device
cuda``: the generated kernels on cuda:LOCAL_RANK over NCCL; CPU: gloo, each rank's projection shards
dequantized once into FP32 ``nn.Linear``), runs the identical benchmark loop in lockstep (the
SpecDecoder broadcasts rank 0's decisions) and only rank 0 prints and writes the report. A synthetic
checkpoint is written once (rank 0, before the others load). ``--tp N`` is a convenience that re-launches
this command as N local ranks through ``python -m torch.distributed.run --standalone`` (the parent
writes any synthetic checkpoint first); e.g. ``dflashgen decode-bench --synthetic --device cuda --tp 4``.
The report gains ``tp`` and, per B, ``allreduce_ms_per_round``: a separately measured estimate (median of
a few repeats, after the run) of one verify forward's row-parallel all-reduces -- as many FP32
``[B * (D + 1), hidden]`` all-reduces as the target has row-parallel projections; the vocab-parallel
lm_head gather and prefill are not included (None at TP1).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflashgen.deployment import load_deployment
from dflashgen.model import ModelConfig, load_model_config, parse_model_config

from .dequant_kernel import parse_budget
from .drafter import BlockDrafter, DFlashDrafter, DrafterConfig, StaticDFlashDrafter, block_drafter_cost
from .parallel import RowParallel, TPContext, init_tp
from .sampling import SamplingParams
from .spec_decode import Drafter, NgramDrafter, ReplayDrafter, SpecDecoder, plain_greedy
from .synthetic import write_synthetic_checkpoint
from .target import PREFILL_FORMS, NonLinearWeights, TargetModel, dequantized_projections

__all__ = [
    "BATCHES",
    "DEFAULT_ACCEPTANCE",
    "EFFICIENCY_GATES",
    "OFFICIAL",
    "Policy",
    "TINY",
    "BenchConfig",
    "acceptance_for_length",
    "add_decode_parsers",
    "expected_accepted_length",
    "load_target",
    "main_decode_bench",
    "main_demo",
    "plot_report",
    "run_decode_bench",
    "run_demo",
]

NUM_DRAFT = 7  # q7
BATCHES = (1, 2, 4, 8)
MAX_BATCH = 8
OFFICIAL = SamplingParams(temperature=1.0, top_p=0.95, top_k=20)  # Qwen3.8's official sampling
DRAFTERS = ("replay", "dflash", "ngram")
PHASE_NAMES = {"target": "target forward", "sample": "sampling+state", "draft": "draft", "host": "host"}
# the endpoint's ideal-efficiency gates (issue 5), drawn on decode_bench.png
EFFICIENCY_GATES = {2: 0.80, 4: 0.70, 8: 0.60}
# The 4-layer hybrid of tests/test_spec_decode.py (GDN, full, GDN, full): the demo's CPU-sized default.
TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attn_output_gate": True,
    "partial_rotary_factor": 0.25, "rope_theta": 1e7, "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 97,
}


# --------------------------------------------------------------------------- acceptance model


def expected_accepted_length(a: float, num_draft: int = NUM_DRAFT) -> float:
    """sum_{i=0..D} a^i: expected tokens per request-round (bonus included) at i.i.d. acceptance a."""
    return sum(a**i for i in range(num_draft + 1))


def acceptance_for_length(length: float, num_draft: int = NUM_DRAFT) -> float:
    """The per-token rate a with ``expected_accepted_length(a) == length`` (bisection; monotone in a)."""
    if not 1.0 <= length <= num_draft + 1:
        raise ValueError(f"accepted length must be in [1, {num_draft + 1}], got {length}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted_length(mid, num_draft) < length else (lo, mid)
    return (lo + hi) / 2


TARGET_ACCEPTED_LENGTH = 4.3  # the seed PR's q7 endpoint mean (4.16 .. 4.49)
DEFAULT_ACCEPTANCE = round(acceptance_for_length(TARGET_ACCEPTED_LENGTH), 4)  # 0.811


def replay_label(a: float, synthetic_decisions: bool = False) -> str:
    how = ("SYNTHETIC accept/reject decisions under sampled verification" if synthetic_decisions
           else "under greedy verification")
    return (f"replay drafter (synthetic acceptance a={a:g} per token, i.i.d.; design accepted length "
            f"{expected_accepted_length(a):.2f} for q7 {how}; draft cost = a real "
            f"DFlash2 block-drafter forward)")


# --------------------------------------------------------------------------- model loading


def load_target(directory: str | Path, deployment: str | None = None, *, device: str = "cpu",
                seed: int = 0, ctx: TPContext | None = None, invariant: bool = False) -> TargetModel:
    """The checkpoint's target. CPU: projections dequantized once into FP32 ``nn.Linear`` (the CPU
    fallback would dequantize on every call); CUDA: the generated kernels via a KernelLibrary.
    ctx (world size > 1, from :func:`~.parallel.init_tp`): this rank's shard (CUDA: on ``ctx.device``;
    CPU: the wrapped shards' projections dequantized in place).
    invariant (CUDA, TP1): batch-invariant projections (:mod:`~.invariance`): kernels at every M and
    fixed-shape FP16 projections, for greedy byte-identity across batch sizes; slower."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    cfg = load_model_config(path / "config.json")
    dep = load_deployment(deployment)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if ctx is not None and ctx.world_size > 1:
        return _load_tp_target(path, cfg, dep, device, seed, ctx)
    if device == "cuda":
        from .library import KernelLibrary

        if not invariant:
            return TargetModel.from_checkpoint(path, cfg, dep, library=KernelLibrary(), seed=seed)
        from .invariance import FixedShapeLinear, invariant_table
        from .library import default_table_path
        from .table import TuningTable

        dev = torch.device("cuda", torch.cuda.current_device())
        lib = KernelLibrary(dev, table=invariant_table(TuningTable.load(default_table_path(dev))))
        target = TargetModel.from_checkpoint(path, cfg, dep, library=lib, seed=seed)
        for md in target.proj:
            for name, m in list(md.items()):
                if isinstance(m, torch.nn.Linear):  # FP16 projections (cuBLAS): one GEMM shape
                    md[name] = FixedShapeLinear(m)
        if isinstance(target.lm_head, torch.nn.Linear):
            target.lm_head = FixedShapeLinear(target.lm_head)
        target.batch_invariant = True
        return target
    q = TargetModel.from_checkpoint(path, cfg, dep, seed=seed, act_dtype=torch.float32)
    projs = dequantized_projections(q)
    return TargetModel(cfg, projs, NonLinearWeights.from_checkpoint(path, cfg, seed=seed), device="cpu",
                       act_dtype=torch.float32)


def _load_tp_target(path: Path, cfg: ModelConfig, dep: Any, device: str, seed: int,
                    ctx: TPContext) -> TargetModel:
    if device == "cuda":
        if ctx.device.type != "cuda":
            raise ValueError("--device cuda under tensor parallelism needs the NCCL backend (CUDA visible)")
        from .library import KernelLibrary

        return TargetModel.from_checkpoint(path, cfg, dep, library=KernelLibrary(ctx.device), seed=seed, ctx=ctx)
    if ctx.device.type != "cpu":
        raise ValueError("--device cpu under tensor parallelism needs the gloo backend")
    q = TargetModel.from_checkpoint(path, cfg, dep, seed=seed, act_dtype=torch.float32, ctx=ctx)
    wrapped = {f"layers.{i}.{k}": m for i, md in enumerate(q.proj) for k, m in md.items()}
    wrapped["lm_head"] = q.lm_head
    for m in wrapped.values():  # each rank's shard, dequantized once (logical rows: [gate | up] unfused)
        w = m.module.dequantize() if hasattr(m.module, "dequantize") else m.module.weight.float()
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w.float()
        m.module = lin
    return TargetModel(cfg, wrapped, NonLinearWeights.from_checkpoint(path, cfg, seed=seed), device="cpu",
                       act_dtype=torch.float32, ctx=ctx)


def _allreduce_ms(target: TargetModel, tokens: int, repeats: int = 5) -> float | None:
    """Median time (ms) of one verify forward's row-parallel all-reduces, measured on their own:
    one FP32 [tokens, hidden] all-reduce per row-parallel projection. None at TP1."""
    group = getattr(target, "tp_group", None)
    if group is None:
        return None
    n = sum(isinstance(m, RowParallel) for md in target.proj for m in md.values())  # type: ignore[attr-defined]
    buf = torch.zeros(tokens, target.cfg.hidden_size, device=target.device)
    cuda = target.device.type == "cuda"
    times = []
    for i in range(repeats + 1):  # the first is a warmup
        dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(target.device)
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(buf, group=group)
        if cuda:
            torch.cuda.synchronize(target.device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _model_config(spec: str | None, layers: int | None) -> ModelConfig:
    from .synthetic import truncate_config

    cfg = parse_model_config(TINY, "tiny") if spec == "tiny" else load_model_config(spec)
    return truncate_config(cfg, layers)


def write_synthetic(directory: str | Path, model: str | None, layers: int | None, deployment: str | None,
                    seed: int = 0, device: str = "cpu") -> ModelConfig:
    """device="cuda": draw and quantize on the GPU (the full 27B checkpoint in seconds, not minutes)."""
    return write_synthetic_checkpoint(directory, _model_config(model, None), load_deployment(deployment),
                                      seed=seed, layers=layers, device=device)


def drafter_config_for(cfg: ModelConfig) -> DrafterConfig:
    """The Qwen3.8-27B drafter for a 5120-wide target (taps respread over a truncated target), else a
    tiny drafter at the target's width. The mask token is clamped into the vocab."""
    base = DrafterConfig()
    n = cfg.num_hidden_layers
    taps = base.target_layers if max(base.target_layers) < n else tuple(sorted({round(i * (n - 1) / 4)
                                                                                for i in range(5)}))
    mask = base.mask_token_id if base.mask_token_id < cfg.vocab_size else cfg.vocab_size - 1
    if cfg.hidden_size == base.hidden_size:
        return replace(base, target_layers=taps, mask_token_id=mask, target_hidden_size=cfg.hidden_size)
    return DrafterConfig.tiny(cfg.hidden_size, mask_token_id=mask, target_layers=taps)


def _block_drafter(target: TargetModel, seed: int) -> BlockDrafter:
    dtype = torch.float16 if target.device.type == "cuda" else torch.float32
    return BlockDrafter.for_target(target, drafter_config_for(target.cfg), seed=seed, dtype=dtype)


# --------------------------------------------------------------------------- benchmark


@dataclass(frozen=True)
class Policy:
    """How joining requests enter the batch: ``prefill`` "overlap" (beside the rounds, on a low-priority
    stream), "stall" (the requests in flight wait) or None (SpecDecoder's default: stall),
    and the admission group (waiting requests join once this many slots are free); and whether the
    rounds are pipelined (SpecDecoder's ``pipeline``: True, False, None = its default)."""

    prefill: str | None = None
    join_group: int = 1
    pipeline: bool | None = None

    ROUNDS = {"pipelined": True, "serial": False}

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``overlap`` | ``stall`` | ``default``, optionally ``:N`` for a join group of N (``stall:2``),
        optionally ``+pipelined`` / ``+serial`` for the rounds (``stall+serial``)."""
        head, plus, rounds = text.partition("+")
        name, _, group = head.partition(":")
        if name not in ("overlap", "stall", "default") or (plus and rounds not in cls.ROUNDS):
            raise ValueError(f"policy {text!r}: expected overlap, stall or default, optionally :N (e.g. stall:2), "
                             "optionally +pipelined or +serial")
        try:
            jg = int(group) if group else 1
        except ValueError:
            raise ValueError(f"policy {text!r}: the join group after ':' must be an integer") from None
        return cls(None if name == "default" else name, jg, cls.ROUNDS[rounds] if plus else None)

    @property
    def overlap(self) -> bool | None:
        return None if self.prefill is None else self.prefill == "overlap"

    @property
    def label(self) -> str:
        rounds = "" if self.pipeline is None else "+pipelined" if self.pipeline else "+serial"
        return (self.prefill or "default") + (f":{self.join_group}" if self.join_group != 1 else "") + rounds


@dataclass(frozen=True)
class BenchConfig:
    prompts: int = 16
    prompt_len: int = 1024
    output_len: int = 512
    batches: tuple[int, ...] = BATCHES
    drafter: str = "replay"
    acceptance: float = DEFAULT_ACCEPTANCE
    params: SamplingParams = OFFICIAL
    seed: int = 0
    max_len: int | None = None  # default prompt_len + output_len
    warmup: bool = True
    synthetic: bool = True  # replay + sampled verification: synthetic accept/reject decisions (benchmark only)
    graphs: bool = True  # CUDA graphs for the target steps and the draft pass (on CUDA); False: eager
    sampler: str | None = None  # "compact" (the generated kernel, default on CUDA) or "dense"
    join_group: int = 1  # SpecDecoder's admission group (join_group_for)
    overlap_prefill: bool | None = None  # SpecDecoder's: joiners prefill beside the rounds (None: its default, stall)
    sampled_drafts: bool = False  # block drafter: sampled requests' drafts drawn with q (default: argmax, DFlash's)
    prefill_sm_carveout: int | None = None  # SpecDecoder's: SMs the overlapped prefill's cuBLAS GEMMs leave free
    # A/B of admission policies on one loaded target: every B > 1 runs each policy (B1 once: a lone
    # request always prefills alone), `repeat` times, alternating; empty: the one policy above.
    policies: tuple[Policy, ...] = ()
    repeat: int = 1

    def policy_list(self) -> tuple[Policy, ...]:
        return self.policies or (Policy(None if self.overlap_prefill is None else
                                        "overlap" if self.overlap_prefill else "stall", self.join_group),)

    def join_group_for(self, b: int, policy: Policy | None = None) -> int:
        """SpecDecoder's admission group at batch size b (capped at b). Default 1, each request as
        soon as a slot frees: on the H200 (session 5) groups of B / 2 moved B4 / B8 by +1% / -1.5%
        once a 1K-token prefill took ~0.17 s, so the idle slots cost what the joint prefills save."""
        return min(self.join_group if policy is None else policy.join_group, b)

    @property
    def synthetic_acceptance(self) -> bool:
        """Whether the run uses the synthetic-acceptance verifier override (replay, sampled)."""
        return self.synthetic and self.drafter == "replay" and not self.params.greedy

    def validate(self) -> None:
        for name in ("prompts", "prompt_len", "output_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not self.batches or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BATCH
                                   for b in self.batches):
            raise ValueError(f"every B must be an integer in 1..{MAX_BATCH}, got {list(self.batches)}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {self.acceptance}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        for pol in self.policy_list():
            jg = pol.join_group
            if isinstance(jg, bool) or not isinstance(jg, int) or jg < 1:
                raise ValueError(f"join_group must be an integer >= 1, got {jg!r}")
            if pol.prefill not in (None, "overlap", "stall"):
                raise ValueError(f"prefill must be overlap, stall or None, got {pol.prefill!r}")
        if self.policies and (self.overlap_prefill is not None or self.join_group != 1):
            raise ValueError("give either policies or overlap_prefill / join_group (--policies replaces "
                             "--prefill and --join-group)")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies repeat: {[p.label for p in self.policies]}")
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or self.repeat < 1:
            raise ValueError(f"repeat must be an integer >= 1, got {self.repeat!r}")
        c = self.prefill_sm_carveout
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1
                              or any(p.overlap is False for p in self.policy_list())):
            raise ValueError(f"prefill_sm_carveout must be an integer >= 1 (SMs) with overlapped prefill, got {c!r}")
        if self.max_len is not None and self.prompt_len + self.output_len > self.max_len:
            raise ValueError(f"prompt length {self.prompt_len} + {self.output_len} output tokens exceeds "
                             f"max_len={self.max_len}")


@dataclass
class _Clock:
    """SpecDecoder observer: per-request admission / first-token / last-token times."""

    admit: dict[int, float] = field(default_factory=dict)
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    on_tokens: Callable[[int], None] | None = None  # new tokens this event (progress bars)

    def __call__(self, event: str, rid: int, n: int) -> None:
        t = time.perf_counter()
        if event == "admit":
            self.admit[rid] = t
            self.count[rid] = 0
        elif event == "tokens":
            self.first.setdefault(rid, t)
            self.last[rid] = t
            if self.on_tokens is not None:
                self.on_tokens(n - self.count.get(rid, 0))
            self.count[rid] = n

    def ttft_ms(self) -> list[float]:
        return [(self.first[r] - self.admit[r]) * 1e3 for r in self.first]

    def tpot_ms(self) -> list[float]:
        return [(self.last[r] - self.first[r]) * 1e3 / (self.count[r] - 1) for r in self.first if self.count[r] > 1]


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _params_for(cfg: BenchConfig, n: int) -> list[SamplingParams]:
    # Per-request seeds: sampled tokens depend on (seed, request, round), not on batch composition.
    if cfg.params.greedy:
        return [cfg.params] * n
    return [replace(cfg.params, seed=cfg.seed * 1_000_003 + i) for i in range(n)]


def _make_drafter(cfg: BenchConfig, target: TargetModel, block: BlockDrafter | None,
                  continuations: list[list[int]] | None, max_batch: int = MAX_BATCH,
                  max_len: int | None = None) -> Drafter:
    """On CUDA the block drafter runs over static slots (one CUDA graph per batch size, fed the real
    target taps); on CPU the per-request DFlashDrafter (replay: random stand-in taps)."""
    if cfg.drafter == "ngram":
        return NgramDrafter(num_draft=NUM_DRAFT)
    assert block is not None
    static = None
    if target.device.type == "cuda" and getattr(target, "tp", 1) == 1:
        static = StaticDFlashDrafter(block, max_batch, max_len or cfg.prompt_len + cfg.output_len,
                                     graphs=cfg.graphs, seed=cfg.seed, sampled=cfg.sampled_drafts)
    if cfg.drafter == "dflash":
        return static or DFlashDrafter(block, cfg.seed, sampled=cfg.sampled_drafts)
    assert continuations is not None
    d = ReplayDrafter(continuations, cfg.acceptance, NUM_DRAFT, seed=cfg.seed,
                      cost_model=static or block_drafter_cost(block, cfg.seed),
                      synthetic_acceptance=cfg.synthetic_acceptance)
    d.label = replay_label(cfg.acceptance, cfg.synthetic_acceptance)
    return d


def replay_continuations(target: TargetModel, prompts: Sequence[Sequence[int]], n: int,
                         cfg: BenchConfig) -> list[list[int]]:
    """The replay drafter's "right" tokens (n per prompt, D more than the output so drafts near the end
    are real). Greedy verification needs the target's own greedy continuation (plain decoding, one
    token per forward). Under synthetic acceptance the accept decisions are the drafter's coins and
    the tokens' content never changes the work, so seeded random tokens stand in (saving the
    prompts x n single-token forwards: minutes at full size)."""
    if cfg.synthetic_acceptance:
        return make_prompts(len(prompts), n, target.cfg.vocab_size, cfg.seed + 1)
    return [plain_greedy(target, p, n) for p in prompts]


def _median(v: Sequence[float]) -> float | None:
    return statistics.median(v) if v else None


def run_decode_bench(target: TargetModel, cfg: BenchConfig, *, command: str = "",
                     log: Callable[[str], None] | None = None,
                     on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The report (JSON-ready): ``header``, ``command``, ``config``, ``rows`` (one per B).
    ``on_row``: called with the report so far after each B (partial results survive a later failure)."""
    vocab = target.cfg.vocab_size
    cfg.validate()
    max_len = cfg.max_len or cfg.prompt_len + cfg.output_len
    prompts = make_prompts(cfg.prompts, cfg.prompt_len, vocab, cfg.seed)
    params = _params_for(cfg, cfg.prompts)
    block = _block_drafter(target, cfg.seed) if cfg.drafter in ("replay", "dflash") else None
    conts = None
    if cfg.drafter == "replay":
        if log:
            log(f"replay: continuations of {cfg.prompts} prompts ...")
        conts = replay_continuations(target, prompts, cfg.output_len + NUM_DRAFT, cfg)
    label = _make_drafter(cfg, target, block, conts, 1, max_len).label
    rows: list[dict[str, Any]] = []
    dec_info: dict[str, Any] = {}
    b1_outputs: list[list[int]] | None = None
    policies = cfg.policy_list()
    many = len(policies) > 1 or cfg.repeat > 1
    for run in range(cfg.repeat):
        for b in cfg.batches:
            # B1: a lone request always prefills alone, so the admission policies are one schedule
            # there; it runs once per round pipelining (which does change it)
            for pol in policies if b > 1 else _b1_policies(policies):
                dec = SpecDecoder(target, _make_drafter(cfg, target, block, conts, b, max_len), max_batch=b,
                                  max_len=max_len, num_draft=NUM_DRAFT, graphs=None if cfg.graphs else False,
                                  sampler=cfg.sampler, join_group=cfg.join_group_for(b, pol),
                                  overlap_prefill=pol.overlap, prefill_sm_carveout=cfg.prefill_sm_carveout,
                                  pipeline=pol.pipeline)
                row, outs = _measure(dec, target, cfg, prompts, params, b)
                # after the run: a failed capture (graphs) or a missing kernel image (sampler) fell back
                dec_info = {"graphs": dec.steps.captured, "sampler": dec.sampler,
                            "pipelined": sorted({*dec_info.get("pipelined", ()), dec.pipeline})}
                row["policy"], row["run"], row["pipelined"] = pol.label, run, dec.pipeline
                del dec  # this B's decoder (states, graphs) goes before the next is built: a peak per B
                if b == 1:
                    b1_outputs = outs
                row["same_as_b1"] = (sum(o == r for o, r in zip(outs, b1_outputs, strict=True))
                                     if b1_outputs else None)
                row["allreduce_ms_per_round"] = _allreduce_ms(target, b * (NUM_DRAFT + 1))
                rows.append(row)
                if log:
                    tag = f" [{pol.label}, run {run + 1}/{cfg.repeat}]" if many else ""
                    log(f"B={b}{tag}: {row['output_tok_s']:.2f} tok/s, accepted length {row['accepted_length']:.2f}, "
                        f"{row['completed']}/{cfg.prompts} completed"
                        + (f", {row['prelaunched_share']:.0%} of rounds pipelined" if row["pipelined"] else ""))
                if on_row is not None:
                    on_row(_report(target, cfg, label, rows, dec_info, command, max_len))
    return _report(target, cfg, label, rows, dec_info, command, max_len)


def _b1_policies(policies: Sequence[Policy]) -> list[Policy]:
    """The policies B1 runs under: the first of each round pipelining setting."""
    first: dict[bool | None, Policy] = {}
    for p in policies:
        first.setdefault(p.pipeline, p)
    return list(first.values())


def _measure(dec: SpecDecoder, target: TargetModel, cfg: BenchConfig, prompts: list[list[int]],
             params: list[SamplingParams], b: int) -> tuple[dict[str, Any], list[list[int]]]:
    """One decoder's measured run over every prompt: its report row (without the cross-row fields)
    and the outputs."""
    if cfg.warmup:  # first-call costs (allocations, lazy init, graph capture) stay out of the measured run
        dec.generate(prompts[:b], params[:b], min(cfg.output_len, 2 * (NUM_DRAFT + 1)))
    clock = _Clock()
    dec.observer = clock
    if target.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target.device)
    outs = dec.generate(prompts, params, cfg.output_len, seed=cfg.seed)
    s = dec.stats.summary()
    tokens = sum(len(o) for o in outs)
    row: dict[str, Any] = {
        "B": b,
        "output_tok_s": tokens / dec.stats.wall_s,
        "completed": sum(len(o) == cfg.output_len for o in outs),
        "requests": cfg.prompts,
        "join_group": dec.join_group,
        "output_tokens": tokens,
        "wall_s": dec.stats.wall_s,
        "p50_ttft_ms": _median(clock.ttft_ms()),
        "p50_tpot_ms": _median(clock.tpot_ms()),
        "accepted_length": s["mean_acceptance_length"],
        "rounds": s["rounds"],
        "mean_batch": s["mean_batch"],
        # rounds whose draft pass was queued during the previous round (SpecDecoder.pipeline)
        "prelaunched_share": s["prelaunched_rounds"] / s["rounds"] if s["rounds"] else 0.0,
        # every other request waits while a joining one prefills (unless overlapped): this share of
        # the wall clock is what separates the efficiency from the per-round phases
        "prefill_s": s["prefill_ms_total"] / 1e3,
        # prefills run beside the rounds (overlap_prefill): their device time, contention included
        "overlapped_prefill_s": s["overlapped_prefill_ms_total"] / 1e3,
        "overlapped_prefills": s["overlapped_prefills"],
        **{f"median_{p}_ms": s[f"median_{p}_ms"] for p in PHASE_NAMES},
        "median_prefill_queue_ms": s["median_prefill_ms"],  # host time queuing overlapped layers
        "output_0": outs[0],
        **_memory(target),
    }
    # What the rounds alone explain (rounds x the sum of the phase medians) and what they leave:
    # the prefills of joining requests (stalling or overlapped) and round-to-round spread.
    round_ms = sum(row[f"median_{p}_ms"] for p in PHASE_NAMES)
    rounds_s = s["rounds"] * round_ms / 1e3
    row["round_ms"] = round_ms
    row["outside_rounds_s"] = row["wall_s"] - rounds_s
    row["rounds_tok_s"] = tokens / rounds_s if rounds_s > 0 else None
    return row, outs


def _budget_text(budget: int | str | None) -> str:
    return "all kept" if budget is None else "auto" if budget == "auto" else f"at most {int(budget) / 2**30:g} GiB"


def _memory(target: TargetModel) -> dict[str, float | None]:
    """GiB: the run's peak of allocated GPU memory, and the dequantized weight copies the library keeps
    for its dequantize + cuBLAS path (``dequant_cache``); None off the GPU."""
    if target.device.type != "cuda":
        return {"peak_gpu_gib": None, "dequant_kept_gib": None}
    lib = target.library
    return {"peak_gpu_gib": torch.cuda.max_memory_allocated(target.device) / 2**30,
            "dequant_kept_gib": lib.dequantized.bytes / 2**30 if lib is not None else None}


def _report(target: TargetModel, cfg: BenchConfig, label: str, rows: list[dict[str, Any]],
            dec_info: dict[str, Any], command: str, max_len: int) -> dict[str, Any]:
    """The report of the rows so far (ratios to B1 filled in place)."""
    for r in rows:  # against the B1 of the same run (repeats alternate: the nearest in time) and round
        # pipelining, else of the same run, else the first
        b1s = [x for x in rows if x["B"] == 1]
        ref = next((x for x in b1s if x.get("run", 0) == r.get("run", 0) and x.get("pipelined") == r.get("pipelined")),
                   next((x for x in b1s if x.get("run", 0) == r.get("run", 0)), b1s[0] if b1s else None))
        b1 = ref["output_tok_s"] if ref else None
        b1_rounds = ref.get("rounds_tok_s") if ref else None
        r["vs_b1"] = r["output_tok_s"] / b1 if b1 else None
        r["ideal_efficiency"] = r["output_tok_s"] / (r["B"] * b1) if b1 else None
        # the same ratio from the rounds alone: what the efficiency would be if nothing outside the
        # rounds (prefill above all) took wall time at any B
        rt = r.get("rounds_tok_s")
        r["rounds_efficiency"] = rt / (r["B"] * b1_rounds) if rt and b1_rounds else None
    p = cfg.params
    sampling = "greedy" if p.greedy else f"temperature={p.temperature:g} top-p={p.top_p:g} top-k={p.top_k}"
    tc = target.cfg
    tp = getattr(target, "tp", 1)
    where = target.device.type + (f" x TP{tp}" if tp > 1 else "")
    header = (f"{label}; target {tc.source} ({tc.num_hidden_layers} layers, vocab {tc.vocab_size}) on "
              f"{where}; {cfg.prompts} prompts x {cfg.prompt_len} random tokens -> {cfg.output_len} "
              f"output tokens; q{NUM_DRAFT}; {sampling}; "
              f"{'CUDA graphs' if dec_info.get('graphs') else 'eager'}, {dec_info.get('sampler')} rejection sampling"
              + {(True,): "; pipelined rounds (the next draft pass queued before the outcome is read)",
                 (False,): "; serial rounds", (False, True): "; pipelined and serial rounds"
                 }.get(tuple(dec_info.get("pipelined", ())), "")
              + (f"; overlapped prefill leaves {cfg.prefill_sm_carveout} SMs to the rounds (cuBLAS carveout)"
                 if cfg.prefill_sm_carveout else "")
              + f"; GDN prefill {os.environ.get('DFLASHGEN_GDN_PREFILL') or 'sequential'}"
              + (f"; dequantized weight copies: {_budget_text(target.library.dequantized.budget)}"
                 if target.library is not None else ""))
    note = None
    if cfg.synthetic_acceptance:
        note = (f"SYNTHETIC ACCEPTANCE (benchmark only): each draft's accept/reject decision under sampled "
                f"verification is a seeded coin with probability a={cfg.acceptance:g} (design accepted length "
                f"{expected_accepted_length(cfg.acceptance):.2f}), not the target's test; the target forward, "
                "sampling work and rollback are real, the emitted tokens do not follow the target distribution")
        header += f"\n{note}"
    elif cfg.drafter == "replay" and not p.greedy:
        note = ("sampled verification: the target accepts each replayed greedy token with its own probability, "
                "so the synthetic rate is not realised; accepted length is as measured (use --greedy for the "
                "design rate)")
        header += f"\nNOTE: {note}"
    return {
        "header": header,
        "note": note,
        "synthetic_acceptance": cfg.synthetic_acceptance,
        "drafter": label,
        "tp": tp,
        "command": command,
        "config": {"prompts": cfg.prompts, "prompt_len": cfg.prompt_len, "output_len": cfg.output_len,
                   "batches": list(cfg.batches), "drafter": cfg.drafter,
                   "acceptance": cfg.acceptance if cfg.drafter == "replay" else None,
                   "synthetic_acceptance": cfg.synthetic_acceptance,
                   "sampling": {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k},
                   "seed": cfg.seed, "max_len": max_len, "num_draft": NUM_DRAFT,
                   "model": tc.source, "layers": tc.num_hidden_layers, "device": target.device.type,
                   "tp": tp, "graphs": dec_info.get("graphs"), "sampler": dec_info.get("sampler"),
                   "policies": [pol.label for pol in cfg.policy_list()], "repeat": cfg.repeat},
        "rows": rows,
        "policy_summary": policy_summary(rows),
    }


def policy_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (B, policy), over the runs: median / min / max tok/s and the median efficiencies and time
    outside the rounds -- what an alternating A/B of admission policies compares."""
    out = []
    for key in dict.fromkeys((r["B"], r.get("policy", "default")) for r in rows):
        group = [r for r in rows if (r["B"], r.get("policy", "default")) == key]
        tok = [r["output_tok_s"] for r in group]

        def med(k: str, group: list[dict[str, Any]] = group) -> float | None:
            return _median([r[k] for r in group if r.get(k) is not None])

        out.append({"B": key[0], "policy": key[1], "runs": len(group), "median_tok_s": statistics.median(tok),
                    "min_tok_s": min(tok), "max_tok_s": max(tok), "median_ideal_efficiency": med("ideal_efficiency"),
                    "median_rounds_efficiency": med("rounds_efficiency"),
                    "median_outside_rounds_s": med("outside_rounds_s")})
    return out


def _many_runs(report: dict[str, Any]) -> bool:
    """Whether the report holds more than one policy or run (an A/B): then its rows carry both."""
    return len({(r.get("policy"), r.get("run", 0)) for r in report["rows"]}) > 1


def format_policy_summary(report: dict[str, Any]) -> str:
    summary = report.get("policy_summary") or policy_summary(report["rows"])
    lines = ["| B | policy | runs | median tok/s | min - max tok/s | median ideal efficiency | "
             "median rounds-only efficiency | median outside rounds |", "|" + "---|" * 8]

    def pct(v: float | None) -> str:
        return _fmt(None if v is None else 100 * v, ".1f", "%")

    for s in summary:
        lines.append(f"| {s['B']} | {s['policy']} | {s['runs']} | {s['median_tok_s']:.2f} | "
                     f"{s['min_tok_s']:.2f} - {s['max_tok_s']:.2f} | {pct(s['median_ideal_efficiency'])} | "
                     f"{pct(s['median_rounds_efficiency'])} | {_fmt(s['median_outside_rounds_s'], '.2f', ' s')} |")
    return "\n".join(lines)


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def _prefill_cell(r: dict[str, Any]) -> str:
    pre = r.get("prefill_s")  # absent in reports written before it was recorded
    if pre is None:
        return "-"
    cell = f"{pre:.2f} s ({100 * pre / r['wall_s']:.0f}%)"
    if r.get("overlapped_prefills"):
        cell += f" + {r['overlapped_prefills']} overlapped ({r['overlapped_prefill_s']:.2f} s)"
    return cell


def format_table(report: dict[str, Any]) -> str:
    many = _many_runs(report)
    cols = ["B", *(["policy", "run"] if many else []), "output tok/s", "vs B1", "ideal efficiency", "p50 TTFT",
            "p50 TPOT", "accepted length",
            "completed", "target fwd", "sampling+state", "draft", "host", "prefill (share of wall)", "join group",
            "rounds-only efficiency", "outside rounds"]
    ar = any(r.get("allreduce_ms_per_round") is not None for r in report["rows"])
    if ar:
        cols.append("all-reduce/round")
    mem = any(r.get("peak_gpu_gib") is not None for r in report["rows"])
    if mem:
        cols.append("peak GPU memory (dequantized copies)")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in report["rows"]:
        eff = None if r["ideal_efficiency"] is None else 100 * r["ideal_efficiency"]
        cells = [str(r["B"]), *([str(r.get("policy", "default")), str(r.get("run", 0) + 1)] if many else []),
                 f"{r['output_tok_s']:.2f}", _fmt(r["vs_b1"], ".3f", "x"), _fmt(eff, ".1f", "%"),
                 _fmt(r["p50_ttft_ms"], ".2f", " ms"), _fmt(r["p50_tpot_ms"], ".2f", " ms"),
                 f"{r['accepted_length']:.2f}", f"{r['completed']}/{r['requests']}",
                 *(f"{r[f'median_{p}_ms']:.2f} ms" for p in PHASE_NAMES), _prefill_cell(r),
                 str(r.get("join_group", 1)),  # reports before the admission group admitted at once
                 _fmt(None if r.get("rounds_efficiency") is None else 100 * r["rounds_efficiency"], ".1f", "%"),
                 _fmt(r.get("outside_rounds_s"), ".2f", " s")]
        if ar:
            cells.append(_fmt(r.get("allreduce_ms_per_round"), ".2f", " ms"))
        if mem:
            kept = _fmt(r.get("dequant_kept_gib"), ".1f", " GiB")
            cells.append(f"{_fmt(r.get('peak_gpu_gib'), '.1f', ' GiB')} ({kept})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    ab = ""
    if _many_runs(report):
        several = len({r.get("policy") for r in report["rows"]}) > 1
        how = ("Every B > 1 ran each admission policy in turn, the runs alternating on one loaded target (B1 "
               "once per run: a lone request prefills alone under any policy)" if several else
               "The batches ran in turn, once per run, on one loaded target")
        ab = (f"## Medians over the runs\n\n{how}; each run's efficiency is against the B1 of the same run."
              "\n\n" + format_policy_summary(report) + "\n\n## Runs\n\n")
    return (f"# decode-bench\n\n{report['header']}\n\n```\n{report['command']}\n```\n\n{ab}{format_table(report)}\n\n"
            "Phase columns: per-round medians (target forward, sampling + state rollback, draft, host; the "
            "device phases from CUDA events, host from the CPU clock: on CUDA the host's preparation of a "
            "round runs while the draft pass is still on the GPU, so the four can sum to more than a round); "
            "prefill: total time spent prefilling joining requests while every request in flight waits, "
            "and its share of the run's wall clock; + overlapped: joiners prefilled on a low-priority side "
            "stream beside the rounds (their device time, contention included; the others keep decoding); "
            "join group: waiting requests are admitted once this many "
            "slots are free (1: at once), in one joint prefill. "
            "Rounds-only efficiency: the ideal efficiency from rounds x the sum of the phase medians alone "
            "(as if nothing outside the rounds took wall time); outside rounds: wall clock minus that "
            "(prefills, stalling or overlapped, and round-to-round spread). "
            "TTFT runs from a request's admission (B requests in flight, prefill included) to its first "
            "token; TPOT = (t_last - t_first) / (n - 1) per request. Ideal efficiency = tok/s(B) / "
            "(B x tok/s(B1)). Peak GPU memory: allocated by torch during the measured run at that B; in "
            "brackets the dequantized FP16 weight copies the dequantize + cuBLAS path keeps "
            "(--dequant-cache).\n")


def plot_report(report: dict[str, Any], path: str | Path) -> bool:
    """decode_bench.png: per B, where the wall clock goes (rounds x each phase's median, and the time
    outside the rounds: prefills and round-to-round spread) against the wall an ideal B-fold speedup
    of B1 and each efficiency gate allow; and ideal / rounds-only efficiency against the gates.
    False (no file) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows: list[dict[str, Any]] = []
    for r in report["rows"]:  # an A/B report: the wall panel shows each B's first run (its first policy)
        if all(r["B"] != x["B"] for x in rows):
            rows.append(r)
    bs = [r["B"] for r in rows]
    x = list(range(len(rows)))
    fig, (wall, eff) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(rows)
    parts = [(f"median_{p}_ms", name) for p, name in PHASE_NAMES.items()]
    for key, name in [*parts, ("outside_rounds_s", "outside rounds (prefill, spread)")]:
        secs = [(r[key] if key == "outside_rounds_s" else r["rounds"] * r[key] / 1e3) or 0.0 for r in rows]
        wall.bar(x, secs, bottom=bottom, label=name, width=0.6)
        bottom = [b + v for b, v in zip(bottom, secs, strict=True)]
    b1 = next((r for r in rows if r["B"] == 1), None)
    if b1 is not None:
        ideal = [b1["wall_s"] * r["output_tokens"] / (b1["output_tokens"] * r["B"]) for r in rows]
        wall.scatter(x, ideal, marker="_", s=900, color="k", zorder=3, label="ideal (B1 wall / B)")
        gated = [(i, w / EFFICIENCY_GATES[r["B"]]) for i, (r, w) in enumerate(zip(rows, ideal, strict=True))
                 if r["B"] in EFFICIENCY_GATES]
        if gated:
            wall.scatter(*zip(*gated, strict=True), marker="_", s=900, color="red", zorder=3, label="gate's wall")
    wall.set_xticks(x, [f"B{b}" for b in bs])
    wall.set_ylabel("wall clock (s)")
    wall.set_title("where the wall clock goes")
    wall.legend(fontsize=7)
    summary = report.get("policy_summary") or policy_summary(report["rows"])
    labels = list(dict.fromkeys(sm["policy"] for sm in summary if sm["B"] > 1)) if _many_runs(report) else [None]
    for pol in labels:
        tag = f" ({pol}, median)" if pol is not None else ""
        for key, name, style in (("median_ideal_efficiency", "ideal efficiency", "o-"),
                                 ("median_rounds_efficiency", "rounds only", "s--")):
            pts = [(sm["B"], 100 * sm[key]) for sm in summary
                   if sm.get(key) is not None and (pol is None or sm["policy"] == pol or sm["B"] == 1)]
            if pts:
                eff.plot(*zip(*pts, strict=True), style, label=name + tag)
    eff.scatter(list(EFFICIENCY_GATES), [100 * g for g in EFFICIENCY_GATES.values()], marker="x", s=80,
                color="red", zorder=3, label="gates")
    eff.set_xscale("log", base=2)
    eff.set_xticks(bs, [str(b) for b in bs])
    eff.set_xlabel("B (requests in flight)")
    eff.set_ylabel("% of B x tok/s(B1)")
    eff.set_title("batch efficiency")
    eff.grid(True, alpha=0.3)
    eff.legend(fontsize=7)
    title = f"decode-bench, TP{report.get('tp', 1)}, mean accepted length {rows[0]['accepted_length']:.2f}"
    fig.suptitle(title + (" (SYNTHETIC acceptance)" if report.get("synthetic_acceptance") else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(report: dict[str, Any], out: str | Path) -> None:
    """decode_bench.json, decode_bench.md and (with matplotlib) decode_bench.png in ``out``."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "decode_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (d / "decode_bench.md").write_text(format_markdown(report))
    plot_report(report, d / "decode_bench.png")


# --------------------------------------------------------------------------- demo


def run_demo(model: str = "tiny", layers: int | None = None, *, prompts: int = 4, prompt_len: int = 32,
             output_len: int = 64, batch: int = 2, drafter: str = "replay", acceptance: float = DEFAULT_ACCEPTANCE,
             params: SamplingParams = OFFICIAL, seed: int = 0, deployment: str | None = None,
             progress: bool = True, out: Callable[[str], None] = print, synthetic: bool = True) -> dict[str, Any]:
    """Write a synthetic checkpoint (tiny by default), speculative-decode a few prompts with a tqdm
    bar, print tokens/s, accepted length and the phase medians; returns ``Stats.summary()`` + label."""
    from tqdm import tqdm

    cfg = BenchConfig(prompts, prompt_len, output_len, (batch,), drafter, acceptance, params, seed, warmup=False,
                      synthetic=synthetic)
    cfg.validate()
    with tempfile.TemporaryDirectory(prefix="dflashgen-demo-") as tmp:
        write_synthetic(tmp, model, layers, deployment, seed)
        target = load_target(tmp, deployment, seed=seed)
    ps = make_prompts(prompts, prompt_len, target.cfg.vocab_size, seed)
    block = _block_drafter(target, seed) if drafter != "ngram" else None
    conts = replay_continuations(target, ps, output_len + NUM_DRAFT, cfg) if drafter == "replay" else None
    dec = SpecDecoder(target, _make_drafter(cfg, target, block, conts, batch, prompt_len + output_len),
                      max_batch=batch, max_len=prompt_len + output_len, num_draft=NUM_DRAFT)
    out(f"demo: {dec.stats.label}")
    out(f"target {target.cfg.source} ({target.cfg.num_hidden_layers} layers), {prompts} prompts x {prompt_len} "
        f"tokens -> {output_len}, B={batch}")
    bar = tqdm(total=prompts * output_len, unit="tok", desc="decode", disable=not progress, leave=False)
    dec.observer = _Clock(on_tokens=bar.update)
    dec.generate(ps, _params_for(cfg, prompts), output_len, seed=seed)
    bar.close()
    s = dec.stats.summary()
    if s["synthetic_acceptance"]:
        out("SYNTHETIC ACCEPTANCE (benchmark only): sampled accept/reject decisions are the replay drafter's "
            "seeded coins, not the target's test")
    out(f"{s['tokens']} tokens in {s['wall_s']:.2f} s: {s['tokens_per_s']:.1f} tok/s; accepted length "
        f"{s['mean_acceptance_length']:.2f}; {s['rounds']} rounds")
    out("per-round medians: " + ", ".join(f"{n} {s[f'median_{p}_ms']:.2f} ms" for p, n in PHASE_NAMES.items()))
    return s


# --------------------------------------------------------------------------- command line


def _params(args: argparse.Namespace) -> SamplingParams:
    if args.greedy:
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="synthetic config: built-in name, .json/.yaml path, or 'tiny'")
    p.add_argument("--layers", type=int, default=None, help="synthetic: keep only the first N layers")
    p.add_argument("--deployment", default=None, help="nvfp4 (default) | fp8 | mixed | a deployment file")
    p.add_argument("--drafter", choices=DRAFTERS, default="replay")
    p.add_argument("--acceptance", type=float, default=DEFAULT_ACCEPTANCE,
                   help=f"replay: i.i.d. per-token acceptance (default {DEFAULT_ACCEPTANCE}: accepted length "
                        f"{expected_accepted_length(DEFAULT_ACCEPTANCE):.2f} for q7)")
    p.add_argument("--temperature", type=float, default=OFFICIAL.temperature)
    p.add_argument("--top-p", type=float, default=OFFICIAL.top_p)
    p.add_argument("--top-k", type=int, default=OFFICIAL.top_k)
    p.add_argument("--greedy", action="store_true", help="greedy verification (overrides the sampling flags)")
    p.add_argument("--no-synthetic-acceptance", action="store_true",
                   help="replay + sampled verification: let the target's real test accept the replayed tokens "
                        "(measured, ~1 on a random target) instead of the default SYNTHETIC accept/reject "
                        "decisions at rate --acceptance (benchmark only)")
    p.add_argument("--seed", type=int, default=0)


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="checkpoint directory (with --synthetic: where to write it; default a temp dir)")
    p.add_argument("--synthetic", action="store_true", help="write a synthetic checkpoint first")
    _common(p)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--max-len", type=int, default=None, help="tokens per request (default prompt + output)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--no-graphs", action="store_true",
                   help="run the verify forward, rollback and draft pass eagerly (same kernels and shapes as the "
                        "CUDA graphs, bitwise-identical tokens)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="CUDA: generated kernels at every M and fixed-shape FP16 projections, so greedy outputs "
                        "are byte-identical across B (slower: a correctness run)")
    p.add_argument("--sampler", choices=("compact", "dense"), default=None,
                   help="rejection sampling: the generated compact kernel (default on CUDA) or the dense torch path")
    p.add_argument("--join-group", type=int, default=1,
                   help="admission: waiting requests join once this many slots are free, in one joint "
                        "prefill (default 1: each as soon as a slot frees)")
    p.add_argument("--prefill", choices=("overlap", "stall"), default=None,
                   help="joining requests: prefill beside the rounds of the requests in flight on a low-priority "
                        "stream (overlap) or while they wait (stall, the default)")
    p.add_argument("--policies", nargs="+", default=None, metavar="POLICY",
                   help="A/B admission policies on one loaded target: every B > 1 runs each in turn (B1 once); "
                        "POLICY is overlap | stall | default, optionally :N for a join group of N (e.g. stall:2), "
                        "optionally +pipelined or +serial for the rounds (e.g. default+serial; B1 runs once per "
                        "rounds setting); replaces --prefill / --join-group")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the batches (and policies) N times, alternating; the report adds per-policy medians")
    p.add_argument("--prefill-sm-carveout", type=int, default=None, metavar="N",
                   help="overlapped prefill: its cuBLAS GEMMs target all but N SMs (torch's experimental cuBLAS SM "
                        "carveout), leaving them to the rounds' kernels; default: none")
    p.add_argument("--gdn-prefill", choices=PREFILL_FORMS, default=None,
                   help="the prefill's GDN recurrence: the sequential kernel (default; bitwise one-token steps), "
                        "the chunk-form kernels (~1e-7 from those bits; ~10%% faster per GDN layer on the H200) or the "
                        "torch chunk form "
                        "(sets $DFLASHGEN_GDN_PREFILL)")
    p.add_argument("--dequant-cache", default=None, metavar="SIZE",
                   help="bytes of dequantized FP16 weight copies the dequantize + cuBLAS path (prefill) may keep: "
                        "auto (default: while 10%% of the GPU, >= 4 GiB, stays free), all, 0 (one per call: no "
                        "FP16 model in memory), or a size such as 12GiB (sets $DFLASHGEN_DEQUANT_CACHE)")
    p.add_argument("--sampled-drafts", action="store_true",
                   help="block drafter: sampled requests draw their drafts from the drafter's distribution and "
                        "verification uses it (q); default: argmax drafts, verified without draft probabilities "
                        "(DFlash's practice; also the replay drafter's cost model)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", default=None, help="write decode_bench.json + decode_bench.md here")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: re-launch as N local ranks via torch.distributed.run "
                        "(NCCL with --device cuda, gloo on CPU); under torchrun WORLD_SIZE decides")
    p.add_argument("--prepared-checkpoint", default=None, help=argparse.SUPPRESS)  # set by --tp's parent


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _env_world() -> int:
    raw = os.environ.get("WORLD_SIZE", "")
    try:
        return int(raw) if raw else 1
    except ValueError:
        return 1


def _launch_tp(args: argparse.Namespace, argv: list[str]) -> int:
    """--tp N outside torchrun: write any synthetic checkpoint once here, then run this command as N
    local ranks under ``python -m torch.distributed.run --standalone``; its exit status."""
    with tempfile.TemporaryDirectory(prefix="dflashgen-bench-") as tmp:
        ckpt = args.checkpoint
        if args.synthetic:
            ckpt = ckpt or tmp
            _log(f"writing a synthetic checkpoint to {ckpt} ...")
            write_synthetic(ckpt, args.model, args.layers, args.deployment, args.seed, args.device)
        elif ckpt is None:
            raise ValueError("give a checkpoint directory or --synthetic")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.tp}",
               "-m", "dflashgen.runtime.decode_bench", *argv, "--prepared-checkpoint", str(ckpt)]
        _log(f"decode-bench: launching {args.tp} ranks: {shlex.join(cmd)}")
        env = {**os.environ, "DFLASHGEN_BENCH_COMMAND": "dflashgen " + shlex.join(argv)}
        env.setdefault("OMP_NUM_THREADS", "1")
        return subprocess.run(cmd, env=env, check=False).returncode


def _run_bench(args: argparse.Namespace) -> int:
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if args.gdn_prefill:  # before any target exists (TP ranks inherit it)
        os.environ["DFLASHGEN_GDN_PREFILL"] = args.gdn_prefill
    if args.dequant_cache is not None:
        try:
            parse_budget(args.dequant_cache)
        except ValueError as e:
            print(f"decode-bench: error: {e}", file=sys.stderr)
            return 2
        os.environ["DFLASHGEN_DEQUANT_CACHE"] = args.dequant_cache
    command = os.environ.get("DFLASHGEN_BENCH_COMMAND") or "dflashgen " + shlex.join(argv)
    world = _env_world()
    ctx: TPContext | None = None
    try:
        cfg = BenchConfig(args.prompts, args.prompt_len, args.output_len, tuple(args.batches), args.drafter,
                          args.acceptance, _params(args), args.seed, args.max_len, not args.no_warmup,
                          not args.no_synthetic_acceptance, not args.no_graphs, args.sampler,
                          args.join_group, None if args.prefill is None else args.prefill == "overlap",
                          args.sampled_drafts, args.prefill_sm_carveout,
                          tuple(Policy.parse(x) for x in args.policies or ()), args.repeat)
        cfg.validate()  # before any checkpoint work
        if args.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {args.tp}")
        if world == 1 and args.tp > 1:
            return _launch_tp(args, argv)
        if world > 1 and args.tp not in (1, world):
            raise ValueError(f"--tp {args.tp} disagrees with WORLD_SIZE={world}")
        if world > 1:
            ctx = init_tp("nccl" if args.device == "cuda" else "gloo")
        rank = ctx.rank if ctx is not None else 0
        log = _log if rank == 0 else None
        with tempfile.TemporaryDirectory(prefix="dflashgen-bench-") as tmp:
            ckpt = args.prepared_checkpoint or args.checkpoint
            if args.synthetic and not args.prepared_checkpoint:
                ckpt = ckpt or tmp
                if ctx is not None:  # every rank loads rank 0's copy
                    box = [ckpt]
                    dist.broadcast_object_list(box, src=0)
                    ckpt = box[0]
                if rank == 0:
                    _log(f"writing a synthetic checkpoint to {ckpt} ...")
                    t_w = time.perf_counter()
                    write_synthetic(ckpt, args.model, args.layers, args.deployment, args.seed,
                                    "cuda" if args.device == "cuda" and rank == 0 else "cpu")
                    _log(f"synthetic checkpoint written in {time.perf_counter() - t_w:.1f} s")
                if ctx is not None:
                    dist.barrier()  # written before any rank loads
            elif ckpt is None:
                raise ValueError("give a checkpoint directory or --synthetic")
            target = load_target(ckpt, args.deployment, device=args.device, seed=args.seed, ctx=ctx,
                                 invariant=args.batch_invariant)
            if ctx is not None:
                dist.barrier()  # every rank loaded before rank 0 removes its temp dir
        out_dir = args.out if args.out and (ctx is None or ctx.rank == 0) else None

        def on_row(rep: dict[str, Any]) -> None:  # each finished B is on disk at once
            if out_dir:
                write_report(rep, out_dir)

        report = run_decode_bench(target, cfg, command=command, log=log, on_row=on_row)
    except (ValueError, FileNotFoundError) as e:
        print(f"decode-bench: error: {e}", file=sys.stderr)
        if ctx is not None:
            ctx.close()
        return 2
    if ctx is not None:
        dist.barrier()
        ctx.close()
        if ctx.rank != 0:
            return 0
    print(report["header"])
    if _many_runs(report):
        print(format_policy_summary(report))
    print(format_table(report))
    if args.out:
        write_report(report, args.out)
        print(f"wrote {args.out}/decode_bench.json, decode_bench.md")
    return 0


def _demo_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.set_defaults(model="tiny")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--no-progress", action="store_true")


def _run_demo(args: argparse.Namespace) -> int:
    try:
        run_demo(args.model, args.layers, prompts=args.prompts, prompt_len=args.prompt_len,
                 output_len=args.output_len, batch=args.batch, drafter=args.drafter, acceptance=args.acceptance,
                 params=_params(args), seed=args.seed, deployment=args.deployment, progress=not args.no_progress,
                 synthetic=not args.no_synthetic_acceptance)
    except (ValueError, FileNotFoundError) as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    return 0


def add_decode_parsers(subparsers: Any) -> None:
    """Register ``decode-bench`` and ``demo`` on an ``ArgumentParser.add_subparsers()`` object."""
    b = subparsers.add_parser("decode-bench", help="endpoint-style speculative decoding benchmark over B=1,2,4,8")
    _bench_args(b)
    b.set_defaults(fn=_run_bench)
    d = subparsers.add_parser("demo", help="speculative decode of a few prompts on a synthetic checkpoint")
    _demo_args(d)
    d.set_defaults(fn=_run_demo)


def _main(cmd: str, add: Callable[[argparse.ArgumentParser], None], fn: Callable[[argparse.Namespace], int],
          argv: Sequence[str] | None) -> int:
    args_l = list(sys.argv[1:] if argv is None else argv)
    if args_l[:1] == [cmd]:
        args_l = args_l[1:]
    p = argparse.ArgumentParser(prog=f"dflashgen {cmd}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add(p)
    args = p.parse_args(args_l)
    args.argv = [cmd, *args_l]
    return fn(args)


def main_decode_bench(argv: Sequence[str] | None = None) -> int:
    """``dflashgen decode-bench [CKPT] [...]``; ``argv`` may start with the subcommand name."""
    return _main("decode-bench", _bench_args, _run_bench, argv)


def main_demo(argv: Sequence[str] | None = None) -> int:
    """``dflashgen demo [...]``; ``argv`` may start with the subcommand name."""
    return _main("demo", _demo_args, _run_demo, argv)


if __name__ == "__main__":  # what --tp re-launches under torchrun
    sys.exit(main_decode_bench())
