#!/usr/bin/env bash
# Session 16 call 4 (repo root on the H200, carry .build): call 3's race again, now that wgmma_race.py
# builds and loads only the kernels it races (call 3's built all 1744 and ran out of time, silently).
SWITCH=wgc-split-rings-on.diff source bench/h200-2026-12-01-s16/prelude.sh
timeout 200 python3 tools/wgmma_race.py nvfp4/store/n34816 nvfp4/store/n14336 fp8_channel/store/n14336 --ms 32 64 \
  --only 'wc1|n14336_k5120_sk1_wk8_kg64_r32_nt2_wn4_st3_xa0_xs1_sw1_mb1' --json "$R/race.json" > "$R/race.txt" 2>&1
echo "race rc $?"; tail -40 "$R/race.txt"
