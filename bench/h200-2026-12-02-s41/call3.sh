#!/bin/bash
# Session 41 call 3: re-tune the four n34816 problems (their new one-wave M = 16 tiles) carrying the
# other 20 from session 29's measurements, then the endpoint B1 / B2 and the 64-layer projection chain.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s41
mkdir -p $OUT/c3
t0=$SECONDS
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|_n34816_" > $OUT/c3/build.txt 2>&1; tail -2 $OUT/c3/build.txt
echo "build done at $((SECONDS - t0)) s"
timeout 200 dflashgen tune --only "n34816" --carry $S/s29-measurements-hashed.json.gz > $OUT/c3/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]" $OUT/c3/tune.log | tail -4
cp tuning/nvidia-h200.json $OUT/c3/ && gzip -c tuning/nvidia-h200.measurements.json > $OUT/c3/tune-measurements.json.gz
python3 - <<'PY'
import json
t = json.load(open("tuning/nvidia-h200.json"))
for k, p in t["problems"].items():
    if "n34816" in k:
        for b in p["buckets"]:
            print(k, b["m"], b.get("kernel"), round(b.get("us") or 0, 2))
PY
timeout 200 dflashgen decode-bench /tmp/ck/ckpt --synthetic --device cuda --batches 1 2 --out $OUT/c3/decode > $OUT/c3/decode.log 2>&1
echo "decode rc $? at $((SECONDS - t0)) s"; grep "^| [12] " $OUT/c3/decode.log
timeout $((560 - (SECONDS - t0))) python3 tools/chain_probe.py --ms 8 16 --out $OUT/c3/chain.json > $OUT/c3/chain.txt 2>&1
echo "chain rc $? at $((SECONDS - t0)) s"; grep -i "graph\|ms" $OUT/c3/chain.txt | head -12
