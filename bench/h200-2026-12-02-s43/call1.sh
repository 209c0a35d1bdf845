#!/bin/bash
# Session 43 call 1: register-path tiles four warp tiles wide (nt4, one warp along N, 2 stages; the
# warps_k 8 plans) raced against the served kernels at M = 1 / 8 / 16. The probe tree is nt4.diff
# (applied here, reverted at the end).
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s43
mkdir -p $OUT/c1
t0=$SECONDS
git apply $S/nt4.diff 2>/dev/null || echo "(nt4.diff already applied)"
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$served|_nt4_wn1_st2_xa1" > $OUT/c1/build.txt 2>&1; tail -1 $OUT/c1/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout 420 python3 tools/wgmma_race.py fp8_channel/store/n14336 fp8_channel/store/n8704 fp8_channel/silu/n8704 \
  fp8_channel/store/n5120/k6144 fp8_channel/store/n5120/k17408 fp8_channel/store/n5120/k4352 \
  nvfp4/store/n14336 nvfp4/store/n8704 nvfp4/store/n5120/k6144 nvfp4/store/n5120/k17408 \
  --ms 1 8 16 --only "_nt4_wn1_st2_xa1" --timeout 60 --json $OUT/c1/race.json > $OUT/c1/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $OUT/c1/race.txt | head -80
