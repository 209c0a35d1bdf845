// dflashgen: exact weight decoders and memory helpers shared by every kernel family.
//
// All decoders are exact (no rounding) and need no lookup table, so they run on sm_70.
//  - E2M1 (NVFP4 element): sign to bit 15, magnitude bits to 9..11 gives value * 2^-14 in FP16.
//  - E4M3 (NVFP4 block scale, FP8 weight): ((v & 0x80) << 8) | ((v & 0x7f) << 7) gives value * 2^-8,
//    subnormals included.
// The NVFP4 element is multiplied by its block scale held as s * 2^7: the product
// e2m1 * s * 2^-7 is a multiple of 2^-17 with at most 6 significant bits and below 22, so it is
// exact in FP16 (even where subnormal). The remaining 2^7 (NVFP4) or 2^8 (FP8) is folded into the
// FP32 per-column scale applied in the epilogue.
#pragma once

#include <cuda_fp16.h>

namespace dflashgen {

enum class Format : int { NVFP4 = 0, FP8 = 1 };
enum class Epilogue : int { Store = 0, SiluMul = 1 };

// Packed weight streams carry this many extra groups of zeros (see dflashgen/prepack.py) so the
// register pipeline may prefetch past the end without a bounds check.
constexpr int PAD_GROUPS = 8;

typedef unsigned int u32;
typedef unsigned short u16;

// Weights are read exactly once: stream them past L1. `volatile` pins the load where the pipeline
// issues it (STAGES groups ahead); a plain asm may be sunk next to its use, which kills the prefetch.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Activations are re-read by every N tile: keep them in L1; issued one group ahead (volatile, as above).
__device__ __forceinline__ uint4 ld_act(const __half* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Two E2M1 codes -> half2 (value * 2^-14). Code j sits in nibble j (low half), code j+4 in
// nibble j+4 (high half); prepack arranges nibbles that way.
template <int J>
__device__ __forceinline__ u32 e2m1x2(u32 w) {
  const u32 v = w >> (4 * J);
  return ((v & 0x00070007u) << 9) | ((v & 0x00080008u) << 12);
}

// Two E4M3 bytes (0,1 for LO, 2,3 for HI) -> half2 (value * 2^-8).
template <bool HI>
__device__ __forceinline__ u32 e4m3x2(u32 w) {
  const u32 x = __byte_perm(w, 0u, HI ? 0x3424u : 0x1404u);  // [0, b, 0, b'] : byte in the top of each half
  return (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
}

// Two E4M3 block scales -> half2 holding scale * 2^7 (exact: power-of-two rescale in range).
template <bool HI>
__device__ __forceinline__ u32 block_scale_x2(u32 w) {
  return hmul2(e4m3x2<HI>(w), 0x78007800u);  // 0x7800 = 2^15
}

__device__ __forceinline__ u32 bcast_lo(u32 h2) { return __byte_perm(h2, h2, 0x1010u); }
__device__ __forceinline__ u32 bcast_hi(u32 h2) { return __byte_perm(h2, h2, 0x3232u); }

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

}  // namespace dflashgen
