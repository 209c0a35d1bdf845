"""The kernel library for one GPU: generated manifest + tuning table + built images, and the
dispatch every quantized projection goes through.

``KernelLibrary.gemm`` picks, per (problem, M), the tuned kernel (nearest tuned M >= requested) or
the fallback (dequantize + cuBLAS), and counts which path each call took (``path_counts``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections import Counter
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from dflashgen import __version__
from dflashgen.prepack import Layout, PackedWeight, prepack
from dflashgen.weights import FP8ChannelWeight, NVFP4Weight

from .dequant_kernel import DequantCache, dequantize
from .images import resolve
from .kernels import GemmKernel, GemmLaunch, native_arch
from .norm_kernel import fused_sigmoid_mul, fused_silu_mul, sigmoid_mul_fits, silu_mul_fits
from .table import Choice, TableError, TuningTable, problem_key, slug

log = logging.getLogger("dflashgen")

_Dispatch = tuple[Choice, str, tuple[str, int, str]]  # choice, table key, path_counts key


@lru_cache(maxsize=1)
def kernel_library_hash() -> str:
    """Identity of the generated GEMM set: its manifest entries and the sources each is built from
    (the GEMM templates its kernels use and the headers they include, transitively). Tables are valid
    only for the kernels they timed, so a change to a GEMM header makes them stale as a new tile does;
    other kernel families' entries and headers do not, nor a tile family none of the kernels uses."""
    manifest = json.loads((resources.files("dflashgen.generated") / "manifest.json").read_text())
    return library_hash(manifest["kernels"])


def library_hash(kernels: list[dict[str, Any]]) -> str:
    """kernel_library_hash of a list of GEMM manifest entries (uncached)."""
    from dflashgen.render import gemm_source_hash, gemm_template

    h = hashlib.sha256(json.dumps(kernels, sort_keys=True, separators=(",", ":")).encode())
    h.update(gemm_source_hash({gemm_template(k["tile"].get("producer", 0)) for k in kernels}).encode())
    return h.hexdigest()[:16]


def machine_fingerprint(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    driver = "unknown"
    try:
        from .driver import check, cu

        v = int(check(cu().cuDriverGetVersion(), "cuDriverGetVersion"))
        driver = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - the fingerprint is informative here, never fatal
        pass
    return {"gpu": props.name, "arch": native_arch(device), "sms": props.multi_processor_count, "driver": driver,
            "cuda": torch.version.cuda, "torch": torch.__version__, "dflashgen": __version__,
            "kernel_library": kernel_library_hash()}


def default_table_path(device: torch.device) -> Path:
    """tuning/<gpu>.json (measured here by `dflashgen tune`), else tuning/sm_XX.json (heuristic)."""
    root = Path(str(resources.files("dflashgen.tuning")))
    measured = root / f"{slug(torch.cuda.get_device_properties(device).name)}.json"
    generic = root / f"sm_{native_arch(device)}.json"
    return measured if measured.exists() or not generic.exists() else generic


@cache
def _layout_key(lay: Layout) -> str:
    return problem_key(lay.arch, lay.fmt, "silu" if lay.silu else "store", lay.n, lay.k)


def mul_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a * b`` computed in the inputs' promoted type (FP32 for FP32 x FP16: the FP16 operand upcasts
    exactly) and rounded once to ``dtype``: the bits of ``(a.float() * b.float()).to(dtype)`` without
    the upcast copies or the FP32 product in memory (the multiply's loads and store convert)."""
    shape = torch.broadcast_shapes(a.shape, b.shape)
    return torch.mul(a, b, out=torch.empty(shape, dtype=dtype, device=a.device))


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``o * sigmoid(gate)`` in FP32, rounded once to ``dtype`` (the gated attention's output gate, o [...,
    H, D], gate of o's shape): on CUDA for FP32 o and an FP16 gate one generated launch with the same bits
    (:func:`~.norm_kernel.fused_sigmoid_mul`), else torch's ops."""
    if dtype is torch.float16 and sigmoid_mul_fits(o, gate):
        return fused_sigmoid_mul(o, gate, check=False)
    return mul_to(o, torch.sigmoid(gate.float()), dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SiLU(gate) * up in FP32, rounded once to ``dtype``: ``(silu(gate.float()) * up.float()).to(dtype)``."""
    return mul_to(torch.nn.functional.silu(gate.float()), up, dtype)


def silu_mul_cat(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`silu_mul` of ``y = [gate | up]``: on CUDA FP16 one generated launch with the same bits
    (norm_kernel.fused_silu_mul), else torch's ops on the halves."""
    if dtype is torch.float16 and silu_mul_fits(y):
        return fused_silu_mul(y, check=False)
    return silu_mul(*y.chunk(2, dim=-1), dtype)


def fallback_gemm(x: torch.Tensor, packed: PackedWeight, w16: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize + cuBLAS, correct for any M; ``w16`` is an already dequantized weight (a kept copy),
    else one is made for this call (:func:`~.dequant_kernel.dequantize`: one generated launch on CUDA)."""
    w = dequantize(packed, x.dtype) if w16 is None else w16
    y = x @ w.t()
    if packed.layout.silu:
        y = silu_mul_cat(y, x.dtype)
    return y


class KernelLibrary:
    def __init__(self, device: torch.device | None = None, table: TuningTable | Path | None = None,
                 on_mismatch: str = "error", build_dir: Path | None = None,
                 dequant_cache: int | str | None = None) -> None:
        """on_mismatch: 'error' raises when the table is for another GPU/library, 'fallback'
        logs it and serves everything through the fallback path. dequant_cache: how many bytes of
        dequantized weight copies the fallback path keeps (:class:`~.dequant_kernel.DequantCache`:
        "auto", "all", 0, "12GiB", ...; None: ``$DFLASHGEN_DEQUANT_CACHE``, else "auto")."""
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.arch = native_arch(self.device)
        self.build_dir = build_dir
        self.dequantized = DequantCache(dequant_cache)
        self._counts: Counter[tuple[str, int, str]] = Counter()  # calls through gemm()
        self._launches: weakref.WeakSet[GemmLaunch] = weakref.WeakSet()  # prepared: they count their own calls
        self._kernels: dict[str, GemmKernel] = {}
        self.image_sources: dict[str, str] = {}  # kernel -> "package" | "cache" | "built"
        # per layout, per M: the choice, the table key and the path_counts key; found through the
        # layout's identity first (a frozen dataclass re-hashes its fields on every lookup)
        self._choices: dict[Layout, dict[int, _Dispatch]] = {}
        self._by_id: dict[int, tuple[Layout, dict[int, _Dispatch]]] = {}
        self._entries: dict[str, dict[str, Any]] | None = None
        self.table: TuningTable | None = None
        path = table if isinstance(table, Path) else None
        tbl = table if isinstance(table, TuningTable) else None
        if tbl is None:
            path = path or default_table_path(self.device)
            if path.exists():
                tbl = TuningTable.load(path)
            else:
                log.warning("dflashgen: no tuning table %s for this GPU: every projection uses the fallback", path)
        if tbl is not None:
            try:
                for w in tbl.check_matches(machine_fingerprint(self.device)):
                    log.warning("dflashgen: tuning table %s: %s", tbl.source, w)
                self.table = tbl
            except TableError:
                if on_mismatch != "fallback":
                    raise
                log.warning("dflashgen: ignoring mismatched tuning table %s; using the fallback", tbl.source)

    def _fallback(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        """cuBLAS on a dequantized copy of the weight: kept within the ``dequant_cache`` budget (what
        the tuner timed as the cuBLAS FP16 peer), else made for this call."""
        return fallback_gemm(x, packed, self.dequantized.weight(packed, x.dtype))

    def entries(self) -> dict[str, dict[str, Any]]:
        if self._entries is None:
            from dflashgen.render import load_manifest

            self._entries = {e["name"]: e for e in load_manifest()["kernels"]}
        return self._entries

    def layout(self, fmt: str, n: int, k: int, silu: bool = False) -> Layout:
        return Layout(self.arch, fmt, n, k, silu)

    def pack(self, w: NVFP4Weight | FP8ChannelWeight, silu: bool = False) -> PackedWeight:
        fmt = "nvfp4" if isinstance(w, NVFP4Weight) else "fp8_channel"
        return prepack(w, self.layout(fmt, w.n, w.k, silu))

    def key(self, packed: PackedWeight) -> str:
        return _layout_key(packed.layout)

    def choose(self, packed: PackedWeight, m: int) -> Choice:
        return self._dispatch(packed.layout, m)[0]

    def _dispatch(self, layout: Layout, m: int) -> _Dispatch:
        # memoised: dispatch sits on every call's host path
        per_layout = self._by_id.get(id(layout))
        if per_layout is None or per_layout[0] is not layout:  # the entry holds layout, so ids stay unique
            if len(self._by_id) > 4096:
                self._by_id.clear()  # layouts made per call (lib.pack in a loop) must not pile up
            per_layout = self._by_id[id(layout)] = (layout, self._choices.setdefault(layout, {}))
        memo = per_layout[1].get(m)
        if memo is None:
            key = _layout_key(layout)
            choice = (Choice("fallback", None, m, "no tuning table") if self.table is None
                      else self.table.lookup(key, m))
            memo = per_layout[1][m] = (choice, key, (key, m, choice.path))
        return memo

    @property
    def path_counts(self) -> Counter[tuple[str, int, str]]:
        """Calls per (problem key, M, path "kernel" | "fallback"), a snapshot: calls through ``gemm``
        plus those of prepared launches (``prepare``; QuantLinear's eager fast path), which count
        their own calls and are folded in here."""
        live = list(self._launches)  # held while summing, so none is retired (folded) twice
        counts = Counter(self._counts)
        for launch in live:
            counts[launch.count_key] += launch.calls[0]
        return counts

    def _retire(self, count_key: tuple[str, int, str], calls: list[int]) -> None:
        self._counts[count_key] += calls[0]  # a dead launch's calls still count

    def prepare(self, packed: PackedWeight, m: int) -> GemmLaunch | None:
        """The kernel launch for M rows of ``packed`` with its arguments written (validated once),
        or None where the table sends M to the fallback (cuBLAS-bound: ``gemm`` serves it)."""
        choice, _, count_key = self._dispatch(packed.layout, m)
        if choice.path != "kernel" or choice.kernel is None:
            return None
        launch = self.kernel(choice.kernel).prepare(packed, m, choice.prefetch)
        launch.count_key = count_key
        self._launches.add(launch)
        weakref.finalize(launch, self._retire, count_key, launch.calls).atexit = False
        return launch

    def kernel(self, name: str) -> GemmKernel:
        if name not in self._kernels:
            entry = self.entries().get(name)
            if entry is None:
                raise TableError(f"tuning table names kernel {name}, which this dflashgen does not generate")
            image = resolve(entry, self.arch, build_dir=self.build_dir)  # package, cache, or compile now
            self.image_sources[name] = image.source
            self._kernels[name] = GemmKernel(entry, image.path, max_m=1 << 16, device=self.device)
        return self._kernels[name]

    def gemm(self, x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        choice, _, count_key = self._dispatch(packed.layout, m)
        self._counts[count_key] += 1
        if choice.path == "kernel" and choice.kernel is not None:
            return self.kernel(choice.kernel)(x, packed, out, prefetch=choice.prefetch)
        y = self._fallback(x, packed)
        if out is not None:
            out.copy_(y)
            return out
        return y
