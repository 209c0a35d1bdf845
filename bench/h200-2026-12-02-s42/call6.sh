#!/bin/bash
# Session 42 call 6: call 5's chains for channel FP8 (call 5's FP8 run died on its scales=None), TP4 and TP1.
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c6
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "dfg_sm90_dequant|dfg_sm90_silumul|$served" > $OUT/c6/build.txt 2>&1; tail -1 $OUT/c6/build.txt
echo "build done at $((SECONDS - t0)) s"
for tp in 4 1; do
  timeout 100 python3 tools/chain_probe.py --tp $tp --deployment fp8 --ms 1 8 16 --out $OUT/c6/chain-tp$tp-fp8.json > $OUT/c6/chain-tp$tp-fp8.txt 2>&1
  echo "chain tp$tp fp8 rc $? at $((SECONDS - t0)) s"; grep -E "^M=|layers" $OUT/c6/chain-tp$tp-fp8.txt
done
