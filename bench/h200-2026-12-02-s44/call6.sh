#!/bin/bash
# Session 44 call 6: sm_90 split_if_below 0.5 -> 0.4, so the TP4 in_proj_qkvzba (n4120) and qkv (n3584)
# problems derive the unsplit warps_k 8 plan (call 5's race). Re-tune the four problems whose candidates
# changed (--carry call 1's report), the GPU tests of their served kernels and the tuned dispatch, then
# dflashgen bench (both formats, TP1 + TP4) on the new table.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44
mkdir -p $OUT/c6
t0=$SECONDS
timeout 300 dflashgen tune --carry $S/c1/tune-measurements.json.gz > $OUT/c6/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]\|s/it\]" $OUT/c6/tune.log | tail -3
gzip -c tuning/nvidia-h200.measurements.json > $OUT/c6/tune-measurements.json.gz 2>/dev/null
cp tuning/nvidia-h200.json $OUT/c6/ 2>/dev/null
python3 - <<'PY' > $OUT/c6/served.txt
import json
t = json.load(open("tuning/nvidia-h200.json"))
for k, p in sorted(t["problems"].items()):
    for b in p["buckets"]:
        print(k, b["m"], (b.get("kernel") or b.get("path")), round(b.get("us") or 0, 2))
PY
grep -E "n4120|n3584" $OUT/c6/served.txt | grep -E " (1|8|16|32|64) " | sed 's/dfg_sm90_//'
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
NEW="$(echo "$served" | tr '|' '\n' | grep -E 'n4120_|n3584_' | paste -sd'|')"
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $OUT/c6/build.txt 2>&1; tail -1 $OUT/c6/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY="$NEW" timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $OUT/c6/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c6/pytest.log
timeout $((420 - (SECONDS - t0))) dflashgen bench --ms 1 8 16 64 --out $OUT/c6/bench > $OUT/c6/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; rm -f $OUT/c6/bench/bench.png $OUT/c6/bench/bench.md
python3 -c "
import json; b=json.load(open('$OUT/c6/bench/bench.json'))
for f in b['forward_totals']: print(f['deployment'], f['tp'], f['m'], f['ours_ms'], f['roofline_fraction'])
print('read', b['read_gbs'])"
