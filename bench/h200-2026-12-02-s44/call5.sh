#!/bin/bash
# Session 44 call 5 (probe, tree = sk1.diff): the TP4 in_proj_qkvzba (n4120) and qkv (n3584) problems
# unsplit (split_k 1, warps_k 8: no partials, no ticket, no serial tail), register-path tiles, raced
# against the served kernels at M = 1 / 8 / 16, both formats.
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c5
t0=$SECONDS
RX="n(4120|3584)_k5120_sk1_wk8_kg(32|64)_r(8|16)_nt"
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel') and ('n4120' in b['kernel'] or 'n3584' in b['kernel'])})))")
dflashgen build --arch 90 -j 16 -q --only "$served|$RX" > $OUT/c5/build.txt 2>&1; tail -1 $OUT/c5/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout 330 python3 tools/wgmma_race.py fp8_channel/store/n4120 fp8_channel/store/n3584 nvfp4/store/n4120 \
  nvfp4/store/n3584 --ms 1 8 16 --only "$RX" --timeout 80 --json $OUT/c5/race.json > $OUT/c5/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $OUT/c5/race.txt | grep -v "^read" | head -70
