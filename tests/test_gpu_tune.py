"""GPU: a tuned run on a reduced shape set, then the runtime reproduces the table's dispatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

SMALL = Path(__file__).parent / "data" / "targets-small.yaml"


def test_tuned_table_drives_dispatch(tmp_path: Path) -> None:
    from dflashgen.runtime.library import KernelLibrary
    from dflashgen.runtime.table import TuningTable

    from dflashgen.tune import run
    from dflashgen.verify import random_nvfp4
    from dflashgen.weights import reference_gemm, rel_l2

    # the fused GDN in_proj_qkvzba TP4 shard: q|k|v|z (4096 rows, one global scale) + b|a (24 rows)
    out = run(SMALL, tmp_path / "t.json", only="nvfp4/store/n4120/", ms=(8, 16, 64), progress=False)
    table = TuningTable.load(out)
    key, prob = next(iter(table.problems().items()))
    lib = KernelLibrary(table=table)
    dev = lib.device
    n, k = 4120, 5120
    w = random_nvfp4(n, k, (4096, 24), dev, torch.Generator(device=dev).manual_seed(0))
    packed = lib.pack(w)
    assert lib.key(packed) == key
    for bucket in prob["buckets"]:
        for m in (bucket["m"], max(1, bucket["m"] - 3)):
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            y = lib.gemm(x, packed)
            assert rel_l2(y, reference_gemm(x, w)) < 1e-3
            choice = lib.choose(packed, m)
            assert choice.path == table.lookup(key, m).path
            assert lib.path_counts[(key, m, choice.path)] >= 1
            if choice.path == "kernel":
                assert choice.kernel in lib.image_sources
