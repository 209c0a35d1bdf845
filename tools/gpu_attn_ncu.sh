#!/usr/bin/env bash
# ncu on the verify-attention main kernels at TP1 16K B4 (one device call, ~1-2 min), from the repo root:
#   OUT=/some/dir bash tools/gpu_attn_ncu.sh      (carry .build)
# ATTN_KERNELS: kernel names (default: the served schedule and its D-split twin, which gives the same bits);
# ATTN_NCU_BATCH: the batch (default 4).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
dfg_install
dflashgen build --arch 90 --only dfg_attn -j 16 -q 2>&1 | tail -1
for k in ${ATTN_KERNELS:-dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds1_sp512 \
  dfg_attn_sm90_h24kv4_d256_q8_fp16_p16_t32_st2_g1_hs1_ds2_sp512}; do
  echo "== ncu $k"  # "$" keeps the `_merge` kernel out
  timeout 200 ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section LaunchStats \
    --section SourceCounters -k "regex:^$k\$" --launch-skip 2 --launch-count 1 \
    dflashgen attn-bench --contexts 16384 --batches ${ATTN_NCU_BATCH:-4} --heads tp1 --out "$OUT/attn-ncu" > "$OUT/ncu-$k.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Stall|Block Limit" \
    "$OUT/ncu-$k.txt" | head -20
done
