#!/bin/bash
# Session 42 call 5: the TP4-rank projections of one 64-layer forward as one CUDA graph (back-to-back
# launches under PDL, every layer its own weights) beside the bench-style per-kernel sum, both formats:
# how much of the small kernels' launch and ramp (#4's TP4 gap) a real chain already hides.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s42
mkdir -p $OUT/c5
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "dfg_sm90_dequant|dfg_sm90_silumul|$served" > $OUT/c5/build.txt 2>&1; tail -1 $OUT/c5/build.txt
echo "build done at $((SECONDS - t0)) s"
for d in nvfp4 fp8; do
  timeout 120 python3 tools/chain_probe.py --tp 4 --deployment $d --ms 1 8 16 --out $OUT/c5/chain-tp4-$d.json > $OUT/c5/chain-tp4-$d.txt 2>&1
  echo "chain tp4 $d rc $? at $((SECONDS - t0)) s"; grep -E "^M=|layers" $OUT/c5/chain-tp4-$d.txt
done
