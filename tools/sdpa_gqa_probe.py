"""The fused prefill attention with grouped K / V heads: repeated per query head (the memory-efficient
kernel's need) vs passed as they are (``enable_gqa``), at Qwen3.8-27B's TP1 prefill shape (1023 queries
x 1024 keys, 24 query / 4 KV heads of 256, causal mask): bitwise agreement, median times (CUDA events),
and which backends take ``enable_gqa``. What `runtime/target.py:_native_gqa` relies on.
    python3 tools/sdpa_gqa_probe.py"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_us(f: Callable[[], torch.Tensor], n: int = 50) -> float:
    for _ in range(5):
        f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        s.record()
        f()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return sorted(ts)[n // 2]


def main() -> None:
    torch.manual_seed(0)
    b, t, h, hkv, d, length = 1, 1023, 24, 4, 256, 1024
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hkv, length, d, device="cuda", dtype=torch.float16)
    pos = torch.arange(t, device="cuda")[None] + 1
    mask = (torch.arange(length, device="cuda") <= pos[:, :, None])[:, None]

    def repeated() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1),
                                              attn_mask=mask, scale=d**-0.5)

    def grouped() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True)

    a, g = repeated(), grouped()
    print(f"enable_gqa: max |diff| vs repeated {float((a.float() - g.float()).abs().max())}, "
          f"bitwise equal: {torch.equal(a, g)}")
    print(f"repeated {median_us(repeated):.1f} us, enable_gqa {median_us(grouped):.1f} us")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                print(f"{backend}: {median_us(grouped):.1f} us, bitwise equal {torch.equal(grouped(), a)}")
        except RuntimeError as ex:
            print(f"{backend}: not available ({str(ex).splitlines()[0][:120]})")


if __name__ == "__main__":
    main()
