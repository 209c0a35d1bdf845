"""The sequential gated delta rule for decode / verify steps: the generated kernel family "gdn" on
CUDA, its torch reference elsewhere.

Per request b and value head h (reading key head ``h // (Hv / Hk)``), for t = 0..T-1 in order::

    S <- d_t S,  d_t = exp(log_decay_t)
    u_t = beta_t (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T q_t

:func:`gdn_step` returns o, u and d for every position (optionally committing the state after ``n[b]``
positions, optionally first replaying a previous step's terms: a deferred rollback); :func:`gdn_advance`
applies the first ``n[b]`` positions' updates from those terms (the rollback after a verify forward,
every layer at once); :func:`gdn_prefill` runs any T in one launch
(a prefill not armed for rollback: outputs o, the state committed in place after ``n[b]`` positions;
the family's prefill kernel, the step's position body: bitwise T one-position steps). All use one
update expression and one fixed reduction order over the key dim (``gdn.cuh``; :func:`reference_step`
mirrors it op for op, its fused multiply-adds emulated exactly by :func:`fma32`), so a T-position step
followed by ``advance(n)`` is bitwise ``n`` one-position steps, and a request's bits do not depend on
the batch, the other requests or T. On CUDA only ``expf`` may differ from the reference (within an ulp or two).

Shapes (FP32): state ``[B, Hv, dk, dv]``; q, k ``[B, T, Hk, dk]`` contiguous; v ``[B, T, Hv, dv]``
(any batch / position strides, channels at one stride); beta, log_decay ``[B, T, Hv]``; o, u
``[B, T, Hv, dv]``; decay ``[B, T, Hv]``. ``gdn_advance`` takes an optional leading layer dim on the
state and the terms (per-layer blocks contiguous, layer strides free: stacked decode-state buffers
narrowed to a batch). T <= 16 (gdn_prefill: any T), dv % 4 == 0, dk a generated key dim. On CUDA the
kernels move q, k, o, u, k_out (and the advance's k / u) as float4: those must start at 16-byte aligned
addresses (checked; fresh torch allocations and whole-tensor views of them are). v may be any view: the
step copies it as float4 when its channels are contiguous and aligned, element by element otherwise.
No host sync: graph capturable.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch

from .driver import ArgPack, current_stream
from .images import entry_here, family_entries, load_module

__all__ = ["GdnInputError", "chunk_available", "chunk_heads_per_cta", "fma32", "gdn_advance", "gdn_prefill",
           "gdn_prefill_chunked", "gdn_step", "per_value_head", "prefill_available", "reference_advance",
           "reference_step"]

Tensor = torch.Tensor
MAX_T = 16  # dflashgen.gdn_family.MAX_T
ROW_LANES = 16  # gdn.cuh LR: the reduction order over the key dim


class GdnInputError(ValueError):
    """An argument does not fit the gated delta rule step (shape, dtype, device, T, head dims)."""


# --------------------------------------------------------------------------- torch reference


def fma32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """a * b + c with one rounding to FP32 (CUDA's ``__fmaf_rn``), for FP32 tensors that broadcast.

    In FP64 the product is exact (2 x 24 significand bits), the sum's rounding error exact by TwoSum;
    rounding the sum to odd (an inexact result whose last bit is even moves one ulp towards the error)
    and then to FP32 rounds the exact value once, since FP64 carries more than FP32's 24 + 2 bits
    (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums", 2008)."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)
    inexact = (err != 0) & torch.isfinite(s) & ((s.view(torch.int64) & 1) == 0)
    towards = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(inexact, torch.nextafter(s, towards), s).float()


def _dot(x: Tensor, s: Tensor) -> Tensor:
    """sum_i x[..., i] s[..., i, :] in gdn.cuh's order: per row lane lr (i = lr + 16 r) a product for
    r = 0, then fused multiply-adds over r, then halving over the 16 lanes (= the xor butterfly, float
    add being commutative)."""
    dk = s.shape[-2]
    lanes = ROW_LANES if dk % ROW_LANES == 0 else 1
    xs = x[..., :, None].unflatten(-2, (dk // lanes, lanes))  # [..., R, lanes, 1]
    ss = s.unflatten(-2, (dk // lanes, lanes))  # [..., R, lanes, dv]
    acc = xs[..., 0, :, :] * ss[..., 0, :, :]
    for r in range(1, dk // lanes):
        acc = fma32(xs[..., r, :, :], ss[..., r, :, :], acc)
    while acc.shape[-2] > 1:
        h = acc.shape[-2] // 2
        acc = acc[..., :h, :] + acc[..., h:, :]
    return acc[..., 0, :]


def per_value_head(x: Tensor, hv: int) -> Tensor:
    """[..., Hk, dk] -> [..., Hv, dk]: value head h reads key head h // (Hv / Hk) (a view, no sync)."""
    *lead, hk, dk = x.shape
    return x[..., None, :].expand(*lead, hk, hv // hk, dk).reshape(*lead, hv, dk)


def reference_step(s0: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, *,
                   commit: Tensor | None = None, n: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The step in torch (any device): (o, u, decay); ``commit`` (may be ``s0``) gets the state after
    ``n[b]`` positions (default T). The same roundings as the kernel (its fmas by :func:`fma32`)."""
    b, t, _, _ = k.shape
    hv = beta.shape[-1]
    kk, qq = per_value_head(k, hv), per_value_head(q, hv)
    s = final = s0
    nb = (n if n is not None else torch.full((b,), t, dtype=torch.long, device=s0.device)).view(b, 1, 1, 1)
    o = torch.empty(v.shape, dtype=torch.float32, device=s0.device)
    u = torch.empty_like(o)
    decay = torch.empty(b, t, hv, dtype=torch.float32, device=s0.device)
    for i in range(t):
        d = torch.exp(log_decay[:, i].contiguous())  # [B, Hv]; same shape at any T: same exp path
        decay[:, i] = d
        s = s * d[..., None, None]
        ui = beta[:, i, :, None] * (v[:, i] - _dot(kk[:, i], s))
        s = fma32(kk[:, i, :, :, None], ui[..., None, :], s)
        u[:, i] = ui
        o[:, i] = _dot(qq[:, i], s)
        if commit is not None:
            final = torch.where(nb == i + 1, s, final)
    if commit is not None:
        commit.copy_(final)
    return o, u, decay


def reference_advance(s: Tensor, k: Tensor, u: Tensor, decay: Tensor, n: Tensor) -> None:
    """In place: s <- the state after the first ``n[b]`` positions' updates (leading dims allowed)."""
    t, hv = k.shape[-3], s.shape[-3]
    kk = per_value_head(k, hv)
    nb = n.view(-1, 1, 1, 1)
    cur = s
    for i in range(t):
        nxt = fma32(kk[..., i, :, :, None], u[..., i, :, None, :], cur * decay[..., i, :, None, None])
        cur = torch.where(nb > i, nxt, cur)
    s.copy_(cur)


# --------------------------------------------------------------------------- validation


def _fail(msg: str) -> None:
    raise GdnInputError(msg)


def _check(name: str, x: Tensor | None, shape: tuple[int, ...], dev: torch.device, *, contiguous: bool = True,
           dtype: torch.dtype = torch.float32) -> None:
    if x is None:
        return
    if tuple(x.shape) != shape or x.dtype != dtype or x.device != dev:
        _fail(f"{name} must be {dtype} {list(shape)} on {dev}, got {x.dtype} {list(x.shape)} on {x.device}")
    if contiguous and not x.is_contiguous():
        _fail(f"{name} must be contiguous")


def _step_dims(s0: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor,
               max_t: int | None = MAX_T) -> tuple[int, int, int, int, int, int]:
    if k.dim() != 4:
        _fail(f"k must be [B, T, Hk, dk], got {list(k.shape)}")
    b, t, hk, dk = k.shape
    if s0.dim() != 4:
        _fail(f"the state must be [B, Hv, dk, dv], got {list(s0.shape)}")
    hv, dv = s0.shape[1], s0.shape[3]
    if t < 1 or (max_t is not None and t > max_t):
        _fail(f"T={t} positions: the gdn step serves 1..{MAX_T} (longer inputs: gdn_prefill or the chunked form)")
    if hk < 1 or hv % hk:
        _fail(f"{hv} value heads are not a multiple of {hk} key heads")
    if dv % 4:
        _fail(f"value head dim {dv} is not a multiple of 4")
    dev = s0.device
    _check("state", s0, (b, hv, dk, dv), dev)
    _check("q", q, (b, t, hk, dk), dev)
    _check("k", k, (b, t, hk, dk), dev)
    _check("v", v, (b, t, hv, dv), dev, contiguous=False)
    if v.stride(2) != dv * v.stride(3):
        _fail("v's head and channel strides must flatten to one channel stride")
    _check("beta", beta, (b, t, hv), dev)
    _check("log_decay", log_decay, (b, t, hv), dev)
    return b, t, hk, hv, dk, dv


def _aligned(*states: Tensor | None) -> None:
    # the kernels move state rows as float4 (gdn.cuh Col::load / store)
    for x in states:
        if x is not None and x.data_ptr() % 16:
            _fail("the recurrent state must start at a 16-byte aligned address (every layer's block too)")


def _aligned16(what: str, **tensors: Tensor | None) -> None:
    """The CUDA kernels copy these as float4 (gdn.cuh stage_rows / the o, u, k_out stores)."""
    bad = [name for name, x in tensors.items() if x is not None and x.data_ptr() % 16]
    if bad:
        _fail(f"{', '.join(bad)} must start at 16-byte aligned addresses ({what} moves them as float4)")


# --------------------------------------------------------------------------- kernels


def kernel_arch(device: torch.device, arch: int | None = None) -> int:
    """90 / 80 / 70 for this GPU, or ``arch`` / $DFLASHGEN_GDN_ARCH (70: the compute_70 PTX via the JIT)."""
    from .images import serving_arch

    return serving_arch(device, arch, "DFLASHGEN_GDN_ARCH", GdnInputError)


@cache
def _entries(mode: str = "step") -> tuple[dict[str, Any], ...]:
    return tuple(e for e in family_entries("gdn").values() if e.get("mode", "step") == mode)


def _entry(mode: str, dk: int, arch: int) -> dict[str, Any]:
    found = [e for e in _entries(mode) if e["arch"] == arch and e["dk"] == dk]
    if not found:
        have = sorted({e["dk"] for e in _entries(mode) if e["arch"] == arch})
        _fail(f"no sm_{arch} gdn {mode} kernel for key head dim {dk} (generated: {have}); add it to "
              "dflashgen/gdn_family.py and run `dflashgen generate`")
    return found[0]


class _Kernels:
    """The step / advance pair for one (key dim, arch, device), with persistent launch arguments."""

    def __init__(self, dk: int, arch: int, device_index: int) -> None:
        entry = _entry("step", dk, arch)
        mod = load_module(entry, device_index)
        self.name = entry["name"]
        self.step, self.advance = mod.function(self.name), mod.function(self.name + "_advance")
        self.step_replay = mod.function(self.name + "_replay")  # the same arguments (gdn.cu.j2)
        # dynamic shared memory per position (gdn.cuh step / advance_smem_floats_per_t): sized per launch
        self.step_smem_per_t, self.adv_smem_per_t = int(entry["smem_per_t"]), int(entry["advance_smem_per_t"])
        self.cols, self.threads = int(entry["cols"]), int(entry["threads"])  # per CTA (gdn_family.COLS / THREADS)
        p, ll, i = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
        self.step_args = ArgPack([p, p, p, p, ll, ll, ll, p, p, i, i, i, i, p, p, p, p, p, p, p, p])
        self.adv_args = ArgPack([p, ll, p, ll, p, ll, p, ll, p, i, i, i, i, i])


class _Prefill:
    """The prefill kernel for one (key dim, arch, device), with persistent launch arguments."""

    def __init__(self, dk: int, arch: int, device_index: int) -> None:
        entry = _entry("prefill", dk, arch)
        self.name = entry["name"]
        self.cols, self.threads = int(entry["cols"]), int(entry["threads"])  # (gdn_family.PREFILL_*)
        self.fn = load_module(entry, device_index).function(self.name)
        p, ll, i = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
        self.args = ArgPack([p, p, p, p, ll, ll, ll, p, p, i, i, i, i, p, p])


class _Chunk:
    """The chunk-form prefill pair (prep + scan) for one (key dim, arch, device). The tensor-core scan
    (manifest ``scan: tf32x3``) runs H value heads of one key head per CTA: ``threads`` and
    ``smem_per_head`` per head, H the largest divisor of the GQA group that fits ``max_heads`` and the
    device's shared memory (:meth:`geometry`)."""

    def __init__(self, dk: int, arch: int, device_index: int) -> None:
        entry = _entry("chunk", dk, arch)
        mod = load_module(entry, device_index)
        self.name = entry["name"]
        self.chunk, self.cols, self.threads = int(entry["chunk"]), int(entry["cols"]), int(entry["threads"])
        self.prep_threads = int(entry["prep_threads"])
        self.prep, self.scan = mod.function(self.name + "_prep"), mod.function(self.name)
        self.grouped = entry["scan"] == "tf32x3"
        if self.grouped:
            optin = getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", 0)
            self.smem_base, self.smem_per_head = int(entry["smem_base"]), int(entry["smem_per_head"])
            self.max_heads = int(entry["max_heads"])
            if optin:  # the heads a CTA may hold on this GPU
                self.max_heads = min(self.max_heads, (int(optin) - self.smem_base) // self.smem_per_head)
            if self.max_heads < 1:
                _fail(f"{self.name} needs {self.smem_base + self.smem_per_head} bytes of shared memory per CTA; "
                      f"this GPU allows {optin}")
            self.scan.allow_dynamic_smem(self.smem_base + self.max_heads * self.smem_per_head)
        else:
            self.smem = int(entry["smem"])  # the scan's dynamic shared memory (gdn_family.chunk_smem_bytes)
            self.scan.allow_dynamic_smem(self.smem)
        p, ll, i = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
        self.prep_args = ArgPack([p, p, p, p, i, i, i, p, p, p])
        self.scan_args = ArgPack([p, p, p, p, ll, ll, ll, p, p, p, p, i, i, i, i, p, p])

    def geometry(self, hk: int, hv: int, dv: int, b: int) -> tuple[tuple[int, int, int], int, int]:
        """The scan's (grid, threads, dynamic shared memory) for these dims."""
        if not self.grouped:
            return (-(-dv // self.cols), hv, b), self.threads, self.smem
        heads = chunk_heads_per_cta(hv // hk, self.max_heads)
        return (-(-dv // self.cols), hv // heads, b), self.threads * heads, self.smem_base + heads * self.smem_per_head


def chunk_heads_per_cta(rep: int, max_heads: int) -> int:
    """Value heads per CTA of the tensor-core chunk scan: the largest divisor of the GQA group (``rep``
    value heads per key head) that is at most ``max_heads`` -- a CTA's heads share one key head."""
    return max(d for d in range(1, min(rep, max_heads) + 1) if rep % d == 0)


_KERNELS: dict[tuple[int, int, int], _Kernels] = {}
_PREFILL: dict[tuple[int, int, int], _Prefill] = {}
_CHUNK: dict[tuple[int, int, int], _Chunk] = {}


def _cached(cache: dict[tuple[int, int, int], Any], cls: Any, dev: torch.device, dk: int,
            arch: int | None) -> tuple[Any, int]:
    """The family's kernel object for (key dim, serving arch, device), made once per process."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    a = kernel_arch(dev, arch)
    key = (dk, a, idx)
    if key not in cache:
        cache[key] = cls(dk, a, idx)
    return cache[key], idx


def _kernels(dev: torch.device, dk: int, arch: int | None) -> tuple[_Kernels, int]:
    return _cached(_KERNELS, _Kernels, dev, dk, arch)


def _prefill_kernel(dev: torch.device, dk: int, arch: int | None) -> tuple[_Prefill, int]:
    return _cached(_PREFILL, _Prefill, dev, dk, arch)


def _chunk_kernel(dev: torch.device, dk: int, arch: int | None) -> tuple[_Chunk, int]:
    return _cached(_CHUNK, _Chunk, dev, dk, arch)


def chunk_available(device: torch.device | str, dk: int, arch: int | None = None) -> bool:
    """Whether :func:`gdn_prefill_chunked` runs the generated chunk-form kernels here (manifest only)."""
    return entry_here(device, arch, "DFLASHGEN_GDN_ARCH", GdnInputError, lambda a: _entry("chunk", dk, a)) is not None


def prefill_available(device: torch.device | str, dk: int, arch: int | None = None) -> bool:
    """Whether :func:`gdn_prefill` runs the generated kernel here: a CUDA device with a prefill
    kernel for key head dim ``dk`` at its serving arch (no compile, no load: manifest only). The
    target runs long unarmed forwards through it when True, the chunk form otherwise."""
    return entry_here(device, arch, "DFLASHGEN_GDN_ARCH", GdnInputError, lambda a: _entry("prefill", dk, a)) is not None


def _ptr(t: Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


def gdn_step(s0: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, *,
             o: Tensor | None = None, u: Tensor | None = None, decay: Tensor | None = None,
             k_out: Tensor | None = None, commit: Tensor | None = None, n: Tensor | None = None,
             replay_n: Tensor | None = None, arrive: Tensor | None = None,
             arch: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """T <= 16 positions of the gated delta rule from state ``s0`` (read only, unless it is ``commit``).

    Returns (o, u, decay) -- into ``o`` / ``u`` / ``decay`` when given (contiguous, e.g. stacked
    decode-state buffers). ``k_out``: also copy k there (what :func:`gdn_advance` needs). ``commit``:
    write the state after ``n[b]`` positions (int64 ``[B]`` on the device; None: all T) there; it may
    be ``s0`` (in place). ``replay_n`` (int64 ``[B]``; needs ``k_out``, ``u``, ``decay`` and ``arrive``):
    first ``s0`` <- ``s0`` after the first ``replay_n[b]`` positions of the terms those buffers hold
    (a previous step's, T positions: :func:`gdn_advance`'s update, bitwise), in place, then this step
    from it -- a rollback folded into the next step (no ``commit`` then: the next step's replay keeps
    what the rollback chooses). ``arrive``: int32 ``[B, Hk]`` zeros (left zero), the kernel's count of
    which CTAs have read the old terms. CUDA: the generated kernel; otherwise :func:`reference_step`."""
    b, t, hk, hv, dk, dv = _step_dims(s0, q, k, v, beta, log_decay)
    dev = s0.device
    for name, x, shape in (("o", o, (b, t, hv, dv)), ("u", u, (b, t, hv, dv)), ("decay", decay, (b, t, hv)),
                           ("k_out", k_out, (b, t, hk, dk)), ("commit", commit, (b, hv, dk, dv))):
        _check(name, x, shape, dev)
    _check("n", n, (b,), dev, dtype=torch.long)
    if replay_n is not None:
        if k_out is None or u is None or decay is None or arrive is None:
            _fail("replay_n needs k_out, u and decay (the terms to replay) and arrive")
        if commit is not None:
            _fail("replay_n and commit do not combine: a replaying step keeps its terms for the next rollback")
        _check("replay_n", replay_n, (b,), dev, dtype=torch.long)
        _check("arrive", arrive, (b, hk), dev, dtype=torch.int32)
    _aligned(s0, commit)
    if dev.type != "cuda":
        if replay_n is not None:
            assert k_out is not None and u is not None and decay is not None
            reference_advance(s0, k_out, u, decay, replay_n)
        ro, ru, rd = reference_step(s0, q, k, v, beta, log_decay, commit=commit, n=n)
        if k_out is not None:
            k_out.copy_(k)
        for dst, src in ((o, ro), (u, ru), (decay, rd)):
            if dst is not None:
                dst.copy_(src)
        return (o if o is not None else ro), (u if u is not None else ru), (decay if decay is not None else rd)
    _aligned16("the step kernel", q=q, k=k, o=o, u=u, k_out=k_out)
    o = torch.empty((b, t, hv, dv), dtype=torch.float32, device=dev) if o is None else o
    u = torch.empty_like(o) if u is None else u
    decay = torch.empty((b, t, hv), dtype=torch.float32, device=dev) if decay is None else decay
    kn, idx = _kernels(dev, dk, arch)
    a = kn.step_args
    with a.lock:
        vals = (s0.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), v.stride(0), v.stride(1), v.stride(3),
                beta.data_ptr(), log_decay.data_ptr(), t, hk, hv, dv, o.data_ptr(), u.data_ptr(),
                decay.data_ptr(), _ptr(k_out), _ptr(commit), _ptr(n), _ptr(replay_n), _ptr(arrive))
        for slot, val in zip(a.values, vals, strict=True):
            slot.value = val
        smem, fn = t * kn.step_smem_per_t, kn.step
        if replay_n is not None:  # gdn.cuh step_replay_offset: the advance's region at a 16-byte boundary
            smem, fn = -(-smem // 16) * 16 + t * kn.adv_smem_per_t, kn.step_replay
        fn.launch_pack((-(-dv // kn.cols), hv, b), (kn.threads, 1, 1), a, current_stream(idx), smem)
    return o, u, decay


def gdn_advance(s: Tensor, k: Tensor, u: Tensor, decay: Tensor, n: Tensor, *, arch: int | None = None) -> None:
    """In place: ``s`` <- the state after the first ``n[b]`` positions whose terms (k, u, decay) a
    :func:`gdn_step` from ``s`` produced (n = 0: unchanged). An optional leading layer dim on every
    tensor but ``n`` covers all layers in one launch. CUDA: the generated kernel; else the reference."""
    layered = s.dim() == 5
    if s.dim() not in (4, 5) or k.dim() != s.dim() or u.dim() != s.dim() or decay.dim() != s.dim() - 1:
        _fail(f"advance takes state [(L,) B, Hv, dk, dv], k [(L,) B, T, Hk, dk], u [(L,) B, T, Hv, dv], "
              f"decay [(L,) B, T, Hv]; got {list(s.shape)}, {list(k.shape)}, {list(u.shape)}, {list(decay.shape)}")
    lead = s.shape[:1] if layered else ()
    nl = s.shape[0] if layered else 1
    b, hv, dk, dv = s.shape[-4:]
    t, hk = k.shape[-3], k.shape[-2]
    if not 1 <= t <= MAX_T or hk < 1 or hv % hk or dv % 4:
        _fail(f"advance: T={t} (1..{MAX_T}), {hv} value / {hk} key heads, dv={dv} (multiple of 4) do not fit")
    dev = s.device
    for name, x, shape in (("state", s, (*lead, b, hv, dk, dv)), ("k", k, (*lead, b, t, hk, dk)),
                           ("u", u, (*lead, b, t, hv, dv)), ("decay", decay, (*lead, b, t, hv))):
        _check(name, x, shape, dev, contiguous=False)
        inner = x[0] if layered else x
        if not inner.is_contiguous():
            _fail(f"{name}: each layer's block must be contiguous")
    _check("n", n, (b,), dev, dtype=torch.long)
    _aligned(s, s[1] if layered and nl > 1 else None)
    if dev.type != "cuda":
        reference_advance(s, k, u, decay, n)
        return
    second = layered and nl > 1  # every layer's block: the layer strides keep the alignment
    _aligned16("the advance kernel", k=k, u=u, k_layer_1=k[1] if second else None, u_layer_1=u[1] if second else None)
    kn, idx = _kernels(dev, dk, arch)

    def lstride(x: Tensor) -> int:
        return x.stride(0) if layered else 0

    a = kn.adv_args
    with a.lock:
        vals = (s.data_ptr(), lstride(s), k.data_ptr(), lstride(k), u.data_ptr(), lstride(u), decay.data_ptr(),
                lstride(decay), n.data_ptr(), b, t, hk, hv, dv)
        for slot, val in zip(a.values, vals, strict=True):
            slot.value = val
        kn.advance.launch_pack((-(-dv // kn.cols), hv, nl * b), (kn.threads, 1, 1), a, current_stream(idx),
                               t * kn.adv_smem_per_t)


def gdn_prefill(s: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, *,
                n: Tensor | None = None, o: Tensor | None = None, arch: int | None = None) -> Tensor:
    """Any T >= 1 positions of the gated delta rule from state ``s``, committing in place: ``s`` <-
    the state after ``n[b]`` positions (int64 ``[B]`` on the device, clamped to [0, T]; n[b] = 0
    leaves it untouched; None: all T). Returns o ``[B, T, Hv, dv]`` (into ``o`` when given). The
    prefill of a forward not armed for rollback: no u / decay outputs. CUDA: the family's prefill
    kernel (one launch, q and k 16-byte aligned), bitwise T one-position :func:`gdn_step` commits;
    otherwise :func:`reference_step` (the same roundings)."""
    b, t, hk, hv, dk, dv = _step_dims(s, q, k, v, beta, log_decay, max_t=None)
    dev = s.device
    _check("o", o, (b, t, hv, dv), dev)
    _check("n", n, (b,), dev, dtype=torch.long)
    _aligned(s)
    if dev.type != "cuda":
        ro, _, _ = reference_step(s, q, k, v, beta, log_decay, commit=s, n=None if n is None else n.clamp(0, t))
        if o is None:
            return ro
        o.copy_(ro)
        return o
    if q.data_ptr() % 16 or k.data_ptr() % 16:
        _fail("q and k must start at 16-byte aligned addresses (the prefill kernel stages them as float4)")
    o = torch.empty((b, t, hv, dv), dtype=torch.float32, device=dev) if o is None else o
    kn, idx = _prefill_kernel(dev, dk, arch)
    kn.args.launch(kn.fn, (-(-dv // kn.cols), hv, b), (kn.threads, 1, 1), current_stream(idx),
                   (s.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), v.stride(0), v.stride(1), v.stride(3),
                    beta.data_ptr(), log_decay.data_ptr(), t, hk, hv, dv, o.data_ptr(), _ptr(n)))
    return o


def gdn_prefill_chunked(s: Tensor, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor, *,
                        n: Tensor | None = None, o: Tensor | None = None, arch: int | None = None) -> Tensor:
    """:func:`gdn_prefill` in chunk (WY) form: the same arguments, contract and outputs, computed as
    FP32 products over chunks of 32 positions (``gdn_chunk.cuh``: a prep launch over every chunk, then
    one scan over the chunks in order; on sm_80+ the scan's products run on tensor cores in 3xTF32,
    ``gdn_chunk_mma.cuh``). Not bitwise the sequential kernels (another summation order: ~4e-7 from an
    FP64 recurrence at T = 1023, they 9e-8); a request's bits still depend only on its own
    inputs (not on T's padding, the batch or the other requests). CUDA only (the CPU path is the
    target's torch chunk form); q, k, o 16-byte aligned."""
    b, t, hk, hv, dk, dv = _step_dims(s, q, k, v, beta, log_decay, max_t=None)
    dev = s.device
    if dev.type != "cuda":
        _fail("gdn_prefill_chunked runs the generated CUDA kernels only (on CPU: gdn_prefill or the chunk form)")
    _check("o", o, (b, t, hv, dv), dev)
    _check("n", n, (b,), dev, dtype=torch.long)
    _aligned(s)
    o = torch.empty((b, t, hv, dv), dtype=torch.float32, device=dev) if o is None else o
    _aligned16("the chunk-form prefill", q=q, k=k, o=o)
    kn, idx = _chunk_kernel(dev, dk, arch)
    nch = -(-t // kn.chunk)
    ws_g = torch.empty((b, hv, nch, 3, kn.chunk), dtype=torch.float32, device=dev)  # g, exp(g), end weights
    ws_t = torch.empty((b, hv, nch, kn.chunk, kn.chunk), dtype=torch.float32, device=dev)
    ws_p = torch.empty_like(ws_t)
    stream = current_stream(idx)
    kn.prep_args.launch(kn.prep, (nch, hk, b), (kn.prep_threads, 1, 1), stream,
                        (q.data_ptr(), k.data_ptr(), beta.data_ptr(), log_decay.data_ptr(), t, hk, hv,
                         ws_g.data_ptr(), ws_t.data_ptr(), ws_p.data_ptr()))
    grid, threads, smem = kn.geometry(hk, hv, dv, b)
    kn.scan_args.launch(kn.scan, grid, (threads, 1, 1), stream,
                        (s.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), v.stride(0), v.stride(1), v.stride(3),
                         beta.data_ptr(), ws_g.data_ptr(), ws_t.data_ptr(), ws_p.data_ptr(), t, hk, hv, dv,
                         o.data_ptr(), _ptr(n)), smem)
    return o
