#!/bin/bash
# Session 42 call 3: the GPU tests of the new register tiles and the tuned dispatch (call 2's run died
# on the test filter; fixed), then a probe on a tree with r32-capped.diff applied: the r32 nt2 wn2 st2
# x_smem tile capped for 5 CTAs per SM (gate_up n34816's 544 CTAs in one wave at M = 24-32) raced
# against the served kernels.
source tools/gpu_env.sh; dfg_install
S=bench/h200-2026-12-02-s42
mkdir -p $OUT/c3
t0=$SECONDS
served=$(python3 -c "import json; t=json.load(open('tuning/nvidia-h200.json')); print('|'.join(sorted({b['kernel'] for p in t['problems'].values() for b in p['buckets'] if b.get('kernel')})))")
dflashgen build --arch 90 -j 16 -q --only "$(cat $S/build-only.txt)|$served|r16_nt2_wn1_st2_xa1" > $OUT/c3/build.txt 2>&1; tail -1 $OUT/c3/build.txt
echo "build done at $((SECONDS - t0)) s"
DFLASHGEN_GPU_ONLY=r16_nt2_wn1_st2_xa1 timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_tune.py \
  tests/test_gpu_runtime.py -k "test_kernel_group or tuned or dispatch or fast_path or bad_input or graph" -rfE > $OUT/c3/pytest.log 2>&1
echo "pytest rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c3/pytest.log
git apply $S/r32-capped.diff && echo "probe tree: $(python3 -c 'from dflashgen.render import load_manifest; print(len(load_manifest()["kernels"]))') GEMM kernels"
timeout 240 python3 tools/wgmma_race.py nvfp4/silu/n34816/k5120 nvfp4/store/n34816/k5120 fp8_channel/silu/n34816/k5120 \
  --ms 16 24 32 --only "r32_nt2_wn2_st2_xa0_xs1_mb5" --json $OUT/c3/race.json > $OUT/c3/race.txt 2>&1
echo "race rc $? at $((SECONDS - t0)) s"; grep -v "compiling" $OUT/c3/race.txt | head -40
git apply -R $S/r32-capped.diff
