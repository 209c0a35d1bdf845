#!/bin/bash
# Session 46 call 3 (probe, tree as in `r16wn1.diff`): NVFP4 r16 tiles with one warp along N (half-size
# CTAs, 128 threads at warps_k 4 / 256 at warps_k 8; the FP8 twin serves TP4 gate_up at M = 16), uncapped
# (126 registers, 4 per SM) and, for n8704, capped for 5 per SM (96 registers, no spill: 544 CTAs in one
# wave), raced against the served kernels at M = 8 / 16 / 24 on the heaviest NVFP4 M = 16 problems.
export DFLASHGEN_CACHE=/root/dfg-cache; mkdir -p $DFLASHGEN_CACHE
[ -f $DFLASHGEN_CACHE/.unpacked ] || { cp .build/build.tar.gz $DFLASHGEN_CACHE/ && touch $DFLASHGEN_CACHE/.unpacked; }
[ -d $DFLASHGEN_CACHE/include/cute ] || cp -r .build/include $DFLASHGEN_CACHE/
source tools/gpu_env.sh; dfg_install
L=/tmp/c3; mkdir -p $OUT/c3 $L
t0=$SECONDS
RX="_r16_nt1_wn1_st[34]_xa1_xs0_mb[245]$"
P="nvfp4/silu/n8704 nvfp4/store/n8704 nvfp4/store/n16480 nvfp4/store/n5120/k17408 nvfp4/store/n5120/k6144 nvfp4/store/n5120/k4352 nvfp4/store/n14336"
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel') and 'nvfp4' in b['kernel']})))")
dflashgen build --arch 90 -j 16 -q --only "$served|^dfg_sm90_nvfp4_.*$RX" > $L/build.txt 2>&1; tail -2 $L/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout $((480 - (SECONDS - t0))) python3 tools/wgmma_race.py $P --ms 8 16 24 --only "$RX" --timeout 65 --json $OUT/c3/race.json > $L/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $L/race.txt | grep -v "^read" | head -60
tar czf $OUT/c3/logs.tgz -C $L build.txt race.txt
