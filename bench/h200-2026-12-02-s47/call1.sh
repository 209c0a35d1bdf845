#!/bin/bash
# Session 47 call 1: tools/l2_next_probe.py -- the successor's weights prefetched into L2 under this
# GEMM (TP4 problems and TP1 o_proj, both formats, M = 1 / 8 / 16, the committed table's kernels).
export DFLASHGEN_CACHE=/root/dfg-cache; mkdir -p $DFLASHGEN_CACHE
[ -f $DFLASHGEN_CACHE/.unpacked ] || { cp .build/build.tar.gz $DFLASHGEN_CACHE/ && touch $DFLASHGEN_CACHE/.unpacked; }
[ -d $DFLASHGEN_CACHE/include/cute ] || cp -r .build/include $DFLASHGEN_CACHE/
source tools/gpu_env.sh; dfg_install
L=/tmp/c1; mkdir -p $OUT/c1 $L
t0=$SECONDS
timeout 420 python3 tools/l2_next_probe.py "n3584|n4120|k1536|k4352|n8704|k6144" --ms 1 8 16 --frac 1.0 0.5 0.25 \
  --json $OUT/c1/probe.json > $L/probe.log 2>&1
echo "probe rc $? at $((SECONDS - t0)) s"; grep -v "^{" $L/probe.log | tail -5
python3 -c "
import json,os
rows=json.load(open(os.environ['OUT']+'/c1/probe.json'))
for r in rows: print(f\"{r['problem']:40s} M={r['m']:2d} {r['mb']:6.1f}MB base {r['base']:6.2f} empty {r['empty']:6.2f} next1 {r['next1']:6.2f} next.5 {r['next0.5']:6.2f} next.25 {r['next0.25']:6.2f}\")"
tar czf $OUT/c1/logs.tgz -C $L probe.log
