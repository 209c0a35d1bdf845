"""decode-bench and demo (runtime/decode_bench.py) on the tiny synthetic hybrid of tests/test_spec_decode.py,
CPU only: report fields, completion, the efficiency formula, the replay label, greedy equivalence with
plain decoding, the acceptance-rate formula, the demo, and argument errors."""

from __future__ import annotations

import json
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
    # Greedy speculative decoding is lossless: request 0 equals plain one-token-per-forward decoding.
    target = load_target(ckpt)
    prompt = make_prompts(P, L, target.cfg.vocab_size, 0)[0]
    assert rows[0]["output_0"] == rows[1]["output_0"] == plain_greedy(target, prompt, O)


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
