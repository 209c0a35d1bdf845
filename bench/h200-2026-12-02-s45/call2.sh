#!/bin/bash
# Session 45 call 2: an unsplit K plan with < 8 K groups per warp also races warps_k / 2
# (k_plan.halve_warps_k_below: FP8 and NVFP4 n5120 k1536, the TP4 o_proj / out_proj). Re-tune the two
# problems whose candidates changed (--carry session 44's c6 report), the GPU tests of their served
# kernels and the tuned dispatch, dflashgen bench on the new table; then (probe, tree patched here) the
# threshold at 12, which gives the NVFP4 K = 5120 / 4352 problems (8-10 groups per warp) the half plan
# too, raced at M = 1 / 8 / 16 against the served kernels.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44
mkdir -p $OUT/c2
t0=$SECONDS
timeout 240 dflashgen tune --carry $S/c6/tune-measurements.json.gz > $OUT/c2/tune.log 2>&1
echo "tune rc $? at $((SECONDS - t0)) s"; grep -v "it/s\]\|s/it\]" $OUT/c2/tune.log | tail -3
gzip -c tuning/nvidia-h200.measurements.json > $OUT/c2/tune-measurements.json.gz 2>/dev/null
cp tuning/nvidia-h200.json $OUT/c2/ 2>/dev/null
python3 - <<'PY' > $OUT/c2/served.txt
import json
t = json.load(open("tuning/nvidia-h200.json"))
for k, p in sorted(t["problems"].items()):
    for b in p["buckets"]:
        print(k, b["m"], (b.get("kernel") or b.get("path")), round(b.get("us") or 0, 2))
PY
grep -E "n5120/k1536" $OUT/c2/served.txt | grep -E " (1|8|16|32|64) " | sed 's/dfg_sm90_//'
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
NEW="$(echo "$served" | tr '|' '\n' | grep -E 'n5120_k1536_' | paste -sd'|')"
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $OUT/c2/build.txt 2>&1; tail -1 $OUT/c2/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY="$NEW" timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $OUT/c2/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/c2/pytest.log
timeout 90 dflashgen bench --ms 1 8 16 64 --out $OUT/c2/bench > $OUT/c2/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; rm -f $OUT/c2/bench/bench.png $OUT/c2/bench/bench.md
python3 -c "
import json; b=json.load(open('$OUT/c2/bench/bench.json'))
for f in b['forward_totals']: print(f['deployment'], f['tp'], f['m'], f['ours_ms'], f['roofline_fraction'])
print('read', b['read_gbs'])"
# probe: halve_warps_k_below 12
sed -i 's/halve_warps_k_below: 8 /halve_warps_k_below: 12/' schedules/sm_90.yaml && timeout 60 dflashgen generate 2>&1 | tail -1
RX="(n8704|n4120|n3584)_k5120_sk1_wk4_kg64_r(8|16)_nt|n5120_k4352_sk1_wk4_kg64_r(8|16)_nt"
dflashgen build --arch 90 -j 16 -q --only "$RX" > $OUT/c2/build-probe.txt 2>&1; tail -1 $OUT/c2/build-probe.txt
timeout $((585 - (SECONDS - t0))) python3 tools/wgmma_race.py nvfp4/silu/n8704 nvfp4/store/n4120 nvfp4/store/n3584 \
  nvfp4/store/n5120/k4352 --ms 1 8 16 --only "$RX" --timeout 60 --json $OUT/c2/race.json > $OUT/c2/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $OUT/c2/race.txt | grep -v "^read" | head -60
