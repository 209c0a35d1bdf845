// dflashgen: the shared-memory tile layout and wgmma descriptor fields of the sm_90a verify-attention
// kernel (verify_attention_wgmma.cuh), host-compilable: tests/wgmma_attention_layout.cpp checks them
// against CuTe's canonical GMMA layouts (Layout_K_SW128_Atom / Layout_MN_SW128_Atom, make_gmma_desc)
// with a host C++ compiler.
//
// A tile of R rows x 256 FP16 (Q: R = 64 query rows; K and V: R = T tokens) is 4 blocks of R x 128 B
// (columns 64 a .. 64 a + 63 in block a, at a x R x 128 B); in a block, 16-byte chunk c of row r sits
// at chunk c ^ (r & 7) of the row's 128 B (the 128-byte swizzle on address bits [4, 7) ^ [7, 10): every
// block starts 1024-byte aligned).
#pragma once

#ifndef __CUDACC__
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#endif

namespace dflashgen {
namespace wgattn {

// Byte offset of 16-byte chunk c (0 .. 31: columns 8 c .. 8 c + 7) of row r in a tile of R rows.
template <int R>
__host__ __device__ constexpr int sw128_off(int r, int c) {
  return (c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// K-major operand (Q as A, K as B) of R rows: the start of k-step ks (columns 16 ks .. 16 ks + 15).
template <int R>
__host__ __device__ constexpr int kmajor_kstep(int ks) {
  return (ks >> 2) * (R * 128) + (ks & 3) * 32;
}
// MN-major operand (V as B, T token rows): the start of k-step ks (tokens 16 ks .. 16 ks + 15).
__host__ __device__ constexpr int mnmajor_kstep(int ks) { return ks * 16 * 128; }

// Descriptor byte offsets (SWIZZLE_128B). K-major: SBO = 8-row groups, LBO unused (1 in 16-byte
// units, as CuTe writes it). MN-major (V, T tokens): LBO = the next 64 columns of N (the next block),
// SBO = the next 8 tokens of K.
constexpr int KMAJOR_LBO = 16, KMAJOR_SBO = 1024;
template <int T>
__host__ __device__ constexpr int mnmajor_lbo() {
  return T * 128;
}
constexpr int MNMAJOR_SBO = 1024;

// TMA (tma: 1): the start of the box holding columns 64 a .. 64 a + 63 of the page of tokens tok0 ..
// tok0 + PAGE - 1 (tok0 % PAGE == 0, PAGE | T) in a tile of T rows. SWIZZLE_128B then writes the box's
// 16-byte chunk c of row i at + 128 i + 16 (c ^ (i & 7)): the start is 1024-byte aligned (PAGE = 16),
// so the TMA's address-based pattern is the tile's chunk c ^ (row & 7).
template <int T>
__host__ __device__ constexpr int tma_box_off(int tok0, int a) {
  return a * (T * 128) + tok0 * 128;
}

}  // namespace wgattn
}  // namespace dflashgen
