"""How much a projection loses to its last partial wave, and what a split dispatch would win: one call
as two launches over disjoint warp-tile ranges (the first a whole wave of one tile, the rest by a
smaller tile of the same K plan: the same bits, since columns never change them).

Without the runtime CTA offset a split needs, the second part is timed as the first n CTAs of its
kernel (the same work per CTA, other columns): a timing stand-in, not a result. Times use the tuner's
method (CUDA graph over rotated weight copies, medians):

  full      the served-style launch of tile A over every CTA (what a call costs today)
  A wave    tile A over one wave's worth of CTAs only (SMs x CTAs per SM)
  B rest    tile B over the CTAs that cover the rest of N
  A + B     both in one graph, back to back (PDL lets B start as A drains): the split's estimate

    python3 tools/wave_split_probe.py [--problem nvfp4/silu/n34816/k5120] [--m 64]
        [--a REGEX] [--b REGEX] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", default="nvfp4/silu/n34816/k5120")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--a", default=r"_r64_nt1_wn12_st8_.*_wsf1_mb1$", help="regex of tile A (the full waves)")
    ap.add_argument("--b", default=r"_r64_nt1_wn8_st8_.*_wsf1_mb1$", help="regex of tile B (the rest)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from dflashgen.runtime import GemmKernel
    from dflashgen.runtime.kernels import GemmLaunch

    from dflashgen.timing import copies_for, graph_time
    from dflashgen.tune import Problem, _weights, rotated_copies
    from dflashgen.verify import native_kernels

    dev = torch.device("cuda")
    key = "sm90/" + args.problem
    prob = re.escape(args.problem.replace("fp8_channel", "fp8").replace("/", "_"))
    images, groups = native_kernels(90, f"^(?=.*{prob})(?=.*({args.a}|{args.b}))")
    entries = groups[key]
    ea = next(e for e in entries if re.search(args.a, e["name"]))
    eb = next(e for e in entries if re.search(args.b, e["name"]) and e["kplan"] == ea["kplan"])
    p = Problem(90, ea["format"], ea["epilogue"] == "silu", ea["n"], ea["k"])
    w, packed = _weights(p, dev, seed=1)
    nbytes = packed.stream_bytes
    copies = copies_for(nbytes, dev)
    ws = rotated_copies(packed, copies)
    x = torch.randn(args.m, p.k, device=dev, dtype=torch.float16)
    out = torch.empty((args.m, ea["n_out"]), dtype=torch.float16, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    launches = {}
    for tag, e in (("A", ea), ("B", eb)):
        kern = GemmKernel(e, images[e["name"]][0], max_m=args.m, device=dev)
        launches[tag] = GemmLaunch(kern)
    grid_full = {tag: g._main.grid[1].value for tag, g in launches.items()}
    wn = {"A": ea["tile"]["warps_n"], "B": eb["tile"]["warps_n"]}  # 16-row warp tiles per CTA
    ctas_a = min(grid_full["A"], sms)  # a 512-thread WGC CTA per SM: a wave is `sms` CTAs
    ctas_b = -(-(grid_full["A"] - ctas_a) * wn["A"] // wn["B"])

    def run(tag: str, ctas: int, i: int) -> None:
        g = launches[tag]
        g.bind(ws[i], args.m)
        g._main.grid[1].value = ctas
        g.launch(x.data_ptr(), out.data_ptr(), torch.cuda.current_stream().cuda_stream)

    res = {
        "full": graph_time(lambda i: run("A", grid_full["A"], i), copies),
        "A wave": graph_time(lambda i: run("A", ctas_a, i), copies),
        "B rest": graph_time(lambda i: run("B", ctas_b, i), copies),
        "A + B": graph_time(lambda i: (run("A", ctas_a, i), run("B", ctas_b, i)), copies),
        "B full": graph_time(lambda i: run("B", grid_full["B"], i), copies),
    }
    print(f"{key} M={args.m}: A {ea['name']} ({grid_full['A']} CTAs), B {eb['name']} ({grid_full['B']} CTAs); "
          f"{sms} SMs; split = A x {ctas_a} + B x {ctas_b}")
    for name, t in res.items():
        print(f"  {name:7} {t.us:8.2f} us  (noise {t.noise_us:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"problem": key, "m": args.m, "a": ea["name"], "b": eb["name"], "ctas_a": ctas_a,
                       "ctas_b": ctas_b, "us": {k: round(t.us, 3) for k, t in res.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
