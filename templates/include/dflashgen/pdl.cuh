// Programmatic dependent launch for the non-GEMM families (sm_90; a no-op before). The runtime
// launches sm_90 GEMMs with programmatic stream serialization and they touch nothing but their
// weights before griddepcontrol.wait (skinny_gemm.cuh). A kernel that runs right before a GEMM (the
// decoder's norm sites, the GDN output gate) releases it at its own start, so the GEMM's CTAs are
// placed and load their first weight groups while this kernel runs instead of after it; the GEMM's
// wait still returns only once this whole grid has finished and its writes are visible. A kernel
// followed by a plainly launched one is unaffected.
//
// The verify-attention kernels are launched that way too (runtime/attention_kernel.py): each waits
// (pdl_wait) before it reads or writes anything, and releases its successor at its start, so the
// merge kernel's CTAs are placed while the main kernel runs and start the moment it has finished.
#pragma once

namespace dflashgen {

__device__ __forceinline__ void pdl_release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Blocks until every grid this one depends on (programmatic stream serialization) has finished and
// its writes are visible; a no-op for a plain launch. Call before the first global read or write.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace dflashgen
