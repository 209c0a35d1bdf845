"""The compact rejection-sampling kernel family: rendering, manifest entries, kernel choice, and the
sm_70 (NVRTC + ptxas 12.9) and sm_90 (nvcc, when present) compiles without spills. The kernel's
exactness against the dense reference runs on a GPU (tests/test_gpu_decode.py)."""

from __future__ import annotations

import shutil

import pytest
from dflashgen.runtime.rejection import pick_entry

from dflashgen import rejection
from dflashgen.build import build
from dflashgen.render import FAMILY_MODULES, family_kernels, generated_dir, load_manifest
from dflashgen.toolchain import parse_ptxas_log

QWEN_VOCAB = 248320


def test_family_renders_specialised_and_generic_kernels() -> None:
    assert FAMILY_MODULES["rejection"] == "dflashgen.rejection"
    ks = family_kernels("rejection")
    names = {k.name for k in ks}
    for arch in (70, 80, 90):
        assert {f"dfg_sm{arch}_rejection_v{QWEN_VOCAB}_d7", f"dfg_sm{arch}_rejection_v{QWEN_VOCAB}_d3",
                f"dfg_sm{arch}_rejection_generic"} <= names
    again = {k.name: k.source for k in family_kernels("rejection")}
    for k in ks:
        assert again[k.name] == k.source  # deterministic
        assert "DO NOT EDIT" in k.source.splitlines()[0] and "#include <dflashgen/rejection.cuh>" in k.source
        assert f"{k.name}(" in k.source and f"{k.name}_decide(" in k.source
    spec = next(k for k in ks if k.name == f"dfg_sm90_rejection_v{QWEN_VOCAB}_d7")
    assert f"{QWEN_VOCAB}, 7, desc);" in spec.source  # vocab and drafts are compile-time constants
    generic = next(k for k in ks if k.name == "dfg_sm90_rejection_generic")
    assert "vocab, num_drafts, desc);" in generic.source


def test_key_plan() -> None:
    assert rejection.key_plan(QWEN_VOCAB) == (18, 6, 7)  # 32 + 18 = 50 key bits -> 7 digits of 8
    assert rejection.key_plan(256) == (8, 0, 5)
    assert rejection.key_plan(None) == (24, 0, 7)
    with pytest.raises(ValueError, match="2\\^24"):
        rejection.key_plan((1 << 24) + 1)


def test_manifest_lists_the_family_and_files_exist() -> None:
    entries = load_manifest()["families"]["rejection"]
    assert len(entries) == 9
    for e in entries:
        assert (generated_dir() / e["file"]).is_file() and e["family"] == "rejection" and e["threads"] == 512
    by_name = {e["name"]: e for e in entries}
    assert pick_entry(by_name, 90, QWEN_VOCAB, 7)["name"] == f"dfg_sm90_rejection_v{QWEN_VOCAB}_d7"
    assert pick_entry(by_name, 90, QWEN_VOCAB, 5)["name"] == "dfg_sm90_rejection_generic"
    assert pick_entry(by_name, 70, 97, 7)["name"] == "dfg_sm70_rejection_generic"
    with pytest.raises(ValueError, match="above"):
        pick_entry(by_name, 90, (1 << 24) + 1, 7)


@pytest.mark.parametrize("arch", [70, 90])
def test_family_compiles_without_spills(arch: int) -> None:
    if arch != 70 and shutil.which("nvcc") is None:
        pytest.skip("no nvcc for sm_90 (NVRTC 12.9 builds sm_70 only here)")
    res = build([arch], only="_rejection_", progress=False)
    assert len(res.resources()) == 3
    for a in res.artifacts.values():
        entries = parse_ptxas_log(a.log.read_text())  # both kernels of the pair, not just the main one
        assert set(entries) == {a.name, a.name + "_decide"}
        assert not [n for n, r in entries.items() if r["spill_stores"] or r["spill_loads"]], entries
        ptx = a.ptx.read_text()
        assert f".entry {a.name}(" in ptx and f".entry {a.name}_decide(" in ptx
        assert a.cubin.stat().st_size > 0
