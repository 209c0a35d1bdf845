#!/bin/bash
# Session 44 call 4 (probe, tree = split5120.diff: sk2 / sk4 warps_k 8 plans added): the N = 5120 FP8
# problems' split-K alternatives with warps_k 8 (sk2 / sk4: 640 / 1280 CTAs of 256 threads, every SM
# evenly loaded) raced against the served kernels at M = 1 / 8 / 16.
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c4
t0=$SECONDS
RX="n5120_k(4352|6144|17408)_sk[24]_wk8_kg32_r(8|16)_nt"
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel') and 'n5120' in b['kernel'] and 'fp8' in b['kernel']})))")
dflashgen build --arch 90 -j 16 -q --only "$served|$RX" > $OUT/c4/build.txt 2>&1; tail -1 $OUT/c4/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout 330 python3 tools/wgmma_race.py fp8_channel/store/n5120/k4352 fp8_channel/store/n5120/k6144 \
  fp8_channel/store/n5120/k17408 --ms 1 8 16 --only "$RX" --timeout 100 --json $OUT/c4/race.json > $OUT/c4/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $OUT/c4/race.txt | grep -v "^read" | head -60
