#!/usr/bin/env bash
# Branch next8 (pdl8 + gdn8 + attn8) on one H200, in two device calls of < 10 minutes each, run from
# the repo root with `.build` carried. Before the first call, on the CPU machine, on branch next8:
#   DFLASHGEN_CACHE=$PWD/.build dflashgen build --arch 70 -j 2 -q && python tools/carry_build.py .build \
#     && python tools/cutlass_subset.py
# (without the carried .build the device has no CUTLASS headers and no compute_70 PTX: builds fail).
#   PART=1 OUT=$OUT bash tools/gpu_next8.sh  # build, verify 90 + 70 (GEMMs under PDL; the wgmma vs
#                                            # mma.sync plan-twin line), tune, bench, the PDL A/B on
#                                            # this machine and table, the GDN step timing  (~6-7 min)
#   PART=2 OUT=$OUT bash tools/gpu_next8.sh  # every GPU test (GDN bitwise with the new staging, TMA
#                                            # attention == its cp.async twin), the TMA race, then the
#                                            # decode endpoint if the tests passed  (~8-9 min)
# Results: $OUT/next8-PART.tgz (the device tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
R=$(mktemp -d); mkdir -p /tmp/dfg
source "$(dirname "$0")/gpu_env.sh"
trap 'tar czf "$OUT/next8-${PART:-1}.tgz" -C "$R" .' EXIT
case "${PART:-1}" in
1)
  OUT=$R/session STEPS="build verify tune bench" bash tools/gpu_session.sh
  cp "$R/session/nvidia-h200.json" /tmp/dfg/ 2>/dev/null
  # the PDL A/B: the same machine, the same table, the TP4 problems and the TP1 ones it slowed
  for p in 1 0; do
    DFLASHGEN_PDL=$p timeout 120 dflashgen bench --table /tmp/dfg/nvidia-h200.json --ms 1 8 16 \
      --only 'n3584|n4120|k1536|k4352|n8704|k6144|k17408' --out "$R/ab-pdl$p" > /dev/null 2>&1
    echo "== PDL=$p"; grep -E "^\| [14] \|" "$R/ab-pdl$p/bench.md"
  done
  echo "== gdn step / advance"; timeout 120 python3 tools/gdn_bench.py --json "$R/gdn-bench.json" ;;
2)
  [ -f /tmp/dfg/nvidia-h200.json ] && cp /tmp/dfg/nvidia-h200.json tuning/nvidia-h200.json
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -1
  dflashgen build --arch 90 -j 16 -q 2>&1 | tail -1
  timeout 240 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE > "$R/pytest-gpu.log" 2>&1
  ok=$?; tail -3 "$R/pytest-gpu.log"
  OUT=$R/attn timeout 120 bash tools/gpu_attn_wg.sh tma 2>&1 | tail -5
  if [ $ok = 0 ]; then
    CK=$(mktemp -d)/ckpt; mkdir -p "$R/decode"
    timeout 300 dflashgen decode-bench "$CK" --synthetic --device cuda --out "$R/decode" 2>&1 | tail -8
  fi ;;
esac
