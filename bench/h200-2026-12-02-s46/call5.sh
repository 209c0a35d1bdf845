#!/bin/bash
# Session 46 call 5 (commit b76b5cb, c4's table): the decode loop's GPU tests on the final table (greedy
# output byte-identical across B1-B8 and to plain decoding, graphs = eager, rollback bitwise).
export DFLASHGEN_CACHE=/root/dfg-cache; mkdir -p $DFLASHGEN_CACHE
[ -f $DFLASHGEN_CACHE/.unpacked ] || { cp .build/build.tar.gz $DFLASHGEN_CACHE/ && touch $DFLASHGEN_CACHE/.unpacked; }
[ -d $DFLASHGEN_CACHE/include/cute ] || cp -r .build/include $DFLASHGEN_CACHE/
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44; mkdir -p $OUT/c5; t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > /tmp/build5.txt 2>&1; tail -1 /tmp/build5.txt
echo "build done at $((SECONDS - t0)) s"
timeout 170 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -rfE -x > $OUT/c5/pytest-decode.log 2>&1
echo "pytest decode rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/c5/pytest-decode.log
