#!/usr/bin/env bash
# Session 16 call 3 (repo root on the H200, carry .build): call 2 again with the activation ring a
# multiple of the activation warps (call 2's x_ring 3 with 2 / 4 warps let a warp wait two phases
# ahead on a shared slot: it hung), built and raced on just the WGC tiles, the table's kernels of
# those problems and n14336's best serial tile (wgmma_race.py --only).
SWITCH=wgc-split-rings-on.diff source bench/h200-2026-12-01-s16/prelude.sh
timeout 150 dflashgen build --arch 90 -j 16 -q --only "$(cat $D/call3-build.regex)" 2>&1 | tail -2
timeout 200 python3 tools/wgmma_race.py nvfp4/store/n34816 nvfp4/store/n14336 fp8_channel/store/n14336 --ms 32 64 \
  --only 'wc1|n14336_k5120_sk1_wk8_kg64_r32_nt2_wn4_st3_xa0_xs1_sw1_mb1' --json "$R/race.json" > "$R/race.txt" 2>&1
tail -40 "$R/race.txt"
mkdir -p "$R/ncu"
NCU_SOURCE=1 ncu_gemms "$R/ncu" "${NCU1:-dfg_sm90_nvfp4_store_n14336_k5120_sk1_wk8_kg64_r64_nt1_wn8_st16_xa0_xs1_sw1_pw4_wc1_xr8_mb1@64}"
