#!/bin/bash
# Session 45 call 3: k_plan.halve_warps_k_below 12 (call 2's probe landed): FP8 k1536 and every NVFP4
# unsplit plan with < 12 K groups per warp (K = 5120 / 4352 / 1536) also race warps_k / 2. Re-tune the
# problems whose candidates changed (--carry session 44's c6 report), the GPU tests of the newly served
# kernels and the tuned dispatch, then dflashgen bench. Logs go in one tarball (8 files come back).
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44
L=/tmp/c3; mkdir -p $OUT/c3 $L
t0=$SECONDS
timeout 330 dflashgen tune --carry $S/c6/tune-measurements.json.gz > $L/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]\|s/it\]" $L/tune.log | tail -3
gzip -c tuning/nvidia-h200.measurements.json > $OUT/c3/tune-measurements.json.gz 2>/dev/null
cp tuning/nvidia-h200.json $OUT/c3/ 2>/dev/null
python3 - <<'PY' > $OUT/c3/served.txt
import json
t = json.load(open("tuning/nvidia-h200.json"))
for k, p in sorted(t["problems"].items()):
    for b in p["buckets"]:
        print(k, b["m"], (b.get("kernel") or b.get("path")), round(b.get("us") or 0, 2))
PY
grep -E "nvfp4|k1536" $OUT/c3/served.txt | grep -E " (1|8|16) " | grep -E "_wk4_|k1536" | sed 's/dfg_sm90_//'
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
NEW="$(echo "$served" | tr '|' '\n' | grep -E 'nvfp4_.*_sk1_wk4_|nvfp4_.*k1536.*_wk2_|fp8_.*k1536' | paste -sd'|')"
echo "new served: $(echo "$NEW" | tr '|' '\n' | wc -l)"
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $L/build.txt 2>&1; tail -1 $L/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY="$NEW" timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $L/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -2 $L/pytest.log
timeout 90 dflashgen bench --ms 1 8 16 64 --out $L/bench > $L/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; cp $L/bench/bench.json $OUT/c3/
python3 -c "
import json; b=json.load(open('$L/bench/bench.json'))
for f in b['forward_totals']: print(f['deployment'], f['tp'], f['m'], f['ours_ms'], f['roofline_fraction'])
print('read', b['read_gbs'])"
tar czf $OUT/c3/logs.tgz -C $L tune.log build.txt pytest.log bench.log
