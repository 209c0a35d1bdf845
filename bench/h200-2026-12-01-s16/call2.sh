#!/usr/bin/env bash
# Session 16 call 2 (repo root on the H200, carry .build): the WGC tiles with split rings (a weight ring
# of `stages` filled by its own warp, an activation ring of x_ring) switched on in the device's copy
# only (wgc-split-rings-on.diff), verified and raced against the served tiles, then profiled.
SWITCH=wgc-split-rings-on.diff source bench/h200-2026-12-01-s16/prelude.sh
timeout 200 dflashgen build --arch 90 -j 16 -q --only 'nvfp4_store_n34816_k5120|nvfp4_store_n14336_k5120|fp8_store_n14336_k5120' 2>&1 | tail -2
timeout 260 python3 tools/wgmma_race.py nvfp4/store/n34816 nvfp4/store/n14336 fp8_channel/store/n14336 --ms 32 48 64 \
  --json "$R/race.json" > "$R/race.txt" 2>&1; tail -40 "$R/race.txt"
mkdir -p "$R/ncu"
NCU_SOURCE=1 ncu_gemms "$R/ncu" "${NCU1:-dfg_sm90_nvfp4_store_n14336_k5120_sk1_wk8_kg64_r64_nt1_wn8_st16_xa0_xs1_sw1_pw4_wc1_xr3_mb1@64}"
