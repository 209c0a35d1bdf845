#!/usr/bin/env bash
# One device session: install, build what is missing, prove every kernel, run the GPU tests.
# Usage (on the GPU machine, repo root; carry .build so prebuilt sm_70 PTX comes along):
#   OUT=/some/dir bash tools/gpu_session.sh [verify-args...]
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export DFLASHGEN_CACHE=${DFLASHGEN_CACHE:-$PWD/.build} PYTHONUNBUFFERED=1
export CUDA_CACHE_PATH=$DFLASHGEN_CACHE/cuda-jit CUDA_CACHE_MAXSIZE=4294967296  # driver JIT cache for PTX
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -2
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
step() { local t=$SECONDS; echo "== $1"; shift; "$@"; echo "   (took $((SECONDS - t)) s)"; }
step build dflashgen build --arch 90 -j 16 --no-spills 2>&1 | tail -4
step verify dflashgen verify --arch 90 70 --json "$OUT/verify.json" "$@" 2>&1 | tee "$OUT/verify.log" | grep -v "verify:"
# PYTEST_ARGS lets a session skip the per-kernel groups already covered by `verify` above.
step pytest python3 -m pytest -q -m gpu tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-gpu.log" | tail -15
