"""Verify-attention outputs on fixed inputs, saved in one tree and compared bitwise in another: proves a
change that should keep the bits (grid order, loads moved) kept them, across commits. On a GPU:

    python3 tools/attn_bits.py save /tmp/before.pt      # with the old tree installed (copy this script)
    python3 tools/attn_bits.py compare /tmp/before.pt   # with the new tree installed

Inputs come from a seeded CPU generator (the same on every machine); every FP16 page-16 schedule of both
head layouts (TP1 24/4, TP4 6/1) plus the served FP8 kernels, native arch and the sm_70 build's PTX,
over a ragged batch with lengths on both sides of each split threshold in a 40K-token-wide table.
Kernels present in only one tree are listed and skipped.
"""

from __future__ import annotations

import sys

import torch

LENGTHS = [9, 1031, 2047, 2048, 2049, 4104, 8191, 8192, 8193, 16392, 32776]
CAPACITY = 40000
PAGE, D, NQ = 16, 256, 8


def outputs() -> dict[str, torch.Tensor]:
    from dflashgen.runtime.attention_kernel import attention_entries, kernel_arch, paged_verify_attention

    native = kernel_arch(torch.device("cuda"))
    g = torch.Generator().manual_seed(5)
    res: dict[str, torch.Tensor] = {}
    width = -(-CAPACITY // PAGE)
    need = [-(-n // PAGE) for n in LENGTHS]
    nblk = sum(need)
    perm = torch.randperm(nblk, generator=g)
    table = torch.zeros(len(LENGTHS), width, dtype=torch.int32)
    o = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[o:o + n].to(torch.int32)
        o += n
    table, lengths = table.cuda(), torch.tensor(LENGTHS, dtype=torch.int32).cuda()
    for hq, hkv in ((24, 4), (6, 1)):
        k = torch.randn(nblk, PAGE, hkv, D, generator=g).cuda()
        v = torch.randn(nblk, PAGE, hkv, D, generator=g).cuda()
        q = torch.randn(len(LENGTHS), NQ, hq, D, generator=g).half().cuda()
        for arch in sorted({native, 70}):
            for e in attention_entries():
                if (e["arch"], e["hq"], e["hkv"], e["page"]) != (arch, hq, hkv, PAGE):
                    continue
                if e["kv"] != "fp16" and not e["default"]:
                    continue
                dt = {"fp16": torch.float16, "e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}[e["kv"]]
                scale = 1.0 if e["kv"] == "fp16" else 0.05
                out = paged_verify_attention(q, (k / scale).to(dt), (v / scale).to(dt), table, lengths,
                                             k_scale=scale, v_scale=scale, kernel=e["name"], arch=arch)
                res[f"{e['name']}@{arch}"] = out.cpu()
    return res


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("save", "compare"):
        print(__doc__)
        return 2
    got = outputs()
    if argv[1] == "save":
        torch.save(got, argv[2])
        print(f"saved {len(got)} kernel outputs to {argv[2]}")
        return 0
    ref = torch.load(argv[2])
    common = sorted(set(ref) & set(got))
    bad = [n for n in common if not torch.equal(ref[n], got[n])]
    for n in sorted(set(ref) ^ set(got)):
        print(f"only in {'the saved run' if n in ref else 'this tree'}: {n}")
    for n in bad:
        print(f"DIFFERS: {n} (max abs diff {(ref[n] - got[n]).abs().max().item():.3e})")
    print(f"{len(common) - len(bad)}/{len(common)} kernels bitwise equal")
    return 1 if bad or not common else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
