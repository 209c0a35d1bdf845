#!/bin/bash
# Session 42 call 2 (the re-tuned table): GPU tests of the new register tiles and the tuned dispatch,
# the endpoint in both deployments, and dflashgen bench of both formats (#4's figures).
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s42
mkdir -p $OUT/c2
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served|r16_nt2_wn1_st2_xa1" > $OUT/c2/build.txt 2>&1; tail -1 $OUT/c2/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY=r16_nt2_wn1_st2_xa1 timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $OUT/c2/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c2/pytest.log
timeout 200 dflashgen decode-bench /tmp/ck/ckpt --synthetic --device cuda --batches 1 2 4 8 --out $OUT/c2/nvfp4 > $OUT/c2/nvfp4.log 2>&1
echo "nvfp4 rc $? at $((SECONDS - t0)) s"; grep "^| [1248] " $OUT/c2/nvfp4.log | cut -c1-200
rm -f $OUT/c2/nvfp4/decode_bench.png
timeout 120 dflashgen bench --ms 1 8 16 64 --out $OUT/c2/bench > $OUT/c2/bench.log 2>&1
echo "bench rc $? at $((SECONDS - t0)) s"; rm -f $OUT/c2/bench/bench.png
grep -i -B2 -A14 "forward" $OUT/c2/bench/bench.md | head -40
timeout $((580 - (SECONDS - t0))) dflashgen decode-bench /tmp/ck8/ckpt --synthetic --deployment fp8 --device cuda --batches 1 2 4 8 --out $OUT/c2/fp8 > $OUT/c2/fp8.log 2>&1
echo "fp8 rc $? at $((SECONDS - t0)) s"; grep "^| [1248] " $OUT/c2/fp8.log | cut -c1-200
rm -f $OUT/c2/fp8/decode_bench.png
