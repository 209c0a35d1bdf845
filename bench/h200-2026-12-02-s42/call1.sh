#!/bin/bash
# Session 42 call 1: re-tune every problem the new register tile ([16, 2, 1, 2, 1, 256, 256]: r16 nt2
# wn1 st2 xa1 in the warps_k 8 plans) joins, carrying the rest from session 41's report. The tuner
# builds only the re-tuned problems' kernels and verifies each candidate before timing it.
source tools/gpu_env.sh; dfg_install
mkdir -p $OUT/c1
t0=$SECONDS
timeout 540 dflashgen tune --carry bench/h200-2026-12-02-s41/c3/tune-measurements.json.gz > $OUT/c1/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]\|s/it\]" $OUT/c1/tune.log | tail -5
cp tuning/nvidia-h200.json $OUT/c1/ 2>/dev/null
gzip -c tuning/nvidia-h200.measurements.json > $OUT/c1/tune-measurements.json.gz 2>/dev/null \
  || gzip -c tuning/nvidia-h200.journal.json > $OUT/c1/tune-journal.json.gz
python3 - <<'PY' > $OUT/c1/served.txt
import json
t = json.load(open("tuning/nvidia-h200.json"))
for k, p in sorted(t["problems"].items()):
    for b in p["buckets"]:
        if b["m"] in (8, 16, 32):
            print(k, b["m"], (b.get("kernel") or b.get("path")), round(b.get("us") or 0, 2))
PY
grep -c "r16_nt2_wn1_st2_xa1" $OUT/c1/served.txt; grep "r16_nt2_wn1_st2_xa1" $OUT/c1/served.txt | head -30
