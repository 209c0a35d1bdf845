"""GPU proof of every generated kernel (run on the device; skipped cleanly without a GPU).

Native-arch kernels run from their cubin; sm_70 kernels from their compute_70 PTX, which the
driver JIT-compiles, so the m8n8k4 path is exercised on newer GPUs too.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
from conftest import has_gpu

from dflashgen.render import load_manifest

pytestmark = pytest.mark.gpu


def _groups() -> dict[str, list[dict]]:
    if not has_gpu():
        return {}
    from dflashgen.runtime import native_arch

    archs = {native_arch(), 70}
    only = os.environ.get("DFLASHGEN_GPU_ONLY")
    groups: dict[str, list[dict]] = defaultdict(list)
    for e in load_manifest()["kernels"]:
        if e["arch"] in archs and (only is None or only in e["name"]):
            groups[f"sm{e['arch']}/{e['format']}/{e['epilogue']}/n{e['n']}/k{e['k']}"].append(e)
    return groups


GROUPS = _groups()


@pytest.fixture(scope="session")
def images():
    from dflashgen.runtime import native_arch

    from dflashgen.verify import artifacts_for

    native = native_arch()
    arts = artifacts_for(sorted({native, 70}), native, os.environ.get("DFLASHGEN_GPU_ONLY"))
    return {n: (p, kind) for n, (_, p, kind) in arts.items()}


@pytest.mark.parametrize("key", sorted(GROUPS))
def test_kernel_group(key: str, images) -> None:
    from dflashgen.verify import DEFAULT_MS, verify_problem

    torch.backends.cuda.matmul.allow_tf32 = False
    reports = verify_problem(GROUPS[key], images, DEFAULT_MS, torch.device("cuda"), seed=hash(key) % 1000)
    bad = {r.name: r.failures for r in reports if not r.ok}
    assert not bad, bad
    assert max(r.worst_rel_l2 for r in reports) <= 1e-3


@pytest.fixture(scope="module")
def small_kernel(images):
    from dflashgen.runtime import GemmKernel, native_arch

    from dflashgen.prepack import Layout, prepack
    from dflashgen.verify import random_nvfp4

    arch = native_arch()
    # the smallest NVFP4 problem's 8-row mma.sync kernel, split-K where it has one (the reduce launch too)
    cands = [e for e in load_manifest()["kernels"] if e["arch"] == arch and e["format"] == "nvfp4"
             and e["tile"]["rows"] == 8 and not e["kplan"].get("wgmma")]
    entry = min(cands, key=lambda e: (e["n"], -e["kplan"]["split_k"], e["name"]))
    dev = torch.device("cuda", 0)
    w = random_nvfp4(entry["n"], entry["k"], (entry["n"],), dev, torch.Generator(device=dev).manual_seed(1))
    packed = prepack(w, Layout(arch, "nvfp4", entry["n"], entry["k"]))
    return GemmKernel(entry, images[entry["name"]][0], max_m=64, device=dev), packed, w


def test_bad_input_raises_and_writes_nothing(small_kernel) -> None:
    from dataclasses import replace

    from dflashgen.runtime import KernelInputError

    from dflashgen.prepack import Layout

    kern, packed, _ = small_kernel
    dev = torch.device("cuda", 0)
    k = kern.k
    x = torch.randn(8, k, device=dev, dtype=torch.float16)
    out = torch.full((8, kern.n_out), 7.0, device=dev, dtype=torch.float16)
    buf = torch.empty(8 * k + 8, device=dev, dtype=torch.float16)
    cases = {
        "float16": (x.float(), packed),
        "CUDA tensor": (x.cpu(), packed),
        "K=": (x[:, : k - 64].contiguous(), packed),
        "2-D": (x[None], packed),
        "contiguous": (x.t().contiguous().t(), packed),
        "aligned": (buf[1 : 1 + 8 * k].view(8, k), packed),
        "range 1..64": (torch.randn(65, k, device=dev, dtype=torch.float16), packed),
        "block scales": (x, replace(packed, scales=None)),
        "packed for": (x, replace(packed, layout=Layout(70, "nvfp4", kern.n, k))),
        "PackedWeight": (x, packed.weights),
        "col_scale": (x, replace(packed, col_scale=packed.col_scale[:-1].contiguous())),
    }
    for needle, (xx, ww) in cases.items():
        with pytest.raises(KernelInputError, match=needle):
            kern(xx, ww, out if xx.shape[0] == 8 and xx.dim() == 2 else None)
        torch.cuda.synchronize()
        assert bool((out == 7.0).all()), f"output written despite bad input ({needle})"
    with pytest.raises(KernelInputError, match="out must be"):
        kern(x, packed, out[:4])


def test_graph_capture_with_changing_inputs(small_kernel) -> None:
    from dflashgen.weights import reference_gemm, rel_l2

    kern, packed, w = small_kernel
    dev = torch.device("cuda", 0)
    x = torch.randn(16, kern.k, device=dev, dtype=torch.float16)
    out = torch.empty(16, kern.n_out, device=dev, dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kern(x, packed, out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kern(x, packed, out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel_l2(out, reference_gemm(x, w)) < 1e-3
