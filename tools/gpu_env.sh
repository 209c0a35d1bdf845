# Sourced by the tools/gpu_*.sh scripts: the build cache (carried .build), the driver's JIT cache for
# PTX, and the CUTLASS header subset in .build/include when the GPU machine has no nvidia-cutlass wheel.
export DFLASHGEN_CACHE=${DFLASHGEN_CACHE:-$PWD/.build} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export CUDA_CACHE_PATH=$DFLASHGEN_CACHE/cuda-jit CUDA_CACHE_MAXSIZE=4294967296
# a carried .build holds the sm_70 build packed (tools/carry_build.py): unpack it once
if [ -f "$DFLASHGEN_CACHE/build.tar.gz" ]; then
  tar xzf "$DFLASHGEN_CACHE/build.tar.gz" -C "$DFLASHGEN_CACHE" && rm -f "$DFLASHGEN_CACHE/build.tar.gz"
fi
if ! python3 -c "import cutlass_library" 2>/dev/null; then
  if [ -d "$DFLASHGEN_CACHE/include/cute" ]; then
    export DFLASHGEN_CUTLASS_INCLUDE=$DFLASHGEN_CACHE/include
  else  # every sm_90 build would fail ~10 s in; say so first (session 25 lost three calls to it)
    echo "ERROR: no CUTLASS headers here and none carried: carry .build (python tools/cutlass_subset.py)" >&2
  fi
fi
# This checkout importable on the GPU machine (no network: no build isolation, no dependency resolution).
dfg_install() { python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -2; }

# The ncu sections every GEMM profile reads, and `ncu_gemms DIR "name_regex@M ..."`: one
# tools/ncu_kernel.py run per kernel into DIR/ncu-<name>-m<M>.txt, with its headline figures printed;
# NCU_SOURCE=1 adds a PC-sampling run per kernel, summarised per SASS line into DIR/stalls-<name>-m<M>.txt.
NCU="ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis
     --section Occupancy --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis
     --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"
ncu_gemms() {
  local dir=$1 km name m
  for km in $2; do
    name=${km%@*} m=${km#*@}
    echo "== ncu $name M=$m"
    timeout 90 $NCU -k "regex:$name" --launch-skip 2 --launch-count 1 python3 tools/ncu_kernel.py "$name" "$m" \
      --sass > "$dir/ncu-$name-m$m.txt" 2>&1
    grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache|Issue Slots|hmma|Registers Per|Achieved Occ" \
      "$dir/ncu-$name-m$m.txt" | head -12
    if [ -n "${NCU_SOURCE:-}" ]; then  # which SASS lines the warps stall on (PC sampling), tools/ncu_stalls.py
      local rep=/tmp/ncu-src-$m-$RANDOM
      timeout 90 ncu --clock-control none --section SourceCounters --section WarpStateStats -k "regex:$name" \
        --launch-skip 2 --launch-count 1 -o "$rep" python3 tools/ncu_kernel.py "$name" "$m" > /dev/null 2>&1
      ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" 2> "$rep.err"
      python3 tools/ncu_stalls.py "$rep.csv" > "$dir/stalls-$name-m$m.txt" 2>&1 || cat "$rep.err" >> "$dir/stalls-$name-m$m.txt"
      gzip -c "$rep.csv" > "$dir/source-$name-m$m.csv.gz"  # the raw page, to re-summarise here
      head -20 "$dir/stalls-$name-m$m.txt"
    fi
  done
}
