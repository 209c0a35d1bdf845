"""The generate-and-tune command line: ``dflashgen <command>``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import __version__


def _shapes(args: argparse.Namespace) -> int:
    from .deployment import WeightFormat, load_deployment
    from .model import derive_projections, load_model_config

    cfg = load_model_config(args.model)
    dep = load_deployment(args.deployment)
    print(f"{cfg.source}  TP{args.tp}  deployment={dep.name}")
    print(f"{'projection':<14} {'layer':<17} {'style':<7} {'N':>7} {'K':>6} {'count':>5}  {'format':<12} segments")
    projs = derive_projections(cfg, args.tp)
    for p in projs:
        segs = " | ".join(f"{s.name} {s.n}" for s in p.segments) if p.fused else ""
        print(f"{p.name:<14} {p.layer_type:<17} {p.parallel:<7} {p.n:>7} {p.k:>6} {p.count:>5}  "
              f"{dep.format_for(p).value:<12} {segs}")
    # bytes per rank: NVFP4 4.5 bits a weight with its E4M3 block scale per 16, FP8 8 (+ a scale per row)
    bits = {WeightFormat.NVFP4: 4.5, WeightFormat.FP8_CHANNEL: 8.0, WeightFormat.FP16: 16.0}
    quant = [p for p in projs if dep.format_for(p) != WeightFormat.FP16]
    held = sum(p.count * p.weight_bytes(bits[dep.format_for(p)]) for p in projs)
    copies = sum(p.count * p.weight_bytes(16) for p in quant)
    print(f"projection weights per rank: {held / 1e9:.2f} GB as deployed; the dequantize + cuBLAS path's FP16 "
          f"copies of the quantized ones, all kept (--dequant-cache all): {copies / 1e9:.2f} GB more")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .render import diff, generated_dir, load_targets, plan, write

    out = Path(args.out) if args.out else generated_dir()
    p = plan(load_targets(Path(args.targets) if args.targets else None))
    if args.check:
        d = diff(p, out)
        print(d.summary())
        if not d.clean:
            print(f"\n{out} is out of date: run `dflashgen generate`", file=sys.stderr)
            return 1
        print(f"{len(p.specs)} kernels, all current")
        return 0
    d = write(p, out)
    print(f"{len(p.specs)} kernels in {out}: {len(d.missing)} new, {len(d.changed)} rewritten, "
          f"{len(d.stale)} stale deleted")
    return 0


def _build(args: argparse.Namespace) -> int:
    from .build import build

    res = build(args.arch, only=args.only, jobs=args.jobs, prefer=args.toolchain, progress=not args.quiet)
    for arch, tc in sorted(res.toolchains.items()):
        print(f"sm_{arch}: {tc}")
    rows = res.resources()
    spills = {n: r for n, r in rows.items() if r["spill_stores"] or r["spill_loads"]}
    regs = [r["registers"] for r in rows.values()]
    print(f"{len(rows)} kernels ready in {res.build_dir} ({res.steps} build steps run)")
    if regs:
        print(f"registers: min {min(regs)} max {max(regs)}; kernels with spills: {len(spills)}")
    if args.verbose:
        for n, r in rows.items():
            spill = f"{r['spill_stores']}/{r['spill_loads']}"
            print(f"  {n:<72} regs {r['registers']:>3} smem {r['smem']:>6} spills {spill}")
    elif spills:  # named either way: a spill is a cost the tuner measures, never a wrong result
        print("spilling (stores / loads, bytes): " + ", ".join(
            f"{n} {r['spill_stores']}/{r['spill_loads']}" for n, r in sorted(spills.items())))
    return 1 if spills and args.no_spills else 0


def _verify(args: argparse.Namespace) -> int:
    from .verify import main as verify_main

    return verify_main(args)


def _tune(args: argparse.Namespace) -> int:
    from .tune import BUCKETS, heuristic_table, run

    if args.heuristic:
        from dflashgen.runtime.table import TuningTable

        out = Path(args.out) if args.out else generated_tuning_dir() / f"sm_{args.heuristic}.json"
        TuningTable(heuristic_table(args.heuristic), str(out)).save(out)
        print(f"untuned heuristic table written: {out}")
        return 0

    ms = tuple(args.ms) if args.ms else BUCKETS
    out = run(Path(args.targets) if args.targets else None, Path(args.out) if args.out else None,
              Path(args.journal) if getattr(args, "journal", None) else None, only=args.only, ms=ms,
              carry=Path(args.carry) if getattr(args, "carry", None) else None)
    print(f"tuning table written: {out}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import REPORT_MS, run

    ms = tuple(args.ms) if args.ms else REPORT_MS
    rep = run(Path(args.table) if args.table else None, Path(args.out), Path(args.targets) if args.targets else None,
              ms=ms, race_all=args.race_all, only=args.only)
    print((Path(args.out) / "bench.md").read_text().split("## Per projection")[0])
    print(f"wrote {args.out}/bench.json, bench.md, bench.png ({rep['seconds']:.0f} s)")
    if rep["failed"]:
        names = ", ".join(sorted(rep["failed"]))
        print(f"dflashgen bench: {len(rep['failed'])} problem(s) failed to measure: {names}")
        return 1
    return 0


def _overhead(args: argparse.Namespace) -> int:
    from .overhead import markdown, run

    print(markdown(run(Path(args.out) if args.out else None, m=args.m)))
    return 0


def generated_tuning_dir() -> Path:
    from importlib import resources

    return Path(str(resources.files("dflashgen.tuning")))


def _run(args: argparse.Namespace) -> int:
    """The main job: shapes -> generate (check) -> build -> on a GPU: verify, tune, bench."""
    import torch

    print("== projections (Qwen3.8-27B default; --model/--tp to change)")
    for tp in (1, 4):
        _shapes(argparse.Namespace(model=args.model, tp=tp, deployment=args.deployment))
    print("\n== generate --check")
    if _generate(argparse.Namespace(check=True, targets=None, out=None)) != 0:
        return 1
    gpu = torch.cuda.is_available()
    archs = [70]
    if gpu:
        from .runtime import native_arch

        archs = sorted({native_arch(), 70})
    print(f"\n== build sm_{', sm_'.join(map(str, archs))}")
    # Spills do not stop the job: some sm_90 candidates spill a few words outside their main loop
    # (e.g. the NVFP4 r64 wn12 `_ww3` tiles, 120 B at the per-worker fold); the tuner times them like
    # every candidate, and tests/test_build.py keeps the committed sm_70 kernels spill-free.
    rc = _build(argparse.Namespace(arch=archs, only=None, jobs=None, toolchain="auto", no_spills=False,
                                   verbose=False, quiet=False))
    if rc or not gpu:
        if not gpu:
            print("\nno CUDA GPU here: kernels generated and compiled; run again on a GPU to verify, tune, bench")
        return rc
    print("\n== verify")
    if _verify(argparse.Namespace(arch=archs, only=None, ms=None, json=None)) != 0:
        return 1
    print("\n== tune")
    _tune(argparse.Namespace(targets=None, out=None, only=None, ms=None))
    print("\n== bench")
    return _bench(argparse.Namespace(table=None, out=args.out, targets=None, ms=None, race_all=False, only=None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflashgen", description=__doc__)
    ap.add_argument("--version", action="version", version=f"dflashgen {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="the main job: shapes, generate --check, build; on a GPU verify, tune, bench")
    r.add_argument("--model", default=None)
    r.add_argument("--deployment", default=None)
    r.add_argument("--out", default="bench", help="bench report folder")
    r.set_defaults(fn=_run)

    s = sub.add_parser("shapes", help="print the projections derived from a model config")
    s.add_argument("--model", default=None, help="built-in name or config .json/.yaml (default qwen3.8-27b)")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--deployment", default=None, help="nvfp4 | fp8 | mixed | a deployment file")
    s.set_defaults(fn=_shapes)

    g = sub.add_parser("generate", help="render kernels for schedules/targets.yaml into generated/")
    g.add_argument("--check", action="store_true", help="fail if generated/ is out of date; write nothing")
    g.add_argument("--targets", default=None, help="targets file (default schedules/targets.yaml)")
    g.add_argument("--out", default=None, help="output folder (default the package's generated/)")
    g.set_defaults(fn=_generate)

    b = sub.add_parser("build", help="compile generated kernels with ninja (content-keyed cache)")
    b.add_argument("--arch", type=int, nargs="+", default=[70])
    b.add_argument("--only", default=None, help="regex on kernel names")
    b.add_argument("--jobs", "-j", type=int, default=None)
    b.add_argument("--toolchain", choices=["auto", "nvrtc", "nvcc"], default="auto")
    b.add_argument("--no-spills", action="store_true", help="exit 1 if any kernel spills")
    b.add_argument("--verbose", "-v", action="store_true")
    b.add_argument("--quiet", "-q", action="store_true")
    b.set_defaults(fn=_build)

    v = sub.add_parser("verify", help="run every generated kernel on the GPU against the FP32 reference")
    v.add_argument("--arch", type=int, nargs="+", default=None, help="kernel archs to run (default: native)")
    v.add_argument("--only", default=None, help="regex on kernel names")
    v.add_argument("--ms", type=int, nargs="+", default=None)
    v.add_argument("--json", default=None, help="write results here")
    v.set_defaults(fn=_verify)

    t = sub.add_parser("tune", help="race kernels vs cuBLAS per projection and M; write tuning/<gpu>.json")
    t.add_argument("--targets", default=None, help="targets file (default schedules/targets.yaml)")
    t.add_argument("--out", default=None, help="table path (default the package's tuning/<gpu>.json)")
    t.add_argument("--only", default=None, help="regex on problem keys to tune")
    t.add_argument("--ms", type=int, nargs="+", default=None, help="M buckets")
    t.add_argument("--carry", default=None, metavar="REPORT",
                   help="an earlier run's measurements report (<table>.measurements.json[.gz]): its problems "
                        "measured on this kind of machine whose kernels are unchanged are kept, not re-timed")
    t.add_argument("--journal", default=None, metavar="PATH",
                   help="where finished problems are kept as they finish (default <table>.journal.json): "
                        "a run interrupted and started again with the same journal resumes")
    t.add_argument("--heuristic", type=int, metavar="ARCH", default=None,
                   help="no GPU: write an untuned cost-model table for this arch (e.g. 70)")
    t.set_defaults(fn=_tune)

    be = sub.add_parser("bench", help="measure the dispatched kernels vs cuBLAS and the roofline")
    be.add_argument("--table", default=None)
    be.add_argument("--out", default="bench")
    be.add_argument("--targets", default=None)
    be.add_argument("--only", default=None, help="regex on problem keys (sm90/nvfp4/store/n5120/k1536)")
    be.add_argument("--ms", type=int, nargs="+", default=None)
    be.add_argument("--race-all", action="store_true", help="no table: race every candidate")
    be.set_defaults(fn=_bench)

    o = sub.add_parser("overhead", help="host cost per projection call (outside graphs) and in-graph cost")
    o.add_argument("--m", type=int, default=8)
    o.add_argument("--out", default=None, help="write JSON here")
    o.set_defaults(fn=_overhead)

    from dflashgen.runtime.synthetic import add_synth_parser

    add_synth_parser(sub)  # dflashgen synth-checkpoint: a random checkpoint in either layout

    from dflashgen.attn_bench import add_parser as add_attn_bench

    add_attn_bench(sub)  # dflashgen attn-bench: verify attention kernels vs SDPA (GPU)

    from dflashgen.runtime.decode_bench import add_decode_parsers

    add_decode_parsers(sub)  # dflashgen decode-bench, dflashgen demo

    args = ap.parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except Exception as e:
        # Expected failures (bad input, tables, toolchains, drivers, files) as one clear line;
        # anything else, or DFLASHGEN_DEBUG=1, keeps the traceback.
        if os.environ.get("DFLASHGEN_DEBUG") or not _expected(e):
            raise
        print(f"dflashgen {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def _expected(e: Exception) -> bool:
    from dflashgen.runtime.driver import DriverError
    from dflashgen.runtime.images import KernelImageError
    from dflashgen.toolchain import ToolchainError

    return isinstance(e, (ValueError, OSError, ToolchainError, DriverError, KernelImageError))


if __name__ == "__main__":
    sys.exit(main())
