"""decode-bench and demo (runtime/decode_bench.py) on the tiny synthetic hybrid of tests/test_spec_decode.py,
CPU only: report fields, completion, the efficiency formula, the replay label, greedy equivalence with
plain decoding, the acceptance-rate formula, the demo, and argument errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dflashgen.runtime.decode_bench import (
    DEFAULT_ACCEPTANCE,
    TINY,
    acceptance_for_length,
    expected_accepted_length,
    load_target,
    main_decode_bench,
    main_demo,
    make_prompts,
    plot_report,
    write_report,
)
from dflashgen.runtime.spec_decode import plain_greedy

P, L, O = 4, 16, 8
ROW_KEYS = {"B", "output_tok_s", "vs_b1", "ideal_efficiency", "p50_ttft_ms", "p50_tpot_ms", "accepted_length",
            "completed", "requests", "output_tokens", "wall_s", "rounds", "median_target_ms", "median_sample_ms",
            "median_draft_ms", "median_host_ms", "output_0", "same_as_b1"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs on a shared 2-core box
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("cfg") / "tiny.json"
    p.write_text(json.dumps(TINY))
    return p


def _bench(tmp: Path, cfg: Path, *extra: str) -> tuple[int, dict[str, Any], Path]:
    ckpt, out = tmp / "ckpt", tmp / "out"
    rc = main_decode_bench(["decode-bench", str(ckpt), "--synthetic", "--model", str(cfg), "--prompts", str(P),
                            "--prompt-len", str(L), "--output-len", str(O), "--batches", "1", "2",
                            "--out", str(out), *extra])
    rep = json.loads((out / "decode_bench.json").read_text()) if rc == 0 else {}
    return rc, rep, ckpt


def test_greedy_replay_bench(tmp_path: Path, tiny_json: Path) -> None:
    rc, rep, ckpt = _bench(tmp_path, tiny_json, "--greedy")
    assert rc == 0
    assert {"header", "drafter", "command", "config", "rows", "note"} <= rep.keys()
    assert "replay drafter (synthetic acceptance" in rep["header"]
    assert "replay drafter (synthetic acceptance" in (tmp_path / "out" / "decode_bench.md").read_text()
    assert "decode-bench" in rep["command"] and "--greedy" in rep["command"]
    rows = rep["rows"]
    assert [r["B"] for r in rows] == [1, 2]
    b1 = rows[0]["output_tok_s"]
    for r in rows:
        assert r.keys() >= ROW_KEYS
        assert r["completed"] == P and r["output_tokens"] == P * O
        assert r["vs_b1"] == pytest.approx(r["output_tok_s"] / b1)
        assert r["ideal_efficiency"] == pytest.approx(r["output_tok_s"] / (r["B"] * b1))
        assert r["p50_ttft_ms"] > 0 and r["p50_tpot_ms"] > 0 and 1 <= r["accepted_length"] <= 8
        assert r["same_as_b1"] == P  # greedy: batch composition does not change tokens
        assert 0 < r["prefill_s"] < r["wall_s"]  # every request prefills (prompts of L > 1 tokens)
        # what the rounds alone explain: rounds x the phase medians, and the rest of the wall clock
        rounds_s = r["rounds"] * sum(r[f"median_{p}_ms"] for p in ("target", "sample", "draft", "host")) / 1e3
        assert r["round_ms"] * r["rounds"] / 1e3 == pytest.approx(rounds_s)
        assert r["outside_rounds_s"] == pytest.approx(r["wall_s"] - rounds_s)
        assert r["rounds_tok_s"] == pytest.approx(r["output_tokens"] / rounds_s)
        assert r["rounds_efficiency"] == pytest.approx(r["rounds_tok_s"] / (r["B"] * rows[0]["rounds_tok_s"]))
    assert rows[0]["rounds_efficiency"] == pytest.approx(1.0)
    md = (tmp_path / "out" / "decode_bench.md").read_text()
    assert "prefill (share of wall)" in md and f"{rows[0]['prefill_s']:.2f} s (" in md
    assert "rounds-only efficiency" in md and f"{100 * rows[1]['rounds_efficiency']:.1f}%" in md
    assert (tmp_path / "out" / "decode_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the wall-clock plot
    # Greedy speculative decoding is lossless: request 0 equals plain one-token-per-forward decoding.
    target = load_target(ckpt)
    prompt = make_prompts(P, L, target.cfg.vocab_size, 0)[0]
    assert rows[0]["output_0"] == rows[1]["output_0"] == plain_greedy(target, prompt, O)


def test_report_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JSON and Markdown report need nothing else; the plot is skipped (not an error) where
    matplotlib is missing."""
    row = {"B": 1, "output_tok_s": 10.0, "vs_b1": 1.0, "ideal_efficiency": 1.0, "p50_ttft_ms": 1.0,
           "p50_tpot_ms": 1.0, "accepted_length": 4.0, "completed": 1, "requests": 1, "rounds": 2,
           "output_tokens": 8, "wall_s": 0.8, "prefill_s": 0.1, "outside_rounds_s": 0.1, "rounds_efficiency": 1.0,
           **{f"median_{p}_ms": 100.0 for p in ("target", "sample", "draft", "host")}}
    report = {"header": "h", "command": "c", "rows": [row], "tp": 1}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert not plot_report(report, tmp_path / "x.png")
    write_report(report, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "decode_bench.json").read_text()) == report
    assert "| 1 | 10.00 |" in (tmp_path / "out" / "decode_bench.md").read_text()
    assert not (tmp_path / "out" / "decode_bench.png").exists()


def test_sampled_bench_ngram(tmp_path: Path, tiny_json: Path) -> None:
    rc, rep, _ = _bench(tmp_path, tiny_json, "--drafter", "ngram", "--no-warmup")
    assert rc == 0
    assert "replay" not in rep["header"] and rep["config"]["sampling"] == {"temperature": 1.0, "top_p": 0.95,
                                                                          "top_k": 20}
    assert all(r["completed"] == P for r in rep["rows"])


def test_acceptance_formula() -> None:
    # q7, i.i.d. per-token acceptance a: E[accepted length] = sum_{i=0..7} a^i = (1 - a^8) / (1 - a).
    a = acceptance_for_length(4.3)
    assert expected_accepted_length(a) == pytest.approx(4.3)
    assert expected_accepted_length(a) == pytest.approx((1 - a**8) / (1 - a))
    assert abs(DEFAULT_ACCEPTANCE - 0.8109) < 1e-4
    assert expected_accepted_length(0.0) == 1 and expected_accepted_length(1.0) == 8


def test_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_demo(["demo", "--prompts", "2", "--prompt-len", "8", "--output-len", "16", "--greedy"]) == 0
    out = capsys.readouterr().out
    assert "replay drafter (synthetic acceptance" in out
    assert "tok/s" in out and "accepted length" in out and "target forward" in out


@pytest.mark.parametrize(("args", "msg"), [
    (["--batches", "1", "9"], "every B must be"),
    (["--batches", "0"], "every B must be"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--acceptance", "1.5"], "acceptance"),
    (["--max-len", "20"], "exceeds max_len"),
    (["--dequant-cache", "lots"], "dequant_cache must be"),
])
def test_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], msg: str) -> None:
    rc = main_decode_bench([str(tmp_path / "none"), "--prompt-len", "16", "--output-len", "8", *args])
    assert rc == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "none").exists()  # validated before any checkpoint work


def test_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_decode_bench([str(tmp_path / "nope"), "--prompts", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main_decode_bench(["--prompts", "1"]) == 2
    assert "--synthetic" in capsys.readouterr().err
    assert main_demo(["--batch", "9"]) == 2


def test_sampled_replay_is_synthetic_by_default(tmp_path: Path, tiny_json: Path) -> None:
    rc, rep, _ = _bench(tmp_path, tiny_json)  # replay + official sampling: synthetic acceptance mode
    assert rc == 0
    assert rep["synthetic_acceptance"] is True and rep["config"]["synthetic_acceptance"] is True
    md = (tmp_path / "out" / "decode_bench.md").read_text()
    for text in (rep["header"], md):
        assert "replay drafter (synthetic acceptance" in text and "SYNTHETIC ACCEPTANCE" in text
    assert "SYNTHETIC accept/reject decisions" in rep["drafter"]
    for r in rep["rows"]:
        assert r["completed"] == P and r["accepted_length"] > 2  # not the ~1.0 of the real sampled path
        assert r["same_as_b1"] == P  # seeded requests and coins: batch composition changes nothing


def test_sampled_replay_real_acceptance_opt_out(tmp_path: Path, tiny_json: Path) -> None:
    rc, rep, _ = _bench(tmp_path, tiny_json, "--no-synthetic-acceptance", "--no-warmup")
    assert rc == 0 and rep["synthetic_acceptance"] is False
    assert "SYNTHETIC" not in rep["header"] and "NOTE: sampled verification" in rep["header"]
    rc, rep, _ = _bench(tmp_path / "g", tiny_json, "--greedy", "--no-warmup")
    assert rc == 0 and rep["synthetic_acceptance"] is False and "SYNTHETIC" not in rep["header"]


def test_demo_synthetic_label(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_demo(["demo", "--prompts", "2", "--prompt-len", "8", "--output-len", "16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "SYNTHETIC ACCEPTANCE" in out and "SYNTHETIC accept/reject decisions" in out


# --------------------------------------------------------------------------- tensor parallel (gloo, CPU)

TP_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TP_TIMEOUT = 90.0


@pytest.fixture(scope="module")
def tp_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The tiny hybrid with a vocab divisible by 2 (mixed deployment: TP2 shards keep whole K groups),
    and its TP1 greedy report."""
    d = tmp_path_factory.mktemp("tp1")
    cfg = d / "tiny96.json"
    cfg.write_text(json.dumps({**TINY, "vocab_size": 96}))
    rc, rep, _ = _bench(d, cfg, "--greedy", "--deployment", "mixed")
    assert rc == 0 and rep["tp"] == 1 and all(r["allreduce_ms_per_round"] is None for r in rep["rows"])
    return cfg, rep


def _tp_args(ckpt: Path, cfg: Path, out: Path) -> list[str]:
    return ["-m", "dflashgen.runtime.decode_bench", "decode-bench", str(ckpt), "--synthetic", "--model", str(cfg),
            "--deployment", "mixed", "--prompts", str(P), "--prompt-len", str(L), "--output-len", str(O),
            "--batches", "1", "2", "--greedy", "--out", str(out)]


def _check_tp2(rep: dict[str, Any], tp1: dict[str, Any]) -> None:
    assert rep["tp"] == 2 and rep["config"]["tp"] == 2 and "TP2" in rep["header"]
    assert [r["B"] for r in rep["rows"]] == [1, 2]
    for r, r1 in zip(rep["rows"], tp1["rows"], strict=True):
        assert r["completed"] == P and r["output_tokens"] == P * O
        assert r["same_as_b1"] == P
        assert r["output_0"] == r1["output_0"]  # greedy TP2 generates TP1's tokens
        assert r["allreduce_ms_per_round"] is not None and r["allreduce_ms_per_round"] > 0


def test_tp2_ranks_match_tp1(tmp_path: Path, tp_tiny: tuple[Path, dict[str, Any]]) -> None:
    """Two torchrun-style ranks (gloo): rank 0 writes the synthetic checkpoint once, both load their
    shard and decode in lockstep, only rank 0 writes the report; tokens equal TP1's."""
    from conftest import launch_ranks

    cfg, tp1 = tp_tiny
    out = tmp_path / "out"
    logs = tmp_path / "logs"
    logs.mkdir()
    launch_ranks(_tp_args(tmp_path / "ckpt", cfg, out), logs, 2, TP_TIMEOUT, drop_env=TP_ENV_KEYS)
    _check_tp2(json.loads((out / "decode_bench.json").read_text()), tp1)
    assert "| B |" in (logs / "rank0.log").read_text() and "| B |" not in (logs / "rank1.log").read_text()


def test_tp_flag_relaunches(tmp_path: Path, tp_tiny: tuple[Path, dict[str, Any]]) -> None:
    """``--tp 2`` outside torchrun writes the checkpoint in the parent and re-launches 2 gloo ranks."""
    import os
    import subprocess
    import sys

    cfg, tp1 = tp_tiny
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in TP_ENV_KEYS}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, *_tp_args(tmp_path / "ckpt", cfg, out), "--tp", "2"], env=env,
                         capture_output=True, text=True, timeout=TP_TIMEOUT, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads((out / "decode_bench.json").read_text())
    _check_tp2(rep, tp1)
    assert "--tp 2" in rep["command"] and "--prepared-checkpoint" not in rep["command"]
    assert res.stdout.count("| B |") == 1  # one report, from rank 0


def test_join_group_policy() -> None:
    from dflashgen.runtime.decode_bench import BenchConfig

    assert [BenchConfig().join_group_for(b) for b in (1, 2, 4, 8)] == [1, 1, 1, 1]
    assert [BenchConfig(join_group=3).join_group_for(b) for b in (1, 2, 4, 8)] == [1, 2, 3, 3]
    with pytest.raises(ValueError, match="join_group must be an integer >= 1"):
        BenchConfig(join_group=0).validate()


def test_prefill_sm_carveout_config() -> None:
    """--prefill-sm-carveout N: an integer >= 1, only with overlapped prefill (not with --prefill stall)."""
    from dflashgen.runtime.decode_bench import BenchConfig

    BenchConfig(prefill_sm_carveout=24).validate()
    for bad in (BenchConfig(prefill_sm_carveout=0), BenchConfig(prefill_sm_carveout=24, overlap_prefill=False)):
        with pytest.raises(ValueError, match="prefill_sm_carveout must be an integer >= 1"):
            bad.validate()


def test_policy_parse() -> None:
    from dflashgen.runtime.decode_bench import BenchConfig, Policy

    assert Policy.parse("overlap") == Policy("overlap", 1) and Policy.parse("overlap").overlap is True
    assert Policy.parse("stall:2") == Policy("stall", 2) and Policy.parse("stall:2").overlap is False
    assert Policy.parse("default").overlap is None and Policy.parse("default:3").label == "default:3"
    assert [Policy.parse(x).label for x in ("overlap", "stall:2", "default")] == ["overlap", "stall:2", "default"]
    assert Policy.parse("stall:2+serial") == Policy("stall", 2, False) and Policy.parse("default+pipelined").pipeline
    assert [Policy.parse(x).label for x in ("default+serial", "overlap:3+pipelined")] == [
        "default+serial", "overlap:3+pipelined"]
    for bad, msg in (("fast", "expected overlap, stall or default"), ("stall:x", "must be an integer"),
                     ("stall+fast", r"\+pipelined or \+serial"), ("stall+", r"\+pipelined or \+serial")):
        with pytest.raises(ValueError, match=msg):
            Policy.parse(bad)
    # the single policy of the plain flags
    assert BenchConfig(overlap_prefill=False, join_group=2).policy_list() == (Policy("stall", 2),)
    assert BenchConfig().policy_list() == (Policy(None, 1),)
    for cfg, msg in ((BenchConfig(policies=(Policy("stall", 0),)), "join_group must be"),
                     (BenchConfig(policies=(Policy("stall"),), join_group=2), "either policies"),
                     (BenchConfig(policies=(Policy("stall"), Policy("stall"))), "policies repeat"),
                     (BenchConfig(repeat=0), "repeat must be"),
                     (BenchConfig(policies=(Policy("overlap"), Policy("stall")), prefill_sm_carveout=8),
                      "prefill_sm_carveout")):
        with pytest.raises(ValueError, match=msg):
            cfg.validate()


def test_policy_ab_bench(tmp_path: Path, tiny_json: Path) -> None:
    """--policies / --repeat: B1 once per run, every B > 1 once per policy per run, alternating; each
    row's efficiency against its own run's B1; the summary's medians; greedy tokens the same under
    every policy (admission order never changes a request's tokens)."""
    rc, rep, _ = _bench(tmp_path, tiny_json, "--greedy", "--no-warmup", "--policies", "overlap", "stall:2",
                        "--repeat", "2")
    assert rc == 0
    rows = rep["rows"]
    assert [(r["B"], r["policy"], r["run"]) for r in rows] == [
        (1, "overlap", 0), (2, "overlap", 0), (2, "stall:2", 0),
        (1, "overlap", 1), (2, "overlap", 1), (2, "stall:2", 1)]
    assert [r["join_group"] for r in rows] == [1, 1, 2, 1, 1, 2]
    for r in rows:
        b1 = next(x for x in rows if x["B"] == 1 and x["run"] == r["run"])
        assert r["ideal_efficiency"] == pytest.approx(r["output_tok_s"] / (r["B"] * b1["output_tok_s"]))
        assert r["completed"] == P and r["same_as_b1"] == P
    assert rep["config"]["policies"] == ["overlap", "stall:2"] and rep["config"]["repeat"] == 2
    summary = {(s["B"], s["policy"]): s for s in rep["policy_summary"]}
    assert set(summary) == {(1, "overlap"), (2, "overlap"), (2, "stall:2")}
    s = summary[(2, "stall:2")]
    tok = [r["output_tok_s"] for r in rows if r["B"] == 2 and r["policy"] == "stall:2"]
    assert s["runs"] == 2 and s["median_tok_s"] == pytest.approx(sum(tok) / 2)
    assert (s["min_tok_s"], s["max_tok_s"]) == (min(tok), max(tok))
    md = (tmp_path / "out" / "decode_bench.md").read_text()
    assert "## Medians over the runs" in md and "| 2 | stall:2 | 2 |" in md and "| B | policy | run |" in md
    assert (tmp_path / "out" / "decode_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_policy_ab_of_round_pipelining(tmp_path: Path, tiny_json: Path) -> None:
    """A ``+serial`` policy beside the default: B1 runs once per rounds setting, rows say whether their
    rounds were pipelined (never on the CPU, where the default is off), each row's efficiency is
    against the first B1 of its run with the same pipelining, and greedy tokens are the same everywhere."""
    rc, rep, _ = _bench(tmp_path, tiny_json, "--greedy", "--no-warmup", "--policies", "default", "stall+serial")
    assert rc == 0
    rows = rep["rows"]
    assert [(r["B"], r["policy"]) for r in rows] == [
        (1, "default"), (1, "stall+serial"), (2, "default"), (2, "stall+serial")]
    assert [r["pipelined"] for r in rows] == [False] * 4
    for r in rows[2:]:
        b1 = rows[0]  # both serial here
        assert r["ideal_efficiency"] == pytest.approx(r["output_tok_s"] / (2 * b1["output_tok_s"]))
        assert r["completed"] == P and r["same_as_b1"] == P
    assert "; serial rounds" in rep["header"]


def test_policies_replace_prefill_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main_decode_bench([str(tmp_path / "none"), "--policies", "stall", "--prefill", "overlap"])
    assert rc == 2 and "either policies" in capsys.readouterr().err
    rc = main_decode_bench([str(tmp_path / "none"), "--policies", "slow"])
    assert rc == 2 and "expected overlap, stall or default" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
