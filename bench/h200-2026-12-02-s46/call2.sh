#!/bin/bash
# Session 46 call 2 (call 1's table in the tree): GPU tests of the 21 newly served kernels, the tuned
# dispatch and a tuned run on a reduced shape set (tests/test_gpu_tune.py: the survivors-only build),
# dflashgen bench, the decode loop's GPU tests, then the endpoint (NVFP4, then FP8 as time allows).
export DFLASHGEN_CACHE=/root/dfg-cache; mkdir -p $DFLASHGEN_CACHE
[ -f $DFLASHGEN_CACHE/.unpacked ] || { cp .build/build.tar.gz $DFLASHGEN_CACHE/ && touch $DFLASHGEN_CACHE/.unpacked; }
[ -d $DFLASHGEN_CACHE/include/cute ] || cp -r .build/include $DFLASHGEN_CACHE/
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s44; H=bench/h200-2026-12-02-s46
L=/tmp/c2; mkdir -p $OUT/c2 $L
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served" > $L/build.txt 2>&1; tail -1 $L/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY="$(cat $H/new-served.txt)" timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $L/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -2 $L/pytest.log
timeout 90 dflashgen bench --ms 1 8 16 64 --out $L/bench > $L/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; cp $L/bench/bench.json $OUT/c2/
python3 -c "
import json; b=json.load(open('$L/bench/bench.json'))
for f in b['forward_totals']: print(f['deployment'], f['tp'], f['m'], f['ours_ms'], f['roofline_fraction'])
print('read', b['read_gbs'])"
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -rfE > $L/pytest-decode.log 2>&1
echo "pytest decode rc $? at $((SECONDS - t0)) s"; tail -2 $L/pytest-decode.log
timeout 150 dflashgen decode-bench /tmp/ck/ckpt --synthetic --device cuda --batches 1 2 4 8 --out $OUT/c2/nvfp4 > $L/nvfp4.log 2>&1
echo "nvfp4 rc $? at $((SECONDS - t0)) s"; grep "^| [1248] " $L/nvfp4.log | cut -c1-200
rm -f $OUT/c2/nvfp4/decode_bench.png
tar czf $OUT/c2/logs.tgz -C $L build.txt pytest.log bench.log pytest-decode.log nvfp4.log
timeout $((570 - (SECONDS - t0))) dflashgen decode-bench /tmp/ck8/ckpt --synthetic --deployment fp8 --device cuda --batches 1 2 4 8 --out $OUT/c2/fp8 > $L/fp8.log 2>&1
echo "fp8 rc $? at $((SECONDS - t0)) s"; grep "^| [1248] " $L/fp8.log | cut -c1-200
rm -f $OUT/c2/fp8/decode_bench.png
tar czf $OUT/c2/logs.tgz -C $L build.txt pytest.log bench.log pytest-decode.log nvfp4.log fp8.log
