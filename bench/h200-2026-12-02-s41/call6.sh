#!/bin/bash
# Session 41 call 6 (probe for the next session; run on a tree with two more register_tiles entries,
# [16, 2, 2, 2, 1, 256, 256] and [16, 2, 1, 2, 1, 256, 256], not committed): do the 2-stage register
# r16 nt2 tiles beat the served M = 16 tiles of the warps_k 4 / 8 problems?
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c6
timeout 140 python3 tools/wgmma_race.py nvfp4/store/n16480/k5120 nvfp4/store/n14336/k5120 nvfp4/store/n5120/k17408 \
  nvfp4/store/n5120/k6144 --ms 16 --only "st2_xa1_xs0" --json $OUT/c6/race.json --timeout 45 2>&1 \
  | grep -v "it/s" | tee $OUT/c6/race.txt | grep -v "^ *wgmma"
