#!/bin/bash
# Session 43 call 3: re-tune the problems the FP8-only register tiles join (r8 nt4 wn1 st2; r16 nt2 / nt1
# wn1 st3 in the warps_k 8 plans; r16 nt2 wn2 st2 in the warps_k 4 plans), carrying the rest from session
# 42's report; then the GPU tests of the new kernels and the tuned dispatch, and dflashgen bench (both
# formats, TP1 + TP4) on the new table.
source tools/gpu_env.sh; dfg_install
NEW="r8_nt4_wn1_st2_xa1|fp8_.*_r16_nt[12]_wn1_st3_xa1_xs0|fp8_.*_r16_nt2_wn2_st2_xa1_xs0"
S=bench/h200-2026-12-02-s43
mkdir -p $OUT/c3
t0=$SECONDS
timeout 400 dflashgen tune --carry bench/h200-2026-12-02-s42/c1/tune-measurements.json.gz > $OUT/c3/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]\|s/it\]" $OUT/c3/tune.log | tail -4
cp tuning/nvidia-h200.json $OUT/c3/ 2>/dev/null
gzip -c tuning/nvidia-h200.measurements.json > $OUT/c3/tune-measurements.json.gz 2>/dev/null
python3 - <<'PY' > $OUT/c3/served.txt
import json
t = json.load(open("tuning/nvidia-h200.json"))
for k, p in sorted(t["problems"].items()):
    for b in p["buckets"]:
        if b["m"] in (1, 8, 16, 32):
            print(k, b["m"], (b.get("kernel") or b.get("path")), round(b.get("us") or 0, 2))
PY
grep -cE "$NEW" $OUT/c3/served.txt; grep -E "$NEW" $OUT/c3/served.txt | head -30
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served|$NEW" > $OUT/c3/build.txt 2>&1; tail -1 $OUT/c3/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY="$NEW" timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $OUT/c3/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c3/pytest.log
timeout $((580 - (SECONDS - t0))) dflashgen bench --ms 1 8 16 64 --out $OUT/c3/bench > $OUT/c3/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; rm -f $OUT/c3/bench/bench.png
grep -i -A14 "forward" $OUT/c3/bench/bench.md | head -30
