#!/bin/bash
# Session 45 call 1: (a) the runtime GPU tests on the committed library, the split-K fast-path tests
# through session 44's TP1 fallback (none may skip on the H200 table); (b) probe, tree patched here with
# bench/h200-2026-12-02-s44/wk4-probe.diff: FP8 n5120 k1536 / k4352 (TP4 o_proj / out_proj, down_proj)
# with a warps_k 4 plan raced against the served kernels at M = 1 / 8 / 16.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44
mkdir -p $OUT/c1
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $OUT/c1/build.txt 2>&1; tail -1 $OUT/c1/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_runtime.py -rs > $OUT/c1/pytest-runtime.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; grep -E "SKIP|FAIL|ERROR" $OUT/c1/pytest-runtime.log | head; tail -2 $OUT/c1/pytest-runtime.log
(patch -p1 -s < $S/wk4-probe.diff || git apply $S/wk4-probe.diff) && timeout 120 dflashgen generate > $OUT/c1/generate.log 2>&1
echo "generate rc $? at $((SECONDS - t0)) s"; tail -1 $OUT/c1/generate.log
RX="n5120_k(1536|4352)_sk1_wk4_kg32_r(8|16)_nt"
dflashgen build --arch 90 -j 16 -q --only "$RX" > $OUT/c1/build-probe.txt 2>&1; tail -1 $OUT/c1/build-probe.txt
timeout $((560 - (SECONDS - t0))) python3 tools/wgmma_race.py fp8_channel/store/n5120/k1536 fp8_channel/store/n5120/k4352 \
  --ms 1 8 16 --only "$RX" --timeout 80 --json $OUT/c1/race.json > $OUT/c1/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $OUT/c1/race.txt | grep -v "^read" | head -60
