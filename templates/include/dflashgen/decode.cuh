// dflashgen: exact weight decoders and memory helpers shared by every kernel family.
//
// All decoders are exact (no rounding).
// Table-free bit placement (sm_70 / sm_80, no FP8 conversion instruction):
//  - E2M1 (NVFP4 element): sign to bit 15, magnitude bits to 9..11 gives value * 2^-14 in FP16.
//  - E4M3 (NVFP4 block scale, FP8 weight): ((v & 0x80) << 8) | ((v & 0x7f) << 7) gives value * 2^-8,
//    subnormals included.
//  The NVFP4 element is multiplied by its block scale held as s * 2^7: the product e2m1 * s * 2^-7.
// Hardware conversion (sm_89+: cvt.rn.f16x2.e4m3x2 = SASS F2FP, exact since E4M3 is a subset of FP16):
//  - E4M3 (FP8 weight, NVFP4 block scale s): value * 2^0.
//  - E2M1 code (s e1 e0 m) placed in an E4M3 byte as s << 7 | (e1 e0 m) << 2 is value * 2^-6 for every
//    code: exponent field 00e1e0 with bias 7 vs E2M1's bias 1, mantissa m00; e1e0 = 0 is the E4M3
//    subnormal m/2 * 2^-6, matching E2M1's subnormal 0.5. The NVFP4 product is e2m1 * s * 2^-6.
// Exactness of the NVFP4 product e2m1 * s * 2^-j (j = 7 or 6): e2m1 has <= 2 significant bits and
// |e2m1| <= 6, E4M3 s has <= 4 and 2^-9 <= s <= 448, so the product has <= 6 significant bits, is
// a multiple of 2^-10 * 2^-j >= 2^-17 (FP16 subnormal step 2^-24) and at most 2688 * 2^-6 = 42, so
// it is exact in FP16. The remaining 2^7 / 2^6 (NVFP4) or 2^8 / 1 (FP8) is folded into the FP32
// per-column scale applied in the epilogue (prepack.Layout.decode_scale).
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

// Weights are read exactly once: stream them past L1. `volatile` keeps NVVM from moving the load,
// but ptxas still may: in the register-path tiles it put every refill of an unrolled trip at the
// trip's end (session 11), which is what the W_ASYNC shared-memory ring avoids.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Activations are re-read by every N tile: keep them in L1; issued one group ahead (volatile, as above).
// A coherent load, not ld.global.nc: the previous kernel writes them, and under programmatic
// dependent launch that kernel may still be running when this one starts. ptxas treats .nc data as
// constant for the kernel's lifetime and was seen hoisting such loads above griddepcontrol.wait.
__device__ __forceinline__ uint4 ld_act(const __half* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Predicated form for the one-group-ahead activation fetch: when !p nothing is read and r keeps
// whatever it held (the caller never uses it then), so no zero-fill or select is needed.
__device__ __forceinline__ void ld_act_if(uint4& r, const __half* p, bool pred) {
  asm volatile("{.reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p ld.global.v4.u32 {%0,%1,%2,%3}, [%4];}"
               : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
               : "l"(p), "r"(static_cast<int>(pred)));
}

// sm_80+: 16-byte global -> shared copy that bypasses registers and L1 (cp.async.cg), issued only
// when `pred`; completion is tracked per committed group (cp_async_commit / cp_async_wait<N>).
__device__ __forceinline__ void cp_async16_if(void* smem, const void* gmem, bool pred) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("{.reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;}"
               :: "r"(s), "l"(gmem), "r"(static_cast<int>(pred)) : "memory");
#endif
}
// base + i * STRIDE in one IMAD.WIDE, opaque to the compiler: in a loop the address is not turned
// into a 64-bit induction variable (an IADD3 pair per step and pointer, plus register copies)
template <unsigned STRIDE>
__device__ __forceinline__ const char* at_wide(const char* base, unsigned i) {
  uint64_t r;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(r) : "r"(i), "n"(STRIDE), "l"(reinterpret_cast<uint64_t>(base)));
  return reinterpret_cast<const char*>(r);
}
// Unpredicated 16- and 4-byte forms (W_ASYNC weight ring: every copy is in bounds, the streams are
// padded); the 4-byte one goes through L1 (.ca: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
#endif
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(s), "l"(gmem) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// 16 bytes from shared memory (LDS.128). `volatile` keeps it where the caller put it (one B
// fragment ahead of the MMAs that use it): left free, the compiler hoists every load of a group to
// its top and holds 4 x NT8 x KSUB registers for them.
__device__ __forceinline__ uint4 lds128(const uint4* p) {
  uint4 r;
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(s) : "memory");
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

// sm_89+: the two E4M3 bytes of half H of w -> half2 (exact; byte 2H to the low half).
template <int H>
__device__ __forceinline__ u32 cvt_e4m3x2(u32 w) {
  u32 d;
  if constexpr (H == 0)
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(d) : "r"(w));
  else
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(d) : "r"(w));
  return d;
}

// sm_89+ NVFP4: one word of 8 E2M1 codes in prepack's E4M3-ready bit order (per byte i: code i at
// bits 7 (sign) and 4..2 (e1 e0 m) = already an E4M3 byte; code i + 4 with its sign at 5, e1 at 6,
// e0 m at 1..0) -> two words of 4 E4M3 bytes each (value * 2^-6): codes 0..3 and 4..7. 5 ALU ops.
__device__ __forceinline__ void e2m1x8_e4m3(u32 w, u32& lo, u32& hi) {
  lo = w & 0x9C9C9C9Cu;
  hi = ((w << 2) & 0x8C8C8C8Cu) | ((w >> 2) & 0x10101010u);
}

// a * (b's low or high half broadcast): ptxas folds the broadcast into HMUL2's .H0_H0 / .H1_H1.
template <int H>
__device__ __forceinline__ u32 hmul2_bcast(u32 a, u32 b) {
  const __half2 x = *reinterpret_cast<const __half2*>(&a), y = *reinterpret_cast<const __half2*>(&b);
  const __half2 r = __hmul2(x, H == 0 ? __low2half2(y) : __high2half2(y));
  return *reinterpret_cast<const u32*>(&r);
}

__device__ __forceinline__ u32 bcast_lo(u32 h2) { return __byte_perm(h2, h2, 0x1010u); }
__device__ __forceinline__ u32 bcast_hi(u32 h2) { return __byte_perm(h2, h2, 0x3232u); }

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

}  // namespace dflashgen
