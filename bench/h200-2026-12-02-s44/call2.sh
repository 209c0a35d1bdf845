#!/bin/bash
# Session 44 call 2: sm_80+ layouts pad N to 64 rows (four warp tiles), so FP8 n4120 and n16480 (TP4 / TP1
# in_proj_qkvzba) can take the warp_nt 4 tiles. Re-tune the four problems whose kernels changed (--carry
# call 1's report), the GPU tests of the new nt4 kernels and every served n4120 / n16480 kernel, then
# dflashgen bench (both formats, TP1 + TP4) on the new table.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44
mkdir -p $OUT/c2
t0=$SECONDS
timeout 380 dflashgen tune --carry $S/c1/tune-measurements.json.gz > $OUT/c2/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]\|s/it\]" $OUT/c2/tune.log | tail -4
gzip -c tuning/nvidia-h200.measurements.json > $OUT/c2/tune-measurements.json.gz 2>/dev/null
cp tuning/nvidia-h200.json $OUT/c2/ 2>/dev/null
python3 - <<'PY' > $OUT/c2/served.txt
import json
t = json.load(open("tuning/nvidia-h200.json"))
for k, p in sorted(t["problems"].items()):
    for b in p["buckets"]:
        print(k, b["m"], (b.get("kernel") or b.get("path")), round(b.get("us") or 0, 2))
PY
grep -E "n4120|n16480" $OUT/c2/served.txt | grep -E " (1|8|16|32) "
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
NEW="$(echo "$served" | tr '|' '\n' | grep -E 'n4120_|n16480_' | paste -sd'|')|(n4120|n16480)_k5120_.*_nt4_wn1_"
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served|$NEW" > $OUT/c2/build.txt 2>&1; tail -1 $OUT/c2/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY="$NEW" timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $OUT/c2/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c2/pytest.log
timeout $((585 - (SECONDS - t0))) dflashgen bench --ms 1 8 16 64 --out $OUT/c2/bench > $OUT/c2/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; rm -f $OUT/c2/bench/bench.png $OUT/c2/bench/bench.md
python3 -c "
import json; b=json.load(open('$OUT/c2/bench/bench.json'))
for f in b['forward_totals']: print(f['deployment'], f['tp'], f['m'], f['ours_ms'], f['roofline_fraction'])
print('read', b['read_gbs'])"
