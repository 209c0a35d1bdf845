// dflashgen gated delta rule prefill in chunk (WY) form: the same recurrence as gdn.cuh's sequential
// kernels, regrouped into matrix products over chunks of C positions, so a long prefill runs at the
// FP32 rate of register-tiled products instead of one latency-bound dependency chain per position.
// FP32 throughout (CUDA cores, any arch); not bitwise the sequential kernels (another summation order),
// but a request's bits depend on nothing but its own inputs: every chunk starts at a multiple of C from
// the request's first position, and every sum runs over that request's positions <= t in a fixed order
// (so padding a request to a longer T, or batching it with others, changes none of its bits).
//
// Per request b and value head h, chunk [t0, t0 + L) with local positions t, i < L and S0 the state at
// its start (S [DK, dv]; d_t = exp(log_decay_t) as in gdn.cuh):
//   g_t   = sum_{i <= t} log_decay_i                  (inclusive, in the chunk)
//   N_ti  = beta_t exp(g_t - g_i) (k_t . k_i)          i < t (strictly lower)
//   Tm    = (I + N)^-1                                 (unit lower triangular, forward substitution)
//   P_ti  = exp(g_t - g_i) (q_t . k_i)                 i <= t
//   r_t   = beta_t (v_t - exp(g_t) S0^T k_t)
//   u     = Tm r                                       (the sequential kernel's u_t, in closed form)
//   o_t   = exp(g_t) S0^T q_t + sum_{i <= t} P_ti u_i
//   S(e)  = exp(g_{e-1}) S0 + sum_{i < e} k_i (exp(g_{e-1} - g_i) u_i)^T   (the state after e positions)
// (unrolling S_t = d_t S_{t-1} + k_t u_t^T, u_t = beta_t (v_t - d_t S_{t-1}^T k_t) over the chunk gives
// (I + N) u = r; every exponent is <= 0, so nothing overflows at any chunk length.)
//
// prep  grid (ceil(T / C), Hk, B): g (and its exponentials), Tm and P per chunk and value head into a
//       workspace (each chunk on its own: fully parallel; the products once per key head). Tm and P
//       [C, C] row-major with zeros above the diagonal.
// scan  grid (ceil(dv / COLS), Hv, B): a CTA owns COLS columns of one head's state (columns are
//       independent, as in gdn.cuh) and walks the chunks in order: S0^T k and S0^T q for the chunk's
//       rows (A), u = Tm r (B), the outputs (C), the state after the chunk (D) -- and, in the chunk
//       holding position n[b] - 1, the state after n[b] positions, committed in place (n = nullptr: all
//       T; n[b] <= 0: S untouched).
#pragma once

#include <dflashgen/gdn.cuh>  // copy16 / copy16_wait / zero16

namespace dflashgen {
namespace gdn_chunk {

template <int DK, int C, int COLS, int THREADS>
struct Geometry {
  static constexpr int DKP = DK + 4;        // padded K / Q rows: eight rows' float4 fall in distinct banks
  static constexpr int CP = C + 4;          // padded Tm / P rows (16-byte aligned, distinct banks per row)
  static constexpr int CG = COLS / 4;       // float4 column groups of the CTA's columns
  static constexpr int ROWS = THREADS / CG; // scan: one thread per (chunk row, column group) in A-C ...
  static constexpr int RPT = DK >= ROWS ? DK / ROWS : 1;  // ... and per (RPT state rows, column group) in D
  static_assert(COLS % 4 == 0 && ROWS == C, "scan: THREADS = C x COLS / 4 (one thread per chunk row and float4)");
  static_assert(DK % 4 == 0 && (DK < ROWS || DK % ROWS == 0) && (RPT == 1 || RPT == 2 || RPT == 4),
                "scan: the state rows split evenly over the row groups");
};

// The scan's shared memory (dynamic: above the 48 KB static limit at DK = 128). k is double-buffered
// (the next chunk's rows land during this chunk's four steps); q, Tm, P and v are refilled as soon as
// this chunk's last reader of each is past a barrier.
template <int DK, int C, int COLS>
struct ScanSmem {
  float ks[2][C][DK + 4], qs[C][DK + 4];  // the chunk's k / q rows (zero past L)
  float ss[DK][COLS];                     // the chunk-start state, this CTA's columns
  float tm[C][C + 4], pm[C][C + 4];       // Tm and P from prep
  float rs[C][COLS], us[C][COLS];         // v, then r (in place); u
  float ws[C][COLS];                      // exp(g_{L-1} - g_t) u_t: step D's weighted u
  float gs[C], bs[C];                     // g, beta
};

template <int DK, int C, int COLS>
constexpr int scan_smem_bytes() { return (int)sizeof(ScanSmem<DK, C, COLS>); }

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, const float (&x)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
// acc[c] = fma(a, b[c], acc[c]) for the four lanes of a float4
__device__ __forceinline__ void fma4(float a, float4 b, float (&acc)[4]) {
  acc[0] = __fmaf_rn(a, b.x, acc[0]);
  acc[1] = __fmaf_rn(a, b.y, acc[1]);
  acc[2] = __fmaf_rn(a, b.z, acc[2]);
  acc[3] = __fmaf_rn(a, b.w, acc[3]);
}

// x[r] += k[r] wu for this thread's RPT state rows (k: those rows of one position's key, in shared
// memory; one float4 when RPT = 4): step D's rank-1 update, one fma per element.
template <int RPT>
__device__ __forceinline__ void add_ku(const float* k, float4 wu, float (&x)[RPT][4]) {
  float kv[RPT];
  if constexpr (RPT == 4) {
    const float4 k4 = ld4(k);
    kv[0] = k4.x, kv[1] = k4.y, kv[2] = k4.z, kv[3] = k4.w;
  } else {
#pragma unroll
    for (int r = 0; r < RPT; ++r) kv[r] = k[r];
  }
#pragma unroll
  for (int r = 0; r < RPT; ++r) fma4(kv[r], wu, x[r]);
}

// Rows [0, L) of DK floats of key head kh from x [B, T, Hk, DK] (rows t0 + t) into dst[t][0, DK)
// (16-byte copies, cp.async on sm_80+), rows [L, C) zero-filled.
template <int DK, int C, int THREADS, int LD>
__device__ __forceinline__ void stage_rows(float (*dst)[LD], const float* x, long long row0, int Hk, int L) {
  constexpr int V4 = DK / 4;
  for (int e = threadIdx.x; e < C * V4; e += THREADS) {
    const int t = e / V4, i4 = e % V4;
    if (t < L)
      gdn::copy16(&dst[t][4 * i4], x + (row0 + (long long)t * Hk) * DK + 4 * i4);
    else
      gdn::zero16(&dst[t][4 * i4]);
  }
}

// prep, per chunk and key head: the k.k and q.k products once for the key head's value heads (GQA),
// then one warp per value head (heads past the warps in turn): g, exp(g), the end weights, P and, by
// forward substitution, Tm. Workspace per (b, value head, chunk): gew [3][C] = g_t, exp(g_t),
// exp(g_{L-1} - g_t) (L the chunk's positions; the scans' decays, so they take no exp of their own at
// the chunk's end), Tm and P [C][C] row-major with zeros above the diagonal.
template <int DK, int C>
struct PrepSmem {
  union {
    struct {
      float ks[C][DK + 4], qs[C][DK + 4];  // padded as the scan's (Geometry::DKP)
    } in;
    struct {
      float kk[C][C + 1], qk[C][C + 1];    // k_t . k_i, q_t . k_i (all t, i)
      float ns[4][C][C + 1];               // per warp: its head's N
    } out;
  } u;
  float lg[4][C], gs[4][C];
};

template <int DK, int C, int THREADS>
__device__ __forceinline__ void prep(const float* __restrict__ q, const float* __restrict__ k,
                                     const float* __restrict__ beta, const float* __restrict__ log_decay, int T,
                                     int Hk, int Hv, float* __restrict__ ws_g, float* __restrict__ ws_t,
                                     float* __restrict__ ws_p) {
  constexpr int TPR = THREADS / C, IPT = C / TPR;  // threads per chunk row; products per thread and kind
  constexpr int WARPS = THREADS / 32;
  static_assert(DK % 4 == 0 && THREADS % C == 0 && C % TPR == 0 && C == 32 && WARPS == 4,
                "whole rows per thread group; one lane per chunk row in the per-head phase");
  __shared__ __align__(16) PrepSmem<DK, C> sm;
  const int c = blockIdx.x, kh = blockIdx.y, b = blockIdx.z, rep = Hv / Hk, nch = gridDim.x;
  const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
  const long long row0 = ((long long)b * T + t0) * Hk + kh;  // (b, t0, kh) in units of DK
  stage_rows<DK, C, THREADS>(sm.u.in.ks, k, row0, Hk, L);
  stage_rows<DK, C, THREADS>(sm.u.in.qs, q, row0, Hk, L);
  gdn::copy16_wait();
  __syncthreads();
  // k_t . k_i and q_t . k_i for this thread's row t and columns i = ig + TPR m (DK ascending, one fma chain)
  {
    const int t = threadIdx.x / TPR, ig = threadIdx.x % TPR;
    float kk[IPT] = {}, qk[IPT] = {};
#pragma unroll 4
    for (int d = 0; d < DK; d += 4) {
      const float4 kt = ld4(&sm.u.in.ks[t][d]), qt = ld4(&sm.u.in.qs[t][d]);
#pragma unroll
      for (int m = 0; m < IPT; ++m) {
        const float4 ki = ld4(&sm.u.in.ks[ig + TPR * m][d]);
        kk[m] = __fmaf_rn(kt.x, ki.x, kk[m]);
        kk[m] = __fmaf_rn(kt.y, ki.y, kk[m]);
        kk[m] = __fmaf_rn(kt.z, ki.z, kk[m]);
        kk[m] = __fmaf_rn(kt.w, ki.w, kk[m]);
        qk[m] = __fmaf_rn(qt.x, ki.x, qk[m]);
        qk[m] = __fmaf_rn(qt.y, ki.y, qk[m]);
        qk[m] = __fmaf_rn(qt.z, ki.z, qk[m]);
        qk[m] = __fmaf_rn(qt.w, ki.w, qk[m]);
      }
    }
    __syncthreads();  // every thread is done with ks / qs: the products take their place
#pragma unroll
    for (int m = 0; m < IPT; ++m) {
      sm.u.out.kk[t][ig + TPR * m] = kk[m];
      sm.u.out.qk[t][ig + TPR * m] = qk[m];
    }
  }
  __syncthreads();
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane;
  float(*ns)[C + 1] = sm.u.out.ns[w];
  for (int hh = w; hh < rep; hh += WARPS) {
    const int h = kh * rep + hh;
    const long long at = ((long long)b * T + t0 + t) * Hv + h;
    sm.lg[w][t] = t < L ? log_decay[at] : 0.f;
    const float bt = t < L ? beta[at] : 0.f;
    __syncwarp();
    float gt = 0.f;  // g_t: its own ascending sum (positions <= t only)
    for (int i = 0; i <= t; ++i) gt = __fadd_rn(gt, sm.lg[w][i]);
    sm.gs[w][t] = gt;
    __syncwarp();
    const float gl = sm.gs[w][L - 1];
    const long long ch = ((long long)b * Hv + h) * nch + c;  // this chunk-head's workspace block
    ws_g[ch * 3 * C + t] = gt;
    ws_g[ch * 3 * C + C + t] = expf(gt);
    ws_g[ch * 3 * C + 2 * C + t] = expf(__fsub_rn(gl, gt));
    sm.lg[w][t] = bt;  // beta, for the rows below (lg is spent)
    __syncwarp();
    // N and P row by row, lane i one column (P's rows stored whole: coalesced)
    const int i = lane;
    float* pc = ws_p + ch * C * C + i;
#pragma unroll 4
    for (int r = 0; r < C; ++r) {
      const float dec = i <= r ? expf(__fsub_rn(sm.gs[w][r], gt)) : 0.f;
      ns[r][i] = i < r ? __fmul_rn(sm.lg[w][r], __fmul_rn(dec, sm.u.out.kk[r][i])) : 0.f;
      pc[r * C] = i <= r ? __fmul_rn(dec, sm.u.out.qk[r][i]) : 0.f;
    }
    __syncwarp();
    // Tm = (I + N)^-1 by forward substitution, one lane per column j: Tm_tj = [t == j] - sum_{i<t} N_ti Tm_ij
    // (i ascending; row t needs rows < t only)
    {
      const int j = lane;
      float col[C];
      float* tcol = ws_t + ch * C * C + j;
#pragma unroll
      for (int r = 0; r < C; ++r) {
        float acc = r == j ? 1.f : 0.f;
#pragma unroll
        for (int i = 0; i < r; ++i) acc = __fmaf_rn(-ns[r][i], col[i], acc);
        col[r] = acc;
        tcol[r * C] = acc;
      }
    }
    __syncwarp();  // ns and lg / gs are this warp's again
  }
}

template <int DK, int C, int COLS, int THREADS>
__device__ __forceinline__ void scan(float* s, const float* __restrict__ q, const float* __restrict__ k,
                                     const float* __restrict__ v, long long vs_b, long long vs_t, long long vs_c,
                                     const float* __restrict__ beta, const float* __restrict__ ws_g,
                                     const float* __restrict__ ws_t, const float* __restrict__ ws_p, int T, int Hk,
                                     int Hv, int dv, float* __restrict__ o, const long long* __restrict__ n) {
  using G = Geometry<DK, C, COLS, THREADS>;
  constexpr int RPT = G::RPT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ScanSmem<DK, C, COLS>& sm = *reinterpret_cast<ScanSmem<DK, C, COLS>*>(smem_raw);
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (Hv / Hk), j0 = blockIdx.x * COLS;
  const int nch = (T + C - 1) / C;
  const int ri = threadIdx.x / G::CG, cg = threadIdx.x % G::CG, jc = j0 + 4 * cg;
  const bool live = jc < dv;                    // dv % 4 == 0: a column group is whole or absent
  const int d0 = ri * RPT;                      // step D: state rows d0 .. d0 + RPT - 1
  const bool drow = d0 < DK;
  float* S = s + ((long long)b * Hv + h) * DK * dv;
  const int keep = n != nullptr ? gdn::clamp_steps(n[b], T) : T;

  float sr[RPT][4];  // this thread's block of the chunk-start state (step D's rows and columns)
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const float4 x = drow && live ? ld4(S + (long long)(d0 + r) * dv + jc) : make_float4(0.f, 0.f, 0.f, 0.f);
    sr[r][0] = x.x, sr[r][1] = x.y, sr[r][2] = x.z, sr[r][3] = x.w;
    if (drow) st4(&sm.ss[d0 + r][4 * cg], sr[r]);
  }
  auto store_state = [&](const float (&x)[RPT][4]) {
    if (!(drow && live)) return;
#pragma unroll
    for (int r = 0; r < RPT; ++r) st4(S + (long long)(d0 + r) * dv + jc, x[r]);
  };
  // the state after `end` < L positions of this chunk (a commit inside it): exp(g_{e-1}) S0 +
  // sum_{i<e} k_i (w_i u_i)^T with w_i = exp(g_{e-1} - g_i), weights taken here (the chunk's end state,
  // e = L, uses step B's weighted u instead: the same products, the same bits)
  auto state_at = [&](const float (*kc)[DK + 4], int end, float (&x)[RPT][4]) {
    const float ge = sm.gs[end - 1], eg = expf(ge);
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) x[r][c] = __fmul_rn(eg, sr[r][c]);
#pragma unroll 2
    for (int i = 0; i < end; ++i) {
      const float w = expf(__fsub_rn(ge, sm.gs[i]));
      const float4 u = ld4(&sm.us[i][4 * cg]);
      add_ku(kc[i] + d0, make_float4(__fmul_rn(w, u.x), __fmul_rn(w, u.y), __fmul_rn(w, u.z), __fmul_rn(w, u.w)), x);
    }
  };

  // Chunk c's inputs: k into ks[c & 1], q, Tm, P as cp.async groups (each committed on its own, so a
  // step waits for exactly the group it reads: wait_group<2> below leaves the two younger ones in
  // flight); v, beta and g through registers (loaded early, stored once the chunk before is done).
  auto fetch_k = [&](int c) {
    const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
    if (c < nch) stage_rows<DK, C, THREADS>(sm.ks[c & 1], k, ((long long)b * T + t0) * Hk + kh, Hk, L);
    cp_async_commit();
  };
  auto fetch_q = [&](int c) {
    const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
    if (c < nch) stage_rows<DK, C, THREADS>(sm.qs, q, ((long long)b * T + t0) * Hk + kh, Hk, L);
    cp_async_commit();
  };
  auto fetch_cc = [&](float (*dst)[C + 4], const float* ws, int c) {  // Tm or P: C x C, row-major
    if (c < nch) {
      const float* src = ws + (((long long)b * Hv + h) * nch + c) * C * C;
      for (int e = threadIdx.x; e < C * (C / 4); e += THREADS)
        gdn::copy16(&dst[e / (C / 4)][4 * (e % (C / 4))], src + 4 * e);
    }
    cp_async_commit();
  };
  constexpr int VPT = C * COLS / THREADS;  // values per thread per chunk
  float vr[VPT], br = 0.f, gr = 0.f;
  auto load_small = [&](int c) {  // v, beta, g of chunk c into registers
    const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
#pragma unroll
    for (int m = 0; m < VPT; ++m) {
      const int e = threadIdx.x + m * THREADS, t = e / COLS, j = j0 + e % COLS;
      vr[m] = c < nch && t < L && j < dv ? v[b * vs_b + (t0 + t) * vs_t + ((long long)h * dv + j) * vs_c] : 0.f;
    }
    if (threadIdx.x < C && c < nch) {
      const int t = threadIdx.x;
      br = t < L ? beta[((long long)b * T + t0 + t) * Hv + h] : 0.f;
      gr = ws_g[(((long long)b * Hv + h) * nch + c) * 3 * C + t];
    }
  };
  auto store_small = [&]() {
#pragma unroll
    for (int m = 0; m < VPT; ++m) {
      const int e = threadIdx.x + m * THREADS;
      sm.rs[e / COLS][e % COLS] = vr[m];
    }
    if (threadIdx.x < C) sm.gs[threadIdx.x] = gr, sm.bs[threadIdx.x] = br;
  };
  fetch_k(0);
  fetch_q(0);
  fetch_cc(sm.tm, ws_t, 0);
  fetch_cc(sm.pm, ws_p, 0);
  load_small(0);
  store_small();

#pragma unroll 1
  for (int c = 0; c < nch; ++c) {
    const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
    const float(*kc)[DK + 4] = sm.ks[c & 1];
    cp_async_wait<2>();  // this chunk's k and q (groups: k, q, Tm, P; Tm and P may still fly)
    __syncthreads();     // ... everyone's, and the small inputs stored at the end of the last chunk
    fetch_k(c + 1);      // into the other buffer: its last reader was chunk c - 1's step D
    load_small(c + 1);   // registers only; stored after step D

    // A: S0^T k_t and S0^T q_t for row t = ri, columns jc.. (DK ascending, one fma chain each)
    float ak[4] = {}, aq[4] = {};
#pragma unroll 4
    for (int d = 0; d < DK; d += 4) {
      const float4 kf = ld4(&kc[ri][d]), qf = ld4(&sm.qs[ri][d]);
      const float kd[4] = {kf.x, kf.y, kf.z, kf.w}, qd[4] = {qf.x, qf.y, qf.z, qf.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float4 sv = ld4(&sm.ss[d + e][4 * cg]);
        fma4(kd[e], sv, ak);
        fma4(qd[e], sv, aq);
      }
    }
    const float eg = expf(sm.gs[ri]), bt = sm.bs[ri];
    float r4[4], oq[4];
    {
      const float4 vv = ld4(&sm.rs[ri][4 * cg]);  // this thread's own values: r replaces them in place
      const float vd[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        r4[e] = __fmul_rn(bt, __fsub_rn(vd[e], __fmul_rn(eg, ak[e])));
        oq[e] = __fmul_rn(eg, aq[e]);
      }
    }
    st4(&sm.rs[ri][4 * cg], r4);
    cp_async_wait<2>();  // Tm (groups now: Tm, P, next k)
    __syncthreads();
    fetch_q(c + 1);  // every thread is past step A

    // B: u_t = sum_{i <= t} Tm_ti r_i; and w_t u_t for step D (w_t = exp(g_{L-1} - g_t))
    float u4[4] = {};
#pragma unroll 4
    for (int i = 0; i <= ri; ++i) fma4(sm.tm[ri][i], ld4(&sm.rs[i][4 * cg]), u4);
    st4(&sm.us[ri][4 * cg], u4);
    {
      const float w = expf(__fsub_rn(sm.gs[L - 1], sm.gs[ri]));
      const float wu[4] = {__fmul_rn(w, u4[0]), __fmul_rn(w, u4[1]), __fmul_rn(w, u4[2]), __fmul_rn(w, u4[3])};
      st4(&sm.ws[ri][4 * cg], wu);
    }
    cp_async_wait<2>();  // P (groups now: P, next k, next q)
    __syncthreads();
    fetch_cc(sm.tm, ws_t, c + 1);  // every thread is past step B

    // C: o_t = exp(g_t) S0^T q_t + sum_{i <= t} P_ti u_i
#pragma unroll 4
    for (int i = 0; i <= ri; ++i) fma4(sm.pm[ri][i], ld4(&sm.us[i][4 * cg]), oq);
    if (ri < L && live) st4(o + (((long long)b * T + t0 + ri) * Hv + h) * dv + jc, oq);

    // D: the commit inside this chunk (if it ends before the chunk does), then the chunk's end state
    if (keep > t0 && keep < t0 + L) {
      float x[RPT][4];
      state_at(kc, keep - t0, x);
      store_state(x);
    }
    {
      const float eg_end = expf(sm.gs[L - 1]);
#pragma unroll
      for (int r = 0; r < RPT; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) sr[r][e] = __fmul_rn(eg_end, sr[r][e]);
#pragma unroll 4
      for (int i = 0; i < L; ++i) add_ku(kc[i] + d0, ld4(&sm.ws[i][4 * cg]), sr);
    }
    if (keep == t0 + L) store_state(sr);
    __syncthreads();  // every thread is done with this chunk's P, ss, k, u, v / r, g before they are refilled
    fetch_cc(sm.pm, ws_p, c + 1);
    if (drow) {
#pragma unroll
      for (int r = 0; r < RPT; ++r) st4(&sm.ss[d0 + r][4 * cg], sr[r]);
    }
    store_small();
  }
  cp_async_wait<0>();  // nothing left in flight at exit (the last fetches are empty groups)
}

}  // namespace gdn_chunk
}  // namespace dflashgen
