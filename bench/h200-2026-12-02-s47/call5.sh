#!/bin/bash
# Session 47 call 5 (the committed table of c3): the NVFP4 decode endpoint on the synthetic checkpoint.
export DFLASHGEN_CACHE=/root/dfg-cache; mkdir -p $DFLASHGEN_CACHE
[ -f $DFLASHGEN_CACHE/.unpacked ] || { cp .build/build.tar.gz $DFLASHGEN_CACHE/ && touch $DFLASHGEN_CACHE/.unpacked; }
[ -d $DFLASHGEN_CACHE/include/cute ] || cp -r .build/include $DFLASHGEN_CACHE/
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44; L=/tmp/c5; mkdir -p $OUT/c5 $L
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $L/build.txt 2>&1; tail -1 $L/build.txt
echo "build at $((SECONDS - t0)) s"
timeout 300 dflashgen decode-bench /tmp/ck/ckpt --synthetic --device cuda --batches 1 2 4 8 --out $OUT/c5/nvfp4 > $L/nvfp4.log 2>&1
echo "decode-bench rc $? at $((SECONDS - t0)) s"; grep -v "^\s*$" $L/nvfp4.log | grep "^B=\|^| [1248] " 
tar czf $OUT/c5/logs.tgz -C $L build.txt nvfp4.log
