#!/bin/bash
# Session 45 call 4 (the tree as committed, call 3's table): the decode loop's GPU tests (greedy output
# byte-identical across B1-B8 and to plain decoding, graphs = eager, pipelined = serial, rollback
# bitwise), then the endpoint in both deployments, B1-B8. Logs in one tarball.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44
L=/tmp/c4; mkdir -p $OUT/c4 $L
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $L/build.txt 2>&1; tail -1 $L/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -rfE > $OUT/c4/pytest-decode.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/c4/pytest-decode.log
timeout 150 dflashgen decode-bench /tmp/ck/ckpt --synthetic --device cuda --batches 1 2 4 8 --out $OUT/c4/nvfp4 > $L/nvfp4.log 2>&1
echo "nvfp4 rc $? at $((SECONDS - t0)) s"; grep "^| [1248] " $L/nvfp4.log | cut -c1-200
rm -f $OUT/c4/nvfp4/decode_bench.png
timeout $((560 - (SECONDS - t0))) dflashgen decode-bench /tmp/ck8/ckpt --synthetic --deployment fp8 --device cuda --batches 1 2 4 8 --out $OUT/c4/fp8 > $L/fp8.log 2>&1
echo "fp8 rc $? at $((SECONDS - t0)) s"; grep "^| [1248] " $L/fp8.log | cut -c1-200
rm -f $OUT/c4/fp8/decode_bench.png
tar czf $OUT/c4/logs.tgz -C $L build.txt nvfp4.log fp8.log
