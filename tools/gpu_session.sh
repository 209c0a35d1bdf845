#!/usr/bin/env bash
# One GPU session, end to end: install, build what is missing, prove every kernel, run the GPU
# tests, tune, bench. Run from the repo root on the GPU machine:
#   OUT=/some/dir bash tools/gpu_session.sh
# STEPS picks a subset (default: all, in this order): build verify pytest overhead tune bench
# Carry .build (prebuilt sm_70 PTX from a CUDA 12 machine; CUTLASS header subset in .build/include
# when the GPU machine has no nvidia-cutlass wheel).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
dfg_install
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"
STEPS=${STEPS:-build verify pytest overhead tune bench}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { local t=$SECONDS; echo "== $*"; "$@"; local rc=$?; echo "   (rc $rc, $((SECONDS - t)) s)"; }
want build && step dflashgen build --arch 90 -j 16 -q 2>&1 | tail -3
want verify && step dflashgen verify --arch 90 70 2>&1 | grep -v "verify:" | tee "$OUT/verify.log"
want pytest && step python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
want overhead && step dflashgen overhead --out "$OUT/overhead.json" 2>&1 | tail -20 | tee "$OUT/overhead.txt"
if want tune; then
  # the journal stays in /tmp/dfg/tune: a run cut short (TUNE_TIMEOUT seconds, 0: none) resumes there
  # on the same (warm) machine; the table and its measurements come back once it completes
  TUNE=/tmp/dfg/tune; mkdir -p "$TUNE"; rm -f "$TUNE/nvidia-h200.json"  # (a table from an earlier run)
  step timeout "${TUNE_TIMEOUT:-0}" dflashgen tune --out "$TUNE/nvidia-h200.json" 2>&1 | grep -v "tune:" | tail -2
  if [ -f "$TUNE/nvidia-h200.json" ]; then
    cp "$TUNE/nvidia-h200.json" "$OUT/"
    # every timed candidate per problem and M (losing K plans, e.g. wgmma, included): tune.py timings_us
    gzip -c "$TUNE/nvidia-h200.measurements.json" > "$OUT/tune-measurements.json.gz"
  else
    echo "tune not finished (journal in $TUNE): run PART=A2 again on this machine"; STEPS=${STEPS/bench/}
  fi
fi
TABLE=$OUT/nvidia-h200.json; [ -f "$TABLE" ] || TABLE=tuning/nvidia-h200.json
want bench && step dflashgen bench --table "$TABLE" --out "$OUT/bench" 2>&1 | grep -v "bench:" | tail -24
