#!/usr/bin/env bash
# Issue #6, the sm_90a warpgroup-MMA verify-attention kernels (wg: 1, `_wg1_` in the name) on an H200,
# from the repo root (carry .build): OUT=/some/dir bash tools/gpu_attn_wg.sh STEP [STEP ...]
#   smoke  build the wg kernels (+ the served ones) and run the wg accuracy tests, stop at the first failure
#   tests  every GPU attention test on the native build (served and wg; not the sm_70 PTX ones)
#   bench  attn-bench of the served default vs the wg candidates (WG_HEADS, WG_CONTEXTS, WG_BATCHES)
#   ncu    ncu of the served kernel's fixed twin and two wg kernels at TP1 16K B4
#   tma    the TMA variant (tma: 1, `_tma1_`; session-7 helper, written before any GPU run): its GPU tests
#          (every candidate bitwise == its cp.async twin, accuracy, graph replay, bad pages, and every
#          KINDS test with kind "tma"), then attn-bench of the served kernel vs its cp.async wg twins
#          (st2 / st4, served rule) and the tma candidates (t32 st2-5) over TMA_CONTEXTS x TMA_BATCHES
#          into $OUT/tma-bench
#   tma-ncu  ncu of the served kernel and the tma st2 / st4 candidates at TP1 16K B1 (TMA_NCU_BATCH)
# Each step logs to $OUT/wg-<step>.log; bench writes $OUT/wg-bench/attn-bench.{json,md}.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
dfg_install
dflashgen build --arch 90 --only '^dfg_attn' -j 16 --no-spills -q 2>&1 | tail -2
dflashgen build --arch 90 --only '^dfg_attn.*_wg1_' -v -q 2>&1 | grep wg1  # registers / spills per wg kernel
TP1_RULE=sp512_le2048s64_le8192s128 TP4_RULE=sp256_le2048s32_le4096s64_le8192s128
for s in "$@"; do
  T0=$SECONDS
  case $s in
    smoke) python3 -m pytest -q -m gpu tests/test_gpu_attention.py -x -p no:cacheprovider -rfE --durations=5 \
             -k "wg and not 70 and (matches_fp32_reference or fewer_query_rows or bad_inputs)" ;;
    tests) python3 -m pytest -q -m gpu tests/test_gpu_attention.py -k "not 70" -p no:cacheprovider -rfE \
             --durations=10 ;;
    bench) dflashgen attn-bench --only '_wg1_' --heads ${WG_HEADS:-tp1 tp4} --contexts ${WG_CONTEXTS:-16384 32768} \
             --batches ${WG_BATCHES:-1 2 4 8} --out "$OUT/wg-bench" ;;
    ncu) ATTN_KERNELS="dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds2_sp512 \
dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds1_wg1_sp512 \
dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st4_g1_hs1_ds1_wg1_sp512" OUT=$OUT bash "$(dirname "$0")/gpu_attn_ncu.sh" ;;
    tma) python3 -m pytest -q -m gpu tests/test_gpu_attention.py -p no:cacheprovider -rfE --durations=10 \
           -k "tma- or tma] or test_tma or work_placement" &&
         dflashgen attn-bench --only "_t32_st[2-5]_g1_hs1_ds1_wg1_(tma1_)?($TP1_RULE|$TP4_RULE)\$" \
           --heads ${TMA_HEADS:-tp1 tp4} --contexts ${TMA_CONTEXTS:-4096 16384 32768} \
           --batches ${TMA_BATCHES:-1 2 4 8} --out "$OUT/tma-bench" ;;
    tma-ncu) ATTN_NCU_BATCH=${TMA_NCU_BATCH:-1} ATTN_KERNELS="dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds1_wg1_$TP1_RULE \
dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds1_wg1_tma1_$TP1_RULE \
dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st4_g1_hs1_ds1_wg1_tma1_$TP1_RULE" OUT=$OUT bash "$(dirname "$0")/gpu_attn_ncu.sh" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac > >(tee "$OUT/wg-$s.log") 2>&1
  echo "== $s: rc $? in $((SECONDS - T0)) s"
done
