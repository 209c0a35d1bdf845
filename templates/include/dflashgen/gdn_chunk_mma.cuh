// dflashgen gated delta rule prefill in chunk (WY) form on tensor cores (sm_80+): gdn_chunk.cuh's scan
// with its products as mma.sync m16n8k8 TF32 in the 3xTF32 split (x = hi + lo, both TF32; a b =
// a_hi b_hi + a_hi b_lo + a_lo b_hi: about FP32's accuracy, the dropped a_lo b_lo is ~2^-22 relative).
// The prep launch (g, Tm = (I + N)^-1, P per chunk) and the algebra are gdn_chunk.cuh's; only the scan
// differs. compute_70 has no TF32 MMA and keeps the CUDA-core scan.
//
// A warp's products keep their operands in registers: it holds its block of the state transposed,
// S^T [16 columns, DK], as MMA accumulator tiles (tile n: d = 8n .. 8n + 7), and
//   A  [Ak | Aq]^T = S0^T [K | Q]^T   (16 x 2C, k = d)   A operand S0^T, B operand k / q rows (shared)
//   B  u^T = r^T Tm^T                 (16 x C, k = i)    A operand r^T (from A's tiles), B Tm (shared)
//   C  o^T = exp(g) Aq^T + u^T P^T    (16 x C, k = i)    A operand u^T, B P (shared)
//   D  S^T = exp(g_e) S0^T + (w u)^T K (16 x DK, k = i)  A operand the weighted u^T, B k rows (shared)
// An accumulator tile (c0 = (g, 2q), c1 = (g, 2q + 1), c2 = (g + 8, 2q), c3 = (g + 8, 2q + 1); g = lane
// / 4, q = lane % 4) is an A fragment when the k slots are permuted: slot q holds k = 2q, slot q + 4
// holds k = 2q + 1 (a = {c0, c2, c1, c3}); the B fragments read their k rows in the same permutation
// (b0 = row 2q, b1 = row 2q + 1), so the state never leaves the registers.
// Parallelism: a 1K prompt has only 48 heads x 8 blocks of 16 columns (B1), so each block's key dim is
// split over R warps (the state's tiles; step A's R partial sums meet in shared memory, steps B / C
// are split by output tile and u is exchanged whole the same way), and a CTA holds the value heads
// that share a key head (GQA), so the chunk's k / q rows are staged once for all of them (L2
// traffic): R = 4 warps x 3 heads per CTA at the Qwen3.8 shapes, one CTA per SM.
// Bits: every product runs over the same k slots in the same order whatever the batch or T's padding;
// the lower-triangular blocks above the diagonal are skipped by position (never by value), and what
// stays multiplies exact zeros (Tm / P above the diagonal; the weighted u past the commit point,
// selected to zero), so a request alone and padded in a batch agree bit for bit, as in gdn_chunk.cuh.
#pragma once

#include <dflashgen/gdn_chunk.cuh>

namespace dflashgen {
namespace gdn_chunk {
namespace mma {

// x = hi + lo, both TF32: hi rounded to nearest (ties away: add half an ulp of TF32, clear the low 13
// bits), lo = x - hi (exact in FP32) truncated to TF32 (error <= 2^-10 |lo| <= 2^-21 |x|). Integer ops:
// cvt.rna.tf32.f32 is a multi-instruction emulation with NaN / overflow checks on sm_90. (ptxas hands
// HMMA the unmasked registers where it can -- the tensor core ignores the low 13 bits -- so a split
// costs ~3 instructions.)
__device__ __forceinline__ void split(float x, unsigned& hi, unsigned& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(__fsub_rn(x, __uint_as_float(hi))) & 0xffffe000u;
}

// The A fragment of an accumulator tile (k slots permuted: a = {c0, c2, c1, c3}), split.
struct FragA {
  unsigned hi[4], lo[4];
};
__device__ __forceinline__ FragA frag_a(const float (&c)[4]) {
  FragA a;
  split(c[0], a.hi[0], a.lo[0]);
  split(c[2], a.hi[1], a.lo[1]);
  split(c[1], a.hi[2], a.lo[2]);
  split(c[3], a.hi[3], a.lo[3]);
  return a;
}

// A B fragment: b0 = logical k row 2q, b1 = row 2q + 1 of column g, split.
struct FragB {
  unsigned hi[2], lo[2];
};
__device__ __forceinline__ FragB frag_b(float b0, float b1) {
  FragB f;
  split(b0, f.hi[0], f.lo[0]);
  split(b1, f.hi[1], f.lo[1]);
  return f;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b in 3xTF32, the small terms first
__device__ __forceinline__ void mma3(float (&d)[4], const FragA& a, const FragB& b) {
  mma_tf32(d, a.lo, b.hi);
  mma_tf32(d, a.hi, b.lo);
  mma_tf32(d, a.hi, b.hi);
}

// k / q rows in shared memory: DK floats per row, unpadded, the row's 16-byte granules XOR-swizzled so
// that both access patterns are free of bank conflicts -- step A's float2 at (row g, d0 + 2q) and step
// D's floats at (rows 2q / 2q + 1, d0 + g): granule G of row r sits at G ^ 2 ((r & 3) ^ ((r >> 2) & 1)).
template <int DK>
__device__ __forceinline__ int kq_at(int r, int d) {
  static_assert(DK >= 16 && (DK & (DK - 1)) == 0, "the swizzle stays inside a power-of-two row");
  const int s = (2 * ((r & 3) ^ ((r >> 2) & 1))) & (DK / 4 - 1);
  return r * DK + ((((d >> 2) ^ s)) << 2) + (d & 3);
}

// The scan's shared memory, per CTA of H value heads (runtime) sharing one key head's k / q rows:
// k and q double-buffered [2][C * DK] (swizzled), then per head Tm and P [2][C][C + 8], v [2][C][20]
// (rows 2q, column g conflict-free), prep's g / exp(g) / end weights [2][3C] and beta [2][C], and the
// exchanges: R x 2 C / 8 float4 per lane and head for step A's partial sums, C / 8 for u.
template <int DK, int C, int R>
struct Layout {
  static constexpr int CP = C + 8, VP = 20;
  static constexpr int BASE = 2 * 2 * C * DK;  // floats: k and q, two buffers each
  static constexpr int PER_HEAD = 2 * 2 * C * CP + 2 * C * VP + 2 * 4 * C + (R * 2 + 1) * (C / 8) * 32 * 4;
  static_assert(BASE % 4 == 0 && PER_HEAD % 4 == 0, "16-byte aligned regions");
};
template <int DK, int C, int R>
constexpr int smem_base_bytes() { return 4 * Layout<DK, C, R>::BASE; }
template <int DK, int C, int R>
constexpr int smem_per_head_bytes() { return 4 * Layout<DK, C, R>::PER_HEAD; }

// grid (ceil(dv / 16), Hv / H, B), 32 R H threads: warp w is split r = w % R of value head h0 + w / R's
// 16 columns (the key dim split R ways: each warp holds S^T[16, DK / R] and runs step A over its
// share, the R partials summed through shared memory in the fixed order 0..R-1; steps B and C run on
// the position tiles nt = r (mod R), u is exchanged whole through shared memory, and step D updates
// each warp's own share of the state).
template <int DK, int C, int R>
__device__ __forceinline__ void scan(float* s, const float* __restrict__ q, const float* __restrict__ k,
                                     const float* __restrict__ v, long long vs_b, long long vs_t, long long vs_c,
                                     const float* __restrict__ beta, const float* __restrict__ ws_g,
                                     const float* __restrict__ ws_t, const float* __restrict__ ws_p, int T, int Hk,
                                     int Hv, int dv, float* __restrict__ o, const long long* __restrict__ n) {
  static_assert(C % 8 == 0 && DK % (8 * R) == 0 && R <= C / 8, "whole m16n8k8 tiles per warp");
  using Lay = Layout<DK, C, R>;
  constexpr int NT = C / 8;        // position tiles of a chunk
  constexpr int DTW = DK / 8 / R;  // key-dim tiles of the state per warp
  constexpr int CP = Lay::CP, VP = Lay::VP;
  extern __shared__ __align__(16) float smem_f[];
  const int H = blockDim.x / (32 * R), threads = blockDim.x;
  float* const ks_base = smem_f;
  float* const qs_base = ks_base + 2 * C * DK;
  float* const tm_base = qs_base + 2 * C * DK;  // [H][2][C][CP]
  float* const pm_base = tm_base + H * 2 * C * CP;
  float* const vs_base = pm_base + H * 2 * C * CP;  // [H][2][C][VP]
  float* const gs_base = vs_base + H * 2 * C * VP;  // [H][2][3C]: g, exp(g), exp(g_{L-1} - g)
  float* const bs_base = gs_base + H * 2 * 3 * C;   // [H][2][C]
  float4* const ex = reinterpret_cast<float4*>(bs_base + H * 2 * C);  // [H * R][2 NT][32]
  float4* const uex = ex + H * R * 2 * NT * 32;                       // [H][NT][32]: u by tile

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, qq = lane % 4;
  const int hs = warp / R, r = warp % R;  // head slot in the CTA, key-dim share
  const int h0 = blockIdx.y * H, h = h0 + hs, b = blockIdx.z, kh = h0 / (Hv / Hk);
  const int j0 = blockIdx.x * 16, ja = j0 + g, jb = ja + 8;  // this lane's two columns
  const bool la = ja < dv, lb = jb < dv;
  const int nd0 = r * DTW;                                   // this warp's first key-dim tile
  const int nch = (T + C - 1) / C;
  float* S = s + ((long long)b * Hv + h) * DK * dv;
  const int keep = n != nullptr ? gdn::clamp_steps(n[b], T) : T;
  // v's rows as 16-byte copies where they can be (the target's v: a column slice of a contiguous row)
  const bool v16 = vs_c == 1 && dv % 4 == 0 && vs_t % 4 == 0 && vs_b % 4 == 0 &&
                   reinterpret_cast<unsigned long long>(v) % 16 == 0;

  // this warp's S^T tiles: st[i] = {S[d][ja], S[d + 1][ja], S[d][jb], S[d + 1][jb]}, d = 8 (nd0 + i) + 2q
  float st[DTW][4];
#pragma unroll
  for (int i = 0; i < DTW; ++i) {
    const long long r0 = (long long)(8 * (nd0 + i) + 2 * qq) * dv;
    st[i][0] = la ? S[r0 + ja] : 0.f;
    st[i][1] = la ? S[r0 + dv + ja] : 0.f;
    st[i][2] = lb ? S[r0 + jb] : 0.f;
    st[i][3] = lb ? S[r0 + dv + jb] : 0.f;
  }
  auto store_tile = [&](int i, const float (&x)[4]) {
    const long long r0 = (long long)(8 * (nd0 + i) + 2 * qq) * dv;
    if (la) S[r0 + ja] = x[0], S[r0 + dv + ja] = x[1];
    if (lb) S[r0 + jb] = x[2], S[r0 + dv + jb] = x[3];
  };

  // chunk c's inputs into buffer p (the key head's k / q rows once; Tm, P, v, g, beta per head), one
  // cp.async group (an empty one past the last chunk)
  auto fetch = [&](int c, int p) {
    if (c < nch) {
      const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
      constexpr int V4 = DK / 4;
      const long long row0 = ((long long)b * T + t0) * Hk + kh;  // (b, t0, kh) in units of DK
      for (int e = threadIdx.x; e < C * V4; e += threads) {
        const int t = e / V4, at = kq_at<DK>(t, 4 * (e % V4));
        float* kd = ks_base + p * C * DK + at;
        float* qd = qs_base + p * C * DK + at;
        if (t < L) {
          const long long src = (row0 + (long long)t * Hk) * DK + 4 * (e % V4);
          gdn::copy16(kd, k + src);
          gdn::copy16(qd, q + src);
        } else {
          gdn::zero16(kd);
          gdn::zero16(qd);
        }
      }
      for (int e = threadIdx.x; e < H * C * (C / 4); e += threads) {
        const int hh = e / (C * (C / 4)), t = e / (C / 4) % C, i4 = 4 * (e % (C / 4));
        const long long wc = ((long long)b * Hv + h0 + hh) * nch + c;  // the chunk-head's workspace block
        const int at = ((hh * 2 + p) * C + t) * CP + i4;
        gdn::copy16(tm_base + at, ws_t + (wc * C + t) * C + i4);
        gdn::copy16(pm_base + at, ws_p + (wc * C + t) * C + i4);
      }
      if (v16) {  // 16-byte rows of v (unit column stride, aligned): four columns per copy
        for (int e = threadIdx.x; e < H * C * 4; e += threads) {
          const int hh = e / (C * 4), t = e / 4 % C, j4 = 4 * (e % 4), j = j0 + j4;
          float* vd = vs_base + ((hh * 2 + p) * C + t) * VP + j4;
          if (t < L && j < dv)
            gdn::copy16(vd, v + b * vs_b + (t0 + t) * vs_t + (long long)(h0 + hh) * dv + j);
          else
            gdn::zero16(vd);
        }
      } else {
        for (int e = threadIdx.x; e < H * C * 16; e += threads) {
          const int hh = e / (C * 16), t = e / 16 % C, jj = e % 16, j = j0 + jj;
          float* vd = vs_base + ((hh * 2 + p) * C + t) * VP + jj;
          if (t < L && j < dv)
            gdn::copy4(vd, v + b * vs_b + (t0 + t) * vs_t + ((long long)(h0 + hh) * dv + j) * vs_c);
          else
            *vd = 0.f;
        }
      }
      for (int e = threadIdx.x; e < H * (3 * C / 4); e += threads) {  // g, exp(g), end weights
        const int hh = e / (3 * C / 4), i4 = 4 * (e % (3 * C / 4));
        const long long wc = ((long long)b * Hv + h0 + hh) * nch + c;
        gdn::copy16(gs_base + (hh * 2 + p) * 3 * C + i4, ws_g + wc * 3 * C + i4);
      }
      for (int e = threadIdx.x; e < H * C; e += threads) {
        const int hh = e / C, t = e % C;
        if (t < L)
          gdn::copy4(bs_base + (hh * 2 + p) * C + t, beta + ((long long)b * T + t0 + t) * Hv + h0 + hh);
        else
          bs_base[(hh * 2 + p) * C + t] = 0.f;
      }
    }
    cp_async_commit();
  };

  fetch(0, 0);
#pragma unroll 1
  for (int c = 0; c < nch; ++c) {
    const int p = c & 1, t0 = c * C, L = T - t0 < C ? T - t0 : C;
    cp_async_wait<0>();
    __syncthreads();  // chunk c landed for every thread; every warp is done with chunk c - 1 (buffer p ^ 1)
    fetch(c + 1, p ^ 1);
    const float* ks = ks_base + p * C * DK;
    const float* qs = qs_base + p * C * DK;
    const float* tm = tm_base + (hs * 2 + p) * C * CP;
    const float* pm = pm_base + (hs * 2 + p) * C * CP;
    const float* vs = vs_base + (hs * 2 + p) * C * VP;
    const float* gs = gs_base + (hs * 2 + p) * 3 * C;  // g; exp(g) at gs + C; end weights at gs + 2 C
    const float* bs = bs_base + (hs * 2 + p) * C;

    // A: this warp's share of S0^T k_t and S0^T q_t (k = d ascending over its tiles) ...
    float ak[NT][4] = {}, aq[NT][4] = {};
#pragma unroll
    for (int i = 0; i < DTW; ++i) {
      const FragA a = frag_a(st[i]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int at = kq_at<DK>(8 * nt + g, 8 * (nd0 + i) + 2 * qq);
        const float2 kf = *reinterpret_cast<const float2*>(&ks[at]);
        const float2 qf = *reinterpret_cast<const float2*>(&qs[at]);
        mma3(ak[nt], a, frag_b(kf.x, kf.y));
        mma3(aq[nt], a, frag_b(qf.x, qf.y));
      }
    }
    // ... and the head's R shares summed in the order 0..R-1. Steps B and C are split by output tile:
    // warp r owns the position tiles nt = r (mod R) -- it needs the sums of S0^T k for the tiles up to
    // its last (r at every tile <= it) and of S0^T q for its own tiles; u is then exchanged whole.
    const auto own = [&](int nt) { return nt % R == r; };
    const int top = r + R * ((NT - 1 - r) / R);  // this warp's last tile
    if constexpr (R > 1) {
      float4* mine = ex + (warp * 2 * NT) * 32 + lane;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mine[nt * 32] = make_float4(ak[nt][0], ak[nt][1], ak[nt][2], ak[nt][3]);
        mine[(NT + nt) * 32] = make_float4(aq[nt][0], aq[nt][1], aq[nt][2], aq[nt][3]);
      }
      __syncthreads();
      const float4* all = ex + (hs * R * 2 * NT) * 32 + lane;
      auto sum = [&](int slot, float (&x)[4]) {  // slot: nt (k) or NT + nt (q)
        float4 a = all[slot * 32];
#pragma unroll
        for (int pr = 1; pr < R; ++pr) {
          const float4 y = all[(pr * 2 * NT + slot) * 32];
          a = make_float4(__fadd_rn(a.x, y.x), __fadd_rn(a.y, y.y), __fadd_rn(a.z, y.z), __fadd_rn(a.w, y.w));
        }
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
      };
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (nt <= top) sum(nt, ak[nt]);
        if (own(nt)) sum(NT + nt, aq[nt]);
      }
    }
    // r_t = beta_t (v_t - exp(g_t) S0^T k_t) in place of ak (tiles up to this warp's last); exp(g_t)
    // S0^T q_t in place of aq (its own tiles)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 8 * nt + 2 * qq + (e & 1), jj = g + 8 * (e >> 1);
        const float eg = gs[C + t];
        if (nt <= top) ak[nt][e] = __fmul_rn(bs[t], __fsub_rn(vs[t * VP + jj], __fmul_rn(eg, ak[nt][e])));
        if (own(nt)) aq[nt][e] = __fmul_rn(eg, aq[nt][e]);
      }
    // acc_t += sum_{i <= t} m_ti x_i for this warp's tiles t (m: Tm or P, C x C row-major in shared
    // memory; position blocks on or below the diagonal only)
    auto lower_product = [&](const float (&x)[NT][4], const float* m, float (&acc)[NT][4]) {
#pragma unroll
      for (int kt = 0; kt < NT; ++kt) {
        if (kt > top) continue;
        const FragA a = frag_a(x[kt]);
#pragma unroll
        for (int nt = kt; nt < NT; ++nt) {
          if (!own(nt)) continue;
          const float2 mf = *reinterpret_cast<const float2*>(&m[(8 * nt + g) * CP + 8 * kt + 2 * qq]);
          mma3(acc[nt], a, frag_b(mf.x, mf.y));
        }
      }
    };
    // B: u_t = sum_{i <= t} Tm_ti r_i for this warp's tiles, then every tile of u from its owner (the
    // same bits whichever warp computed it)
    float u[NT][4] = {};
    lower_product(ak, tm, u);
    if constexpr (R > 1) {
      float4* uh = uex + (hs * NT) * 32 + lane;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (own(nt)) uh[nt * 32] = make_float4(u[nt][0], u[nt][1], u[nt][2], u[nt][3]);
      __syncthreads();
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (own(nt)) continue;
        const float4 x = uh[nt * 32];
        u[nt][0] = x.x, u[nt][1] = x.y, u[nt][2] = x.z, u[nt][3] = x.w;
      }
    }
    // C: o_t = exp(g_t) S0^T q_t + sum_{i <= t} P_ti u_i for this warp's tiles, stored
    lower_product(u, pm, aq);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (!own(nt)) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 8 * nt + 2 * qq + (e & 1);
        if (t < L && (e < 2 ? la : lb))
          o[(((long long)b * T + t0 + t) * Hv + h) * dv + (e < 2 ? ja : jb)] = aq[nt][e];
      }
    }

    // D: the state after e positions of the chunk, this warp's tiles: exp(g_{e-1}) S0^T + sum_{i < e}
    // (exp(g_{e-1} - g_i) u_i)^T k_i. A commit inside the chunk (e = keep - t0) writes its tiles out;
    // the chunk's end (e = L) replaces the registers' state (and is the commit when keep = t0 + L).
    // One instance of the code for both (rolled: the loop body stays small for the instruction cache).
#pragma unroll 1
    for (int pass = keep > t0 && keep < t0 + L ? 0 : 1; pass < 2; ++pass) {
      const int e = pass == 0 ? keep - t0 : L;
      const bool advance = pass == 1, commit = pass == 0 || keep == t0 + L;
      const float ge = gs[e - 1], eg = gs[C + e - 1];
      FragA wa[NT];
#pragma unroll
      for (int kt = 0; kt < NT; ++kt) {
        float wu[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) {  // the end weights from prep, or the same expression here mid-chunk
          const int i = 8 * kt + 2 * qq + (x & 1);
          const float wi = advance ? gs[2 * C + i] : expf(__fsub_rn(ge, gs[i]));
          wu[x] = i < e ? __fmul_rn(wi, u[kt][x]) : 0.f;
        }
        wa[kt] = frag_a(wu);
      }
#pragma unroll
      for (int i = 0; i < DTW; ++i) {
        float x[4];
#pragma unroll
        for (int y = 0; y < 4; ++y) x[y] = __fmul_rn(eg, st[i][y]);
#pragma unroll
        for (int kt = 0; kt < NT; ++kt) {
          const int ii = 8 * kt + 2 * qq, d = 8 * (nd0 + i) + g;
          mma3(x, wa[kt], frag_b(ks[kq_at<DK>(ii, d)], ks[kq_at<DK>(ii + 1, d)]));
        }
        if (commit) store_tile(i, x);
        if (advance) {
#pragma unroll
          for (int y = 0; y < 4; ++y) st[i][y] = x[y];
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing left in flight at exit (the last fetch is an empty group)
}

}  // namespace mma
}  // namespace gdn_chunk
}  // namespace dflashgen
