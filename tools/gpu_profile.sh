#!/usr/bin/env bash
# Profiling call (one device command): ncu on the GEMM kernels that miss their targets and on the
# verify-attention kernel at 16K, then torch.profiler over steady-state decode rounds at B1 and B8.
#   OUT=... bash tools/gpu_profile.sh     (carry .build; results in $OUT/profile.tgz)
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
R=$(mktemp -d)
source "$(dirname "$0")/gpu_env.sh"
trap 'tar czf "$OUT/profile.tgz" -C "$R" .' EXIT
dfg_install
dflashgen build --arch 90 -j 16 -q 2>&1 | tail -30
# KERNELS: "name_regex@M ..." (the GEMM kernels to profile and their batch rows)
ncu_gemms "$R" "${KERNELS:-nvfp4_silu_n34816_k5120_sk1_wk2_kg64_r8_nt2_wn2_st3_xa1_xs0_mb1@8 \
  nvfp4_store_n5120_k17408_sk1_wk8_kg64_r8_nt2_wn2_st3_xa1_xs0_mb1@8 \
  fp8_silu_n34816_k5120_sk1_wk2_kg32_r8_nt2_wn2_st3_xa1_xs0_mb1@8 \
  nvfp4_store_n34816_k5120_sk1_wk2_kg64_r64_nt1_wn2_st3_xa0_xs0_mb1@64 \
  nvfp4_store_n5120_k6144_sk1_wk8_kg64_r8_nt2_wn2_st3_xa1_xs0_mb1@8}"
# The main kernels ("$" keeps `_merge` out): the served default and its D-split twin (same bits).
# ATTN=0 skips the attention kernels; BATCHES picks the decode profile's batch sizes.
[ "${ATTN:-1}" = 1 ] && for k in ${ATTN_KERNELS:-dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds1_sp512 \
  dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds2_sp512}; do
  echo "== ncu $k 16K B4 tp1"
  timeout 150 $NCU -k "regex:^$k\$" --launch-skip 2 --launch-count 1 \
    dflashgen attn-bench --contexts 16384 --batches 4 --heads tp1 --out "$R/attn" > "$R/ncu-$k.txt" 2>&1
  tail -5 "$R/ncu-$k.txt"
done
echo "== decode profile"
timeout 300 python3 tools/profile_decode.py --batches ${BATCHES:-1 8} --trace "$R/trace" 2>&1 | tee "$R/profile-decode.txt" | tail -150
