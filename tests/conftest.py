"""Shared test fixtures. GPU tests are marked ``gpu`` and skip cleanly without a CUDA device."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


def has_gpu() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("cuda") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and cuda-python")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def spy_on_prefill(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Replace the target's ``gdn_prefill`` by a pass-through that records each call's T (the
    GDN layers a forward sends through the sequential prefill kernel); returns that list."""
    from dflashgen.runtime import target as target_mod

    calls: list[int] = []
    real = target_mod.gdn_prefill

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1].shape[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(target_mod, "gdn_prefill", spy)
    return calls


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Tiny GEMMs: one thread avoids multi-thread stalls on a shared 2-core box (and is deterministic)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def built_family(arch: int, only: str, count: int) -> list[tuple[Any, dict[str, Any]]]:
    """Build the kernels ``only`` names for ``arch`` (sm_80 / sm_90 skip without nvcc: NVRTC 12.9 builds
    sm_70 only here): ``count`` of them, none of their entry points spilling. Returns (artifact, ptxas
    entries by entry point) per kernel, for the family's own checks."""
    import shutil

    from dflashgen.build import build
    from dflashgen.toolchain import parse_ptxas_log

    if arch != 70 and shutil.which("nvcc") is None:
        pytest.skip(f"no nvcc for sm_{arch} (NVRTC 12.9 builds sm_70 only here)")
    res = build([arch], only=only, progress=False)
    assert len(res.resources()) == count
    out = []
    for a in res.artifacts.values():
        entries = parse_ptxas_log(a.log.read_text())
        assert not [n for n, r in entries.items() if r["spill_stores"] or r["spill_loads"]], entries
        out.append((a, entries))
    return out


def tiny_fp32_target(out: Path, cfg: Any, deployment: str = "nvfp4") -> Any:
    """A synthetic checkpoint of ``cfg`` written to ``out``, loaded with its projections dequantized
    once into FP32 nn.Linear: same weights as the quantized model, fast and deterministic on CPU."""
    from dflashgen.runtime.synthetic import write_synthetic_checkpoint
    from dflashgen.runtime.target import NonLinearWeights, TargetModel, dequantized_projections

    from dflashgen.deployment import load_deployment

    dep = load_deployment(deployment)
    write_synthetic_checkpoint(out, cfg, dep, "modelopt", seed=3)
    q = TargetModel.from_checkpoint(out, cfg, dep, seed=5, act_dtype=torch.float32)
    return TargetModel(cfg, dequantized_projections(q), NonLinearWeights.from_checkpoint(out, cfg, seed=5),
                       device="cpu", act_dtype=torch.float32)


def launch_ranks(argv: list[str], out: Path, world: int, timeout: float, drop_env: tuple[str, ...] = ()) -> None:
    """Run ``world`` ranks of ``python argv`` with torchrun's variables; "{result}" in argv becomes
    out/rank{r}.pt and rank r logs to out/rank{r}.log. Ranks past ``timeout`` are killed, so a hang
    fails the test instead of blocking it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    procs = []
    for r in range(world):
        log = open(out / f"rank{r}.log", "w")  # noqa: SIM115 (closed below)
        args = [a.replace("{result}", str(out / f"rank{r}.pt")) for a in argv]
        procs.append((subprocess.Popen([sys.executable, *args],
                                       env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                       stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for p, _ in procs:
            p.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    if timed_out or any(p.returncode != 0 for p, _ in procs):
        logs = "\n".join(f"--- rank {r} (rc {p.returncode})\n" + (out / f"rank{r}.log").read_text()[-3000:]
                         for r, (p, _) in enumerate(procs))
        pytest.fail(f"{world} ranks {'timed out' if timed_out else 'failed'}:\n{logs}")
