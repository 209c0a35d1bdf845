# Sourced by this session's call scripts (repo root on the H200, carry .build): results dir R packed into
# $OUT/results.tgz on exit, the GPU environment, an editable install, and (SWITCH=file.diff) a schedule
# change applied to the device's copy only, with the kernels regenerated.
set -uo pipefail
D=bench/h200-2026-12-01-s16; R=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$R" .' EXIT
source tools/gpu_env.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -2
if [ -n "${SWITCH:-}" ]; then git apply "$D/$SWITCH" && dflashgen generate | tail -1; fi
