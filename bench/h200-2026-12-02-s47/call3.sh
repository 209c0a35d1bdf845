#!/bin/bash
# Session 47 call 3 (schedule: deep r8 register rings, 6 / 8 stages, in the warps_k 8 plans):
# `dflashgen tune --carry` session 46's c4 report (the problems whose candidates changed are re-timed).
export DFLASHGEN_CACHE=/root/dfg-cache; mkdir -p $DFLASHGEN_CACHE
[ -f $DFLASHGEN_CACHE/.unpacked ] || { cp .build/build.tar.gz $DFLASHGEN_CACHE/ && touch $DFLASHGEN_CACHE/.unpacked; }
[ -d $DFLASHGEN_CACHE/include/cute ] || cp -r .build/include $DFLASHGEN_CACHE/
source tools/gpu_env.sh; dfg_install
L=/tmp/c3; mkdir -p $OUT/c3 $L
t0=$SECONDS
git show HEAD:tuning/nvidia-h200.json > /tmp/old-table.json
timeout 540 dflashgen tune --carry bench/h200-2026-12-02-s46/c4/tune-measurements.json.gz \
  --journal /root/tune3.journal.json > $L/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]\|s/it\]" $L/tune.log | tail -3
gzip -c tuning/nvidia-h200.measurements.json > $OUT/c3/tune-measurements.json.gz 2>/dev/null
cp tuning/nvidia-h200.json $OUT/c3/ 2>/dev/null
python3 -c "
import json
o=json.load(open('/tmp/old-table.json'))['problems']; n=json.load(open('tuning/nvidia-h200.json'))['problems']
for k in sorted(n):
    ob={b['m']:b for b in o.get(k,{}).get('buckets',[])}
    for b in n[k]['buckets']:
        a=ob.get(b['m'],{})
        if b.get('kernel')!=a.get('kernel') or abs(b.get('us',0)-a.get('us',0))>0.03*a.get('us',1):
            print(k, b['m'], round(a.get('us',0),2), '->', round(b.get('us',0),2), (b.get('kernel') or b.get('path'))[len('dfg_sm90_'):] if b.get('kernel') else b.get('path'))
"
tar czf $OUT/c3/logs.tgz -C $L tune.log
