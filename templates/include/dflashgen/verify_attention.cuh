// dflashgen: grouped verification attention over a paged KV cache (speculative decoding verify).
//
// One CTA = one (request, KV head, split, row part). A request of `len` tokens is cut into splits of
// Cfg::split_for(len) tokens (the schedule's rule: small splits for short requests, more CTAs and
// fewer serial tiles each; SPLIT otherwise). The KV group's ROWS_ALL = GROUP x QROWS query rows
// (all query heads of the group, all verify positions of the request; row r = head r / QROWS,
// position r % QROWS) are cut into HS parts of ROWS rows, one CTA each (HS > 1
// reads the split's K/V once per part, the repeats from L2: more CTAs when requests are few and
// short; a row's arithmetic is the same for any HS). A CTA makes one pass over the split's K/V: the
// split's page ids are staged in shared memory once, then tiles of TILE tokens are copied
// into shared memory (cp.async with STAGES in flight on sm_80+, plain copies on sm_70), FP8 tiles
// are decoded exactly to FP16 there, and each warp owns 16 rows of one of KVG token groups:
//   S = Q K^T (MMA, FP32)  ->  smem  ->  online softmax in FP32 (exp2 domain, causal mask)  ->
//   P (FP16) -> smem  ->  O = O * alpha + P V (MMA, FP32).
// The per-split (max, sum) go to a workspace in FP32 and O / sum in FP16 (a convex combination of V
// rows, so within FP16's range; half the bytes of FP32 partials, which at 16K cost ~8-14% of the
// K/V traffic); the merge kernel combines a request's splits in ascending split order. Split
// boundaries are multiples of split_for(len) from position 0, so they depend on the request's own
// length only: a request's output is bitwise the same in any batch.
// Lengths and block tables are read on the device (CUDA-graph replay with new values works);
// bad lengths / page ids raise bits in *err and never cause an out-of-bounds read.
#pragma once

#include <cuda_fp16.h>

#include <cute/arch/mma_sm70.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "decode.cuh"

namespace dflashgen {

enum class KvType : int { FP16 = 0, E5M2 = 1, E4M3 = 2 };

// Error bits written to *err (the runtime reports them).
constexpr int ATTN_ERR_LENGTH = 1;  // length < query rows or beyond the block table's capacity
constexpr int ATTN_ERR_PAGE = 2;    // a block table entry outside [0, num_blocks)

constexpr float LOG2E = 1.4426950408889634f;
// NVRTC has no <cmath>: IEEE infinity and quiet NaN from their bits.
#define DFG_INF __int_as_float(0x7f800000)
#define DFG_NAN __int_as_float(0x7fc00000)

// Swizzled 16-byte chunk index in a tile with CHUNKS chunks per row: chunk c of row r lands at
// c ^ (r & 7), so 8 consecutive rows at one logical chunk hit 8 different bank groups.
template <int CHUNKS>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * CHUNKS + (chunk ^ (row & 7));
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// *p when ok, else -1: a predicated read-only load in volatile asm, so the compiler keeps it where it
// is written (issued before a branch on another load's value, not sunk past it).
__device__ __forceinline__ int ldg_if(const int* p, bool ok) {
  int v = -1;
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q ld.global.nc.b32 %0, [%1];\n\t}"
               : "+r"(v) : "l"(p), "r"(static_cast<int>(ok)));
  return v;
}

// ---------------------------------------------------------------------------------------------
// sm_80 / sm_90: mma.sync.m16n8k16, operands from shared memory through ldmatrix.
// A warp's 16 rows are one MMA M tile; thread (g = lane / 4, t = lane % 4) holds accumulator rows
// g and g + 8, columns 2t, 2t + 1 of every 8-wide N tile.
// ---------------------------------------------------------------------------------------------
struct AttnSm80 {
  static constexpr bool ASYNC_COPY = true;

  __device__ static void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
  }
  __device__ static void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
  }
  __device__ static void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], a0, a1, a2, a3, b0, b1, c[0], c[1], c[2], c[3]);
  }

  // S[16 x T] = Q[r0 .. r0+15] . K[0 .. T-1]^T over D, times f, stored to s (row stride S_LD floats).
  // Q and K tiles: FP16 rows of D / 8 swizzled chunks.
  template <int T, int D, int S_LD>
  __device__ static void qk(const __half* sq, int r0, const __half* sk, float f, float* s) {
    constexpr int CH = D / 8;
    const int lane = threadIdx.x & 31;
    float c[T / 8][4];
#pragma unroll
    for (int n = 0; n < T / 8; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
    const u32 qb = smem_addr(sq), kb = smem_addr(sk);
    const int qrow = r0 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 a0, a1, a2, a3;
      ldsm_x4(qb + 16 * swz<CH>(qrow, 2 * kk + (lane >> 4)), a0, a1, a2, a3);
#pragma unroll
      for (int j = 0; j < T / 16; ++j) {
        u32 b0, b1, b2, b3;
        const int tok = 16 * j + (lane & 7) + 8 * (lane >> 4);
        ldsm_x4(kb + 16 * swz<CH>(tok, 2 * kk + ((lane >> 3) & 1)), b0, b1, b2, b3);
        mma(c[2 * j], a0, a1, a2, a3, b0, b1);
        mma(c[2 * j + 1], a0, a1, a2, a3, b2, b3);
      }
    }
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < T / 8; ++n) {
      *reinterpret_cast<float2*>(s + g * S_LD + 8 * n + 2 * t) = make_float2(c[n][0] * f, c[n][1] * f);
      *reinterpret_cast<float2*>(s + (g + 8) * S_LD + 8 * n + 2 * t) = make_float2(c[n][2] * f, c[n][3] * f);
    }
  }

  static constexpr int acc_n(int D) { return D / 8; }  // accumulator N tiles per thread
  // Row (0..15 in the warp) and column of accumulator element e of N tile n.
  __device__ static int acc_row(int /*n*/, int e) { return ((threadIdx.x & 31) >> 2) + 8 * (e >> 1); }
  __device__ static int acc_col(int n, int e) { return 8 * n + 2 * (threadIdx.x & 3) + (e & 1); }

  // O[16 x cols] = O * alpha[row] + P[16 x T] . V[T x cols]; P row-major FP16 (row stride P_LD halves).
  // The warp's columns: accumulator N tiles n0 .. n0 + NN - 1 (all D / 8 of them, or a part).
  template <int T, int D, int P_LD, int NN>
  __device__ static void pv(const __half* sp, const __half* sv, const float* alpha, float (&o)[NN][4], int n0) {
    constexpr int CH = D / 8;
    const int lane = threadIdx.x & 31;
    const float al0 = alpha[lane >> 2], al1 = alpha[(lane >> 2) + 8];
#pragma unroll
    for (int n = 0; n < NN; ++n) {
      o[n][0] *= al0;
      o[n][1] *= al0;
      o[n][2] *= al1;
      o[n][3] *= al1;
    }
    const u32 pb = smem_addr(sp), vb = smem_addr(sv);
    const int prow = (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int ks = 0; ks < T / 16; ++ks) {
      u32 a0, a1, a2, a3;
      ldsm_x4(pb + 2 * (prow * P_LD + 16 * ks + 8 * (lane >> 4)), a0, a1, a2, a3);
      const int tok = 16 * ks + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
      for (int j = 0; j < NN / 2; ++j) {
        u32 b0, b1, b2, b3;
        ldsm_x4_t(vb + 16 * swz<CH>(tok, n0 + 2 * j + (lane >> 4)), b0, b1, b2, b3);
        mma(o[2 * j], a0, a1, a2, a3, b0, b1);
        mma(o[2 * j + 1], a0, a1, a2, a3, b2, b3);
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// sm_70: mma.sync.m8n8k4 (CuTe SM70 atoms). The four quad-pairs (QP) of a warp multiply four
// independent 8x8x4 blocks; logical thread i of a QP = (lane & 3) + 4 * (lane >> 4).
// Q K^T: .row.col (TN): A = Q row i, 4 consecutive d; B = K token i, 4 consecutive d.
// P V:   .row.row (TT): A = P row i, 4 consecutive tokens; B = V token (i & 3), d 4 * (i >> 2) .. +3.
// Accumulator (CuTe SM70_8x8_32b): element e sits at row (i & 1) + 2 ((e >> 1) & 1) + 4 (i >> 2),
// column 2 ((i >> 1) & 1) + (e & 1) + 4 (e >> 2) of the QP's 8x8 block.
// QP q takes row block q & 1 of the warp's 16 rows and column blocks (q >> 1) + 2 j.
// ---------------------------------------------------------------------------------------------
struct AttnSm70 {
  static constexpr bool ASYNC_COPY = false;

  __device__ static int qp() { return ((threadIdx.x & 31) >> 2) & 3; }
  __device__ static int qthread() { return (threadIdx.x & 3) + 4 * ((threadIdx.x & 31) >> 4); }
  __device__ static int c_row(int e) { const int i = qthread(); return (i & 1) + 2 * ((e >> 1) & 1) + 4 * (i >> 2); }
  __device__ static int c_col(int e) { return 2 * ((qthread() >> 1) & 1) + (e & 1) + 4 * (e >> 2); }

  // 4 consecutive FP16 (8 bytes) at element e of row `row` in a swizzled FP16 tile.
  template <int CH>
  __device__ static uint2 ld4(const __half* tile, int row, int e) {
    return *reinterpret_cast<const uint2*>(tile + 8 * swz<CH>(row, e >> 3) + (e & 7));
  }

  template <int T, int D, int S_LD>
  __device__ static void qk(const __half* sq, int r0, const __half* sk, float f, float* s) {
    constexpr int CH = D / 8, NB = T / 16;  // token blocks per QP
    const int i = qthread(), rb = qp() & 1, tb0 = qp() >> 1;
    float c[NB][8];
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) c[j][e] = 0.0f;
#pragma unroll 8
    for (int kd = 0; kd < D / 4; ++kd) {
      const uint2 a = ld4<CH>(sq, r0 + 8 * rb + i, 4 * kd);
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const uint2 b = ld4<CH>(sk, 8 * (tb0 + 2 * j) + i, 4 * kd);
        cute::SM70_8x8x4_F32F16F16F32_TN::fma(c[j][0], c[j][1], c[j][2], c[j][3], c[j][4], c[j][5], c[j][6], c[j][7],
                                              a.x, a.y, b.x, b.y, c[j][0], c[j][1], c[j][2], c[j][3], c[j][4],
                                              c[j][5], c[j][6], c[j][7]);
      }
    }
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) s[(8 * rb + c_row(e)) * S_LD + 8 * (tb0 + 2 * j) + c_col(e)] = c[j][e] * f;
  }

  static constexpr int acc_n(int D) { return D / 16; }
  __device__ static int acc_row(int /*n*/, int e) { return 8 * (qp() & 1) + c_row(e); }
  __device__ static int acc_col(int n, int e) { return 8 * ((qp() >> 1) + 2 * n) + c_col(e); }

  template <int T, int D, int P_LD, int NN>
  __device__ static void pv(const __half* sp, const __half* sv, const float* alpha, float (&o)[NN][8], int n0) {
    constexpr int CH = D / 8;
    const int i = qthread(), rb = qp() & 1, db0 = qp() >> 1;
    float al[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) al[e] = alpha[8 * rb + c_row(e)];
#pragma unroll
    for (int n = 0; n < NN; ++n)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[n][e] *= al[e];
#pragma unroll 2
    for (int kt = 0; kt < T / 4; ++kt) {
      const uint2 a = *reinterpret_cast<const uint2*>(sp + (8 * rb + i) * P_LD + 4 * kt);
      const int tok = 4 * kt + (i & 3);
#pragma unroll
      for (int n = 0; n < NN; ++n) {
        const uint2 b = ld4<CH>(sv, tok, 8 * (db0 + 2 * (n0 + n)) + 4 * (i >> 2));
        cute::SM70_8x8x4_F32F16F16F32_TT::fma(o[n][0], o[n][1], o[n][2], o[n][3], o[n][4], o[n][5], o[n][6], o[n][7],
                                              a.x, a.y, b.x, b.y, o[n][0], o[n][1], o[n][2], o[n][3], o[n][4],
                                              o[n][5], o[n][6], o[n][7]);
      }
    }
  }
};

// Four FP8 bytes -> two half2 (exact). E5M2 is the top byte of an FP16; E4M3 gives value * 2^-8
// (decode.cuh), the 2^8 is folded into the per-tensor scale by the runtime.
template <KvType KV>
__device__ __forceinline__ void fp8x4_to_half(u32 w, u32& lo, u32& hi) {
  if constexpr (KV == KvType::E4M3) {
    lo = e4m3x2<false>(w);
    hi = e4m3x2<true>(w);
  } else {
    lo = __byte_perm(w, 0u, 0x1404u);
    hi = __byte_perm(w, 0u, 0x3424u);
  }
}

// Sixteen FP8 bytes (one stored chunk) -> sixteen halves: the chunk's first 8 in lo, last 8 in hi.
template <KvType KV>
__device__ __forceinline__ void fp8x16_to_half(const uint4& w, uint4& lo, uint4& hi) {
  fp8x4_to_half<KV>(w.x, lo.x, lo.y);
  fp8x4_to_half<KV>(w.y, lo.z, lo.w);
  fp8x4_to_half<KV>(w.z, hi.x, hi.y);
  fp8x4_to_half<KV>(w.w, hi.z, hi.w);
}

template <class Cfg>
struct VerifyAttention {
  using Mma = typename Cfg::Mma;
  static constexpr int GROUP = Cfg::GROUP, QROWS = Cfg::QROWS, HKV = Cfg::HKV, HQ = GROUP * HKV;
  static constexpr int D = Cfg::D, T = Cfg::TILE, STAGES = Cfg::STAGES, SPLIT = Cfg::SPLIT, PAGE = Cfg::PAGE;
  // KVG token groups of RWARPS warps each: group g takes tile g of every stage of KVG tiles, with its
  // own softmax state; the groups' states are combined in group order at the end of the split.
  static constexpr int KVG = Cfg::KVG, TT = T * KVG;
  static constexpr int HS = Cfg::HS, ROWS_ALL = GROUP * QROWS, ROWS = ROWS_ALL / HS;  // rows per CTA
  // DS warps share a (16-row block, token group) team: QK over T / DS tokens each, softmax by the
  // team's first warp, PV over D / DS columns each. Every S, P and O element is computed by the same
  // instructions in the same order for any DS: the bits do not depend on DS. DS > 1 halves the
  // O registers per thread (the 128-register FP32 accumulator caps a CTA pair at 8 warps per SM).
  static constexpr int DS = Cfg::DS;
  static constexpr int RWARPS = ROWS / 16, TEAMS = RWARPS * KVG, WARPS = TEAMS * DS, THREADS = 32 * WARPS;
  static constexpr bool FP8 = Cfg::KV != KvType::FP16;
  static constexpr int KV_BYTES = FP8 ? 1 : 2;
  static constexpr int CH = D / 8;                   // 16-byte chunks per FP16 row
  static constexpr int RAW_CH = D * KV_BYTES / 16;   // 16-byte chunks per stored row
  static constexpr int S_LD = T + 4, P_LD = T + 8;  // padded rows: conflict-free softmax / ldmatrix
  static constexpr int NACC = Mma::acc_n(D) / DS;  // accumulator N tiles per thread (its D / DS columns)
  static constexpr int ACC_E = 128 / Mma::acc_n(D);  // elements per N tile (16 rows x D / 32 lanes)
  static_assert(T % (16 * DS) == 0 && Mma::acc_n(D) % (2 * DS) == 0, "D split: 16-token QK and 16-column PV units");
  static_assert(DS == 1 || TEAMS < 16, "one named barrier per team (ids 1..15)");
  static_assert(ROWS_ALL % HS == 0 && ROWS % 16 == 0, "each CTA's query rows must fill 16-row MMA tiles");
  static_assert(SPLIT % TT == 0 && Cfg::MIN_SPLIT % TT == 0 && T % 16 == 0 && D % 64 == 0, "tile shape");
  static_assert((PAGE & (PAGE - 1)) == 0, "page size must be a power of two");
  static_assert(D * 16 / 32 == 128, "accumulator layout assumes D = 256");  // 16 rows x D floats / 32 lanes

  // Shared memory (dynamic), in bytes.
  static constexpr int Q_BYTES = ROWS * D * 2;
  static constexpr int RAW_TILE = TT * D * KV_BYTES;              // one of K or V of a stage, as stored
  static constexpr int RAW_BYTES = STAGES * 2 * RAW_TILE;
  static constexpr int CVT_BYTES = FP8 ? 2 * TT * D * 2 : 0;      // decoded FP16 K and V
  static constexpr int S_BYTES = TEAMS * 16 * S_LD * 4;
  static constexpr int P_BYTES = TEAMS * 16 * P_LD * 2;
  static constexpr int A_BYTES = TEAMS * 16 * 4;
  // The split's page ids (a split of <= SPLIT tokens from a multiple of its size touches at most this many).
  static constexpr int NPG = (SPLIT + PAGE - 1) / PAGE + 1;
  static constexpr int TB_BYTES = (NPG * 4 + 15) / 16 * 16;
  static constexpr int SMEM = Q_BYTES + RAW_BYTES + CVT_BYTES + S_BYTES + P_BYTES + A_BYTES + TB_BYTES;
  // Group combine (KVG > 1): groups 1.. park O and (max, sum) in the then idle Q and stage buffers.
  static constexpr int X_FLOATS = (KVG - 1) * RWARPS * 128 * 32 + KVG * ROWS * 2;
  static_assert(X_FLOATS * 4 <= Q_BYTES + RAW_BYTES + CVT_BYTES, "group combine buffer exceeds Q + stages");

  __device__ static void copy16(void* dst, const char* src, bool ok) {
    if constexpr (Mma::ASYNC_COPY) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0));
    } else {
      *reinterpret_cast<uint4*>(dst) = ok ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  __device__ static void commit() {
    if constexpr (Mma::ASYNC_COPY) asm volatile("cp.async.commit_group;");
  }
  template <int N>
  __device__ static void wait() {
    if constexpr (Mma::ASYNC_COPY) asm volatile("cp.async.wait_group %0;" ::"n"(N));
  }

  // The DS warps of a team: a warp barrier, or named barrier 1 + team over the team (immediate ids,
  // so ptxas counts TEAMS + 1 barriers, not all 16).
  template <int I = 0>
  __device__ static void team_sync(int team) {
    if constexpr (DS == 1) {
      __syncwarp();
    } else if constexpr (I < TEAMS) {
      if (team == I) {
        asm volatile("bar.sync %0, %1;" ::"n"(1 + I), "n"(32 * DS) : "memory");
      } else {
        team_sync<I + 1>(team);
      }
    }
  }

  // Valid request? (its length covers the query rows and fits the block table)
  __device__ static bool length_ok(int len, int nq, int capacity) { return len >= nq && len <= capacity; }

  // This thread's page id of the split under each split size the rule can pick, loaded together with
  // the length (in bounds of the table row; -1 past it): the one the length picks is in hand when
  // the length arrives, one dependent round trip less before the first K/V copy. Checked by
  // stage_pages, and only where used. (Shared with VerifyAttentionWg.)
  __device__ static void page_candidates(const int* table, int table_stride, int split, int (&cand)[Cfg::NSIZES]) {
#pragma unroll
    for (int t = 0; t < Cfg::NSIZES; ++t) {
      const int sz = Cfg::size_at(t), pg = split * sz / PAGE + static_cast<int>(threadIdx.x);
      cand[t] = ldg_if(table + pg, static_cast<int>(threadIdx.x) < (sz + PAGE - 1) / PAGE + 1 && pg < table_stride);
    }
  }

  // The split's npg page ids from page pg0 into spages, checked once (bad ones flag the error and
  // read as -1: their tiles are zeros), by the CTA's NTHREADS threads.
  template <int NTHREADS>
  __device__ static void stage_pages(const int (&cand)[Cfg::NSIZES], int size, const int* table, int pg0, int npg,
                                     int num_blocks, int* err, int* spages) {
    int mine = cand[0];  // page pg0 + threadIdx.x under this request's split size
#pragma unroll
    for (int t = 1; t < Cfg::NSIZES; ++t)
      if (size == Cfg::size_at(t)) mine = cand[t];
    for (int i = threadIdx.x; i < npg; i += NTHREADS) {
      int blk = i == static_cast<int>(threadIdx.x) ? mine : __ldg(table + pg0 + i);
      if (blk < 0 || blk >= num_blocks) {
        atomicOr(err, ATTN_ERR_PAGE);
        blk = -1;
      }
      spages[i] = blk;
    }
  }

  // K and V tokens [t0, t0 + TT) of this request (zeros past `end`) into stage buffer `raw`. `pages`:
  // the split's page ids from page pg0 on, staged in shared memory (-1: out of range, already flagged),
  // so no copy waits on a dependent global load of the block table.
  __device__ static void load_tile(char* raw, int t0, int end, const int* pages, int pg0, const char* kb,
                                   const char* vb, long long block_stride, int kh) {
    constexpr int N = 2 * TT * RAW_CH;
#pragma unroll 4
    for (int idx = threadIdx.x; idx < N; idx += THREADS) {
      const int which = idx / (TT * RAW_CH), rem = idx % (TT * RAW_CH);
      const int tok = rem / RAW_CH, c = rem % RAW_CH, pos = t0 + tok;
      bool ok = pos < end;
      long long off = 0;
      if (ok) {
        const int blk = pages[pos / PAGE - pg0];
        ok = blk >= 0;
        if (ok) off = (blk * block_stride + static_cast<long long>((pos % PAGE) * HKV + kh) * D) * KV_BYTES + 16 * c;
      }
      copy16(raw + which * RAW_TILE + 16 * swz<RAW_CH>(tok, c), (which ? vb : kb) + off, ok);
    }
  }

  // FP8 stage -> FP16 K and V tiles (exact).
  __device__ static void decode_tile(const char* raw, __half* cvt) {
    constexpr int N = 2 * TT * RAW_CH;
    for (int idx = threadIdx.x; idx < N; idx += THREADS) {
      const int which = idx / (TT * RAW_CH), rem = idx % (TT * RAW_CH);
      const int tok = rem / RAW_CH, c = rem % RAW_CH;
      const uint4 w = *reinterpret_cast<const uint4*>(raw + which * RAW_TILE + 16 * swz<RAW_CH>(tok, c));
      uint4 lo, hi;
      fp8x16_to_half<Cfg::KV>(w, lo, hi);
      __half* dst = cvt + which * TT * D;
      *reinterpret_cast<uint4*>(dst + 8 * swz<CH>(tok, 2 * c)) = lo;
      *reinterpret_cast<uint4*>(dst + 8 * swz<CH>(tok, 2 * c + 1)) = hi;
    }
  }

  // Grid (HS x HKV, B, max_splits), THREADS threads, SMEM bytes of dynamic shared memory: max_splits
  // covers the most splits any length up to the table's capacity has under the rule; CTAs past a
  // request's own split count exit. The split index is the slowest-varying grid index (z): the block
  // scheduler dispatches CTAs in linear order, so split 0 of every (request, KV head) comes first, then
  // split 1, ...: the working CTAs are dispatched before any CTA that exits and spread one per SM
  // before doubling up (with the split fastest, exiting CTAs sat between the working ones and the
  // first wave put two working CTAs on some SMs while others got only exiting ones). The HS parts of a
  // split are adjacent in x, so they run together and share its K/V through L2.
  __device__ static void run(const __half* __restrict__ q, int nq, const char* __restrict__ kpool,
                             const char* __restrict__ vpool, long long block_stride, int num_blocks,
                             const int* __restrict__ block_tables, int table_stride, const int* __restrict__ lengths,
                             float qk_scale, __half* __restrict__ part_o, float* __restrict__ part_ml,
                             int max_splits, int* __restrict__ err, char* smem) {
    const int part = blockIdx.x % HS, kh = blockIdx.x / HS, b = blockIdx.y, split = blockIdx.z;  // split index
    const int* table = block_tables + static_cast<long long>(b) * table_stride;
    int cand[Cfg::NSIZES];
    page_candidates(table, table_stride, split, cand);
    const int len = lengths[b];
    if (!length_ok(len, nq, table_stride * PAGE)) {
      if (split == 0 && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(err, ATTN_ERR_LENGTH);
      return;
    }
    const int size = Cfg::split_for(len), begin = split * size;
    if (begin >= len) return;
    const int end = min(begin + size, len), tiles = (end - begin + TT - 1) / TT;  // stages of KVG tiles

    __half* sq = reinterpret_cast<__half*>(smem);
    char* sraw = smem + Q_BYTES;
    __half* scvt = reinterpret_cast<__half*>(sraw + RAW_BYTES);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, team = warp / DS, dh = warp % DS;
    const int grp = team / RWARPS, rw = team % RWARPS;
    float* ss = reinterpret_cast<float*>(sraw + RAW_BYTES + CVT_BYTES) + team * 16 * S_LD;
    __half* sp = reinterpret_cast<__half*>(sraw + RAW_BYTES + CVT_BYTES + S_BYTES) + team * 16 * P_LD;
    float* salpha = reinterpret_cast<float*>(sraw + RAW_BYTES + CVT_BYTES + S_BYTES + P_BYTES) + team * 16;
    int* spages = reinterpret_cast<int*>(sraw + RAW_BYTES + CVT_BYTES + S_BYTES + P_BYTES + A_BYTES);

    const int pg0 = begin / PAGE, npg = (end - 1) / PAGE - pg0 + 1;
    stage_pages<THREADS>(cand, size, table, pg0, npg, num_blocks, err, spages);
    __syncthreads();

    // Pipeline prologue first, so the K/V copies are in flight while Q is staged.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < tiles)
        load_tile(sraw + s * 2 * RAW_TILE, begin + s * TT, end, spages, pg0, kpool, vpool, block_stride, kh);
      commit();
    }
    for (int idx = threadIdx.x; idx < ROWS * CH; idx += THREADS) {  // Q rows: zeros past nq
      const int r = idx / CH, c = idx % CH, rr = part * ROWS + r, i = rr % QROWS, h = kh * GROUP + rr / QROWS;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (i < nq) v = __ldg(reinterpret_cast<const uint4*>(q + ((static_cast<long long>(b) * nq + i) * HQ + h) * D) + c);
      *reinterpret_cast<uint4*>(sq + 8 * swz<CH>(r, c)) = v;
    }

    // Softmax state: lanes 2r and 2r + 1 both track row r of this warp (tokens split in halves).
    const int srow = lane >> 1, half = lane & 1;
    const int qi = (part * ROWS + 16 * rw + srow) % QROWS;
    const int limit = qi < nq ? len - nq + qi : len - 1;  // last visible position of this row
    float m_run = -DFG_INF, l_run = 0.0f;
    float o[NACC][ACC_E];
#pragma unroll
    for (int n = 0; n < NACC; ++n)
#pragma unroll
      for (int e = 0; e < ACC_E; ++e) o[n][e] = 0.0f;

    for (int it = 0; it < tiles; ++it) {
      if (it + STAGES - 1 < tiles)
        load_tile(sraw + ((it + STAGES - 1) % STAGES) * 2 * RAW_TILE, begin + (it + STAGES - 1) * TT, end, spages,
                  pg0, kpool, vpool, block_stride, kh);
      commit();
      wait<STAGES - 1>();
      __syncthreads();
      const char* stage = sraw + (it % STAGES) * 2 * RAW_TILE;
      const __half* sk = reinterpret_cast<const __half*>(stage);
      if constexpr (FP8) {
        decode_tile(stage, scvt);
        __syncthreads();
        sk = scvt;
      }
      const __half* sv = sk + TT * D + grp * T * D;  // this group's tile (rows keep their swizzle: T % 8 == 0)
      sk += grp * T * D;

      Mma::template qk<T / DS, D, S_LD>(sq, 16 * rw, sk + dh * (T / DS) * D, qk_scale, ss + dh * (T / DS));
      team_sync(team);
      if (DS == 1 || dh == 0) {
        const int t0 = begin + it * TT + grp * T;
        constexpr int HALF = T / 2;
        float v[HALF];
        float mx = -DFG_INF;
#pragma unroll
        for (int j = 0; j < HALF; j += 4) {
          const float4 x = *reinterpret_cast<const float4*>(ss + srow * S_LD + half * HALF + j);
          v[j] = x.x;
          v[j + 1] = x.y;
          v[j + 2] = x.z;
          v[j + 3] = x.w;
        }
#pragma unroll
        for (int j = 0; j < HALF; ++j) {
          if (t0 + half * HALF + j > limit) v[j] = -DFG_INF;  // causal mask (and the tile's tail)
          mx = fmaxf(mx, v[j]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float m_new = fmaxf(m_run, mx);
        const float base = m_new == -DFG_INF ? 0.0f : m_new;  // all masked so far: exp2 gives 0, not NaN
        const float alpha = exp2f(m_run - base);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < HALF; j += 2) {
          const float p0 = exp2f(v[j] - base), p1 = exp2f(v[j + 1] - base);
          sum += p0;
          sum += p1;
          *reinterpret_cast<__half2*>(sp + srow * P_LD + half * HALF + j) = __floats2half2_rn(p0, p1);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l_run = l_run * alpha + sum;
        m_run = m_new;
        if (half == 0) salpha[srow] = alpha;
      }
      team_sync(team);
      Mma::template pv<T, D, P_LD, NACC>(sp, sv, salpha, o, dh * NACC);
      __syncthreads();  // the stage (and the FP8 decode buffer) is refilled next
    }
    wait<0>();
    if constexpr (KVG > 1)
      combine_groups(reinterpret_cast<float*>(smem), grp, rw, dh, lane, srow, half, m_run, l_run, o);
    if (grp > 0) return;

    // Partial results of this split: O / sum in FP16 (0 for a row the split does not reach), and
    // (max, sum) per row (max in log2 units). The team's softmax lanes hand 1 / sum to the
    // accumulator rows through salpha (free once every warp of the team is past its last PV).
    team_sync(team);
    if ((DS == 1 || dh == 0) && half == 0) salpha[srow] = l_run > 0.0f ? 1.0f / l_run : 0.0f;
    team_sync(team);
    const long long slot = (static_cast<long long>(b) * HKV + kh) * max_splits + split;
    __half* po = part_o + (slot * ROWS_ALL + part * ROWS) * D;
#pragma unroll
    for (int n = 0; n < NACC; ++n)
#pragma unroll
      for (int e = 0; e < ACC_E; ++e)
        po[(16 * rw + Mma::acc_row(n, e)) * D + Mma::acc_col(dh * NACC + n, e)] =
            __float2half_rn(o[n][e] * salpha[Mma::acc_row(n, e)]);
    if (half == 0 && dh == 0) {  // the team's softmax warp holds the row state
      float* pml = part_ml + (slot * ROWS_ALL + part * ROWS + 16 * rw + srow) * 2;
      pml[0] = m_run;
      pml[1] = l_run;
    }
  }

  // Groups 1.. hand their (max, sum, O) to group 0 through shared memory (Q and the stage buffers,
  // idle after the loop's last barrier); group 0 combines them in group order. Thread (g, rw, dh, lane)
  // holds the same accumulator elements for every g, so O travels by (rw, dh, lane, element).
  __device__ static void combine_groups(float* x, int grp, int rw, int dh, int lane, int srow, int half,
                                        float& m_run, float& l_run, float (&o)[NACC][ACC_E]) {
    constexpr int EL = NACC * ACC_E;                  // accumulator elements per thread
    float* xo = x;                                    // [KVG-1][RWARPS][DS][EL][32]
    float* xml = x + (KVG - 1) * RWARPS * 128 * 32;   // [KVG][ROWS][2]
    const int slot = rw * DS + dh;
    if (grp > 0) {
      float* dst = xo + ((grp - 1) * RWARPS * DS + slot) * EL * 32 + lane;
#pragma unroll
      for (int n = 0; n < NACC; ++n)
#pragma unroll
        for (int e = 0; e < ACC_E; ++e) dst[(n * ACC_E + e) * 32] = o[n][e];
    }
    if (half == 0 && dh == 0) {
      xml[(grp * ROWS + 16 * rw + srow) * 2] = m_run;
      xml[(grp * ROWS + 16 * rw + srow) * 2 + 1] = l_run;
    }
    __syncthreads();
    if (grp > 0) return;
    // Combined max of row r and each group's weight; a row none of the groups saw stays at -inf.
    auto weights = [&](int r, float (&w)[KVG]) {
      float mx = -DFG_INF;
#pragma unroll
      for (int g = 0; g < KVG; ++g) mx = fmaxf(mx, xml[(g * ROWS + r) * 2]);
      const float base = mx == -DFG_INF ? 0.0f : mx;
#pragma unroll
      for (int g = 0; g < KVG; ++g) w[g] = exp2f(xml[(g * ROWS + r) * 2] - base);
      return mx;
    };
#pragma unroll
    for (int n = 0; n < NACC; ++n)
#pragma unroll
      for (int e = 0; e < ACC_E; ++e) {
        float w[KVG];
        weights(16 * rw + Mma::acc_row(n, e), w);
        float v = o[n][e] * w[0];
#pragma unroll
        for (int g = 1; g < KVG; ++g)
          v += xo[((g - 1) * RWARPS * DS + slot) * EL * 32 + (n * ACC_E + e) * 32 + lane] * w[g];
        o[n][e] = v;
      }
    float w[KVG];
    m_run = weights(16 * rw + srow, w);
    float l = 0.0f;
#pragma unroll
    for (int g = 0; g < KVG; ++g) l += xml[(g * ROWS + 16 * rw + srow) * 2 + 1] * w[g];
    l_run = l;
  }

  // Grid (ROWS_ALL, HKV, B), D / 4 threads: row r of (request, KV head), 4 columns per thread.
  // Splits are combined in ascending order, split j weighted by sum_j 2^(max_j - max); out is FP32
  // [B, nq, HQ, D].
  __device__ static void merge(const __half* __restrict__ part_o, const float* __restrict__ part_ml, int nq,
                               const int* __restrict__ lengths, int capacity, int max_splits, float v_scale,
                               float* __restrict__ out) {
    const int r = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
    const int i = r % QROWS, h = kh * GROUP + r / QROWS;
    if (i >= nq) return;
    const int len = lengths[b];
    float4 res;
    if (!length_ok(len, nq, capacity)) {
      res = make_float4(DFG_NAN, DFG_NAN, DFG_NAN, DFG_NAN);
    } else {
      const int size = Cfg::split_for(len), ns = (len + size - 1) / size;
      const long long slot0 = (static_cast<long long>(b) * HKV + kh) * max_splits;
      const float* ml = part_ml + (slot0 * ROWS_ALL + r) * 2;
      const __half* po = part_o + (slot0 * ROWS_ALL + r) * D + 4 * threadIdx.x;
      // Chunks of MCH splits, (max, sum) and O loaded together: every load of a chunk issues before
      // its first use, and chunk 0's issue with the max pass over the other splits' maxima, so a
      // request of <= MCH splits (every split of TP1 / TP4 up to 16K) costs one L2 round trip, where
      // a max pass then chunks of 16 took 1 + ceil(ns / 16) (the merge was ~5 of TP1 16K B1's 35 us).
      // The arithmetic and its order are unchanged (same bits).
      constexpr int MCH = 32, MCH_MAX = 64;
      float2 p[MCH];
      uint2 x[MCH];
      auto load_chunk = [&](int s0) {
#pragma unroll
        for (int j = 0; j < MCH; ++j) {
          const bool ok = s0 + j < ns;
          p[j] = ok ? *reinterpret_cast<const float2*>(ml + (s0 + j) * ROWS_ALL * 2) : make_float2(-DFG_INF, 0.0f);
          x[j] = ok ? *reinterpret_cast<const uint2*>(po + (s0 + j) * ROWS_ALL * D) : make_uint2(0u, 0u);
        }
      };
      load_chunk(0);
      float mx = -DFG_INF;
      for (int s0 = MCH; s0 < ns; s0 += MCH_MAX) {  // the maxima past chunk 0 (none for <= MCH splits)
        float m[MCH_MAX];
#pragma unroll
        for (int j = 0; j < MCH_MAX; ++j) m[j] = s0 + j < ns ? ml[(s0 + j) * ROWS_ALL * 2] : -DFG_INF;
#pragma unroll
        for (int j = 0; j < MCH_MAX; ++j) mx = fmaxf(mx, m[j]);  // max with -inf: a no-op for the tail
      }
#pragma unroll
      for (int j = 0; j < MCH; ++j) mx = fmaxf(mx, p[j].x);  // a max: the same value in any order
      float den = 0.0f;
      float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int s0 = 0; s0 < ns; s0 += MCH) {
        if (s0 > 0) load_chunk(s0);
#pragma unroll
        for (int j = 0; j < MCH; ++j) {
          if (s0 + j >= ns) break;
          const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&x[j].x));
          const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&x[j].y));
          const float w = p[j].y * exp2f(p[j].x - mx);  // split 0 holds position 0: mx is finite
          den += w;
          num.x += lo.x * w;
          num.y += lo.y * w;
          num.z += hi.x * w;
          num.w += hi.y * w;
        }
      }
      const float f = v_scale / den;
      res = make_float4(num.x * f, num.y * f, num.z * f, num.w * f);
    }
    *reinterpret_cast<float4*>(out + ((static_cast<long long>(b) * nq + i) * HQ + h) * D + 4 * threadIdx.x) = res;
  }
};

}  // namespace dflashgen
