"""Grouped verification attention kernels on a GPU: the native build (sm_90 on the H200) and the sm_70
build's compute_70 PTX (JIT-compiled by the driver) against an FP32 reference, over B in {1, 2, 4, 8},
ragged contexts from 1 to 32K, separate / interleaved pools, FP16 / E5M2 / E4M3 KV, pages 4 and 16;
bitwise batch invariance; CUDA-graph replay with new lengths and tables; device-side error flags;
the target model's dense-cache path; the length-adaptive split rule (lengths on both sides of each
threshold: accuracy, bitwise invariance, graph replay across a threshold, long requests unchanged); the
grid order (split index slowest, sized for the table's capacity) vs per-request launches.

Tests parametrized by `kind` run the served schedule ("served") and the sm_90a warpgroup-MMA kernel
("wg" / "wg4" / "wg2": the wg: 1 candidates with the served split rule: t32 stages 2 (in-order loop) /
4 (FA3's overlapped loop) / two warpgroups (kvg 2, t16 st4); page 16, FP16 (and FP8 for wg, wg4) KV;
skipped elsewhere) through the same checks; their accuracy bound is rel. L2 <= 1e-3 with FP16 KV.
"tma": the wg kernel's TMA variant (tma: 1, K/V by cp.async.bulk.tensor from a producer warp; the
candidate with the most stages), FP16 KV and page 16 only; test_tma_candidates_equal_their_cp_async_twins
checks every tma candidate bitwise against its cp.async twin (written before any GPU run)."""

from __future__ import annotations

import math

import pytest
import torch
from dflashgen.runtime.attention_kernel import (
    AttentionInputError,
    dense_verify_attention,
    device_errors,
    entry_rule,
    kernel_arch,
    paged_verify_attention,
    select_kernel,
)

pytestmark = pytest.mark.gpu

HEADS = [(24, 4), (6, 1)]
DTYPES = [torch.float16, torch.float8_e5m2, torch.float8_e4m3fn]
CONTEXTS = {1: [32760], 2: [1, 5000], 4: [7, 16, 1000, 16384], 8: [1, 2, 15, 64, 255, 511, 2049, 9000]}
# wg: the in-order loop (t32 st2); wg4: FA3's overlapped loop (t32 st4); wg2: two warpgroups (t16 st4 kvg2)
KINDS = ["served", "wg", "wg4", "wg2", "tma"]
WG_REL = 1e-3  # rel. L2 bound of the wgmma kernel vs the FP32 reference


def _archs() -> list[int]:
    if not torch.cuda.is_available():
        return [90]
    major, _ = torch.cuda.get_device_capability()
    return [90 if major >= 9 else 80 if major >= 8 else 70] + ([70] if major >= 8 else [])


def _kernel(kind: str, arch: int, hq: int, hkv: int, dtype: torch.dtype = torch.float16, page: int = 16) -> str | None:
    """The kernel name a test runs: None (the served schedule) or the wg candidate with the served rule
    ("wg": t32 stages 2, "wg4": t32 with the most stages, "wg2": two warpgroups (kvg 2), "tma": the TMA
    variant (tma: 1) with the most stages)."""
    if kind == "served":
        return None
    if arch != 90 or (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9):
        pytest.skip("the wgmma kernel runs on sm_90a only")
    if page != 16:
        pytest.skip("the wgmma kernels are built for 16-token pages")
    from dflashgen.runtime.attention_kernel import KV_TAG, attention_entries

    kv = KV_TAG[dtype]
    served = select_kernel(90, hq, hkv, 256, kv, 16)
    found = sorted((e for e in attention_entries() if e.get("wg") and (e["kvg"] == 2) == (kind == "wg2")
                    and bool(e.get("tma")) == (kind == "tma") and e["arch"] == 90 and e["hq"] == hq
                    and e["hkv"] == hkv and e["kv"] == kv and e["page"] == 16 and e["split"] == served["split"]
                    and e.get("short") == served.get("short")),
                   key=lambda e: (e["tile"] != 32, e["stages"] if kind not in ("wg4", "tma") else -e["stages"],
                                  e["name"]))
    if not found and kv != "fp16":
        pytest.skip(f"no {kind} candidate for {kv} KV")
    assert found, f"no {kind} candidate with the served split rule for {hq}/{hkv} heads, {kv} KV"
    return found[0]["name"]


class Case:
    """Random paged KV for a batch: blocks dealt in a random order, spare table columns of -1."""

    def __init__(self, contexts: list[int], hq: int, hkv: int, dtype: torch.dtype, page: int, interleaved: bool,
                 nq: int = 8, seed: int = 0, d: int = 256) -> None:
        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(seed)
        self.lengths_list = [c + nq for c in contexts]
        need = [-(-n // page) for n in self.lengths_list]
        nblocks = sum(need) + 3
        self.k_scale, self.v_scale = (0.05, 0.02) if dtype != torch.float16 else (1.0, 1.0)
        shape = (nblocks, page, hkv, d)

        def fill(scale: float, mult: float) -> torch.Tensor:
            x = torch.randn(shape, device=dev, generator=g) * mult / scale
            if dtype != torch.float16:
                x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
            return x.to(dtype)

        if interleaved:  # copy_ (not stack/cat): works for every FP8 dtype
            self.kv = torch.empty((nblocks, 2, *shape[1:]), dtype=dtype, device=dev)
            self.kv[:, 0].copy_(fill(self.k_scale, 2.0))
            self.kv[:, 1].copy_(fill(self.v_scale, 1.0))
            self.k_pool, self.v_pool = self.kv[:, 0], self.kv[:, 1]
        else:
            self.k_pool, self.v_pool = fill(self.k_scale, 2.0), fill(self.v_scale, 1.0)
        perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed)).tolist()
        width = max(need) + 2
        table = torch.full((len(contexts), width), -1, dtype=torch.int32)
        for b, n in enumerate(need):
            table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        self.table = table.to(dev)
        self.lengths = torch.tensor(self.lengths_list, dtype=torch.int32, device=dev)
        self.q = torch.randn(len(contexts), nq, hq, d, device=dev, generator=g).half()
        self.page = page

    def run(self, **kw) -> torch.Tensor:
        return paged_verify_attention(self.q, self.k_pool, self.v_pool, self.table, self.lengths,
                                      k_scale=self.k_scale, v_scale=self.v_scale, **kw)

    def gathered(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.lengths_list[b]
        ids = self.table[b, : -(-n // self.page)].long()

        def pages(pool: torch.Tensor, scale: float) -> torch.Tensor:
            raw = pool.view(torch.uint8)[ids] if pool.element_size() == 1 else pool[ids]  # FP8 gathered as bytes
            return raw.view(pool.dtype).reshape(-1, *pool.shape[2:])[:n].float() * scale

        return pages(self.k_pool, self.k_scale), pages(self.v_pool, self.v_scale)

    def reference(self) -> torch.Tensor:
        """FP32 softmax attention per request over its dequantised keys (GQA without expansion)."""
        nb, nq, hq, d = self.q.shape
        hkv = self.k_pool.shape[2]
        out = torch.empty(nb, nq, hq, d, device=self.q.device)
        for b in range(nb):
            k, v = self.gathered(b)
            n = k.shape[0]
            qb = self.q[b].float().view(nq, hkv, hq // hkv, d)
            s = torch.einsum("qhgd,lhd->hgql", qb, k) / math.sqrt(d)
            vis = torch.arange(n, device=s.device)[None, :] <= (n - nq + torch.arange(nq, device=s.device))[:, None]
            p = torch.softmax(s.masked_fill(~vis, -math.inf), dim=-1)
            out[b] = torch.einsum("hgql,lhd->qhgd", p, v).reshape(nq, hq, d)
        return out

    def check(self, got: torch.Tensor, rel_tol: float = 3e-3) -> None:
        ref = self.reference()
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert torch.isfinite(got).all()
        vmax = max(float(self.gathered(b)[1].abs().max()) for b in range(len(self.lengths_list)))
        err = (got - ref).abs().max().item()
        assert err <= 4e-3 * vmax, f"max abs error {err:.3e} (max |V| {vmax:.2f})"
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel <= rel_tol, f"rel. L2 error {rel:.3e}"


@pytest.mark.parametrize("arch", _archs())
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "e5m2", "e4m3"])
@pytest.mark.parametrize("page,interleaved", [(16, False), (4, True), (4, False), (16, True)])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_fp32_reference(arch, hq, hkv, dtype, page, interleaved, kind) -> None:
    k = _kernel(kind, arch, hq, hkv, dtype, page)
    for nb, ctx in CONTEXTS.items():
        if (page == 4) != (nb % 4 == 0) and dtype != torch.float16:
            continue  # FP8 x every layout x every batch is redundant: each batch size meets each page once
        case = Case(ctx, hq, hkv, dtype, page, interleaved, seed=nb)
        out = torch.full(case.q.shape, math.nan, device="cuda")  # poisoned: every row must be written
        case.run(arch=arch, out=out, kernel=k)
        case.check(out, WG_REL if k and dtype == torch.float16 else 3e-3)


@pytest.mark.parametrize("arch", _archs())
@pytest.mark.parametrize("nq", [1, 3, 7])
@pytest.mark.parametrize("kind", KINDS)
def test_fewer_query_rows(arch, nq, kind) -> None:
    k = _kernel(kind, arch, 24, 4)
    case = Case([0, 1, 700], 24, 4, torch.float16, 16, False, nq=nq, seed=nq)
    case.check(case.run(arch=arch, kernel=k), WG_REL if k else 3e-3)


@pytest.mark.parametrize("arch", _archs())
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_batch_invariance_is_bitwise(arch, hq, hkv, kind) -> None:
    """Request 0 alone == request 0 at any position of batches of other lengths and sizes."""
    k = _kernel(kind, arch, hq, hkv)
    case = Case([3000, 1, 40000 - 8, 17, 513, 6000, 255, 9], hq, hkv, torch.float16, 16, False, seed=11)
    alone = paged_verify_attention(case.q[:1], case.k_pool, case.v_pool, case.table[:1], case.lengths[:1],
                                   arch=arch, kernel=k)[0]
    for idx in ([0, 1], [2, 0, 3], [4, 5, 6, 0], [1, 2, 3, 4, 5, 6, 7, 0], [0, 0]):
        sel = torch.tensor(idx, device="cuda")
        got = paged_verify_attention(case.q[sel], case.k_pool, case.v_pool, case.table[sel], case.lengths[sel],
                                     arch=arch, kernel=k)
        for pos in [i for i, r in enumerate(idx) if r == 0]:
            assert torch.equal(got[pos], alone), f"batch {idx}: request 0 at {pos} differs"


@pytest.mark.parametrize("arch", _archs())
@pytest.mark.parametrize("kind", KINDS)
def test_graph_replay_with_new_lengths_and_tables(arch, kind) -> None:
    k = _kernel(kind, arch, 24, 4)
    case = Case([100, 4000, 30, 2048], 24, 4, torch.float16, 16, False, seed=5)
    table, lengths = case.table.clone(), case.lengths.clone()
    q = case.q.clone()
    paged_verify_attention(q, case.k_pool, case.v_pool, table, lengths, arch=arch, kernel=k)  # load + warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_verify_attention(q, case.k_pool, case.v_pool, table, lengths, arch=arch, kernel=k)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, case.run(arch=arch, kernel=k))
    # New lengths (shorter and longer) and a permuted table: same graph.
    other = Case([3000, 8, 2500, 90], 24, 4, torch.float16, 16, False, seed=6)
    other.k_pool, other.v_pool = case.k_pool, case.v_pool
    perm = torch.tensor([2, 0, 3, 1], device="cuda")
    other.table = case.table[perm].clone()
    lens = [case.lengths_list[int(i)] for i in perm.tolist()]
    other.lengths_list = [min(n, x) for n, x in zip(lens, [3000, 8, 2500, 90], strict=True)]
    other.lengths = torch.tensor(other.lengths_list, dtype=torch.int32, device="cuda")
    table.copy_(other.table)
    lengths.copy_(other.lengths)
    q.copy_(other.q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, other.run(arch=arch, kernel=k))
    other.check(out, WG_REL if k else 3e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_raise_or_flag(kind) -> None:
    k = _kernel(kind, kernel_arch(torch.device("cuda")), 6, 1)
    case = Case([40, 70], 6, 1, torch.float16, 16, False)
    bad = case.table.clone()
    bad[1, 2] = case.k_pool.shape[0]  # out of range
    with pytest.raises(AttentionInputError, match="request 1: page table entry 2"):
        paged_verify_attention(case.q, case.k_pool, case.v_pool, bad, case.lengths)
    too_long = torch.tensor([40, 10_000], dtype=torch.int32, device="cuda")
    with pytest.raises(AttentionInputError, match="exceeds the block table's capacity"):
        paged_verify_attention(case.q, case.k_pool, case.v_pool, case.table, too_long)
    with pytest.raises(AttentionInputError, match="no sm_.. attention kernel for 12 query"):
        paged_verify_attention(torch.zeros(2, 8, 12, 256, device="cuda"), case.k_pool, case.v_pool, case.table,
                               case.lengths)
    device_errors()
    paged_verify_attention(case.q, case.k_pool, case.v_pool, bad, case.lengths, validate=False, kernel=k)
    assert device_errors() == ["a block table entry out of range"]
    out = paged_verify_attention(case.q, case.k_pool, case.v_pool, case.table, too_long, validate=False, kernel=k)
    assert device_errors() == ["a length below the query rows or beyond the block table"]
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()  # only the bad request is poisoned


@pytest.mark.parametrize("t", [8, 3, 20])
def test_target_dense_cache_path(t) -> None:
    """The target model's contiguous caches (DecodeState) through the kernel == TargetModel._attend."""
    from dflashgen.runtime.target import TargetModel

    g = torch.Generator(device="cuda").manual_seed(t)
    b, max_len, hkv, hq, d = 3, 4096, 4, 24, 256
    kc = torch.randn(b, max_len, hkv, d, device="cuda", generator=g).half()
    vc = torch.randn(b, max_len, hkv, d, device="cuda", generator=g).half()
    n_vis = torch.tensor([t, 100 + t, 3000], device="cuda")
    q = torch.randn(b, t, hq, d, device="cuda", generator=g)
    got = dense_verify_attention(q, kc, vc, n_vis)
    assert got is not None
    pos = n_vis[:, None] - t + torch.arange(t, device="cuda")  # query t of request b at n_vis[b] - T + t
    ref = TargetModel._attend(q.half().float(), kc, vc, pos)  # the capturable FP32 reference
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-2)


def test_benchmark_schedules_match_too() -> None:
    """The non-default schedules `dflashgen attn-bench` races are correct as well (and the wg kernels'
    FP8 builds)."""
    from dflashgen.runtime.attention_kernel import KV_TAG, attention_entries, kernel_arch

    arch = kernel_arch(torch.device("cuda"))
    dtype_of = {tag: dt for dt, tag in KV_TAG.items()}
    extra = [e for e in attention_entries() if e["arch"] == arch and not e["default"]]
    for e in extra:
        case = Case([1000, 5000, 1], e["hq"], e["hkv"], dtype_of[e["kv"]], e["page"], False, seed=3)
        case.check(case.run(kernel=e["name"]))


def test_schedules_differing_only_in_work_placement_agree_bitwise() -> None:
    """Stages, row parts (hs) and the D split (ds) only move the same per-element arithmetic between
    pipeline slots, CTAs and warps: all schedules with one (tile, token groups, split) give equal bits,
    with nq = 8 and nq = 3 rows, over contexts that end mid-tile and mid-split."""
    from dflashgen.runtime.attention_kernel import attention_entries, kernel_arch

    arch = kernel_arch(torch.device("cuda"))
    groups: dict[tuple, list[dict]] = {}
    for e in attention_entries():
        if e["arch"] == arch and e["kv"] == "fp16" and e["page"] == 16:
            key = (e["hq"], e["hkv"], e["tile"], e["kvg"], e["split"], tuple(map(tuple, e.get("short", ()))),
                   e.get("wg", 0))  # the wgmma kernel's arithmetic differs; its stages do not change it
            groups.setdefault(key, []).append(e)
    checked = 0
    for (hq, hkv, *_), es in sorted(groups.items()):
        if len(es) < 2:
            continue
        for nq in (8, 3):
            case = Case([1000, 5000, 1, 130], hq, hkv, torch.float16, 16, False, nq=nq, seed=7)
            ref = case.run(kernel=es[0]["name"])
            for e in es[1:]:  # (same split rule: the group key includes it)
                assert torch.equal(case.run(kernel=e["name"]), ref), f"{e['name']} != {es[0]['name']}"
                checked += 1
    assert checked > 0


# --- the length-adaptive split rule: a request's split size from its own length ----------------------

def _served(arch: int, hq: int, hkv: int) -> dict:
    return select_kernel(arch, hq, hkv, 256, "fp16", 16)


def _edges(arch: int, hq: int, hkv: int) -> list[int]:
    """Cached lengths (incl. the 8 verify rows) at, just below and just above each tier's threshold."""
    rule = entry_rule(_served(arch, hq, hkv))
    assert rule.tiers, "the served schedules carry a split rule (schedules/attention.yaml short_splits)"
    return sorted({n for lim, _ in rule.tiers for n in (lim - 1, lim, lim + 1)})


@pytest.mark.parametrize("arch", _archs())
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_split_rule_thresholds_match_fp32_reference(arch, hq, hkv, kind) -> None:
    """Every tier edge, in one ragged batch with a long request, against the FP32 reference."""
    k = _kernel(kind, arch, hq, hkv)
    lens = _edges(arch, hq, hkv)
    case = Case([n - 8 for n in lens] + [20000, 9], hq, hkv, torch.float16, 16, False, seed=21)
    out = torch.full(case.q.shape, math.nan, device="cuda")
    case.run(arch=arch, out=out, kernel=k)
    case.check(out, WG_REL if k else 3e-3)


@pytest.mark.parametrize("arch", _archs())
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_split_rule_batch_invariance_across_thresholds(arch, hq, hkv, kind) -> None:
    """Requests right at, below and above each threshold: each one's output alone == inside batches of
    the others (different split sizes, split counts and B), bitwise."""
    k = _kernel(kind, arch, hq, hkv)
    lens = _edges(arch, hq, hkv) + [17, 12000]
    case = Case([n - 8 for n in lens], hq, hkv, torch.float16, 16, False, seed=22)

    def run(idx: list[int]) -> torch.Tensor:
        sel = torch.tensor(idx, device="cuda")
        return paged_verify_attention(case.q[sel], case.k_pool, case.v_pool, case.table[sel], case.lengths[sel],
                                      arch=arch, kernel=k)

    alone = [run([r])[0] for r in range(len(lens))]
    n = len(lens)
    for idx in (list(range(n)), list(range(n))[::-1], [n - 1, 0], [1, n - 2, 2, 2], list(range(1, n, 2))):
        got = run(idx)
        for pos, r in enumerate(idx):
            assert torch.equal(got[pos], alone[r]), f"batch {idx}: request {r} (length {lens[r]}) at {pos} differs"


@pytest.mark.parametrize("arch", _archs())
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_split_rule_graph_replay_across_thresholds(arch, hq, hkv, kind) -> None:
    """A graph captured with every request below the first threshold replays with lengths moved across
    the thresholds (more splits than at capture, fewer, the long split): the grid is sized for the
    table's capacity, the split sizes are read from the device lengths."""
    k = _kernel(kind, arch, hq, hkv)
    rule = entry_rule(_served(arch, hq, hkv))
    first, last = rule.tiers[0][0], rule.tiers[-1][0]
    case = Case([last + 3000] * 4, hq, hkv, torch.float16, 16, False, seed=23)  # capacity past every tier
    table, lengths, q = case.table.clone(), case.lengths.clone(), case.q.clone()
    lengths.copy_(torch.tensor([first - 8, 40, first, 9], dtype=torch.int32))
    paged_verify_attention(q, case.k_pool, case.v_pool, table, lengths, arch=arch, kernel=k)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_verify_attention(q, case.k_pool, case.v_pool, table, lengths, arch=arch, kernel=k)
    for new in ([first - 8, 40, first, 9], [first + 1, last, last + 1, first], [last + 3008, 8, first + 1, last - 1]):
        case.lengths_list = new
        case.lengths = torch.tensor(new, dtype=torch.int32, device="cuda")
        lengths.copy_(case.lengths)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, case.run(arch=arch, kernel=k)), new
        case.check(out, WG_REL if k else 3e-3)


def test_split_rule_leaves_long_requests_unchanged() -> None:
    """Past the last tier the served kernel is the fixed-split kernel of the same tile, token groups and
    split (raced as the no-rule candidate): bitwise equal at 16K-32K, so long contexts keep their bits."""
    from dflashgen.runtime.attention_kernel import attention_entries

    arch = kernel_arch(torch.device("cuda"))
    for hq, hkv in HEADS:
        served = _served(arch, hq, hkv)
        # the twin runs the same arithmetic: same kernel (wgmma or mma.sync), tile, token groups, split
        fixed = [e for e in attention_entries() if not e.get("short") and e.get("wg", 0) == served.get("wg", 0)
                 and (e["arch"], e["hq"], e["hkv"], e["kv"], e["page"], e["tile"], e["kvg"], e["split"])
                 == (arch, hq, hkv, "fp16", 16, served["tile"], served["kvg"], served["split"])]
        assert fixed, f"no fixed-split twin of {served['name']} in the race"
        last = entry_rule(served).tiers[-1][0]
        case = Case([16384, last + 1 - 8, 32760], hq, hkv, torch.float16, 16, False, seed=24)
        assert torch.equal(case.run(kernel=served["name"]), case.run(kernel=fixed[0]["name"]))


# --- the grid order (split index slowest) and the page ids loaded with the length --------------------

@pytest.mark.parametrize("arch", _archs())
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("kind", KINDS)
def test_wide_table_ragged_batch_matches_per_request_launches(arch, hq, hkv, kind) -> None:
    """The grid is sized for the table's capacity (here 40K tokens, so most CTAs exit) with the split
    index slowest: a ragged batch with lengths on both sides of every threshold (and at 16K, 32K) ==
    each request launched alone with a table of just its own pages (a different grid, split count
    and workspace layout), bitwise, B = 1..8; unused table entries hold garbage ids (the kernel reads
    the split's page ids for every split size before the length is known: only those used are checked)."""
    k = _kernel(kind, arch, hq, hkv)
    lens = _edges(arch, hq, hkv) + [17, 16392, 32776]
    case = Case([n - 8 for n in lens] + [40000 - 8], hq, hkv, torch.float16, 16, False, seed=25)
    nblocks = case.k_pool.shape[0]
    need = [-(-n // 16) for n in case.lengths_list]
    wide = case.table.clone()
    for b, n in enumerate(need):  # past each request's pages: out-of-range ids, never read for K/V
        wide[b, n:] = torch.arange(wide.shape[1] - n, device="cuda", dtype=torch.int32) % 3 * (nblocks + 5) - 1
    device_errors()  # clear
    alone = []
    for b, n in enumerate(need):
        tight = case.table[b:b + 1, :n].contiguous()
        alone.append(paged_verify_attention(case.q[b:b + 1], case.k_pool, case.v_pool, tight, case.lengths[b:b + 1],
                                            arch=arch, validate=False, kernel=k)[0])
    assert device_errors() == []
    r = len(lens)  # the 40K request stays in the table (its capacity) but out of most batches
    batches = [list(range(r)), list(range(r))[::-1][:8], [r - 1, 0, r - 2, 1], [r - 3], [0, r, 2], [r]]
    for idx in batches:
        for start in range(0, len(idx), 8):
            sel = torch.tensor(idx[start:start + 8], device="cuda")
            got = paged_verify_attention(case.q[sel], case.k_pool, case.v_pool, wide[sel], case.lengths[sel],
                                         arch=arch, validate=False, kernel=k)
            assert device_errors() == [], idx
            for pos, b in enumerate(idx[start:start + 8]):
                assert torch.equal(got[pos], alone[b]), f"batch {idx}: request {b} (length {case.lengths_list[b]})"
    case.check(paged_verify_attention(case.q, case.k_pool, case.v_pool, wide, case.lengths, arch=arch,
                                      validate=False, kernel=k), WG_REL if k else 3e-3)


# --- the TMA variant (tma: 1): only the copy mechanism differs from the cp.async wg kernel -------------

TMA_CONTEXTS = {1: [32755], 2: [1, 5000], 4: [7, 16, 1000, 16384], 8: [1, 2, 15, 64, 255, 511, 2049, 30001]}


def _tma_pairs(hq: int, hkv: int) -> list[tuple[str, str]]:
    """(tma candidate, its cp.async twin): same tile, token groups and split rule (so the same
    arithmetic), the twin with the same stages where one is built."""
    from dflashgen.runtime.attention_kernel import attention_entries

    if kernel_arch(torch.device("cuda")) != 90 or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernels run on sm_90a only")
    es = [e for e in attention_entries() if e["arch"] == 90 and (e["hq"], e["hkv"]) == (hq, hkv) and e.get("wg")]
    pairs = []
    for t in (e for e in es if e.get("tma")):
        twins = sorted((e for e in es if not e.get("tma") and (e["tile"], e["kvg"], e["split"], e.get("short"),
                        e["kv"], e["page"]) == (t["tile"], t["kvg"], t["split"], t.get("short"), t["kv"], t["page"])),
                       key=lambda e: (e["stages"] != t["stages"], e["name"]))
        assert twins, f"no cp.async twin of {t['name']}"
        pairs.append((t["name"], twins[0]["name"]))
    assert pairs, f"no tma candidates for {hq}/{hkv} heads"
    return pairs


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_tma_candidates_equal_their_cp_async_twins(hq, hkv, interleaved) -> None:
    """Every tma: 1 candidate == its cp.async twin, bitwise, over B in {1, 2, 4, 8} with ragged contexts
    up to 32K (ending mid-page, mid-tile, mid-split), nq 8 and 3, separate / interleaved pools; and
    within the wg accuracy bound of the FP32 reference. Then a bad page id: the same error flag, the
    same (zero-page) output as the twin, no out-of-bounds read."""
    for tma, twin in _tma_pairs(hq, hkv):
        for nb, ctx in TMA_CONTEXTS.items():
            for nq in (8, 3):
                case = Case(ctx, hq, hkv, torch.float16, 16, interleaved, nq=nq, seed=100 + nb + nq)
                out = torch.full(case.q.shape, math.nan, device="cuda")  # every row must be written
                case.run(out=out, kernel=tma)
                ref = case.run(kernel=twin)
                assert torch.equal(out, ref), f"{tma} != {twin} at B{nb} {ctx} nq {nq}"
                if nq == 8:
                    case.check(out, WG_REL)
        case = Case([40, 70, 3000], hq, hkv, torch.float16, 16, interleaved, seed=7)
        bad = case.table.clone()
        bad[1, 2] = case.k_pool.shape[0]  # out of range: flagged, read as a zero page
        bad[2, 100] = -5
        device_errors()
        got = paged_verify_attention(case.q, case.k_pool, case.v_pool, bad, case.lengths, validate=False, kernel=tma)
        assert device_errors() == ["a block table entry out of range"]
        want = paged_verify_attention(case.q, case.k_pool, case.v_pool, bad, case.lengths, validate=False,
                                      kernel=twin)
        device_errors()
        assert torch.equal(got, want) and torch.equal(got[0], case.run(kernel=tma)[0])


@pytest.mark.parametrize("hq,hkv", HEADS)
def test_tma_graph_replay_with_new_lengths(hq, hkv) -> None:
    """Every tma candidate in a CUDA graph (the tensor maps are kernel parameters, captured once): replays
    with lengths moved across the split tiers and to 32K == eager launches == the cp.async twin."""
    for tma, twin in _tma_pairs(hq, hkv):
        case = Case([32760] * 4, hq, hkv, torch.float16, 16, False, seed=31)
        table, lengths, q = case.table.clone(), case.lengths.clone(), case.q.clone()
        lengths.copy_(torch.tensor([100, 8, 2049, 33], dtype=torch.int32))
        paged_verify_attention(q, case.k_pool, case.v_pool, table, lengths, kernel=tma)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_verify_attention(q, case.k_pool, case.v_pool, table, lengths, kernel=tma)
        for new in ([100, 8, 2049, 33], [9000, 4097, 32768, 17], [32768, 32767, 16, 16385]):
            case.lengths_list = new
            case.lengths = torch.tensor(new, dtype=torch.int32, device="cuda")
            lengths.copy_(case.lengths)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, case.run(kernel=tma)), (tma, new)
            assert torch.equal(out, case.run(kernel=twin)), (twin, new)
        case.check(out, WG_REL)
