"""CUDA-graph structure of a decode round, checked on the CPU: the captured steps (target verify
forward, rollback, static drafter step) run under FakeTensorMode, which rejects every data-dependent
host sync (``.item()``, ``bool(tensor)``, dynamic shapes) -- what CUDA graph capture forbids; narrowed
states share storage; batch-size bookkeeping and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import single_thread, tiny_fp32_target
from dflashgen.runtime.decode_bench import TINY, _block_drafter
from dflashgen.runtime.drafter import StaticDFlashDrafter
from dflashgen.runtime.graphs import DecodeGraphs
from dflashgen.runtime.target import TargetModel
from torch._subclasses.fake_tensor import FakeTensorMode

from dflashgen.model import parse_model_config

CFG = parse_model_config(TINY)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    with single_thread():
        return tiny_fp32_target(tmp_path_factory.mktemp("tiny-graphs"), CFG)


def test_captured_steps_have_no_host_sync(model: TargetModel) -> None:
    st = model.new_state(4, 40)
    steps = DecodeGraphs(model, st, 8, 4, taps=(0, 2), capture=False)
    steps.verify(4, torch.zeros(4, 8, dtype=torch.long))  # allocates the verify scratch, as the warmup does
    steps.rollback(4, torch.zeros(4, dtype=torch.long))
    drafter = StaticDFlashDrafter(_block_drafter(model, 0), 4, 40)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for b in (1, 3):
            logits, hidden = steps.verify(b, torch.zeros(b, 8, dtype=torch.long))
            assert logits.shape == (b, 8, CFG.vocab_size) and set(hidden) == {0, 2}
            steps.rollback(b, torch.zeros(b, dtype=torch.long))
            assert drafter._step(b).shape == (b, 7, CFG.vocab_size)


def test_narrowed_state_shares_storage_and_batch_limits(model: TargetModel) -> None:
    st = model.new_state(3, 40)
    sub = st.narrow(2)
    assert sub.lengths.data_ptr() == st.lengths.data_ptr() and sub.batch == 2
    model(torch.zeros(2, 5, dtype=torch.long), sub)
    assert st.lengths.tolist() == [5, 5, 0]
    assert torch.equal(st.k[1][:2], sub.k[1]) and not bool(st.k[1][2].any())
    with pytest.raises(ValueError, match="narrow"):
        st.narrow(4)
    steps = DecodeGraphs(model, model.new_state(3, 40), 8, 2, capture=False)
    with pytest.raises(ValueError, match="captured maximum of 2"):
        steps.verify(3, torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, model.new_state(2, 40), 8, 2, capture=True)
    with pytest.raises(ValueError, match="max_batch"):
        DecodeGraphs(model, model.new_state(2, 40), 8, 3, capture=False)


def test_eager_steps_equal_a_plain_armed_forward(model: TargetModel, tmp_path: Path) -> None:
    # The graph steps on slots [0, b) are the ordinary forward + rollback on a narrowed state.
    toks = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    a, b = model.new_state(4, 40), model.new_state(2, 40)
    steps = DecodeGraphs(model, a, 8, 4, capture=False)
    got, _ = steps.verify(2, toks)
    b.checkpoint(8)
    ref = model(toks, b)
    assert torch.equal(got, ref)
    steps.rollback(2, torch.tensor([3, 8]))
    b.rollback(torch.tensor([3, 8]))
    assert a.lengths.tolist() == [3, 8, 0, 0]
    for i in b.ssm:
        assert torch.equal(a.ssm[i][:2], b.ssm[i]) and torch.equal(a.conv[i][:2], b.conv[i])


def test_invariant_table_and_fixed_shape_linear() -> None:
    from dflashgen.runtime.invariance import ANY_M, FixedShapeLinear, invariant_table
    from dflashgen.runtime.table import TuningTable

    src = Path(__file__).parents[1] / "tuning" / "nvidia-h200.json"
    table = TuningTable.load(src)
    inv = invariant_table(table)
    for key in table.problems():
        kernels = {b["kernel"] for b in table.problems()[key]["buckets"] if b["path"] == "kernel"}
        for m in (1, 8, 16, 24, 32, 64, 1023, 8184):
            got = inv.lookup(key, m)
            if kernels:
                assert got.path == "kernel" and got.kernel in kernels, (key, m)
            else:
                assert got.path == "fallback"
    assert inv.lookup(next(iter(table.problems())), ANY_M + 1).path == "fallback"  # beyond: unchanged rule
    lin = torch.nn.Linear(16, 5, bias=False)
    fixed = FixedShapeLinear(lin, rows=4)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(fixed(x), lin(x))
    assert fixed(x[:1, :3]).shape == (1, 3, 5) and fixed.weight is lin.weight
