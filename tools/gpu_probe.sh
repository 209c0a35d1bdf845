#!/usr/bin/env bash
# A short measuring call (one device command, ~4-6 min): host cost per projection call, where a
# prefill's time goes, ncu of chosen GEMM kernels, and the two-GPU tests when two GPUs are present.
#   KERNELS="name_regex@M ..." OUT=... bash tools/gpu_probe.sh     (carry .build; results in $OUT/probe.tgz)
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
R=$(mktemp -d)
source "$(dirname "$0")/gpu_env.sh"
trap 'tar czf "$OUT/probe.tgz" -C "$R" .' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
dfg_install
dflashgen build --arch 90 -j "$(nproc)" -q 2>&1 | tail -3
echo "== overhead"; dflashgen overhead --out "$R/overhead.json" 2>&1 | tee "$R/overhead.txt" | tail -22
echo "== prefill profile"
timeout 240 python3 tools/profile_prefill.py --layers ${PREFILL_LAYERS:-4} 2>&1 | tee "$R/profile-prefill.txt" | head -60
echo "== prefill profile, GDN in the torch chunk form (before / after)"
timeout 240 python3 tools/profile_prefill.py --layers ${PREFILL_LAYERS:-4} --gdn torch 2>&1 \
  | tee "$R/profile-prefill-chunk.txt" | head -30
ncu_gemms "$R" "${KERNELS:-}"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "== two-GPU tests"
  timeout 300 python3 -m pytest -q -m gpu tests/test_parallel.py 2>&1 | tee "$R/pytest-tp2.log" | tail -5
fi
