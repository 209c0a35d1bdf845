#!/usr/bin/env bash
# Session 16 call 1 (run from the repo root on the H200, carry .build): the GPU tests on the tree
# as committed, then (on the device's copy only) the WGC tiles switched on (wgc-tiles-on.diff), raced
# against the served tiles and profiled. Everything lands in $OUT/results.tgz.
source bench/h200-2026-12-01-s16/prelude.sh
OUT=$R STEPS="build pytest" bash tools/gpu_session.sh > "$R/session.log" 2>&1; tail -4 "$R/session.log"
git apply "$D/wgc-tiles-on.diff" && dflashgen generate | tail -1
timeout 120 dflashgen build --arch 90 -j 16 -q --only 'nvfp4_store_n34816_k5120|nvfp4_store_n14336_k5120' 2>&1 | tail -2
timeout 170 python3 tools/wgmma_race.py nvfp4/store/n34816 nvfp4/store/n14336 --ms 32 64 --json "$R/race.json" \
  > "$R/race.txt" 2>&1; tail -32 "$R/race.txt"
mkdir -p "$R/ncu"
NCU_SOURCE=1 ncu_gemms "$R/ncu" "dfg_sm90_nvfp4_store_n14336_k5120_sk1_wk8_kg64_r64_nt1_wn4_st4_xa0_xs1_sw1_pw4_wc1_mb1@64"
ncu_gemms "$R/ncu" "dfg_sm90_nvfp4_store_n14336_k5120_sk1_wk8_kg64_r64_nt1_wn8_st4_xa0_xs1_sw1_pw4_wc1_mb1@64"
