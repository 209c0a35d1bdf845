#!/usr/bin/env bash
# Everything a GPU session proves, in two calls that each fit the 10-minute command limit, packed
# into one archive per call (the device tool returns at most 8 files):
#   PART=A OUT=... bash tools/gpu_all.sh   # build, verify (sm_90 + compute_70 PTX), tune, bench;
#                                          # the new table is kept in /tmp/dfg (PART=A1 then A2:
#                                          # the same in two calls)
#   PART=B ...                             # every GPU test (TP2 over NCCL when 2 GPUs) on that table,
#                                          # overhead, attn-bench
#   PART=C ...                             # a prefill profile and the decode-loop endpoint
#                                          # benchmark on that table. Options: TESTS="tests/..." runs
#                                          # those GPU tests first;
#                                          # AB="decode-bench args" also runs B4 / B8 (AB_BATCHES) with them (e.g.
#                                          # AB="--prefill stall", AB="--join-group 2"); NCU_GEMMS="kernel@M ..."
#                                          # profiles GEMM kernels (tools/ncu_kernel.py; NCU_SOURCE=1:
#                                          # also the stalls per SASS line, tools/ncu_stalls.py);
#                                          # (TESTS_TIMEOUT=s: their limit, default 240 s);
#                                          # BUILD_ONLY_FILE=f builds only the kernels its regex names;
#                                          # ATTN="attn-bench args" (or ATTN=all) runs attn-bench first;
#                                          # DEQUANT=1 times the dequantize kernel (tools/dequant_bench.py);
#                                          # GDN=1 times the GDN step / advance / 1023-token prefill
#                                          # (tools/gdn_bench.py); NCU_GDN=regex: ncu of those GDN
#                                          # kernels in a 1023-token prefill + SASS stalls;
#                                          # GDN_AB=file.diff times them without
#                                          # the diff (git apply -R) and with it, alternating twice;
#                                          # GDN_ENVS="NAME=VALUE ..." once more per setting;
#                                          # DECODE=0 skips the decode-bench and prefill profile;
#                                          # DECODE_ARGS="..." extra decode-bench args (e.g.
#                                          # "--gdn-prefill chunked"); PROFILE_GDN="sequential chunked"
#                                          # profiles the prefill once per GDN form
#   PART=R ...                             # a race of chosen GEMM kernels against the served ones
#                                          # (tools/wgmma_race.py: verified first, then timed):
#                                          # RACE="problem ... --ms 32 64 --only REGEX"; SWITCH=file.diff
#                                          # applied to this copy only first (e.g. a tile list switched
#                                          # on); GEMM_AB=file.diff (a GEMM-header diff, applied in
#                                          # this tree, e.g. by SWITCH) then races without it (git apply
#                                          # -R) and with it, alternating twice, RACE's kernels rebuilt
#                                          # each way (--only '^$': the table's served ones alone);
#                                          # NCU_GEMMS / NCU_SOURCE as in PART=C; CLOCKS="kernel
#                                          # ..." then times each WGC kernel's steps from clock64
#                                          # stamps (tools/wgc_clock_probe.py, CLOCKS_M rows, default 64)
#   PART=W ...                             # tools/wgmma_roles_probe.cu (which wgmma shape an M = 32-64
#                                          # GEMM can feed: m64n64k16 RS vs m64n256k16 SS, with and
#                                          # without a storing warpgroup) and tools/wgmma_swap_proto.cu
#                                          # (an FP8 GEMM with the batch rows as A, self-checked, timed
#                                          # at four shapes per SWAP_VARIANTS="RAW,BST,WLOAD ...";
#                                          # PROBE=0 skips the probe, NCU_SWAP="RAW,BST,WLOAD" profiles
#                                          # one variant); ~1-2 min, no dflashgen kernels; carry
#                                          # .build/include (the CUTLASS headers)
#   PART=F ...                             # torch.profiler over steady-state decode rounds per
#                                          # B (tools/profile_decode.py; BATCHES="1 8", ROUNDS=12,
#                                          # TRACE=1 keeps Chrome traces, BUILD_ONLY_FILE as in PART=C)
#   PART=P ...                             # runtime-knob A/B on PART=A's table (or the committed one):
#                                          # `dflashgen bench --ms $MS $BENCH_ARGS` once per ENVS item
#                                          # ("NAME=VALUE", VALUE "default": unset) or, without ENVS, per
#                                          # DFLASHGEN_L2_PREFETCH value in PF (default "0 4 8 16 0");
#                                          # BUILD_ONLY_FILE, TESTS as in PART=C
# Carry .build (prebuilt sm_70 PTX and, to skip device builds, sm_90 cubins).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
R=$(mktemp -d); mkdir -p /tmp/dfg
source "$(dirname "$0")/gpu_env.sh"
# A/B diffs must apply (and reverse) cleanly: a silently failed `git apply` times the same code twice
# (session 33 lost a call to a stale manifest hunk)
apply_or_die() {  # apply_or_die [-R] FILE
  git apply --check "$@" 2>/dev/null || { echo "ERROR: git apply $* does not apply to this tree" >&2; exit 3; }
  git apply "$@"
}
pack() { tar czf "$OUT/results-$PART.tgz" -C "$R" . ; }
gpu_tests() {  # TESTS="tests/..." (tests: all of them) under a $1-second limit, then pack what is done
  [ -n "${TESTS:-}" ] || return 0
  echo "== pytest -m gpu $TESTS"
  timeout "${TESTS_TIMEOUT:-$1}" python3 -m pytest -q -m gpu $TESTS -p no:cacheprovider -rfE > "$R/pytest-gpu.log" 2>&1
  tail -3 "$R/pytest-gpu.log"
  pack
}
trap pack EXIT
install_and_build() {  # this checkout importable, and its sm_90 kernels built in parallel now rather
  # one by one on first use; BUILD_ONLY_FILE: a file holding a --only regex (e.g. the table's kernels
  # and the non-GEMM families) when the GEMMs are not what the call tests
  dfg_install
  local only=(); [ -n "${BUILD_ONLY_FILE:-}" ] && only=(--only "$(cat "$BUILD_ONLY_FILE")")
  dflashgen build --arch 90 -j 16 -q "${only[@]}" 2>&1 | tail -1
}
use_table() {  # the table PART=A measured on this (still warm) machine
  if [ -f /tmp/dfg/nvidia-h200.json ]; then cp /tmp/dfg/nvidia-h200.json tuning/nvidia-h200.json
  else echo "WARNING: no table from PART=A on this machine: the committed table is used"; fi
}
case "${PART:-A}" in
A)
  OUT=$R/session STEPS="build verify tune bench" bash tools/gpu_session.sh
  cp "$R/session/nvidia-h200.json" /tmp/dfg/ 2>/dev/null ;;
A1)  # PART=A in two calls when it would pass the 10-minute limit: build + verify, then (issued
  # within the warm window and WITHOUT carrying .build, so the device keeps this build: a carried
  # .build replaces the device's, cubins and all) PART=A2: tune + bench
  OUT=$R/session STEPS="build verify" bash tools/gpu_session.sh ;;
A2)
  OUT=$R/session STEPS="build tune bench" bash tools/gpu_session.sh
  cp "$R/session/nvidia-h200.json" /tmp/dfg/ 2>/dev/null ;;
B)
  use_table
  OUT=$R/session STEPS="build pytest overhead" bash tools/gpu_session.sh
  mkdir -p "$R/attn"
  echo "== attn-bench"; timeout 240 dflashgen attn-bench --out "$R/attn" 2>&1 | tail -30 ;;
C)
  use_table
  install_and_build
  gpu_tests 240  # the bench runs either way (its numbers come with this log)
  if [ -n "${ATTN:-}" ]; then  # ATTN="attn-bench args" (ATTN=all: its defaults)
    mkdir -p "$R/attn"; [ "$ATTN" = all ] && ATTN=""
    echo "== attn-bench $ATTN"; timeout 200 dflashgen attn-bench --out "$R/attn" $ATTN 2>&1 | tail -30
    pack
  fi
  if [ -n "${DEQUANT:-}" ]; then  # DEQUANT=1: the dequantize kernel vs torch's path and a prefill GEMM
    echo "== dequant-bench"; timeout 200 python3 tools/dequant_bench.py --out "$R/dequant" 2>&1 | tail -16
    pack
  fi
  if [ -n "${GDN:-}" ]; then  # GDN=1: the GDN verify step / advance per batch (tools/gdn_bench.py)
    echo "== gdn-bench"; timeout 120 python3 tools/gdn_bench.py --prefill 1023 --json "$R/gdn-bench.json" 2>&1 | tail -8
  fi
  if [ -n "${NCU_GDN:-}" ]; then  # NCU_GDN=regex: ncu of those GDN kernels in a 1023-token prefill (the first
    # two launches), and the SASS stalls of the first whose name ends in w4 (e.g. NCU_GDN=gdnck: the scan)
    echo "== ncu $NCU_GDN"
    timeout 120 $NCU -k "regex:$NCU_GDN" --launch-count 2 python3 tools/gdn_bench.py --batches 1 --prefill 1023 \
      > "$R/ncu-gdn.txt" 2>&1
    grep -E "dfg_|Duration|Issue Slots|Achieved Occ|Registers Per|L1/TEX Hit|L2 Cache Throughput|DRAM Throughput" "$R/ncu-gdn.txt" | head -24
    rep=/tmp/ncu-gdn-$RANDOM
    timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats -k "regex:$NCU_GDN.*w4\$" \
      --launch-count 1 -o "$rep" python3 tools/gdn_bench.py --batches 1 --prefill 1023 > /dev/null 2>&1
    ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" 2> "$rep.err"
    python3 tools/ncu_stalls.py "$rep.csv" > "$R/stalls-gdn.txt" 2>&1 || cat "$rep.err" >> "$R/stalls-gdn.txt"
    head -30 "$R/stalls-gdn.txt"
    pack
  fi
  if [ -n "${GDN_AB:-}" ]; then  # base (the diff reversed) / new, twice; the family rebuilt each way
    for run in base1 new1 base2 new2; do
      [ "${run#base}" != "$run" ] && apply_or_die -R "$GDN_AB"
      dflashgen build --arch 90 -j 16 -q --only gdn 2>&1 | tail -1
      echo "== gdn-bench $run"
      timeout 120 python3 tools/gdn_bench.py --prefill 1023 --json "$R/gdn-$run.json" 2>&1 | tail -5
      [ "${run#base}" != "$run" ] && apply_or_die "$GDN_AB"
    done
    pack
  fi
  for spec in ${GDN_ENVS:-}; do  # GDN_ENVS="NAME=VALUE ...": gdn-bench once more per setting
    echo "== gdn-bench $spec"
    env "$spec" timeout 120 python3 tools/gdn_bench.py --prefill 1023 --json "$R/gdn-${spec//=/-}.json" 2>&1 | tail -5
  done
  [ "${DECODE:-1}" = 0 ] && exit 0
  mkdir -p "$R/decode"
  echo "== decode-bench full size"
  CK=$(mktemp -d)/ckpt
  timeout 360 dflashgen decode-bench "$CK" --synthetic --device cuda --out "$R/decode" ${DECODE_ARGS:-} 2>&1 | tail -40
  pack
  for g in ${PROFILE_GDN:-sequential}; do
    f="$R/decode/profile-prefill.txt"; [ -n "${PROFILE_GDN:-}" ] && f="$R/decode/profile-prefill-$g.txt"
    echo "== prefill profile ($g)"; timeout 90 python3 tools/profile_prefill.py --layers 4 --gdn "$g" > "$f" 2>&1
    head -1 "$f"
  done
  if [ -n "${AB:-}" ]; then
    mkdir -p "$R/decode-ab"
    echo "== decode-bench $AB (B ${AB_BATCHES:-4 8})"
    timeout 150 dflashgen decode-bench "$CK" --device cuda --batches ${AB_BATCHES:-4 8} $AB --out "$R/decode-ab" 2>&1 | tail -12
  fi
  if [ -n "${NCU_GEMMS:-}" ]; then mkdir -p "$R/ncu"; ncu_gemms "$R/ncu" "$NCU_GEMMS"; fi ;;
F)  # where a decode round's time goes: torch.profiler over steady-state rounds (tools/profile_decode.py)
  use_table
  install_and_build
  echo "== decode profile"
  trace=(); [ -n "${TRACE:-}" ] && trace=(--trace "$R/trace")  # TRACE=1: a Chrome trace per B (gzip)
  timeout 400 python3 tools/profile_decode.py --batches ${BATCHES:-1 8} --rounds ${ROUNDS:-12} "${trace[@]}" \
    > "$R/profile-decode.txt" 2>&1
  grep -E "^(B|==|wall)" "$R/profile-decode.txt" | head -20 ;;
P)
  use_table
  install_and_build
  # ENVS: the runs as NAME=VALUE (NAME unset: NAME=default), e.g. ENVS="DFLASHGEN_PDL_TRIGGER=end
  # DFLASHGEN_PDL_TRIGGER=early"; PF="0 4": shorthand for DFLASHGEN_L2_PREFETCH=0 DFLASHGEN_L2_PREFETCH=4
  specs=${ENVS:-}
  if [ -z "$specs" ]; then for p in ${PF:-0 4 8 16 0}; do specs="$specs DFLASHGEN_L2_PREFETCH=$p"; done; fi
  i=0
  for spec in $specs; do
    i=$((i + 1)); name=${spec%%=*} val=${spec#*=}; echo "== $spec (run $i)"
    if [ "$val" = default ]; then runenv=(env -u "$name"); else runenv=(env "$spec"); fi
    tag=$val; [ "$name" = DFLASHGEN_L2_PREFETCH ] && tag=pf$val  # (session 20's folder names)
    "${runenv[@]}" timeout 240 dflashgen bench --table tuning/nvidia-h200.json --ms ${MS:-1 8 16} ${BENCH_ARGS:-} \
      --out "$R/$tag-run$i" 2>&1 | grep -E "^\| [14] \|" | head -20
    pack
  done
  gpu_tests 200 ;;
W)
  inc=${DFLASHGEN_CUTLASS_INCLUDE:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}
  if [ "${PROBE:-1}" != 0 ]; then  # PROBE=0: the prototype only
    nvcc -std=c++17 -O3 -arch=sm_90a -I"$inc" -Itemplates/include tools/wgmma_roles_probe.cu -o "$R/wgmma_roles_probe" 2>&1 | tail -3
    timeout 120 "$R/wgmma_roles_probe" 2>&1 | tee "$R/wgmma-roles.txt"
  fi
  # the batch-rows-as-A prototype (FP8, M <= 64): self-checked against an FP32 reference, then timed
  # per SWAP_VARIANTS item "RAW,BST,WLOAD[,PF[,ROT[,DEFS]]]" (ring depths: SWAP_RAW chunks of FP8 weights + activations,
  # SWAP_BST FP16 weight stages; SWAP_WLOAD how the weights are copied, SWAP_PF the L2 prefetch
  # distance, SWAP_ROT each CTA's K starting chunk, DEFS more
  # -D flags joined by '+', e.g. SWAP_ELECT=1+SWAP_NOCVT=1: see the prototype's header)
  echo "${SWAP_VARIANTS:-5,3,0 5,3,1 5,3,2}" | tr ' ' '\n' | while IFS=, read -r raw bst wl pf rot defs; do
    extra=""; [ -n "${defs:-}" ] && extra="-D${defs//+/ -D}"
    nvcc -std=c++17 -O3 -arch=sm_90a -DSWAP_RAW=$raw -DSWAP_BST=$bst -DSWAP_WLOAD=$wl -DSWAP_PF=${pf:-0} -DSWAP_ROT=${rot:-0} $extra -I"$inc" \
      -Itemplates/include tools/wgmma_swap_proto.cu -o "$R/swap-$raw-$bst-$wl-${pf:-0}-${rot:-0}-${defs:-}" 2>&1 | tail -3
    for shape in ${SWAP_SHAPES:-"34816,5120,64" "33792,5120,64" "14336,5120,64" "34816,5120,32"}; do
      shape=${shape//,/ }
      timeout 60 "$R/swap-$raw-$bst-$wl-${pf:-0}-${rot:-0}-${defs:-}" $shape 2>&1 | tee -a "$R/wgmma-swap.txt"
    done
  done
  # NCU_SWAP="RAW,BST,WLOAD[,PF[,ROT[,DEFS]]]" (one of SWAP_VARIANTS): ncu of that variant at n33792 (one wave): speed of light + stalls per SASS line
  if [ -n "${NCU_SWAP:-}" ]; then
    IFS=, read -r raw bst wl pf rot defs <<< "$NCU_SWAP"
    timeout 120 $NCU -k regex:swap_gemm --launch-skip 1 --launch-count 1 "$R/swap-$raw-$bst-$wl-${pf:-0}-${rot:-0}-${defs:-}" 33792 5120 64 \
      > "$R/ncu-swap.txt" 2>&1
    grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache|Issue Slots|Registers Per|Achieved Occ" "$R/ncu-swap.txt"
    rep=/tmp/ncu-swap-$RANDOM
    timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:swap_gemm \
      --launch-skip 1 --launch-count 1 -o "$rep" "$R/swap-$raw-$bst-$wl-${pf:-0}-${rot:-0}-${defs:-}" 33792 5120 64 > /dev/null 2>&1
    ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" 2> "$rep.err"
    python3 tools/ncu_stalls.py "$rep.csv" > "$R/stalls-swap.txt" 2>&1 || cat "$rep.err" >> "$R/stalls-swap.txt"
    head -30 "$R/stalls-swap.txt"
  fi
  rm -f "$R"/swap-* "$R/wgmma_roles_probe" ;;
R)
  dfg_install
  if [ -n "${SWITCH:-}" ]; then apply_or_die "$SWITCH" && dflashgen generate | tail -1; fi
  # builds only the raced problems' kernels (with --only: the named ones and the table's)
  if [ -n "${GEMM_AB:-}" ]; then  # base (the diff reversed) / new, twice: the same kernels, each header
    for run in base1 new1 base2 new2; do
      [ "${run#base}" != "$run" ] && apply_or_die -R "$GEMM_AB"
      echo "== race $run"
      timeout 300 python3 tools/wgmma_race.py ${RACE:-} --json "$R/race-$run.json" > "$R/race-$run.txt" 2>&1
      echo "race rc $?"; tail -12 "$R/race-$run.txt"
      [ "${run#base}" != "$run" ] && apply_or_die "$GEMM_AB"
      pack
    done
    python3 - "$R" <<'PY' | tee "$R/race-ab.txt"  # per kernel and M: the mean of each side's two runs
import json, sys
from collections import defaultdict
t = defaultdict(lambda: defaultdict(list))
for run in ("base1", "new1", "base2", "new2"):
    try:
        rows = json.load(open(f"{sys.argv[1]}/race-{run}.json"))
    except (OSError, ValueError):
        continue
    for r in rows:
        t[(r["kernel"], r["m"])][run[:-1]].append(r["us"])
for (k, m), v in sorted(t.items()):
    b, n = (sum(v[s]) / len(v[s]) if v[s] else float("nan") for s in ("base", "new"))
    print(f"M={m:<3} base {b:8.2f} us  new {n:8.2f} us  {n / b - 1:+6.1%}  {k}")
PY
    pack
  else
    timeout 540 python3 tools/wgmma_race.py ${RACE:-} --json "$R/race.json" > "$R/race.txt" 2>&1  # and --timeout per problem
    echo "race rc $?"; tail -40 "$R/race.txt"
    pack
  fi
  if [ -n "${CLOCKS:-}" ]; then
    echo "== clock probe"; timeout 180 python3 tools/wgc_clock_probe.py $CLOCKS --m ${CLOCKS_M:-64} --json "$R/clocks.json" \
      > "$R/clocks.txt" 2>&1; echo "probe rc $?"; tail -60 "$R/clocks.txt"
  fi
  if [ -n "${NCU_GEMMS:-}" ]; then mkdir -p "$R/ncu"; ncu_gemms "$R/ncu" "$NCU_GEMMS"; fi ;;
esac
