#!/bin/bash
# Session 44 call 1: FP8 n4120 (TP4 in_proj_qkvzba) gets an sk2 alternative K plan (an evenly loaded
# split plan now races fewer splits), and the unserved FP8 warps_k 4 r16 nt2 wn2 st2 entry is gone.
# Re-tune the problems whose candidates changed (--carry session 43's report), the GPU tests of the new
# kernels and the tuned dispatch, then dflashgen bench (both formats, TP1 + TP4) on the new table.
source tools/gpu_env.sh; dfg_install
NEW="fp8_store_n4120_k5120_sk2_"
S=bench/h200-2026-12-02-s44
mkdir -p $OUT/c1
t0=$SECONDS
timeout 330 dflashgen tune --carry bench/h200-2026-12-02-s43/c3/tune-measurements.json.gz > $OUT/c1/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]\|s/it\]" $OUT/c1/tune.log | tail -4
gzip -c tuning/nvidia-h200.measurements.json > $OUT/c1/tune-measurements.json.gz 2>/dev/null
cp tuning/nvidia-h200.json $OUT/c1/ 2>/dev/null
python3 - <<'PY' > $OUT/c1/served.txt
import json
t = json.load(open("tuning/nvidia-h200.json"))
for k, p in sorted(t["problems"].items()):
    for b in p["buckets"]:
        if b["m"] in (1, 8, 16, 32):
            print(k, b["m"], (b.get("kernel") or b.get("path")), round(b.get("us") or 0, 2))
PY
grep "n4120" $OUT/c1/served.txt
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served|$NEW" > $OUT/c1/build.txt 2>&1; tail -1 $OUT/c1/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY="$NEW" timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $OUT/c1/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c1/pytest.log
timeout $((585 - (SECONDS - t0))) dflashgen bench --ms 1 8 16 64 --out $OUT/c1/bench > $OUT/c1/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; rm -f $OUT/c1/bench/bench.png $OUT/c1/bench/bench.md
python3 -c "
import json; b=json.load(open('$OUT/c1/bench/bench.json'))
for f in b['forward_totals']: print(f['deployment'], f['tp'], f['m'], f['ours_ms'], f['roofline_fraction'])
print('read', b['read_gbs'])"
