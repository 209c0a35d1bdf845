#!/bin/bash
# Session 41 call 1: the per-warpgroup TMA attention kernel (tma: 2) verified and raced.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s41
mkdir -p $OUT/c1
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)" > $OUT/c1/build.txt 2>&1; tail -2 $OUT/c1/build.txt
python3 -m pytest -q -m gpu tests/test_gpu_attention.py -rfE > $OUT/c1/pytest-attn.log 2>&1; tail -4 $OUT/c1/pytest-attn.log
dflashgen attn-bench --heads tp1 tp4 --contexts 1024 4096 16384 32768 --batches 1 2 4 8 \
  --only "g2_hs1_ds1_wg1" --out $OUT/c1/attn > $OUT/c1/attn.log 2>&1; tail -60 $OUT/c1/attn.log
ls $OUT/c1/attn
