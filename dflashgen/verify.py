"""Prove generated kernels right on the GPU at hand.

For every kernel (grouped by problem: same layout and K plan) and every M:
- relative L2 error <= 1e-3 against the FP32 reference (same codes dequantized, same FP16 input),
  no NaN/Inf, and every output element written (the output is poisoned with NaN first);
- bitwise batch invariance: each row equals the same row computed alone (M = 1, by the group's
  first kernel) and the rows computed in 8-row slices, for every row tile of the group;
- CUDA graph capture + replay with new input values equals eager launches.
Kernels for another arch run from their PTX (the driver JIT-compiles it): that is how the
compute_70 (m8n8k4) path is exercised on a newer GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .prepack import Layout, PackedWeight, prepack
from .weights import FP8ChannelWeight, NVFP4Weight, reference_gemm, reference_silu_mul, rel_l2

DEFAULT_MS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64)
TOLERANCE = 1e-3


def random_nvfp4(n: int, k: int, segments: tuple[int, ...], device: torch.device,
                 gen: torch.Generator) -> NVFP4Weight:
    """Random codes (all 16), block scales across the E4M3 range incl. subnormals, a global scale
    per segment: exercises every decode path, and outputs stay O(1)."""
    codes = torch.randint(0, 16, (n, k), device=device, generator=gen, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    exp = torch.randint(-9, 3, (n, k // 16), device=device, generator=gen).float()
    mant = torch.rand((n, k // 16), device=device, generator=gen) + 1.0
    scale = (torch.exp2(exp) * mant).to(torch.float8_e4m3fn)
    segs = segments or (n,)
    gs = (torch.rand(len(segs), device=device, generator=gen) + 0.5) / (k**0.5)
    return NVFP4Weight(packed.contiguous(), scale, gs, segs)


def random_fp8(n: int, k: int, device: torch.device, gen: torch.Generator) -> FP8ChannelWeight:
    raw = torch.randint(0, 256, (n, k), device=device, generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # E4M3 has NaN at S.1111.111: never a real weight
    scale = (torch.rand(n, device=device, generator=gen) + 0.5) / (64 * k**0.5)
    return FP8ChannelWeight(raw.view(torch.float8_e4m3fn), scale)


def random_packed(arch: int, fmt: str, n: int, k: int, silu: bool, device: torch.device,
                  gen: torch.Generator) -> tuple[NVFP4Weight | FP8ChannelWeight, PackedWeight]:
    """A random weight for one problem (NVFP4: a global scale per gate / up half when fused) and its
    prepack for that arch: what verify, tune and the probes run kernels on."""
    w = random_nvfp4(n, k, (n // 2, n // 2) if silu else (n,), device, gen) if fmt == "nvfp4" \
        else random_fp8(n, k, device, gen)
    return w, prepack(w, Layout(arch, fmt, n, k, silu))


@dataclass
class KernelReport:
    name: str
    arch: int
    image: str  # "cubin" | "ptx"
    worst_rel_l2: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _graph_check(kern: Any, x_static: torch.Tensor, w: PackedWeight, new_x: torch.Tensor) -> bool:
    out = torch.empty((x_static.shape[0], kern.n_out), dtype=torch.float16, device=x_static.device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kern(x_static, w, out)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kern(x_static, w, out)
    x_static.copy_(new_x)
    g.replay()
    torch.cuda.synchronize()
    eager = kern(new_x.clone(), w)
    return torch.equal(out, eager)


def plan_twins(plans: list[str]) -> list[tuple[str, str]]:
    """Pairs (mma.sync plan, wgmma plan) of K plans (JSON, as in verify_problem) that differ only in the
    ``wgmma`` flag: the same K groups, workers and split order, so if wgmma rounds like mma.sync their
    rows are bitwise equal and a table could serve one problem's M buckets from both (it does not
    yet: a plan of its own, see tune.choose)."""
    def strip(p: str) -> str:
        d = json.loads(p)
        d.pop("wgmma", None)
        return json.dumps(d, sort_keys=True)

    base = {strip(p): p for p in plans if not json.loads(p).get("wgmma")}
    return [(base[strip(p)], p) for p in plans if json.loads(p).get("wgmma") and strip(p) in base]


# Per problem with plan twins: (problem, rows, rows that differ bitwise) -- what `dflashgen verify` reports
# about wgmma vs mma.sync rounding (collected by verify_problem, printed by main).
TWIN_RESULTS: list[tuple[str, int, int]] = []


def verify_problem(entries: list[dict[str, Any]], images: dict[str, tuple[Path, str]], ms: tuple[int, ...],
                   device: torch.device, seed: int = 0) -> list[KernelReport]:
    from dflashgen.runtime import GemmKernel

    e0 = entries[0]
    gen = torch.Generator(device=device).manual_seed(seed)
    n, k, silu = e0["n"], e0["k"], e0["epilogue"] == "silu"
    w, packed = random_packed(e0["arch"], e0["format"], n, k, silu, device, gen)
    mmax = max(ms)
    x = torch.randn((mmax, k), device=device, dtype=torch.float16, generator=gen)
    ref = reference_gemm(x, w)
    if silu:
        ref = reference_silu_mul(ref)
    kernels = [GemmKernel(e, images[e["name"]][0], max_m=mmax, device=device) for e in entries]
    # Each row computed alone by the first kernel of each K plan: the bitwise anchor for all others
    # of that plan (a problem may offer several plans; the tuner serves every M from one of them).
    anchors: dict[str, torch.Tensor] = {}
    reports = []
    for kern in kernels:
        plan = json.dumps(kern.entry["kplan"], sort_keys=True)
        if plan not in anchors:
            anchors[plan] = torch.cat([kern(x[i : i + 1].contiguous(), packed) for i in range(mmax)])
        alone = anchors[plan]
        rep = KernelReport(kern.name, kern.arch, images[kern.name][1])
        for m in ms:
            out = torch.full((m, kern.n_out), float("nan"), dtype=torch.float16, device=device)
            kern(x[:m].contiguous(), packed, out)
            torch.cuda.synchronize()
            if not torch.isfinite(out).all():
                bad = int((~torch.isfinite(out)).sum())
                rep.failures.append(f"M={m}: {bad} NaN/Inf or unwritten outputs")
                continue
            err = rel_l2(out, ref[:m])
            rep.worst_rel_l2 = max(rep.worst_rel_l2, err)
            if err > TOLERANCE:
                rep.failures.append(f"M={m}: rel L2 {err:.2e} > {TOLERANCE}")
            if not torch.equal(out, alone[:m]):
                rows = int((out != alone[:m]).any(dim=1).sum())
                rep.failures.append(f"M={m}: {rows} rows differ bitwise from the same rows computed alone")
        slices = torch.cat([kern(x[i : i + 8].contiguous(), packed) for i in range(0, mmax, 8)])
        if not torch.equal(slices, alone[: slices.shape[0]]):
            rep.failures.append("8-row slices differ bitwise from rows computed alone")
        for m in sorted({17, mmax} & set(range(1, mmax + 1))):
            new_x = torch.randn((m, k), device=device, dtype=torch.float16, generator=gen)
            if not _graph_check(kern, x[:m].clone(), packed, new_x):
                rep.failures.append(f"M={m}: CUDA graph replay differs from eager")
        reports.append(rep)
    for a, b in plan_twins(list(anchors)):
        diff = int((anchors[a] != anchors[b]).any(dim=1).sum())
        TWIN_RESULTS.append((group_key(e0), anchors[a].shape[0], diff))
    return reports


def artifacts_for(archs: list[int], native: int, only: str | None) -> dict[str, tuple[dict[str, Any], Path, str]]:
    """name -> (manifest entry, image path, 'cubin'|'ptx'); builds what is missing."""
    from .build import build, select
    from .render import load_manifest

    manifest = load_manifest()
    out = {}
    for arch in archs:
        if only and not select(manifest, [arch], only):
            continue  # a filter that names none of this arch's kernels (build() would refuse it)
        res = build([arch], only=only, progress=False, manifest=manifest)
        for name, art in res.artifacts.items():
            use_cubin = arch == native
            out[name] = (arch, art.cubin if use_cubin else art.ptx, "cubin" if use_cubin else "ptx")
    entries = {e["name"]: e for e in manifest["kernels"]}
    return {n: (entries[n], p, kind) for n, (_, p, kind) in out.items() if n in entries}  # GEMMs only


def group_key(e: dict[str, Any]) -> str:
    """Kernels with the same key share a layout and a K plan: one problem."""
    return f"sm{e['arch']}/{e['format']}/{e['epilogue']}/n{e['n']}/k{e['k']}"


def manifest_problems(arch: int | None, kernels: list[dict[str, Any]] | None = None) -> dict[str, list[dict[str, Any]]]:
    """GEMM manifest entries (this install's manifest, or ``kernels``) of one arch (None: all) grouped by
    problem (nothing built)."""
    from .render import load_manifest

    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in load_manifest()["kernels"] if kernels is None else kernels:
        if arch is None or e["arch"] == arch:
            groups[group_key(e)].append(e)
    return dict(groups)


def native_kernels(arch: int, only: str | None = None) -> tuple[dict[str, tuple[Path, str]],
                                                                 dict[str, list[dict[str, Any]]]]:
    """This GPU's kernels (those whose names match `only`, built if missing): name -> (image, kind), and
    the manifest entries grouped by problem."""
    arts = artifacts_for([arch], arch, only)
    images = {n: (path, kind) for n, (_, path, kind) in arts.items()}
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e, _, _ in arts.values():
        groups[group_key(e)].append(e)
    return images, groups


def run(archs: list[int] | None = None, only: str | None = None, ms: tuple[int, ...] = DEFAULT_MS,
        progress: bool = True) -> list[KernelReport]:
    from tqdm import tqdm

    from dflashgen.runtime import native_arch

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference must be true FP32
    TWIN_RESULTS.clear()
    device = torch.device("cuda", torch.cuda.current_device())
    native = native_arch(device)
    archs = archs or [native]
    arts = artifacts_for(archs, native, only)
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for name in sorted(arts):
        groups[group_key(arts[name][0])].append(arts[name][0])
    images = {n: (p, kind) for n, (_, p, kind) in arts.items()}
    reports: list[KernelReport] = []
    bar = tqdm(total=len(arts), desc="verify", unit="kernel", disable=not progress)
    for i, key in enumerate(sorted(groups)):
        reps = verify_problem(groups[key], images, ms, device, seed=i)
        reports += reps
        bar.update(len(reps))
        torch.cuda.empty_cache()
    bar.close()
    return reports


def main(args: argparse.Namespace) -> int:
    t0 = time.time()
    ms = tuple(args.ms) if args.ms else DEFAULT_MS
    reports = run(args.arch, args.only, ms)
    bad = [r for r in reports if not r.ok]
    by_arch: dict[str, list[KernelReport]] = defaultdict(list)
    for r in reports:
        by_arch[f"sm_{r.arch} ({r.image})"].append(r)
    print(f"{'kernels':<18} {'count':>6} {'passed':>7} {'worst rel L2':>13}")
    for key, rs in sorted(by_arch.items()):
        print(f"{key:<18} {len(rs):>6} {sum(r.ok for r in rs):>7} {max(r.worst_rel_l2 for r in rs):>13.2e}")
    for r in bad[:20]:
        print(f"FAIL {r.name}: " + "; ".join(r.failures[:4]))
    if TWIN_RESULTS:
        same = sum(d == 0 for _, _, d in TWIN_RESULTS)
        print(f"wgmma vs mma.sync K plans with the same K order: {same} of {len(TWIN_RESULTS)} problems bitwise "
              "equal row by row" + "".join(f"; {p}: {d} of {r} rows differ" for p, r, d in TWIN_RESULTS if d)[:600])
    print(f"{len(reports) - len(bad)} passed, {len(bad)} failed  (M in {list(ms)}; {time.time() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return 1 if bad or not reports else 0

