#!/bin/bash
# Session 47 call 4 (c3's table committed): build the served + build-only kernels, GPU tests of the newly
# served kernels + tuned dispatch, `dflashgen bench`, then the decode GPU tests on this table.
export DFLASHGEN_CACHE=/root/dfg-cache; mkdir -p $DFLASHGEN_CACHE
[ -f $DFLASHGEN_CACHE/.unpacked ] || { cp .build/build.tar.gz $DFLASHGEN_CACHE/ && touch $DFLASHGEN_CACHE/.unpacked; }
[ -d $DFLASHGEN_CACHE/include/cute ] || cp -r .build/include $DFLASHGEN_CACHE/
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44; L=/tmp/c4; mkdir -p $OUT/c4 $L
t0=$SECONDS
git show HEAD~1:tuning/nvidia-h200.json > /tmp/old-table.json
NEW=$(python3 -c "
import json
o=json.load(open('/tmp/old-table.json')); n=json.load(open('tuning/nvidia-h200.json'))
s=lambda t: {b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')}
print('|'.join(sorted(s(n)-s(o))))")
echo "new served: $NEW"
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $L/build.txt 2>&1; tail -1 $L/build.txt
echo "build at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY="$NEW" timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $L/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -2 $L/pytest.log
timeout 90 dflashgen bench --ms 1 8 16 64 --out $L/bench > $L/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; cp $L/bench/bench.json $OUT/c4/
python3 -c "
import json; b=json.load(open('$L/bench/bench.json'))
for f in b['forward_totals']: print(f['deployment'], f['tp'], f['m'], f['ours_ms'], f['roofline_fraction'])
print('read', b['read_gbs'])"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -x > $L/pytest-decode.log 2>&1
echo "decode pytest rc $? at $((SECONDS - t0)) s"; tail -2 $L/pytest-decode.log
tar czf $OUT/c4/logs.tgz -C $L build.txt pytest.log bench.log pytest-decode.log
