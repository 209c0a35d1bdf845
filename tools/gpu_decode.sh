#!/usr/bin/env bash
# The decode loop on one H200, in one call (issue #5): build what the decode path loads, run the
# decode GPU tests (compact rejection kernel vs dense for sm_90 cubin + compute_70 PTX, CUDA graphs
# == eager, greedy byte-identity B1/B2/B4/B8 and vs plain decoding, bad inputs), then the full-size
# endpoint benchmark (Qwen3.8-27B-shaped synthetic NVFP4 checkpoint written on the GPU; 16 prompts
# x 1024 tokens -> 512; B = 1, 2, 4, 8; replay drafter, accepted length ~4.3, official sampling).
#   OUT=/some/dir bash tools/gpu_decode.sh        (carry .build like tools/gpu_session.sh)
# Writes 4 files under $OUT: gpu_decode.log (every step, elapsed seconds), pytest-decode.log,
# decode_bench.json, decode_bench.md. Bound: each step has its own timeout (below), 24 min in all;
# expected ~8-12 min (build 0-4 min depending on .build, GPU tests ~2, smoke ~1, full-size bench ~4-5
# including the checkpoint write); gpu_decode.log has every step's elapsed seconds.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
LOG=$OUT/gpu_decode.log; : > "$LOG"
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
log() { echo "$*" | tee -a "$LOG"; }
step() {  # step TIMEOUT_S CMD...: run with a timeout, log its output tail and elapsed time
  local lim=$1; shift; local t=$SECONDS cmd="$*"
  log "== [$((SECONDS - T0)) s] ${cmd:0:200} (timeout ${lim} s)"
  timeout "$lim" "$@" 2>&1 | tail -40 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "   (rc $rc, $((SECONDS - t)) s)"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
dfg_install
# sm_90: the GEMMs the H200 tuning table dispatches + the rejection and gdn families, not all ~300 (any
# header change re-fingerprints every kernel; a no-op when .build is warm); sm_70: those families'
# compute_70 PTX (NVRTC 12.9 wheel), JIT-compiled by the driver in the tests.
ONLY=$(python3 -c '
import json, re
names = set(re.findall(r"\"(dfg_sm90_[a-z0-9_]+)\"", open("tuning/nvidia-h200.json").read()))
print("^(" + "|".join(sorted(names)) + ")$|_rejection_|_gdn_")')
step 300 dflashgen build --arch 90 --only "$ONLY" -j 16 -q
step 120 dflashgen build --arch 70 --only "_rejection_|_gdn_" -j 16 -q
step 300 bash -c "python3 -m pytest -q -m gpu tests/test_gpu_gdn.py tests/test_gpu_decode.py -p no:cacheprovider -rfP 2>&1 | tee '$OUT/pytest-decode.log'"
# smoke: the whole bench path on 4 layers in seconds, so a failure shows before the full-size run
step 120 dflashgen decode-bench --synthetic --device cuda --layers 4 --prompts 4 --prompt-len 128 \
  --output-len 64 --batches 1 2
step 600 dflashgen decode-bench --synthetic --device cuda --out "$OUT"
log "== total $((SECONDS - T0)) s"
