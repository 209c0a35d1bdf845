#!/bin/bash
# Session 41 call 5: dflashgen bench of the NVFP4 problems on the re-tuned table (#4's figures).
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c5
timeout 220 dflashgen bench --only "sm90/nvfp4" --ms 1 8 16 --out $OUT/c5/bench > $OUT/c5/bench.log 2>&1
echo "bench rc $?"; grep -v "it/s\]" $OUT/c5/bench.log | tail -3; rm -f $OUT/c5/bench/bench.png
grep -A12 -i "forward" $OUT/c5/bench/bench.md | head -30
