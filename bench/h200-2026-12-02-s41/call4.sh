#!/bin/bash
# Session 41 call 4 (final tree): GPU tests of the new tiles and the tuned dispatch, then the endpoint
# at B1-B8 in both deployments.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s41
mkdir -p $OUT/c4
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served|n34816.*_st2_|n34816.*_mb[59]$" > $OUT/c4/build.txt 2>&1; tail -1 $OUT/c4/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY=_n34816_ timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "n34816 or tuned or dispatch or fast_path or bad_input or graph" -rfE > $OUT/c4/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c4/pytest.log
timeout 200 dflashgen decode-bench /tmp/ck/ckpt --synthetic --device cuda --batches 1 2 4 8 --out $OUT/c4/nvfp4 > $OUT/c4/nvfp4.log 2>&1
echo "nvfp4 rc $? at $((SECONDS - t0)) s"; grep "^| [1248] " $OUT/c4/nvfp4.log
rm -f $OUT/c4/nvfp4/decode_bench.png
timeout $((570 - (SECONDS - t0))) dflashgen decode-bench /tmp/ck8/ckpt --synthetic --deployment fp8 --device cuda --batches 1 2 4 8 --out $OUT/c4/fp8 > $OUT/c4/fp8.log 2>&1
echo "fp8 rc $? at $((SECONDS - t0)) s"; grep "^| [1248] " $OUT/c4/fp8.log
rm -f $OUT/c4/fp8/decode_bench.png
