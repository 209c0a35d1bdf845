#!/usr/bin/env bash
# Issue #6 on the GPU machine, in one call: build the attention kernels for this GPU, run the GPU
# attention tests (native cubins and the sm_70 build's compute_70 PTX via the driver JIT) and the
# benchmark. From the repo root:
#   OUT=/some/dir bash tools/gpu_attention.sh
# Carry .build holding the sm_70 attention kernels (the H200 has no CUDA 12 toolchain); on a CUDA 12
# machine: DFLASHGEN_CACHE=.build dflashgen build --arch 70 --only dfg_attn
# Writes exactly: $OUT/attention.log, $OUT/attn-bench.json, $OUT/attn-bench.md.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
exec > >(tee -a "$OUT/attention.log") 2>&1
T0=$SECONDS
step() { local t=$SECONDS; echo "== $*"; "$@"; local rc=$?; echo "   (rc $rc, $((SECONDS - t)) s)"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
dfg_install
ARCH=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); a = 10 * m + n; \
print(90 if a >= 90 else 80 if a >= 80 else 70)")
step dflashgen build --arch "$ARCH" --only dfg_attn -j 16 --no-spills -v -q
step dflashgen build --arch 70 --only dfg_attn -q  # prebuilt from the carried cache when no CUDA 12 here
# Native build first, then the sm_70 build's PTX in its own process (a fault there cannot hide the rest).
step python3 -m pytest -q -m gpu tests/test_gpu_attention.py -k "not 70" -p no:cacheprovider -rfE --durations=5
step python3 -m pytest -q -m gpu tests/test_gpu_attention.py -k "70" -p no:cacheprovider -rfE --durations=5
step dflashgen attn-bench --out "$OUT"
echo "== total $((SECONDS - T0)) s"
