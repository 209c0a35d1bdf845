// dflashgen: sm_90a warpgroup MMA (wgmma.mma_async, HGMMA) pieces for the skinny GEMM's `wgmma`
// K plan (skinny_gemm.cuh, SkinnyGemm::run_wgmma). Included only by kernels rendered with
// DFLASHGEN_WGMMA (built for compute_90a / sm_90a); the mma.sync kernels never see this header.
//
// Operands of one wgmma.m64nNk16 (N = the CTA's batch rows, 8..64):
// - A (64 weight rows x 16 K) from registers: warp w of the warpgroup supplies rows 16w..16w+15 in
//   the mma.m16n8k16 A fragment layout (PTX ISA, "Register fragment for wgmma .m64nNk16 A"), i.e.
//   exactly Sm80Traits::Frag::a[k-step] of the warp's 16-row weight tile.
// - B (16 K x N batch rows) from shared memory, K-major ("non-transposed"), no swizzle: core
//   matrices of 8 batch rows x 16 bytes (8 K values), 128 contiguous bytes. The descriptor's
//   leading-byte offset is the stride between the two core matrices along K, its stride-byte
//   offset the stride between 8-row blocks along N (CuTe make_gmma_desc<Major::K>, INTERLEAVE:
//   ((8,n),2):((1,SBO),LBO) in 16-byte units). Checked on sm_90a SASS: for this stage layout CuTe's
//   make_gmma_desc<Major::K> yields the same descriptor as desc_base() (LBO 8, SBO 16, INTERLEAVE).
// - D (64 x N FP32) in registers: per warp the m16n8 C layout repeated over N/8, so element e of
//   8-row block j is what acc[j][e] holds in the mma.sync path.
#pragma once

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/numeric/integer_sequence.hpp>

namespace dflashgen {

template <int N>
struct WgmmaAtom;
#define DFLASHGEN_WGMMA_ATOM(N)                                                                      \
  template <>                                                                                        \
  struct WgmmaAtom<N> {                                                                              \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32F16F16_RS<cute::SM90::GMMA::Major::K,          \
                                                                cute::SM90::GMMA::Major::K>;          \
  };
DFLASHGEN_WGMMA_ATOM(8)
DFLASHGEN_WGMMA_ATOM(16)
DFLASHGEN_WGMMA_ATOM(32)
DFLASHGEN_WGMMA_ATOM(64)
#undef DFLASHGEN_WGMMA_ATOM

// Shared-memory stage of one warpgroup: [k-step][8-row block nb][K half c][row r][16 bytes].
template <int ROWS>
struct WgmmaBLayout {
  static constexpr int CORE = 128;              // bytes per core matrix (8 rows x 16 B)
  static constexpr int LBO = CORE;              // K half 0 -> K half 1
  static constexpr int SBO = 2 * CORE;          // 8-row block nb -> nb + 1
  static constexpr int KSTEP = ROWS * 16 * 2;   // bytes per k-step (16 K x ROWS rows, FP16)
  // Byte offset of the 4-byte pair (logical k 8c + 2t, +1) of batch row n in k-step ks.
  __host__ __device__ static constexpr int offset(int ks, int n, int c, int t) {
    return ks * KSTEP + (n / 8) * SBO + c * LBO + (n % 8) * 16 + 4 * t;
  }
  // Descriptor with start address 0: add (byte address >> 4) to select a stage and k-step.
  __device__ static uint64_t desc_base() {
    cute::GmmaDescriptor d;
    d.bitfield.start_address_ = 0;
    d.bitfield.leading_byte_offset_ = LBO >> 4;
    d.bitfield.stride_byte_offset_ = SBO >> 4;
    d.bitfield.base_offset_ = 0;
    d.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::INTERLEAVE);
    return d.desc_;
  }
};

// D += A(regs) * B(desc) for one k-step; `c` is the thread's [N/8][4] accumulators.
template <int N, class Acc, size_t... I>
__device__ __forceinline__ void wgmma_rs(const u32 (&a)[4], uint64_t desc, Acc& c, cute::index_sequence<I...>) {
  WgmmaAtom<N>::type::fma(a[0], a[1], a[2], a[3], desc, c[I / 4][I % 4]..., cute::SM90::GMMA::ScaleOut::One);
}
template <int N>
__device__ __forceinline__ void wgmma_rs(const u32 (&a)[4], uint64_t desc, float (&c)[N / 8][4]) {
  wgmma_rs<N>(a, desc, c, cute::make_index_sequence<N / 2>{});
}

// The four 4-byte words of the 16-byte activation chunk at gmem + OFF bytes, with 4-byte cp.async
// (.ca: the only form below 16 bytes): word w to smem_addr + DOFF + (w >> 1) * D1 + (w & 1) * D0.
// All offsets are immediates. No predicate inside the asm (`@p cp.async`): callers branch around
// it (with one, ptxas 13.0 serialized the wgmmas of a kernel that copied in its MMA warps, C7513).
template <int D0, int D1, int OFF, int DOFF>
__device__ __forceinline__ void cp_async4x4(unsigned smem_addr, const void* gmem) {
  asm volatile(
      "{cp.async.ca.shared.global [%0+%3], [%1+%2], 4;\n"
      " cp.async.ca.shared.global [%0+%4], [%1+%5], 4;\n"
      " cp.async.ca.shared.global [%0+%6], [%1+%7], 4;\n"
      " cp.async.ca.shared.global [%0+%8], [%1+%9], 4;}"
      :: "r"(smem_addr), "l"(gmem), "n"(OFF), "n"(DOFF), "n"(DOFF + D0), "n"(OFF + 4), "n"(DOFF + D1),
         "n"(OFF + 8), "n"(DOFF + D0 + D1), "n"(OFF + 12) : "memory");
}

// Generic-proxy writes to shared memory (cp.async, st.shared) -> visible to the async proxy
// (wgmma reading B through its descriptor); each writing thread, before the barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace dflashgen
