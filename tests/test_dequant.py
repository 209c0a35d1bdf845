"""The weight dequantizer family ("dequant") and the library's kept copies: rendering, manifest, the
sm_70 (NVRTC + ptxas 12.9) / sm_80 / sm_90 (nvcc, when present) compiles, the kernel's index map
(dequant.cuh FragMap + logical_row, mirrored here) against prepack's layouts, and the DequantCache
budget on CPU tensors. The kernel itself against torch runs on a GPU (tests/test_gpu_dequant.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import built_family
from dflashgen.runtime.dequant_kernel import DequantCache, dequantize, dequantize_packed, kernel_arch, parse_budget
from dflashgen.runtime.library import kernel_library_hash, library_hash

from dflashgen import dequant_family
from dflashgen.prepack import Layout, _permute_rows, _to_stream
from dflashgen.render import FAMILY_MODULES, family_kernels, generated_dir, load_manifest
from dflashgen.verify import random_packed

CPU = torch.device("cpu")


def _packed(arch: int, fmt: str, n: int, k: int, silu: bool = False, seed: int = 0):
    return random_packed(arch, fmt, n, k, silu, CPU, torch.Generator().manual_seed(seed))[1]


def test_family_renders_one_kernel_per_arch_and_format() -> None:
    assert FAMILY_MODULES["dequant"] == "dflashgen.dequant_family"
    ks = family_kernels("dequant")
    assert {(k.arch, k.meta["format"]) for k in ks} == {(a, f) for a in (70, 80, 90) for f in ("nvfp4", "fp8_channel")}
    again = {k.name: k.source for k in family_kernels("dequant")}
    for k in ks:
        assert again[k.name] == k.source  # deterministic
        short = "nvfp4" if k.meta["format"] == "nvfp4" else "fp8"
        assert k.name == f"dfg_sm{k.arch}_dequant_{short}_w{dequant_family.WARPS}"
        assert "DO NOT EDIT" in k.source.splitlines()[0] and "#include <dflashgen/dequant.cuh>" in k.source
        traits = "Sm70Traits" if k.arch == 70 else "Sm80Traits"  # the GEMM kernels' decoder for that arch
        assert f"{traits}<dflashgen::Format::{'NVFP4' if short == 'nvfp4' else 'FP8'}, {k.arch}>" in k.source
        assert k.meta["threads"] == 32 * k.meta["warps"] == 256


def test_manifest_lists_the_family_outside_the_gemm_library_hash() -> None:
    manifest = load_manifest()
    entries = manifest["families"]["dequant"]
    assert len(entries) == 6
    for e in entries:
        assert (generated_dir() / e["file"]).is_file() and e["family"] == "dequant" and e["kind"] == "dequant"
    # a tuning table names the GEMM set it timed: this family is not part of it
    assert kernel_library_hash() == library_hash(manifest["kernels"])
    assert not any(e["name"].startswith("dfg_sm90_dequant") for e in manifest["kernels"])


@pytest.mark.parametrize("arch", [70, 80, 90])
def test_family_compiles_without_spills(arch: int) -> None:
    for a, entries in built_family(arch, "_dequant_", 2):
        assert set(entries) == {a.name} and f".entry {a.name}(" in a.ptx.read_text()


# --------------------------------------------------------------------------- the kernel's index map

def _lane_pos(lay: Layout, ks: int, r: int, e: int) -> int:
    """Which element of a lane's 16 bytes (prepack's stream order) Traits::decode puts in fragment
    element (k-step ks, register r, half e) -- read off mma_traits.cuh's decode."""
    if lay.fam == "sm80" and lay.fmt == "nvfp4":  # words (p, row g / g+8), codes 4h + 2 (r >> 1) + e
        return 8 * (2 * (ks // 2) + (r & 1)) + 4 * (ks % 2) + 2 * (r >> 1) + e
    if lay.fam == "sm80":  # words (row g, s0) (row g, s1) (row g+8, s0) (row g+8, s1), bytes 2 (r >> 1) + e
        return 4 * (2 * (r & 1) + ks) + 2 * (r >> 1) + e
    return 4 * ks + 2 * r + e  # sm70: a lane's KG consecutive K of one row


def _kernel_coords(lay: Layout, tile: int, lane: int, ks: int, r: int) -> tuple[int, int]:
    """dequant.cuh: (logical row or -1, K offset in the group) of fragment element (ks, r, 0)."""
    if lay.fam == "sm80":
        row, kk, block = lane // 4 + 8 * (r & 1), 32 * (ks // 2) + 8 * (lane % 4) + 4 * (ks & 1) + 2 * (r >> 1), 8
    else:
        row, kk, block = 8 * ((lane >> 2) & 3) + (lane & 3) + 4 * (lane >> 4), 4 * ks + 2 * r, 2
    lr = tile * lay.tile_rows + row
    if not lay.silu:
        return (lr if lr < lay.n else -1), kk
    j, q = lr % block, lr // block
    return (q & 1) * (lay.n // 2) + (q >> 1) * block + j, kk


@pytest.mark.parametrize("arch,fmt,n,k,silu", [(a, f, n, k, s) for a in (70, 80, 90) for f in ("nvfp4", "fp8_channel")
                                               for (n, k, s) in ((40, 128, False), (64, 64, True))])
def test_kernel_index_map_inverts_prepack(arch: int, fmt: str, n: int, k: int, silu: bool) -> None:
    lay = Layout(arch, fmt, n, k, silu)
    ids = torch.arange(1, n * k + 1, dtype=torch.int64).view(n, k)  # 0: padding rows
    stream = _to_stream(_permute_rows(ids, lay), lay.weight_view())
    per_lane = 32 if fmt == "nvfp4" else 16
    ksteps = lay.k_group // 16 if lay.fam == "sm80" else lay.k_group // 4
    regs = 4 if lay.fam == "sm80" else 2
    groups = k // lay.k_group
    seen = 0
    for chunk in range(lay.n_pad // lay.tile_rows * groups):
        tile, g = divmod(chunk, groups)
        for lane in range(32):
            for ks in range(ksteps):
                for r in range(regs):
                    row, kk = _kernel_coords(lay, tile, lane, ks, r)
                    for e in range(2):
                        got = int(stream[chunk * 32 * per_lane + lane * per_lane + _lane_pos(lay, ks, r, e)])
                        want = 0 if row < 0 else row * k + g * lay.k_group + kk + e + 1
                        assert got == want, (chunk, lane, ks, r, e)
                        seen += got > 0
    assert seen == n * k  # every weight written once


# --------------------------------------------------------------------------- torch path and the budget

def test_dequantize_off_the_gpu_is_torchs_formulation() -> None:
    p = _packed(90, "nvfp4", 64, 128)
    assert kernel_arch(p.layout, CPU) is None
    ref = dequantize_packed(p)
    assert torch.equal(dequantize(p, torch.float32), ref)
    out = torch.empty(64, 128, dtype=torch.float16)
    assert dequantize(p, torch.float16, out=out) is out and torch.equal(out, ref.to(torch.float16))


@pytest.mark.parametrize("text,want", [("auto", "auto"), ("all", None), (None, None), ("0", 0), (0, 0),
                                       ("512MiB", 512 << 20), ("12G", 12 << 30), ("1.5 GB", 3 << 29), (4096, 4096)])
def test_budget_parse(text: object, want: object) -> None:
    assert parse_budget(text) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["lots", "-1", -1, "12 parsecs"])
def test_budget_parse_rejects_nonsense(bad: object) -> None:
    with pytest.raises(ValueError, match="dequant_cache"):
        parse_budget(bad)  # type: ignore[arg-type]


def test_cache_keeps_within_its_budget_and_drops_dead_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASHGEN_DEQUANT_CACHE", raising=False)
    packs = [_packed(90, "fp8_channel", 32, 64, seed=i) for i in range(3)]
    one = 32 * 64 * 2  # bytes of an FP16 copy
    c = DequantCache(2 * one)
    ws = [c.weight(p, torch.float16) for p in packs]
    assert len(c) == 2 and c.bytes == 2 * one  # first come, first kept; the third does not fit
    assert c.weight(packs[0], torch.float16) is ws[0]  # kept: the same tensor
    third = c.weight(packs[2], torch.float16)
    assert third is not ws[2] and torch.equal(third, ws[2])  # made again, same bits
    for p, w in zip(packs, ws, strict=True):
        assert torch.equal(w, dequantize_packed(p).to(torch.float16))
    del packs[0], ws[0]  # a garbage-collected weight gives its copy back
    gc.collect()
    assert len(c) == 1 and c.bytes == one
    assert c.weight(packs[1], torch.float32).dtype == torch.float32 and len(c) == 1  # per dtype: over budget now

    none, every = DequantCache(0), DequantCache("all")
    for p in packs:
        none.weight(p, torch.float16), every.weight(p, torch.float16)
    assert (len(none), none.bytes, len(every), every.bytes) == (0, 0, 2, 2 * one)
    assert len(DequantCache("auto")) == 0 and DequantCache().budget == "auto"  # "auto" off the GPU keeps all
    auto = DequantCache()
    auto.weight(packs[0], torch.float16)
    assert len(auto) == 1
    auto.clear()
    assert (len(auto), auto.bytes) == (0, 0)
    monkeypatch.setenv("DFLASHGEN_DEQUANT_CACHE", "1KiB")
    assert DequantCache().budget == 1024 and DequantCache(0).budget == 0  # the argument wins over the variable
