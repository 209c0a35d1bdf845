// dflashgen: per-arch warp tiles. Weights are the MMA "A" operand (their N rows fill the MMA's M),
// activations the "B" operand (up to 8 rows of the batch per MMA), so M = 8 wastes nothing.
//
// A warp owns TILE_ROWS weight rows and one K group (KG elements) per 16-byte weight load per
// thread. Each trait knows its prepacked fragment order (mirrored by dflashgen/prepack.py), how
// to turn one group into MMAs, and where each accumulator element lands.
#pragma once

#include <cute/arch/mma_sm70.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "decode.cuh"

namespace dflashgen {

// ---------------------------------------------------------------------------------------------
// sm_80 / sm_90: mma.sync.m16n8k16 (HMMA.16816). A warp tile is 16 weight rows.
// Thread (g = lane/4, t = lane%4) holds weight rows g and g+8 and, per 32-K sub-block, the eight
// physical K positions 8t..8t+7; k-step s of the sub-block uses 8t+4s..8t+4s+3 (a K permutation
// inside the MMA, identical for A and B, so one 16-byte activation load feeds two k-steps).
// ---------------------------------------------------------------------------------------------
template <Format F, int ARCH>
struct Sm80Traits {
  static constexpr int TILE_ROWS = 16;
  static constexpr int KG = F == Format::NVFP4 ? 64 : 32;  // K per 16-byte weight load
  static constexpr int KSUB = KG / 32;                    // 32-K activation loads per group
  static constexpr int NACC = 4;                          // floats per thread per (tile, 8 rows)
  static constexpr int SCALE_WORDS = 16;                  // u32 of block scales per (tile, group)
  // sm_89+ converts E4M3 in hardware (and NVFP4 via E4M3-ready bytes, see decode.cuh); the prepack
  // lays NVFP4 codes out for whichever decoder the arch uses (prepack.Layout.hw_e4m3).
  static constexpr bool HW_E4M3 = ARCH >= 89;
  using Scale = u32;

  // A fragments of one group: [k-step][4 registers].
  struct Frag {
    u32 a[2 * KSUB][4];
  };

  __device__ static void decode(const uint4& w, Scale sc, Frag& f) {
    if constexpr (F == Format::NVFP4 && HW_E4M3) {
      // words as below; per word codes 0..3 -> k-step 2p (pairs 01, 23), codes 4..7 -> k-step 2p+1
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const u32 wg = p == 0 ? w.x : w.z, wg8 = p == 0 ? w.y : w.w;
        const u32 s2 = p == 0 ? cvt_e4m3x2<0>(sc) : cvt_e4m3x2<1>(sc);  // (s_g, s_g8), exact
        u32 g_lo, g_hi, g8_lo, g8_hi;
        e2m1x8_e4m3(wg, g_lo, g_hi);
        e2m1x8_e4m3(wg8, g8_lo, g8_hi);
        f.a[2 * p + 0][0] = hmul2_bcast<0>(cvt_e4m3x2<0>(g_lo), s2);
        f.a[2 * p + 0][1] = hmul2_bcast<1>(cvt_e4m3x2<0>(g8_lo), s2);
        f.a[2 * p + 0][2] = hmul2_bcast<0>(cvt_e4m3x2<1>(g_lo), s2);
        f.a[2 * p + 0][3] = hmul2_bcast<1>(cvt_e4m3x2<1>(g8_lo), s2);
        f.a[2 * p + 1][0] = hmul2_bcast<0>(cvt_e4m3x2<0>(g_hi), s2);
        f.a[2 * p + 1][1] = hmul2_bcast<1>(cvt_e4m3x2<0>(g8_hi), s2);
        f.a[2 * p + 1][2] = hmul2_bcast<0>(cvt_e4m3x2<1>(g_hi), s2);
        f.a[2 * p + 1][3] = hmul2_bcast<1>(cvt_e4m3x2<1>(g8_hi), s2);
      }
    } else if constexpr (F == Format::NVFP4) {
      // words: (p0,row g) (p0,row g+8) (p1,row g) (p1,row g+8); scale bytes: g.p0 g8.p0 g.p1 g8.p1
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const u32 wg = p == 0 ? w.x : w.z, wg8 = p == 0 ? w.y : w.w;
        const u32 s2 = p == 0 ? block_scale_x2<false>(sc) : block_scale_x2<true>(sc);
        const u32 sg = bcast_lo(s2), sg8 = bcast_hi(s2);
        f.a[2 * p + 0][0] = hmul2(e2m1x2<0>(wg), sg);
        f.a[2 * p + 0][1] = hmul2(e2m1x2<0>(wg8), sg8);
        f.a[2 * p + 0][2] = hmul2(e2m1x2<1>(wg), sg);
        f.a[2 * p + 0][3] = hmul2(e2m1x2<1>(wg8), sg8);
        f.a[2 * p + 1][0] = hmul2(e2m1x2<2>(wg), sg);
        f.a[2 * p + 1][1] = hmul2(e2m1x2<2>(wg8), sg8);
        f.a[2 * p + 1][2] = hmul2(e2m1x2<3>(wg), sg);
        f.a[2 * p + 1][3] = hmul2(e2m1x2<3>(wg8), sg8);
      }
    } else {
      // words: (row g, s0) (row g, s1) (row g+8, s0) (row g+8, s1); 4 E4M3 bytes each
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const u32 wg = s == 0 ? w.x : w.y, wg8 = s == 0 ? w.z : w.w;
        if constexpr (HW_E4M3) {
          f.a[s][0] = cvt_e4m3x2<0>(wg);
          f.a[s][1] = cvt_e4m3x2<0>(wg8);
          f.a[s][2] = cvt_e4m3x2<1>(wg);
          f.a[s][3] = cvt_e4m3x2<1>(wg8);
        } else {
          f.a[s][0] = e4m3x2<false>(wg);
          f.a[s][1] = e4m3x2<false>(wg8);
          f.a[s][2] = e4m3x2<true>(wg);
          f.a[s][3] = e4m3x2<true>(wg8);
        }
      }
    }
  }

  // Activation fragments of one group for 8 batch rows: row (lane/4), K 8t..8t+7 per sub-block.
  struct XFrag {
    uint4 v[KSUB];
  };
  // `row` already includes x_lane_offset(), so every load below is an immediate offset. Loads only
  // when `pred` (else x keeps stale data the caller never uses).
  __device__ static int x_lane_offset() { return 8 * (threadIdx.x & 3); }
  __device__ static void load_x(const __half* row, bool pred, int k0, XFrag& x) {
#pragma unroll
    for (int p = 0; p < KSUB; ++p) ld_act_if(x.v[p], row + k0 + 32 * p, pred);
  }

  // X_SMEM (skinny_gemm.cuh): a group's activations staged in shared memory as [rows][XCPR chunks of
  // 16 B]; chunk c of row r sits at c ^ xs_swizzle(r). NVFP4 rows are 128 B: odd rows swap their
  // 64-byte halves, so the two rows a quarter-warp reads per LDS.128 (2q, 2q+1) hit disjoint banks;
  // FP8 rows are 64 B and already do.
  static constexpr bool HAS_X_SMEM = true;
  static constexpr int XCPR = KG / 8;
  __host__ __device__ static constexpr int xs_swizzle(int r) { return XCPR == 8 ? (r & 1) << 2 : 0; }
  // This lane's chunk of 32-K sub-block p: row b_mrow(), K 32p + 8t .. +7 (the XFrag element p).
  __device__ static int xs_lane_chunk(int p) { return (4 * p + (threadIdx.x & 3)) ^ xs_swizzle(b_mrow()); }

  // k-steps 2p and 2p + 1 (one 32-K sub-block) with the activations of sub-block p in xv.
  __device__ static void mma_sub(const Frag& f, const uint4& xv, int p, float (&c)[NACC]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ks = 2 * p + h;
      const u32 b0 = h ? xv.z : xv.x, b1 = h ? xv.w : xv.y;
      cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], f.a[ks][0], f.a[ks][1], f.a[ks][2],
                                              f.a[ks][3], b0, b1, c[0], c[1], c[2], c[3]);
    }
  }

  __device__ static void mma(const Frag& f, const XFrag& x, float (&c)[NACC]) {
#pragma unroll
    for (int ks = 0; ks < 2 * KSUB; ++ks) {
      const uint4& xv = x.v[ks / 2];
      const u32 b0 = (ks & 1) ? xv.z : xv.x, b1 = (ks & 1) ? xv.w : xv.y;
      cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], f.a[ks][0], f.a[ks][1], f.a[ks][2],
                                              f.a[ks][3], b0, b1, c[0], c[1], c[2], c[3]);
    }
  }

  // Accumulator element e of this thread: weight row within the tile, batch row within the 8.
  __device__ static int acc_wrow(int e) { return (threadIdx.x & 31) / 4 + 8 * (e >> 1); }
  __device__ static int acc_mrow(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }
  // This thread's batch row for B fragments.
  __device__ static int b_mrow() { return (threadIdx.x & 31) / 4; }
  __device__ static int scale_index() { return (threadIdx.x & 31) / 4 * 2 + ((threadIdx.x & 3) >> 1); }

  // Fused gate|up layout: a tile holds gate rows 8i..8i+7 then up rows 8i..8i+7, so element e
  // (gate) and e + 2 (up) of the same thread pair up.
  static constexpr int SILU_PAIR = 2;
  __device__ static bool acc_is_gate(int e) { return (e >> 1) == 0; }
  __host__ __device__ static int gate_col(int tile, int wrow) { return 8 * tile + wrow % 8; }
};

// ---------------------------------------------------------------------------------------------
// sm_70: mma.sync.m8n8k4 (HMMA.884). Each quad-pair (QP) of the warp multiplies its own 8x8x4;
// the four QPs take four consecutive 8-row blocks, so a warp tile is 32 weight rows. Logical
// thread i of a QP (lanes 4q..4q+3 -> i = 0..3, lanes 16+4q.. -> i = 4..7) holds weight row i of
// its block (A, row-major) and batch row i (B); it owns 32 (NVFP4) or 16 (FP8) consecutive K of
// its row per 16-byte load. Accumulator layout: CuTe's SM70_8x8_32b.
// ---------------------------------------------------------------------------------------------
template <Format F, int ARCH>
struct Sm70Traits {
  static constexpr int TILE_ROWS = 32;
  static constexpr int KG = F == Format::NVFP4 ? 32 : 16;
  static constexpr int KSTEPS = KG / 4;
  static constexpr int NACC = 8;
  static constexpr int SCALE_WORDS = 32;  // u16 per (tile, group): two block scales per lane
  using Scale = u16;
  static constexpr bool HAS_X_SMEM = false;  // each lane holds a whole K group of its batch row
  static constexpr int XCPR = KG / 8;

  struct Frag {
    u32 a[KSTEPS][2];
  };

  __device__ static void decode(const uint4& w, Scale sc, Frag& f) {
    const u32 words[4] = {w.x, w.y, w.z, w.w};
    if constexpr (F == Format::NVFP4) {
      const u32 s2 = block_scale_x2<false>(static_cast<u32>(sc));
      const u32 s_lo = bcast_lo(s2), s_hi = bcast_hi(s2);  // K 0..15 and 16..31 of the group
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 s = i < 2 ? s_lo : s_hi;
        f.a[2 * i + 0][0] = hmul2(e2m1x2<0>(words[i]), s);
        f.a[2 * i + 0][1] = hmul2(e2m1x2<1>(words[i]), s);
        f.a[2 * i + 1][0] = hmul2(e2m1x2<2>(words[i]), s);
        f.a[2 * i + 1][1] = hmul2(e2m1x2<3>(words[i]), s);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f.a[i][0] = e4m3x2<false>(words[i]);
        f.a[i][1] = e4m3x2<true>(words[i]);
      }
    }
  }

  struct XFrag {
    uint4 v[KG / 8];
  };
  __device__ static int x_lane_offset() { return 0; }
  __device__ static void load_x(const __half* row, bool pred, int k0, XFrag& x) {
#pragma unroll
    for (int i = 0; i < KG / 8; ++i) ld_act_if(x.v[i], row + k0 + 8 * i, pred);
  }

  __device__ static void mma(const Frag& f, const XFrag& x, float (&c)[NACC]) {
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const uint4& xv = x.v[ks / 2];
      const u32 b0 = (ks & 1) ? xv.z : xv.x, b1 = (ks & 1) ? xv.w : xv.y;
      cute::SM70_8x8x4_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], f.a[ks][0],
                                            f.a[ks][1], b0, b1, c[0], c[1], c[2], c[3], c[4], c[5], c[6],
                                            c[7]);
    }
  }

  __device__ static int qp() { return ((threadIdx.x & 31) >> 2) & 3; }
  __device__ static int qthread() { return (threadIdx.x & 3) + 4 * ((threadIdx.x & 31) >> 4); }
  __device__ static int acc_wrow(int e) {
    const int i = qthread();
    return 8 * qp() + (i & 1) + 2 * ((e >> 1) & 1) + 4 * (i >> 2);
  }
  __device__ static int acc_mrow(int e) { return 2 * ((qthread() >> 1) & 1) + (e & 1) + 4 * (e >> 2); }
  __device__ static int b_mrow() { return qthread(); }
  __device__ static int scale_index() { return threadIdx.x & 31; }

  // Fused gate|up layout: in every 8-row block rows {0,1,4,5} are gate, {2,3,6,7} up, so element e
  // (gate) and e + 2 (up) of the same thread pair up.
  static constexpr int SILU_PAIR = 2;
  __device__ static bool acc_is_gate(int e) { return ((e >> 1) & 1) == 0; }
  __host__ __device__ static int gate_col(int tile, int wrow) {
    const int r = wrow % 8;
    return 16 * tile + 4 * (wrow / 8) + (r & 1) + 2 * (r >> 2);
  }
};

}  // namespace dflashgen
