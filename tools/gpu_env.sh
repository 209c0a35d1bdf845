# Sourced by the tools/gpu_*.sh scripts: the build cache (carried .build), the driver's JIT cache for
# PTX, and the CUTLASS header subset in .build/include when the GPU machine has no nvidia-cutlass wheel.
export DFLASHGEN_CACHE=${DFLASHGEN_CACHE:-$PWD/.build} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export CUDA_CACHE_PATH=$DFLASHGEN_CACHE/cuda-jit CUDA_CACHE_MAXSIZE=4294967296
if ! python3 -c "import cutlass_library" 2>/dev/null && [ -d "$DFLASHGEN_CACHE/include/cute" ]; then
  export DFLASHGEN_CUTLASS_INCLUDE=$DFLASHGEN_CACHE/include
fi
