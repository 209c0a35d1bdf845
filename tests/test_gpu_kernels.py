"""GPU proof of every generated kernel (run on the device; skipped cleanly without a GPU).

Native-arch kernels run from their cubin; sm_70 kernels from their compute_70 PTX, which the
driver JIT-compiles, so the m8n8k4 path is exercised on newer GPUs too.
"""

from __future__ import annotations

import os
import re
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
    only = os.environ.get("DFLASHGEN_GPU_ONLY")  # a regex on kernel names, as `dflashgen build --only`
    groups: dict[str, list[dict]] = defaultdict(list)
    for e in load_manifest()["kernels"]:
        if e["arch"] in archs and (only is None or re.search(only, e["name"])):
            groups[f"sm{e['arch']}/{e['format']}/{e['epilogue']}/n{e['n']}/k{e['k']}"].append(e)
    return groups


GROUPS = _groups()


@pytest.fixture(scope="session")
def images():
    from dflashgen.runtime import native_arch

    from dflashgen.verify import artifacts_for

    native = native_arch()
    only = os.environ.get("DFLASHGEN_GPU_ONLY")
    if only:  # the filtered kernels, and the one the small_kernel tests run
        only = f"(?:{only})|^{re.escape(_small_entry(native)['name'])}$"
    arts = artifacts_for(sorted({native, 70}), native, only)
    return {n: (p, kind) for n, (_, p, kind) in arts.items()}


@pytest.mark.parametrize("key", sorted(GROUPS))
def test_kernel_group(key: str, images) -> None:
    from dflashgen.verify import DEFAULT_MS, verify_problem

    torch.backends.cuda.matmul.allow_tf32 = False
    reports = verify_problem(GROUPS[key], images, DEFAULT_MS, torch.device("cuda"), seed=hash(key) % 1000)
    bad = {r.name: r.failures for r in reports if not r.ok}
    assert not bad, bad
    assert max(r.worst_rel_l2 for r in reports) <= 1e-3


def _small_entry(arch: int) -> dict:
    """The smallest NVFP4 problem's 8-row mma.sync kernel, split-K where it has one (its in-kernel reduce too)."""
    cands = [e for e in load_manifest()["kernels"] if e["arch"] == arch and e["format"] == "nvfp4"
             and e["tile"]["rows"] == 8 and not e["kplan"].get("wgmma")]
    return min(cands, key=lambda e: (e["n"], -e["kplan"]["split_k"], e["name"]))


@pytest.fixture(scope="module")
def small_kernel(images):
    from dflashgen.runtime import GemmKernel, native_arch

    from dflashgen.prepack import Layout, prepack
    from dflashgen.verify import random_nvfp4

    arch = native_arch()
    entry = _small_entry(arch)
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


def _split_k_kernel(images, kind: str):
    """The smallest split-K kernel of a kind on this GPU ("store" / "silu": mma.sync, 8-row tiles;
    "wgmma": the sm_90a K plan), its packed weight and the reference function; skips if none."""
    from dflashgen.runtime import GemmKernel, native_arch

    from dflashgen.prepack import Layout, prepack
    from dflashgen.verify import random_nvfp4
    from dflashgen.weights import reference_gemm, reference_silu_mul

    arch = native_arch()
    cands = [e for e in load_manifest()["kernels"] if e["arch"] == arch and e["kplan"]["split_k"] > 1
             and e["format"] == "nvfp4" and bool(e["kplan"].get("wgmma")) == (kind == "wgmma")
             and e["epilogue"] == ("silu" if kind == "silu" else "store") and e["name"] in images]
    if not cands:
        pytest.skip(f"no {kind} split-K NVFP4 kernel for sm_{arch}")
    entry = min(cands, key=lambda e: (e["n"] * e["k"], e["tile"]["rows"], e["name"]))
    dev = torch.device("cuda", 0)
    n, k, silu = entry["n"], entry["k"], entry["epilogue"] == "silu"
    w = random_nvfp4(n, k, (n // 2, n // 2) if silu else (n,), dev, torch.Generator(device=dev).manual_seed(2))
    packed = prepack(w, Layout(arch, "nvfp4", n, k, silu))
    kern = GemmKernel(entry, images[entry["name"]][0], max_m=128, device=dev)

    def ref(x: torch.Tensor) -> torch.Tensor:
        y = reference_gemm(x, w)
        return reference_silu_mul(y) if silu else y

    return kern, packed, ref


SPLIT_MS = (1, 8, 17, 64, 80)  # 80 > 64: a workspace (partials + zeroed tickets) per call


@pytest.mark.parametrize("kind", ["store", "silu", "wgmma"])
def test_split_k_one_launch_back_to_back_graphs_and_streams(images, kind: str) -> None:
    """Split-K in one launch: the last CTA of each output tile sums the partials and leaves its
    ticket counter at 0, so back-to-back launches (mixed M), CUDA-graph replays and two streams at
    once all give the bits of a lone launch, and the counters read 0 afterwards."""
    from dflashgen.weights import rel_l2

    torch.backends.cuda.matmul.allow_tf32 = False
    kern, packed, ref = _split_k_kernel(images, kind)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(max(SPLIT_MS), kern.k, device=dev, dtype=torch.float16, generator=gen)
    alone = {}
    for m in SPLIT_MS:
        alone[m] = kern(x[:m], packed)
        torch.cuda.synchronize()
        assert rel_l2(alone[m], ref(x[:m])) < 1e-3, m
    assert all(torch.equal(alone[m], alone[max(SPLIT_MS)][:m]) for m in SPLIT_MS)  # rows independent of M

    def tickets_zero() -> bool:
        return all(not t.any() for _, t in kern._workspaces.values())

    # back to back on one stream, no synchronization in between, M changing from call to call
    outs = [(m, kern(x[:m], packed)) for _ in range(8) for m in SPLIT_MS]
    torch.cuda.synchronize()
    assert all(torch.equal(y, alone[m]) for m, y in outs)
    assert tickets_zero()

    # CUDA graph: warm-up on a side stream, capture a mixed-M sequence, replay with new inputs
    xs = {m: x[:m].clone() for m in SPLIT_MS}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for m in SPLIT_MS:
            kern(xs[m], packed)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = [(m, kern(xs[m], packed)) for _ in range(3) for m in SPLIT_MS]
    for _ in range(4):
        new = torch.randn(x.shape, device=dev, dtype=torch.float16, generator=gen)
        for m in SPLIT_MS:
            xs[m].copy_(new[:m])
        g.replay()
        torch.cuda.synchronize()
        want = {m: kern(xs[m].clone(), packed) for m in SPLIT_MS}
        torch.cuda.synchronize()
        assert all(torch.equal(y, want[m]) for m, y in ys)
        assert tickets_zero()

    # two streams at once: each its own workspace, results as if alone
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for st in (s1, s2):
        st.wait_stream(torch.cuda.current_stream())
    res: list[tuple[int, torch.Tensor]] = []
    for _ in range(20):
        for st, m in ((s1, 8), (s2, 64), (s1, 17), (s2, 1)):
            with torch.cuda.stream(st):
                res.append((m, kern(x[:m], packed)))
    torch.cuda.synchronize()
    assert all(torch.equal(y, alone[m]) for m, y in res)
    ws = {id(kern._workspaces[st.cuda_stream][1]) for st in (s1, s2)}
    assert len(ws) == 2 and tickets_zero()
