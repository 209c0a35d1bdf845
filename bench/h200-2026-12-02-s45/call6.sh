#!/bin/bash
# Session 45 call 6 (probe, tree patched here: k_plan.halve_warps_k_below 12 -> 24): the FP8 K = 5120
# problems (20 K groups per warp at warps_k 8) with the warps_k 4 plan, raced against the served
# kernels at M = 1 / 8 / 16 (TP1 in_proj_qkvzba n16480, qkv n14336).
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c6
t0=$SECONDS
sed -i 's/halve_warps_k_below: 12 /halve_warps_k_below: 24 /' schedules/sm_90.yaml && timeout 60 dflashgen generate 2>&1 | tail -1
RX="(n16480|n14336)_k5120_sk1_wk4_kg32_r(8|16)_nt"
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel') and 'fp8' in b['kernel'] and ('n16480' in b['kernel'] or 'n14336' in b['kernel'])})))")
dflashgen build --arch 90 -j 16 -q --only "$served|$RX" > $OUT/c6/build.txt 2>&1; tail -1 $OUT/c6/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout $((170 - (SECONDS - t0))) python3 tools/wgmma_race.py fp8_channel/store/n16480 fp8_channel/store/n14336 \
  --ms 1 8 16 --only "$RX" --timeout 60 --json $OUT/c6/race.json > $OUT/c6/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $OUT/c6/race.txt | grep -v "^read" | head -40
