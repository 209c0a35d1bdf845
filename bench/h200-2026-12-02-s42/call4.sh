#!/bin/bash
# Session 42 call 4 (final tree): the decode loop's GPU tests on the re-tuned library (greedy output
# byte-identical across B1-B8 and to plain decoding, graphs = eager, pipelined = serial, rollback bitwise),
# then a second endpoint run at B1 / B2.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s42
mkdir -p $OUT/c4
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $OUT/c4/build.txt 2>&1; tail -1 $OUT/c4/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -rfE > $OUT/c4/pytest-decode.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c4/pytest-decode.log
timeout $((560 - (SECONDS - t0))) dflashgen decode-bench /tmp/ck/ckpt --synthetic --device cuda --batches 1 2 --out $OUT/c4/decode > $OUT/c4/decode.log 2>&1
echo "decode rc $? at $((SECONDS - t0)) s"; grep "^| [12] " $OUT/c4/decode.log | cut -c1-200
rm -f $OUT/c4/decode/decode_bench.png
