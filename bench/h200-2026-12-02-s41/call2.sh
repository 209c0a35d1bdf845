#!/bin/bash
# Session 41 call 2: gate_up n34816 M = 16 tiles that fit one wave (r16 nt2 wn2 st2, capped st3 / nt1),
# verified against the served kernels (bitwise per K plan) and timed with the tuner's method.
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c2
python3 tools/wgmma_race.py nvfp4/silu/n34816/k5120 nvfp4/store/n34816/k5120 fp8_channel/silu/n34816/k5120 \
  --ms 8 16 24 32 --only "(st2_xa0_xs1_mb1|_mb5|_mb9)$" --json $OUT/c2/race.json --timeout 240 2>&1 \
  | grep -v "^  *[0-9]*%\|it/s" | tee $OUT/c2/race.txt | tail -60
