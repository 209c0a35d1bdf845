#!/usr/bin/env bash
# Session 16 call 6 (repo root on the H200, carry .build): ncu (with PC-sampling stalls) of the bulk-copy
# weight warp's best call-4 shape, NVFP4 n14336 r64 wn8 st16 xr8 at M = 64.
SWITCH=wgc-split-rings-on.diff source bench/h200-2026-12-01-s16/prelude.sh
K=dfg_sm90_nvfp4_store_n14336_k5120_sk1_wk8_kg64_r64_nt1_wn8_st16_xa0_xs1_sw1_pw4_wc1_xr8_mb1
timeout 60 dflashgen build --arch 90 -j 16 -q --only "$K" 2>&1 | tail -1
NCU_SOURCE=1 ncu_gemms "$R" "$K@64"
