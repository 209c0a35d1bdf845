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
