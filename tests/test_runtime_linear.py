"""QuantLinear on CPU (fallback path), its custom op under opcheck / torch.compile, and on a GPU the
KernelLibrary path."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from dflashgen.runtime import linear
from dflashgen.runtime.linear import QuantLinear

from dflashgen.quant import quantize_fp8_channel, quantize_nvfp4
from dflashgen.weights import FP8ChannelWeight, NVFP4Weight, reference_gemm, reference_silu_mul, rel_l2

N, K = 192, 256


def _weight(fmt: str, n: int = N, k: int = K, seed: int = 0) -> NVFP4Weight | FP8ChannelWeight:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).half()
    # NVFP4: three segments with very different ranges so a shared global scale would show.
    if fmt == "nvfp4":
        w[: n // 4] *= 8
        return quantize_nvfp4(w, (n // 4, n // 4, n // 2))
    return quantize_fp8_channel(w)


def _x(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half()


@pytest.mark.parametrize("arch", [70, 80, 90])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
def test_fallback_matches_reference(arch: int, fmt: str) -> None:
    w = _weight(fmt)
    mod = QuantLinear(w, "p", arch=arch)
    assert torch.equal(mod.dequantize(), w.dequantize())  # the prepack is lossless
    for m in (1, 8, 33):
        x = _x(m)
        y = mod(x)
        assert y.dtype == torch.float16 and y.shape == (m, N)
        assert rel_l2(y, reference_gemm(x, w)) < 1e-3
    x3 = _x(12).reshape(3, 4, K)  # leading dims are flattened and restored
    assert mod(x3).shape == (3, 4, N)
    assert torch.equal(mod(x3).reshape(12, N), mod(x3.reshape(12, K)))


@pytest.mark.parametrize("arch", [70, 90])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
def test_silu_variant(arch: int, fmt: str) -> None:
    w = _weight(fmt, n=256)
    mod = QuantLinear(w, "gate_up", silu=True, arch=arch)
    assert (mod.in_features, mod.out_features) == (K, 128)
    x = _x(16)
    assert rel_l2(mod(x), reference_silu_mul(reference_gemm(x, w))) < 1e-3
    assert torch.equal(mod.dequantize(), w.dequantize())  # logical row order (gate rows first)


def test_module_basics() -> None:
    w = _weight("nvfp4")
    mod = QuantLinear(w, "layers.0.qkv_proj")
    r = repr(mod)
    for part in ("layers.0.qkv_proj", "format=nvfp4", f"N={N}", f"K={K}", "silu=False", "sm_90", "fallback"):
        assert part in r
    assert set(dict(mod.named_buffers())) == {"weights", "scales", "col_scale_bits"}
    assert torch.equal(mod.col_scale, w.column_scale() * mod.layout.decode_scale)  # one global scale per segment
    x = _x(8)
    y = mod(x)
    mod.half()  # dtype casts must not touch the fp32 scales (stored as int32 bits)
    assert mod.col_scale.dtype == torch.float32 and torch.equal(mod(x), y)
    assert rel_l2(mod(x.float()), reference_gemm(x, w)) < 1e-6  # fp32 input: fp32 fallback matmul
    twin = copy.deepcopy(mod)
    assert twin._handle != mod._handle and torch.equal(twin(x), y)
    handle = mod._handle
    del mod
    gc.collect()
    assert handle not in linear._REGISTRY  # registry entries die with their module
    assert torch.equal(twin(x), y)
    f8 = QuantLinear(_weight("fp8_channel"), "o")
    assert f8.scales is None and f8.fmt == "fp8_channel"


def test_errors() -> None:
    w = _weight("nvfp4")
    mod = QuantLinear(w, "p")
    with pytest.raises(ValueError, match=r"p: expected a float input \[\.\.\., 256\]"):
        mod(torch.zeros(2, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="float input"):
        mod(torch.zeros(2, K, dtype=torch.int32))
    with pytest.raises(TypeError, match="NVFP4Weight or FP8ChannelWeight"):
        QuantLinear(torch.zeros(4, 4), "p")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="p: K=48 is not a multiple of 64"):
        QuantLinear(quantize_nvfp4(torch.randn(16, 48)), "p")

    class FakeLibrary:  # only .arch and .device are used off the GPU
        arch = 80
        device = torch.device("cpu")

    with pytest.raises(ValueError, match="disagrees"):
        QuantLinear(w, "p", library=FakeLibrary(), arch=70)  # type: ignore[arg-type]
    on_cpu = QuantLinear(w, "p", library=FakeLibrary())  # type: ignore[arg-type]
    assert on_cpu.layout.arch == 80 and "path=library" in repr(on_cpu)
    assert rel_l2(on_cpu(_x(4)), reference_gemm(_x(4), w)) < 1e-3  # CPU input: fallback


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_channel"])
def test_opcheck(fmt: str) -> None:
    mod = QuantLinear(_weight(fmt), "p", silu=fmt == "nvfp4")
    args = (_x(8), mod.weights, mod.scales, mod.col_scale, mod._handle)
    torch.library.opcheck(torch.ops.dflashgen.quant_linear.default, args)


class _Block(torch.nn.Module):
    """gate_up (fused SiLU) -> down, the MLP shape every layer has."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = QuantLinear(_weight("nvfp4", n=256, k=128), "gate_up", silu=True)
        self.down = QuantLinear(_weight("fp8_channel", n=128, k=128, seed=3), "down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(x)) + x


def test_torch_compile_treats_the_op_as_opaque() -> None:
    block = _Block()
    x = _x(8, 128)
    want = block(x)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        assert torch.equal(torch.compile(block, fullgraph=True, backend=record)(x), want)
        assert torch.equal(torch.compile(block, fullgraph=True, backend="aot_eager")(x), want)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count("dflashgen.quant_linear.default") == 2  # one opaque node per projection


@pytest.mark.slow
def test_torch_compile_inductor() -> None:
    block = _Block()
    x = _x(8, 128)
    with torch.no_grad():
        want = block(x)
        compiled = torch.compile(block, fullgraph=True)
        assert rel_l2(compiled(x), want) < 1e-3
        assert compiled(_x(24, 128)).shape == (24, 128)  # another M


@pytest.mark.gpu
def test_library_path_on_gpu() -> None:
    from dflashgen.runtime.library import KernelLibrary

    lib = KernelLibrary(on_mismatch="fallback")
    w = _weight("nvfp4", n=256)
    mod = QuantLinear(w, "p", library=lib).to(lib.device)
    x = _x(8).to(lib.device)
    assert rel_l2(mod(x).cpu(), reference_gemm(x.cpu(), w)) < 1e-3
    assert sum(c for (key, m, _), c in lib.path_counts.items() if m == 8 and "n256/k256" in key) == 1
    silu = QuantLinear(w, "gu", silu=True, library=lib).to(lib.device)
    compiled = torch.compile(silu, fullgraph=True)
    assert rel_l2(compiled(x).cpu(), reference_silu_mul(reference_gemm(x.cpu(), w))) < 1e-3


# -- the eager fast path (prepared launches), on CPU: a KernelLibrary whose table sends M = 8 and 16
# to a kernel, the kernel's functions and cuLaunchKernel replaced by a recorder. CPU tensors stand in
# for the kernel's device (x.get_device() == -1 on both sides).

class _Recorder:
    """cuLaunchKernel's stand-in: records (function, grid, stream, kernel arguments) per launch,
    reading the parameters through the addresses the driver would read."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[int, ...], int, list[int]]] = []
        self.shared: list[int] = []  # dynamic shared memory bytes per launch
        self.pdl: list[bool] = []  # launched through cuLaunchKernelEx with programmatic serialization
        self.prefetch: list[int] = []  # the prefetch_groups argument per launch

    def __call__(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        import ctypes

        n = 7 if fn.value == 1 else 8  # 7 pointers and M; split-K kernels (handle 2) add the tickets
        ptrs = (ctypes.c_void_p * (n + 1)).from_address(params.value)
        vals = [ctypes.c_void_p.from_address(ptrs[i]).value or 0 for i in range(n)]
        vals[1] = ctypes.c_int.from_address(ptrs[1]).value  # M
        self.prefetch.append(ctypes.c_int.from_address(ptrs[n]).value)  # the L2 prefetch groups (last)
        self.calls.append((fn.value, (gx.value, gy.value, gz.value), stream.value or 0, vals))
        self.shared.append(shared.value)
        self.pdl.append(False)
        return 0

    def ex(self, cfg_ref, fn, params, extra) -> int:
        """cuLaunchKernelEx's stand-in: the same record from the CUlaunchConfig the driver would read."""
        import ctypes

        cfg = cfg_ref._obj
        attrs = [cfg.attrs[i] for i in range(cfg.num_attrs)]
        c = ctypes.c_uint
        self(fn, *(c(g) for g in cfg.grid), *(c(b) for b in cfg.block), c(cfg.shared), ctypes.c_void_p(cfg.stream),
             params, extra)
        # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6), value 1
        self.pdl[-1] = [(a.id, a.value[0]) for a in attrs] == [(6, 1)]
        return 0


@pytest.fixture
def fake_gpu(monkeypatch):
    """(make_library, recorder): libraries on the CPU with a table sending M in (8, 16) to the
    committed sm_90 kernel for the layout, every other M to the fallback."""
    import types
    from pathlib import Path

    from dflashgen.runtime import driver, kernels, library
    from dflashgen.runtime.table import Choice

    rec = _Recorder()

    class Fn:
        def __init__(self, name: str, handle: int) -> None:
            self.name, self.handle, self._raw_handle = name, handle, handle

    monkeypatch.setattr(library, "native_arch", lambda dev: 90)
    monkeypatch.setattr(library, "machine_fingerprint", lambda dev: {})
    monkeypatch.setattr(library, "resolve", lambda entry, arch, build_dir=None:
                        types.SimpleNamespace(path=Path("/nonexistent"), source="fake"))
    monkeypatch.setattr(kernels.GemmKernel, "_function", lambda self: Fn(self.name, 2 if self.split_k > 1 else 1))
    monkeypatch.setattr(kernels, "stream_getter", lambda: (lambda index: 7))
    monkeypatch.setattr(driver, "_untyped_launch", lambda: rec)
    monkeypatch.setattr(driver, "_untyped_launch_ex", lambda: rec.ex)

    def make(fmt: str = "nvfp4", n: int = N, k: int = K, split_k: int = 1) -> library.KernelLibrary:
        lib = library.KernelLibrary(device=torch.device("cpu"), table=Path("/nonexistent"))
        base = next(e for e in lib.entries().values() if e["arch"] == 90 and e["format"] == fmt
                    and e["epilogue"] == "store" and e["tile"]["rows"] == 8 and e["kplan"]["split_k"] == split_k)
        entry = {**base, "name": f"fake_{fmt}_n{n}_k{k}", "n": n, "k": k, "n_out": n, "n_pad": n}
        lib.entries()[entry["name"]] = entry

        def lookup(key: str, m: int) -> Choice:
            if m in (8, 16):
                return Choice("kernel", entry["name"], m, "fake table")
            return Choice("fallback", None, m, "fake table")

        lib.table = types.SimpleNamespace(lookup=lookup)
        return lib

    return make, rec


def test_sm90_gemms_launch_with_programmatic_serialization(fake_gpu, monkeypatch) -> None:
    """sm_90 GEMMs (their kernels wait on griddepcontrol before touching anything but weights) go
    through cuLaunchKernelEx with programmatic stream serialization, grid / stream / arguments as
    the plain launch; DFLASHGEN_PDL=0 launches them plainly."""
    import ctypes

    from dflashgen.runtime import driver

    make, rec = fake_gpu
    n, k = 24, 5120
    for env, want in ((None, True), ("0", False)):
        if env is None:
            monkeypatch.delenv("DFLASHGEN_PDL", raising=False)
        else:
            monkeypatch.setenv("DFLASHGEN_PDL", env)
        lib = make("nvfp4", n, k, split_k=2)
        mod = QuantLinear(_weight("nvfp4", n, k), "in_proj_ba", library=lib)
        launch = mod.prepare(8)
        assert launch is not None and launch.kern.pdl is want and launch._main.pdl is want
        x = _x(8, k)
        y = mod(x)
        assert rec.pdl[-1] is want
        _, grid, stream, main = rec.calls[-1]
        assert grid == (1, launch.kern._grid_y, launch.kern.split_k) and stream == 7
        assert main[0] == x.data_ptr() and main[1] == 8 and main[5] == y.data_ptr()
        before = len(rec.calls)
        launch._main.grid[0].value, launch._main.stream.value = 5, 9  # the views write the launch config
        launch._main.launch()
        assert len(rec.calls) == before + 1 and rec.calls[-1][1][0] == 5 and rec.calls[-1][2] == 9
        assert rec.pdl[-1] is want
    # the config struct is cuda.h's CUlaunchConfig / CUlaunchAttribute byte for byte
    assert (ctypes.sizeof(driver._LaunchConfig), driver._LaunchConfig.stream.offset,
            driver._LaunchConfig.attrs.offset, driver._LaunchConfig.num_attrs.offset) == (56, 32, 40, 48)
    assert ctypes.sizeof(driver._LaunchAttribute) == 72 and driver._LaunchAttribute.value.offset == 8


def test_fast_path_launches_with_prepared_arguments(fake_gpu) -> None:
    make, rec = fake_gpu
    n, k = 24, 5120  # GDN in_proj_ba's shape at TP4, split-K: still one launch per call
    lib = make("nvfp4", n, k, split_k=2)
    mod = QuantLinear(_weight("nvfp4", n, k), "in_proj_ba", library=lib)
    assert mod.prepare(4) is None  # M = 4 goes to the fallback: nothing to prepare
    launch = mod.prepare(8)
    assert launch is not None and mod.prepare(8) is launch
    x = _x(8, k)
    y = mod(x)
    assert y.shape == (8, n) and y.dtype == torch.float16
    assert [c[0] for c in rec.calls] == [2]  # one launch: the kernel reduces its own partials
    ((_, grid, stream, main),) = rec.calls
    pw = mod.packed()
    kern = lib._kernels[launch.kern.name]
    partials, tickets = kern._workspaces[7]
    assert main == [x.data_ptr(), 8, pw.weights.data_ptr(), pw.scales.data_ptr(), pw.col_scale.data_ptr(),
                    y.data_ptr(), partials.data_ptr(), tickets.data_ptr()]
    assert stream == 7 and grid == (1, kern._grid_y, kern.split_k)
    # the stream's workspace: partials for 64 rows, a zeroed ticket counter per (row block, N tile, warp)
    assert partials.dtype == torch.float32 and partials.numel() == kern.split_k * 64 * kern.n_pad
    assert tickets.dtype == torch.int32 and tickets.numel() == 64 // kern.rows * kern._grid_y * kern.warps_n
    assert not tickets.any() and kern._spare is not None and not kern._spare[1].any()
    x2 = _x(8, k, seed=5)  # a second call writes only the new x and out
    y2 = mod(x2)
    assert rec.calls[1][3][0] == x2.data_ptr() and rec.calls[1][3][5] == y2.data_ptr()
    assert rec.calls[1][3][2:] == main[2:5] + [y2.data_ptr(), partials.data_ptr(), tickets.data_ptr()]
    assert len(kern._workspaces) == 1


def test_l2_prefetch_setting(fake_gpu, monkeypatch) -> None:
    """DFLASHGEN_L2_PREFETCH: unset, a quarter of each K worker's stream (<= 6 groups) for sm_90
    channel-FP8 kernels of <= 16 rows with >= 8 groups per worker, else off; "0" off; "1" prefetches
    whole streams of sm_90 kernels with at most L2_PREFETCH_MAX_BYTES of weights; k > 1 the first k
    groups of any; passed as the launch's last argument; bad values are named."""
    import types
    from pathlib import Path

    from dflashgen.runtime import kernels
    from dflashgen.runtime.kernels import L2_PREFETCH_MAX_BYTES, l2_prefetch_groups

    make, rec = fake_gpu
    monkeypatch.delenv("DFLASHGEN_L2_PREFETCH", raising=False)
    assert l2_prefetch_groups(90, "nvfp4", 5120, 1536) == 0
    assert l2_prefetch_groups(90, "nvfp4", 14336, 5120, 20, 8) == 0  # NVFP4: measured slower
    assert l2_prefetch_groups(90, "fp8_channel", 14336, 5120, 20, 8) == 5
    assert l2_prefetch_groups(90, "fp8_channel", 34816, 5120, 80, 16) == 6  # capped
    assert l2_prefetch_groups(90, "fp8_channel", 4120, 5120, 5, 8) == 0  # short streams: off
    assert l2_prefetch_groups(90, "fp8_channel", 34816, 5120, 80, 32) == 0  # not measured past 16 rows
    assert l2_prefetch_groups(90, "fp8_channel", 14336, 5120) == 0  # no plan given: off
    assert l2_prefetch_groups(80, "fp8_channel", 14336, 5120, 20, 8) == 0  # sm_90 only
    monkeypatch.setenv("DFLASHGEN_L2_PREFETCH", "0")
    assert l2_prefetch_groups(90, "fp8_channel", 14336, 5120, 20, 8) == 0
    # the default goes with launches of <= 16 rows only (a bound launch's last argument)
    monkeypatch.delenv("DFLASHGEN_L2_PREFETCH", raising=False)
    lib = make("fp8_channel", 14336, 5120)
    entry = next(e for e in lib.entries().values() if e["name"].startswith("fake_fp8"))
    entry = {**entry, "kplan": {**entry["kplan"], "split_k": 1, "warps_k": 1}}  # a long stream per worker
    kern = kernels.GemmKernel(entry, Path("/nonexistent"), 64, torch.device("cpu"))
    assert kern.prefetch_groups == 6
    launch = kernels.GemmLaunch(kern)
    t = torch.zeros(4)
    w = types.SimpleNamespace(weights=t, scales=None, col_scale=t)
    for m, want in ((8, 6), (16, 6), (24, 0), (64, 0)):
        launch.bind(w, m)
        assert launch._main.pack.values[-1].value == want, m
    launch.bind(w, 24, prefetch=2)  # a table's tuned depth for the bucket: at any M
    assert launch._main.pack.values[-1].value == 2 and kern.prefetch_for(8, 0) == 0
    # the library hands the bucket's tuned depth to prepared and plain launches alike
    from dflashgen.runtime.table import Choice

    lib.table = types.SimpleNamespace(lookup=lambda key, m: Choice("kernel", entry["name"], m, "fake", prefetch=3))
    mod = QuantLinear(_weight("fp8_channel", 14336, 5120), "qkv", library=lib)
    assert mod.prepare(8) is not None
    mod(_x(8, 5120))
    assert rec.prefetch[-1] == 3
    seen = {}
    monkeypatch.setattr(lib, "kernel", lambda name: lambda x, w, out, prefetch=None: seen.setdefault("pf", prefetch))
    lib.gemm(_x(16, 5120), mod.packed())
    assert seen == {"pf": 3}
    monkeypatch.setenv("DFLASHGEN_L2_PREFETCH", "5")  # set: every M, over the table's depth
    kern = kernels.GemmKernel(entry, Path("/nonexistent"), 64, torch.device("cpu"))
    launch = kernels.GemmLaunch(kern)
    launch.bind(w, 64, prefetch=2)
    assert launch._main.pack.values[-1].value == 5
    monkeypatch.setenv("DFLASHGEN_L2_PREFETCH", "1")
    assert l2_prefetch_groups(90, "nvfp4", 5120, 1536) >= 1536 // 64  # 4.4 MB: its whole streams
    assert L2_PREFETCH_MAX_BYTES < 34816 * 5120 * 9 / 16 and l2_prefetch_groups(90, "nvfp4", 34816, 5120) == 0
    assert l2_prefetch_groups(90, "fp8_channel", 24576, 1024) > 0  # 24 MiB of FP8: at the cap
    assert l2_prefetch_groups(90, "fp8_channel", 24576 + 16, 1024) == 0
    assert l2_prefetch_groups(80, "nvfp4", 5120, 1536) == 0  # sm_90 only (a no-op in older kernels)
    monkeypatch.setenv("DFLASHGEN_L2_PREFETCH", "6")
    assert l2_prefetch_groups(90, "nvfp4", 34816, 5120) == 6
    mod = QuantLinear(_weight("nvfp4", 24, 5120), "in_proj_ba", library=make("nvfp4", 24, 5120, split_k=2))
    assert mod.prepare(8) is not None  # the prepared (fast) launch: CPU tensors take it with the fake GPU
    mod(_x(8, 5120))
    assert rec.calls and rec.prefetch[-1] == 6
    monkeypatch.setenv("DFLASHGEN_L2_PREFETCH", "1")  # whole streams: clamped into the argument's 16 bits
    kern = kernels.GemmKernel({**entry, "n": 5120, "k": 1536, "n_out": 5120, "n_pad": 5120},
                              Path("/nonexistent"), 64, torch.device("cpu"))
    launch = kernels.GemmLaunch(kern)
    launch.bind(w, 8)
    assert launch._main.pack.values[-1].value == kernels.LAUNCH_PREFETCH_MASK
    for bad in ("-1", "yes"):
        monkeypatch.setenv("DFLASHGEN_L2_PREFETCH", bad)
        with pytest.raises(ValueError, match="DFLASHGEN_L2_PREFETCH must be an integer >= 0"):
            l2_prefetch_groups(90, "nvfp4", 5120, 1536)


def test_split_k_workspaces_per_stream_per_call_and_under_capture(fake_gpu, monkeypatch) -> None:
    """Split-K scratch: one (partials, tickets) pair per stream up to 64 rows, a fresh zeroed pair per
    call above; a stream first seen under CUDA graph capture gets a whole pair made outside the
    capture (the spare: nothing is allocated under capture), and without one the launch is refused
    with a clear error."""
    from dflashgen.runtime import kernels

    make, rec = fake_gpu
    n, k = 24, 5120
    lib = make("nvfp4", n, k, split_k=2)
    kern = lib.kernel(next(name for name in lib.entries() if name.startswith("fake_")))
    w = lib.pack(_weight("nvfp4", n, k))
    launch = kern.prepare(w, 8)
    launch.launch(11, 12, 7)
    first = kern._workspaces[7]
    assert rec.calls[-1][3] == [11, 8, *rec.calls[-1][3][2:5], 12, first[0].data_ptr(), first[1].data_ptr()]
    monkeypatch.setattr(kernels.GemmKernel, "_capturing", lambda self: True)  # from here on: "capturing"
    spare = kern._spare
    assert spare is not None and spare[0] is not first[0] and spare[1] is not first[1]
    launch.launch(11, 12, 8)  # a new stream under capture takes the spare pair (made eagerly)
    assert kern._workspaces[8] is spare and kern._spare is None  # and none is made now
    assert rec.calls[-1][3][6:] == [spare[0].data_ptr(), spare[1].data_ptr()]
    kern.prepare(w, 16).launch(11, 12, 8)  # same stream, another launch: the same workspace
    assert rec.calls[-1][3][6:] == [spare[0].data_ptr(), spare[1].data_ptr()]
    n_calls = len(rec.calls)
    with pytest.raises(RuntimeError, match="inside CUDA graph capture.*launch the kernel once outside capture"):
        launch.launch(11, 12, 9)  # stream 9, still capturing, no spare left
    assert len(rec.calls) == n_calls and 9 not in kern._workspaces
    monkeypatch.setattr(kernels.GemmKernel, "_capturing", lambda self: False)
    launch.launch(11, 12, 7)  # back outside capture: a new spare is made for the next capture
    assert kern._workspaces[7] is first and kern._spare is not None
    assert rec.calls[-1][3][6:] == [first[0].data_ptr(), first[1].data_ptr()]
    # above 64 rows: each call its own pair, the tickets zeroed for it; nothing is kept
    kern.max_m = 1 << 16
    big = kern.prepare(w, 80)
    kept = dict(kern._workspaces)
    for _ in range(2):
        big.launch(11, 12, 7)
        assert rec.calls[-1][3][1] == 80 and rec.calls[-1][1][0] == 10
    assert kern._workspaces == kept
    assert rec.calls[-1][3][7] not in (first[1].data_ptr(), spare[1].data_ptr())


def test_fast_path_guards_fall_back_to_the_validated_path(fake_gpu) -> None:
    make, rec = fake_gpu
    lib = make()
    w = _weight("nvfp4")
    mod = QuantLinear(w, "p", library=lib)
    launch = mod.prepare(8)
    x = _x(8)
    mod(x)
    assert len(rec.calls) == 1
    buf = torch.zeros(8 * K + 8, dtype=torch.float16)
    declined = {
        "dtype": x.float(),
        "non-contiguous": x.t().contiguous().t(),
        "misaligned": buf[1: 1 + 8 * K].view(8, K).copy_(x),
        "M not prepared": _x(9),
        "3-D": x[None],
        "subclass": torch.nn.Parameter(x, requires_grad=False),
    }
    for what, xx in declined.items():
        y = mod(xx)  # a CPU x on the validated path: the fallback, exact to the reference
        assert len(rec.calls) == 1, f"{what}: launched through the prepared launch"
        assert rel_l2(y.reshape(-1, N), reference_gemm(xx.reshape(-1, K), w)) < 1e-3, what
    launch._dev = 0  # a launch for another device declines this x
    mod(x)
    assert len(rec.calls) == 1
    launch._dev = -1
    with launch.lock:  # another thread inside the launch: this call takes the validated path
        mod(x)
    assert len(rec.calls) == 1
    mod(x)
    assert len(rec.calls) == 2
    # what the validated path rejects is still rejected, with the same errors
    with pytest.raises(ValueError, match=r"p: expected a float input \[\.\.\., 256\]"):
        mod(torch.zeros(8, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="float input"):
        mod(torch.zeros(8, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="float input"):
        mod(torch.zeros(8, K + 64, dtype=torch.float16))


def test_fast_path_follows_replaced_buffers(fake_gpu) -> None:
    make, rec = fake_gpu
    lib = make()
    mod = QuantLinear(_weight("nvfp4"), "p", library=lib)
    other = QuantLinear(_weight("nvfp4", seed=7), "p", library=lib)
    x = _x(8)
    old = mod.prepare(8)
    mod.load_state_dict(other.state_dict())  # in place (copy_): same buffers, same launch
    assert mod.prepare(8) is old
    mod(x)
    assert rec.calls[-1][3][2] == mod.weights.data_ptr()
    fresh = {k_: v.clone() for k_, v in other.state_dict().items()}
    mod.load_state_dict(fresh, assign=True)  # new buffer objects: the launch is rebuilt for them
    assert mod.weights is fresh["weights"]
    n_calls = len(rec.calls)
    mod(x)  # no prepared launch for the new buffers yet: the validated path (the CPU fallback)
    assert len(rec.calls) == n_calls
    new = mod.prepare(8)
    assert new is not old
    mod(x)
    assert rec.calls[-1][3][2:5] == [fresh["weights"].data_ptr(), fresh["scales"].data_ptr(),
                                     fresh["col_scale_bits"].data_ptr()]
    mod.scales = mod.scales.clone()  # one buffer replaced by assignment
    assert mod.prepare(8) is not new
    mod.to("cpu")  # .to() drops the prepared launches at once (the old buffers are not kept alive)
    assert mod._ops is None
    mod.prepare(8)
    assert mod.__getstate__()["_ops"] is None  # copies and pickles get none (locks, ctypes storage)


def test_fast_path_any_leading_dims(fake_gpu) -> None:
    make, rec = fake_gpu
    lib = make()
    w = _weight("nvfp4")
    mod = QuantLinear(w, "p", library=lib)
    launch = mod.prepare(2, 4)  # [B, T, K] as the decode loop passes it: M = 8 rows
    assert launch is not None and launch.m == 8 and mod.prepare(8) is not launch
    x = _x(8).reshape(2, 4, K)
    y = mod(x)
    assert y.shape == (2, 4, N) and rec.calls[-1][3][:2] == [x.data_ptr(), 8]
    assert rec.calls[-1][3][5] == y.data_ptr() and launch.calls[0] == 1
    assert mod.prepare(3, 4) is None and mod.prepare(1, 1) is None  # M = 12, 1: the fallback
    n_calls = len(rec.calls)
    y = mod(_x(12).reshape(3, 4, K))
    assert y.shape == (3, 4, N) and len(rec.calls) == n_calls


def test_fast_path_calls_are_counted(fake_gpu) -> None:
    make, rec = fake_gpu
    lib = make()
    mod = QuantLinear(_weight("nvfp4"), "p", library=lib)
    mod.prepare(8)
    mod.prepare(16)
    for _ in range(3):
        mod(_x(8))
    mod(_x(16))
    key = lib.key(mod.packed())
    assert lib.path_counts[(key, 8, "kernel")] == 3 and lib.path_counts[(key, 16, "kernel")] == 1
    del mod
    gc.collect()
    assert lib.path_counts[(key, 8, "kernel")] == 3  # a dead module's calls still count
    mod2 = QuantLinear(_weight("nvfp4"), "p", library=lib)
    mod2.prepare(8)
    mod2(_x(8))
    assert lib.path_counts[(key, 8, "kernel")] == 4


def test_fast_path_is_thread_safe(fake_gpu) -> None:
    import threading

    make, rec = fake_gpu
    lib = make()
    mod = QuantLinear(_weight("nvfp4"), "p", library=lib)
    mod.prepare(8)
    seen: list[tuple[int, int]] = []

    def worker(seed: int) -> None:
        x = _x(8, seed=seed)
        for _ in range(200):
            y = mod(x)
            seen.append((x.data_ptr(), y.data_ptr()))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    launched = {(c[3][0], c[3][5]) for c in rec.calls}
    # every launch carried one call's own x and out (never another thread's half-written pair);
    # calls that found the launch busy took the validated path instead
    assert len(seen) == 800 and launched <= set(seen)
    assert lib.path_counts[(lib.key(mod.packed()), 8, "kernel")] == len(rec.calls)


def test_overhead_table_keeps_the_cited_keys() -> None:
    import json
    from pathlib import Path

    from dflashgen.overhead import TABLE, markdown

    old = json.loads(Path(__file__).parent.parent.joinpath("bench/h200-2026-11-29-s3/overhead.json").read_text())
    keys = {k for k, _ in TABLE}
    cited = {k.removeprefix("o_proj_") for k in old} - {"launches_per_call"}
    assert cited <= keys  # the bench READMEs cite these; new keys are added, none renamed
    md = markdown({**old, "torch_add_us": 3.0})
    assert md.splitlines()[0].startswith("| host us per call |") and "| 5.96 | 5.70 |" in md
    assert "x.add_(0) (an elementwise launch, no allocation) | 3.00 |  |" in md


def test_out_argument_fast_path_and_validation(fake_gpu) -> None:
    """out=: the prepared launch writes into the caller's buffer (no allocation); an out that does
    not fit is declined by the fast path and rejected by the validated path with a clear error."""
    make, rec = fake_gpu
    lib = make()
    mod = QuantLinear(_weight("nvfp4"), "p", library=lib)
    mod.prepare(8)
    mod.prepare(2, 4)
    x = _x(8)
    mod(x)
    assert len(rec.calls) == 1
    out = torch.empty(8, N, dtype=torch.float16)
    assert mod(x, out=out) is out
    assert len(rec.calls) == 2 and rec.calls[1][3][5] == out.data_ptr()  # launched into out
    x3, out3 = _x(8).view(2, 4, K), torch.empty(2, 4, N, dtype=torch.float16)
    assert mod(x3, out=out3) is out3 and rec.calls[-1][3][5] == out3.data_ptr()
    n_calls = len(rec.calls)
    bad = {
        "shape": (torch.empty(8, N + 8, dtype=torch.float16), ValueError, "out must be"),
        "dtype": (torch.empty(8, N, dtype=torch.float32), ValueError, "out must be"),
        "non-contiguous": (torch.empty(N, 8, dtype=torch.float16).t(), ValueError, "contiguous"),
        "overlap": (None, ValueError, "overlaps x"),
        "type": (object(), TypeError, "out must be a torch.Tensor"),
    }
    big = torch.zeros(8 * max(N, K) * 2, dtype=torch.float16)
    for what, (o, exc, msg) in bad.items():
        xx = x
        if o is None:  # x and out share storage
            xx = big[: 8 * K].view(8, K).copy_(x)
            o = big[8 * K - 16: 8 * K - 16 + 8 * N].view(8, N)
        with pytest.raises(exc, match=msg):
            mod(xx, out=o)
        assert len(rec.calls) == n_calls, f"{what}: launched"


def test_out_argument_on_the_fallback_path() -> None:
    w = _weight("fp8_channel")
    mod = QuantLinear(w, "p")  # no library: dequantize + matmul on the CPU
    x = _x(5)
    out = torch.full((5, N), float("nan"), dtype=torch.float16)
    assert mod(x, out=out) is out
    assert torch.equal(out, mod(x))
    with pytest.raises(ValueError, match=r"out must be torch.float16 \(5, 192\)"):
        mod(x, out=torch.empty(5, N - 1, dtype=torch.float16))


def test_kernel_is_freed_by_refcount_after_a_generic_call(fake_gpu) -> None:
    """GemmKernel.__call__ keeps a launch that points back at its kernel only weakly: no reference
    cycle, so a kernel and its split-K workspaces die when the last user lets go (never later, in
    whatever CUDA graph capture the cyclic GC happens to run, where freeing memory is an error)."""
    import gc
    import weakref

    make, _ = fake_gpu
    n, k = 24, 5120
    lib = make("nvfp4", n, k, split_k=2)
    name = next(name for name in lib.entries() if name.startswith("fake_"))
    kern = lib.kernel(name)
    w = lib.pack(_weight("nvfp4", n, k))
    x = _x(8, k)
    kern.validate = lambda x, w, out=None: x.shape[0]  # the fake GPU's CPU tensors pass the checks
    kern(x, w, torch.empty(8, n, dtype=torch.float16))
    assert kern._generic is not None and kern._workspaces
    ref = weakref.ref(kern)
    gc.disable()
    try:
        del kern
        lib._kernels.clear()
        assert ref() is None, "the kernel is kept alive by a reference cycle"
    finally:
        gc.enable()


def _stub_module_loads(monkeypatch, handle: int, opted: list[tuple[str, int]]) -> _Recorder:
    """GemmKernel's driver side replaced for CPU tests: modules load as stubs whose functions carry
    ``handle`` (1: the recorder reads the plain signature, 2: the split-K one with tickets) and note
    dynamic shared-memory opt-ins in ``opted``; launches go to the returned recorder on stream 7."""
    from dflashgen.runtime import driver, kernels

    rec = _Recorder()

    class Fn:
        def __init__(self, name: str) -> None:
            self.name, self.handle, self._raw_handle = name, handle, handle

        def allow_dynamic_smem(self, nbytes: int) -> None:
            opted.append((self.name, nbytes))

    class Module:
        def __init__(self, image: bytes, label: str) -> None:
            pass

        def function(self, name: str) -> Fn:
            return Fn(name)

    monkeypatch.setattr(kernels, "Module", Module)
    monkeypatch.setattr(kernels, "ensure_context", lambda index: None)
    monkeypatch.setattr(kernels, "stream_getter", lambda: (lambda index: 7))
    monkeypatch.setattr(driver, "_untyped_launch", lambda: rec)
    monkeypatch.setattr(driver, "_untyped_launch_ex", lambda: rec.ex)
    return rec


def test_dynamic_shared_memory_kernels_opt_in_and_pass_their_size(monkeypatch, tmp_path) -> None:
    """An x_smem ring above 48 KB is dynamic shared memory: the kernel opts in to its size when its
    module loads and every launch passes that size; static kernels pass 0 and never opt in."""
    from dflashgen.runtime import kernels

    from dflashgen.schedule import KernelSpec, Tile, k_plan

    opted: list[tuple[str, int]] = []
    rec = _stub_module_loads(monkeypatch, 1, opted)
    image = tmp_path / "k.cubin"
    image.write_bytes(b"")
    n, k = 16480, 5120
    kp = k_plan(90, "nvfp4", n, k)
    assert kp.warps_k == 8
    names = []
    for rows, dynamic in ((32, True), (16, False)):  # warps_k 8 x rows x 64 K x 3 stages x 2 B: 96 / 48 KB
        spec = KernelSpec(90, "nvfp4", n, k, False, kp, Tile(rows, 1, 1, 3, x_ahead=0, x_smem=1))
        names.append(spec.name)
        entry = spec.to_dict()
        assert spec.smem_dynamic is dynamic and entry.get("smem_dynamic", False) is dynamic
        kern = kernels.GemmKernel(entry, image, max_m=64, device=torch.device("cpu"))
        launch = kernels.GemmLaunch(kern)
        launch.m = 32
        launch.launch(11, 12, 7)
        assert rec.shared[-1] == (entry["smem_bytes"] if dynamic else 0)
    assert opted == [(names[0], 98304)]


def test_wsplit_kernels_launch_a_cta_per_k_worker(monkeypatch, tmp_path) -> None:
    """A wsplit tile (the plan's warps_k K workers as CTAs of their own) launches split_k x warps_k
    CTAs along z with warps_n warps each, passes the split-K workspace and tickets (it reduces its
    partials itself), and sizes the partials for every worker: [8][M][N_PAD] for an sk1 wk8 plan."""
    from dflashgen.runtime import kernels

    from dflashgen.schedule import KernelSpec, Tile, k_plan

    opted: list[tuple[str, int]] = []
    rec = _stub_module_loads(monkeypatch, 2, opted)  # split-K signature: the recorder reads the tickets
    image = tmp_path / "k.cubin"
    image.write_bytes(b"")
    kp = k_plan(90, "nvfp4", 8704, 5120)
    assert (kp.split_k, kp.warps_k) == (1, 8)
    spec = KernelSpec(90, "nvfp4", 8704, 5120, False, kp, Tile(64, 1, 4, 3, x_ahead=0, x_smem=1, wsplit=1))
    entry = spec.to_dict()
    assert entry["ctas_k"] == 8 and entry["threads"] == 128 and entry["tile"]["wsplit"] == 1
    assert entry["kplan"] == {"split_k": 1, "warps_k": 8, "k_group": 64}  # the plan's key: its in-CTA tiles' twin
    kern = kernels.GemmKernel(entry, image, max_m=64, device=torch.device("cpu"))
    assert kern.split_k == 8
    launch = kernels.GemmLaunch(kern)
    launch.m = 64
    launch.launch(11, 12, 7)
    fn, grid, _, vals = rec.calls[-1]
    assert fn == 2 and grid == (1, 8704 // 16 // 4, 8)
    partials = kern._workspaces[7][0]
    assert partials.numel() == 8 * 64 * entry["n_pad"] and vals[6] == partials.data_ptr()
    assert not opted  # a 24 KB ring is static shared memory


def test_persist_kernels_launch_one_cta_per_sm_with_worker_partials(monkeypatch, tmp_path) -> None:
    """A persist tile (`_ps132`: gate_up's rest column blocks as K workers on 132 CTAs) launches the
    manifest's grid (row blocks, 132, 1), not one CTA per column block along y and its workers along z,
    and passes partials for every K worker ([2][M][N_PAD]) and ticket counters (its last worker per rest
    block sums them)."""
    from dflashgen.runtime import kernels

    from dflashgen.schedule import candidates

    opted: list[tuple[str, int]] = []
    rec = _stub_module_loads(monkeypatch, 2, opted)
    image = tmp_path / "k.cubin"
    image.write_bytes(b"")
    spec = next(c for c in candidates(90, "nvfp4", 34816, 5120, silu=True) if c.tile.persist)
    entry = spec.to_dict()
    kern = kernels.GemmKernel(entry, image, max_m=64, device=torch.device("cpu"))
    assert (kern.split_k, kern._grid_y, kern._grid_z) == (2, 132, 1)
    launch = kernels.GemmLaunch(kern)
    launch.m = 64
    launch.launch(11, 12, 7)
    fn, grid, _, vals = rec.calls[-1]
    assert fn == 2 and grid == (1, 132, 1)
    partials, tickets = kern._workspaces[7]
    assert partials.numel() == 2 * 64 * entry["n_pad"] and vals[6] == partials.data_ptr()
    assert tickets.numel() == 132 * 12 and vals[7] == tickets.data_ptr() and not tickets.any()


def test_pdl_trigger_setting(fake_gpu, monkeypatch) -> None:
    """DFLASHGEN_PDL_TRIGGER=early sets LAUNCH_PDL_EARLY (bit 16) in every sm_90 launch's last
    argument beside the prefetch depth; "end" (the default) and DFLASHGEN_PDL=0 leave it clear; other
    values are named."""
    from dflashgen.runtime import kernels

    make, rec = fake_gpu
    monkeypatch.setenv("DFLASHGEN_L2_PREFETCH", "6")
    for trig, pdl, bit in (("early", "1", kernels.LAUNCH_PDL_EARLY), ("end", "1", 0), ("early", "0", 0)):
        monkeypatch.setenv("DFLASHGEN_PDL_TRIGGER", trig)
        monkeypatch.setenv("DFLASHGEN_PDL", pdl)
        mod = QuantLinear(_weight("nvfp4", 24, 5120), "in_proj_ba", library=make("nvfp4", 24, 5120, split_k=2))
        assert mod.prepare(8) is not None
        mod(_x(8, 5120))
        assert rec.prefetch[-1] == 6 | bit, (trig, pdl)
    monkeypatch.setenv("DFLASHGEN_PDL_TRIGGER", "soon")
    with pytest.raises(ValueError, match="DFLASHGEN_PDL_TRIGGER must be 'end' or 'early'"):
        kernels.pdl_trigger_early()
