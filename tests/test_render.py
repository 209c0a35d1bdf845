"""Rendering is deterministic and `generate --check` catches every kind of drift."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashgen.cli import main
from dflashgen.render import diff, generated_dir, load_targets, plan, render_kernel, specs_for, write
from dflashgen.schedule import candidates

SMALL = Path(__file__).parent / "data" / "targets-small.yaml"


@pytest.fixture(scope="module")
def small_plan():
    return plan(load_targets(SMALL))


def test_render_is_deterministic_and_marked_generated() -> None:
    spec = candidates(70, "nvfp4", 5120, 6144)[0]
    a, b = render_kernel(spec), render_kernel(spec)
    assert a == b
    assert "DO NOT EDIT" in a.splitlines()[0]
    assert f"{spec.name}(" in a and "static constexpr int K = 6144;" in a


def test_plan_is_deterministic(small_plan) -> None:
    again = plan(load_targets(SMALL))
    assert again.files == small_plan.files
    manifest = json.loads(small_plan.files["manifest.json"])
    for k in manifest["kernels"]:
        assert k["serves"] and k["source_sha256"] and k["file"] in small_plan.files


def test_check_detects_edit_missing_and_stale(tmp_path: Path, small_plan) -> None:
    out = tmp_path / "gen"
    first = write(small_plan, out)
    assert first.missing and not first.changed
    assert diff(small_plan, out).clean
    some = sorted(p for p in small_plan.files if p.endswith(".cu"))
    (out / some[0]).write_text((out / some[0]).read_text() + "// hand edit\n")
    (out / some[1]).unlink()
    stale = out / "sm_70" / "dfg_sm70_old_kernel.cu"
    stale.write_text("// stale\n")
    d = diff(small_plan, out)
    assert d.changed == [some[0]] and d.missing == [some[1]] and d.stale == ["sm_70/dfg_sm70_old_kernel.cu"]
    text = d.summary()
    assert "hand-edited" in text and some[1] in text and "stale" in text
    rc = main(["generate", "--check", "--targets", str(SMALL), "--out", str(out)])
    assert rc == 1
    write(small_plan, out)
    assert not stale.exists() and diff(small_plan, out).clean
    assert main(["generate", "--check", "--targets", str(SMALL), "--out", str(out)]) == 0


def test_committed_generated_is_current() -> None:
    d = diff(plan(load_targets()), generated_dir())
    assert d.clean, d.summary()


def test_projections_are_deduplicated_with_all_users() -> None:
    specs = specs_for(load_targets(SMALL))
    users = {u for s in specs for u in s.serves}
    # o_proj and out_proj share a shape at TP4, so one kernel serves both
    shared = [s for s in specs if any("o_proj" in u for u in s.serves)]
    assert shared and all(any("out_proj" in u for u in s.serves) for s in shared)
    assert any(u.endswith("gate_up_proj+silu") for u in users)


def family_kernels():  # a stand-in kernel family (see test_kernel_families_are_planned_built_and_pruned)
    from dflashgen.render import FamilyKernel

    return [FamilyKernel("dfg_toy_sm70_a", 70, "// generated, DO NOT EDIT\nextern \"C\" __global__ void "
                         "dfg_toy_sm70_a(float* p) { p[0] = 1.0f; }\n", {"rows": 8})]


def test_kernel_families_are_planned_built_and_pruned(tmp_path: Path, monkeypatch) -> None:
    from dflashgen import render
    from dflashgen.build import select

    monkeypatch.setitem(render.FAMILY_MODULES, "toy", __name__)
    p = plan(load_targets(SMALL))
    rel = "toy/sm_70/dfg_toy_sm70_a.cu"
    manifest = json.loads(p.files["manifest.json"])
    (entry,) = manifest["families"]["toy"]
    assert entry["file"] == rel and entry["rows"] == 8 and entry["family"] == "toy"
    assert rel in p.files and any(k["name"] == "dfg_toy_sm70_a" for k in select(manifest, [70]))
    assert not any(k["name"] == "dfg_toy_sm70_a" for k in select(manifest, [90]))
    out = tmp_path / "gen"
    write(p, out)
    assert (out / rel).exists()
    monkeypatch.delitem(render.FAMILY_MODULES, "toy")
    d = write(plan(load_targets(SMALL)), out)  # the family is gone: its file and folders go too
    assert rel in d.stale and not (out / "toy").exists()


def test_build_fingerprint_covers_exactly_the_included_headers() -> None:
    from dflashgen.render import _INCLUDE, header_hash

    src = render_kernel(candidates(90, "nvfp4", 5120, 6144)[0])
    assert _INCLUDE.findall(src) == ["skinny_gemm.cuh"]
    # the closure reaches decode.cuh and mma_traits.cuh through skinny_gemm.cuh ...
    assert header_hash(src) == header_hash("#include <dflashgen/skinny_gemm.cuh>")
    # ... and not another family's header
    assert header_hash(src) != header_hash("#include <dflashgen/verify_attention.cuh>")
    assert header_hash("no includes") == header_hash("")


def test_wgmma_kernel_renders_its_plan_and_only_it_includes_wgmma() -> None:
    cands = candidates(90, "nvfp4", 34816, 5120)
    wg = next(c for c in cands if c.kplan.wgmma and c.tile.rows == 64)
    src = render_kernel(wg)
    assert "_wg1_r64_nt1_wn4_" in wg.name and f"{wg.name}(" in src
    assert "#define DFLASHGEN_WGMMA 1" in src and "static constexpr bool WGMMA = true;" in src
    assert "wgmma.m64nNk16" in src and "wgmma=1" in src
    assert "static constexpr int WARPS_N = 4;" in src and "static constexpr bool X_SMEM = true;" in src
    # mma.sync kernels of the same problem render exactly as before the wgmma plans existed (the
    # wgmma-consumer producer tiles, on the mma.sync plans, are wgmma kernels of their own)
    assert any(c.tile.wgc for c in cands)
    for c in (c for c in cands if not c.kplan.wgmma and not c.tile.wgc):
        s = render_kernel(c)
        assert "WGMMA" not in s and "wgmma" not in s


def test_wgmma_manifest_entries_carry_the_sm90a_target() -> None:
    from dflashgen.render import load_manifest

    kernels = load_manifest()["kernels"]
    wg = [k for k in kernels if k["kplan"].get("wgmma")]
    assert wg and all(k["arch"] == 90 and k["target"] == "90a" and "_wg1_" in k["name"] for k in wg)
    wc = [k for k in kernels if k["tile"].get("wgc")]  # wgmma consumers on an mma.sync plan
    assert wc and all(k["arch"] == 90 and k["target"] == "90a" and "_wc1_" in k["name"] for k in wc)
    assert all("target" not in k and "_wg1_" not in k["name"]
               for k in kernels if not k["kplan"].get("wgmma") and not k["tile"].get("wgc"))
    # every wgmma problem has a tile for every M bucket (rows 8..64) in its one plan
    by_problem: dict[str, set[int]] = {}
    for k in wg:
        by_problem.setdefault(f"{k['format']}/{k['epilogue']}/{k['n']}/{k['k']}/{json.dumps(k['kplan'])}",
                              set()).add(k["tile"]["rows"])
    assert all(rows == {8, 16, 32, 64} for rows in by_problem.values())
    assert len({p.rsplit("/", 1)[0] for p in by_problem}) == len(by_problem), "one wgmma plan per problem"


def test_shapes_prints_the_weights_per_rank_and_the_fp16_copies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shapes", "--tp", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # Qwen3.8-27B NVFP4 TP1: 24.35e9 weights at 4.5 bits + the FP16 lm_head; their FP16 copies 48.7 GB
    assert "16.24 GB as deployed" in last and "48.70 GB more" in last
    assert main(["shapes", "--tp", "4", "--deployment", "fp8"]) == 0
    assert "12.18 GB more" in capsys.readouterr().out  # a rank's quarter of the copies


def test_cli_reports_expected_errors_in_one_line(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    from dflashgen.cli import main

    monkeypatch.delenv("DFLASHGEN_DEBUG", raising=False)
    assert main(["build", "--arch", "70", "--only", "no-such-kernel"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dflashgen build: error: --only 'no-such-kernel' matches no kernel for sm_70"
    monkeypatch.setenv("DFLASHGEN_DEBUG", "1")
    with pytest.raises(ValueError, match="matches no kernel"):
        main(["build", "--arch", "70", "--only", "no-such-kernel"])


def test_x_smem_rings_above_48k_render_dynamic_shared_memory() -> None:
    """A warps_k = 8 plan's 32- and 64-row x_smem rings (8 workers x 3 stages x rows x 64 K x 2 B =
    96 / 192 KB) are dynamic shared memory, sized in the manifest and checked against the struct at compile time;
    every static kernel renders its __shared__ struct as before; sm_80 and wgmma plans stay static."""
    from dflashgen.render import load_manifest

    cands = candidates(90, "nvfp4", 16480, 5120)
    # (w_async x_smem tiles add their weight ring to the activation ring: those cross 48 KB from 16 rows)
    assert all(c.smem_dynamic == (c.smem_bytes() > 48 * 1024) for c in cands if c.tile.w_async and c.tile.x_smem)
    # (and serial tiles their running sums: r64 wn8 with split-K crosses it)
    assert all(c.smem_dynamic == (c.smem_bytes() > 48 * 1024) for c in cands if c.tile.serial)
    dyn = [c for c in cands if c.smem_dynamic and not c.tile.w_async and not c.tile.serial]
    assert {c.tile.rows for c in dyn} == {32, 64} and all(c.kplan.warps_k == 8 for c in dyn)
    assert {c.smem_bytes() for c in dyn} == {98304, 196608}  # 32 / 64 rows; the 64-row ring is 1 CTA per SM
    dyn.sort(key=lambda c: c.tile.rows)
    src = render_kernel(dyn[0])
    assert "extern __shared__ uint4 dyn_smem[];" in src and "__shared__ Gemm::Smem smem;" not in src
    assert "static_assert(sizeof(Gemm::Smem) <= 98304" in src
    assert dyn[0].to_dict()["smem_dynamic"] is True
    for c in cands:
        if not c.smem_dynamic:
            s = render_kernel(c)
            assert "__shared__ Gemm::Smem smem;" in s and "dyn_smem" not in s and "smem_dynamic" not in c.to_dict()
            assert c.smem_bytes() <= 49152
    kernels = load_manifest()["kernels"]
    assert all(k["arch"] == 90 and not k["kplan"].get("wgmma") and k["smem_bytes"] > 49152
               for k in kernels if k.get("smem_dynamic"))
    assert all(k["smem_bytes"] <= 49152 for k in kernels if not k.get("smem_dynamic"))
