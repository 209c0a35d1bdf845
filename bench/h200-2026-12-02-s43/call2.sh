#!/bin/bash
# Session 43 call 2: the FP8-only r8 nt4 register tiles (schedule `register_tiles` with the `fp8` tag)
# on every FP8 K plan they join (warps_k 8: wn1, 256 threads; warps_k 4: wn2 / 256 and wn1 / 128),
# raced against the served kernels at M = 1 / 8 / 16 on the tree as it is.
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c2
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$served|fp8_.*_r8_nt4_wn[12]_st2_xa1" > $OUT/c2/build.txt 2>&1; tail -1 $OUT/c2/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout 480 python3 tools/wgmma_race.py fp8_channel/store/n8704 fp8_channel/silu/n8704 fp8_channel/store/n3584 \
  fp8_channel/store/n5120/k1536 fp8_channel/store/n5120/k4352 fp8_channel/store/n5120/k6144 \
  fp8_channel/store/n5120/k17408 fp8_channel/store/n14336 \
  --ms 1 8 16 --only "_r8_nt4_wn[12]_st2_xa1" --timeout 60 --json $OUT/c2/race.json > $OUT/c2/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $OUT/c2/race.txt | grep -v "^read" | head -80
