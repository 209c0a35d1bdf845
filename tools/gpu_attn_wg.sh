#!/usr/bin/env bash
# Issue #6, the sm_90a warpgroup-MMA verify-attention kernels (wg: 1, `_wg1_` in the name) on an H200,
# from the repo root (carry .build): OUT=/some/dir bash tools/gpu_attn_wg.sh STEP [STEP ...]
#   smoke  build the wg kernels (+ the served ones) and run the wg accuracy tests, stop at the first failure
#   tests  every GPU attention test on the native build (served and wg; not the sm_70 PTX ones)
#   bench  attn-bench of the served default vs the wg candidates (WG_HEADS, WG_CONTEXTS, WG_BATCHES)
#   ncu    ncu of the served kernel's fixed twin and two wg kernels at TP1 16K B4
# Each step logs to $OUT/wg-<step>.log; bench writes $OUT/wg-bench/attn-bench.{json,md}.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -2
dflashgen build --arch 90 --only '^dfg_attn' -j 16 --no-spills -q 2>&1 | tail -2
dflashgen build --arch 90 --only '^dfg_attn.*_wg1_' -v -q 2>&1 | grep wg1  # registers / spills per wg kernel
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
    *) echo "unknown step $s"; exit 2 ;;
  esac > >(tee "$OUT/wg-$s.log") 2>&1
  echo "== $s: rc $? in $((SECONDS - T0)) s"
done
