// dflashgen gated delta rule (Gated DeltaNet) for decode / verify steps: sequential, exact, batch-invariant.
//
// Per request b and value head h (key head h / (Hv / Hk)), for t = 0..T-1 in order:
//   S <- d_t S                           d_t = expf(log_decay_t)
//   u_t = beta_t (v_t - S^T k_t)         (S already decayed)
//   S <- S + k_t u_t^T
//   o_t = S^T q_t
// S is [DK, dv] FP32; every column j evolves on its own (u_t[j] and o_t[j] need only column j), so a
// CTA owns a block of columns and no reduction ever crosses columns, requests or heads.
//
// Thread layout (mirrored by runtime/gdn_kernel.py::reference_step, which reproduces the bits up to
// expf): lane = 2 * lr + lc, lr in [0, 16) splits the DK rows, lc in [0, 2) the columns. A thread
// holds rows i = lr + 16 r (r < DK / 16) of columns j = col0 + 8 w + 4 lc + c (c < 4). A dot product
// over DK: per thread p = fma(x_r, s_r, ... fma(x_1, s_1, x_0 s_0)) (r ascending), then an xor
// butterfly over lr (lane offsets 16, 8, 4, 2): a fixed order for any T, batch or grid. (The step and
// prefill reduce-scatter it, Col::scatter2: the butterfly's additions, each lane keeping one column.)
// Explicit roundings only (__fmul_rn / __fadd_rn / __fmaf_rn, never a compiler contraction): the dots
// and the rank-1 update S += k u^T are fused multiply-adds (one rounding each: fewer instructions
// than a mul and an add, and more accurate), the decay and u = beta (v - S^T k) plain products; the
// torch reference (runtime/gdn_kernel.py) emulates each fma exactly, so the bits stay the reference's.
//
// step    grid (ceil(dv / COLS), Hv, B): o, u and decay for every position; S0 is only read, except
//         with `commit`: S after n[b] positions (n = nullptr: all T) is written to `commit` (may be S0),
//         and with `replay_n`: first S0 <- S0 after replay_n[b] positions of the terms k_out / u /
//         decay still hold (the previous armed step's: a deferred advance, the same update), written
//         back to S0, and then this step's positions from it (a rollback folded into the next step).
// advance grid (ceil(dv / COLS), Hv, L * B): S <- S after n[b] positions, from the u / decay / k a step
//         wrote (one launch for every GDN layer: per-layer strides). The same update functions as step,
//         so a T-position verify followed by advance(n) is bitwise n single-position steps.
// prefill grid (ceil(dv / COLS), Hv, B): any T in one launch, o only, S committed in place after n[b]
//         positions: step's position body over CHUNK-position stagings, bitwise T one-position steps.
#pragma once

#include <dflashgen/decode.cuh>  // cp_async16 / cp_async4, cp_async_commit / cp_async_wait

namespace dflashgen {
namespace gdn {

constexpr int LR = 16;  // lanes along DK
constexpr int LC = 2;   // lanes along the columns
constexpr int CPT = 4;  // columns per thread: one float4 per row

__device__ __forceinline__ int clamp_steps(long long n, int T) { return n < 0 ? 0 : n > T ? T : (int)n; }

// 16-byte global -> shared copy (both addresses 16-byte aligned). sm_80+: cp.async (no registers, every
// copy of the CTA in flight at once, overlapping the state's loads); before: a float4 load and store.
// Data movement only: the bits that land in shared memory are the loaded ones either way.
__device__ __forceinline__ void copy16(float* smem, const float* gmem) {
#if __CUDA_ARCH__ >= 800
  cp_async16(smem, gmem);
#else
  *reinterpret_cast<float4*>(smem) = __ldg(reinterpret_cast<const float4*>(gmem));
#endif
}
// Waits for this thread's copy16s (a __syncthreads must follow before other threads read them).
__device__ __forceinline__ void copy16_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
__device__ __forceinline__ void zero16(float* smem) { *reinterpret_cast<float4*>(smem) = make_float4(0.f, 0.f, 0.f, 0.f); }
// The 4-byte form (sm_80+: cp.async.ca, no register round trip that would hold the issuing warp).
__device__ __forceinline__ void copy4(float* smem, const float* gmem) {
#if __CUDA_ARCH__ >= 800
  cp_async4(smem, gmem);
#else
  *smem = __ldg(gmem);
#endif
}

// Rows [0, rows) of DK floats each, row t at src + t * stride (16-byte aligned, stride % 4 == 0), into
// dst[t * DK ...] as float4, for NS (source, destination) pairs with the same row stride (q and k): a
// thread copies float4 i4 = tid % (DK / 4) of rows tid / (DK / 4) + m * (THREADS / (DK / 4)), its source
// addresses advancing by a fixed stride (no index math per element). Not unrolled: with cp.async
// nothing waits inside the loop, and unrolled addresses would sit in registers beside the state.
template <int DK, int THREADS, int NS>
__device__ __forceinline__ void stage_rows(float* const (&dst)[NS], const float* const (&src)[NS], long long stride,
                                           int rows) {
  constexpr int V4 = DK / 4, RPR = THREADS / V4;  // float4 per row, rows per round of the CTA
  static_assert(DK % 4 == 0 && THREADS % V4 == 0, "a round of the CTA covers whole rows");
  const int i4 = threadIdx.x % V4;
  int t = threadIdx.x / V4;
  const float* from[NS];
  float* to[NS];
#pragma unroll
  for (int i = 0; i < NS; ++i) from[i] = src[i] + t * stride + 4 * i4, to[i] = dst[i] + t * DK + 4 * i4;
#pragma unroll 1
  for (; t < rows; t += RPR) {
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      copy16(to[i], from[i]);
      from[i] += RPR * stride;
      to[i] += RPR * DK;
    }
  }
}

template <int DK, int C = CPT>
struct Col {
  static constexpr int R = DK / LR;
  static_assert(DK % LR == 0, "DK must be a multiple of 16");
  static_assert(C == 4 || C == 2, "columns per thread: one float4 or float2 per row");
  float s[R][C];

  __device__ __forceinline__ void decay(float d) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) s[r][c] = __fmul_rn(d, s[r][c]);
  }
  // S += k u^T on this thread's rows / columns (x: the DK-vector in shared memory).
  __device__ __forceinline__ void add(const float* x, const float (&u)[C], int lr) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float k = x[lr + LR * r];
#pragma unroll
      for (int c = 0; c < C; ++c) s[r][c] = __fmaf_rn(k, u[c], s[r][c]);
    }
  }
  // One position of the delta rule, shared by the step and prefill kernels (same bits): S <- d S,
  // u = beta (v - S^T k), S += k u^T, o = S^T q. k, q: DK-vectors in shared memory. Software-pipelined
  // over positions: the q dot of position t is split into its per-thread part (taken at the end of
  // position t, on S_t before the next decay) and its reduction over the lr lanes, which runs in
  // position t + 1's enter() beside that position's k-dot reduction (two independent chains
  // interleaved, instead of a warp stalled on each in turn). The reductions scatter (scatter2): lane
  // lr ends with the sums of its own column own(lr) only, so u is computed once per column and
  // broadcast to the C slots every lane's rank-1 update needs. Every operation and its order per value
  // is that of decay, dot(k), u, update, dot(q) in sequence with full xor butterflies: the same bits.
  // enter: S <- d S and kv[0] = (S^T k)[own]; qp: in, position t - 1's q partials (zeros at the first
  // position), out, qp[0] = that position's o[own]. leave: v = this thread's own value; returns
  // u[own]; S += k u^T; qp = this position's q partials.
  __device__ __forceinline__ void enter(float d, const float* k, int lr, float (&kv)[C], float (&qp)[C]) {
    decay(d);
    partial(k, kv, lr);
    scatter2(kv, qp, lr);
  }
  __device__ __forceinline__ float leave(float beta, const float* k, const float* q, float v, int lr,
                                         const float (&kv)[C], float (&qp)[C]) {
    const float uo = __fmul_rn(beta, __fsub_rn(v, kv[0]));
    float ut[C];
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < C; ++c)  // column c's u from a lane that owns it (same lc, same low lr bits)
      ut[c] = __shfl_sync(0xffffffffu, uo, (lane & ~OWN_MASK) | (c << OWN_SHIFT));
    add(k, ut, lr);
    partial(q, qp, lr);
    return uo;
  }
  // the column whose reduced sums lane lr holds after scatter2 (lr's top log2(C) bits), and where
  // those bits sit in the lane index (lane = LC lr + lc)
  static constexpr int OWN_SPAN = LR / C, OWN_SHIFT = (OWN_SPAN == 4 ? 2 : 3) + 1, OWN_MASK = (C - 1) << OWN_SHIFT;
  static_assert(OWN_SPAN == 4 || OWN_SPAN == 8, "C = 4 or 2 of LR = 16 row lanes");
  static __device__ __forceinline__ int own(int lr) { return lr / OWN_SPAN; }
  static __device__ __forceinline__ bool stores(int lr) { return lr % OWN_SPAN == 0; }  // one lane per column
  // Reduce-scatter of two partial-sum sets over the lr lanes, level for level and pair for pair the
  // xor butterfly's additions (mine + partner's, offsets LR / 2 .. 1): while a lane holds w > 1
  // columns, the level keeps the half selected by its lr bit (the partner, across that bit, keeps the
  // other) and adds the partner's copy of it; with one column left, a plain butterfly step. Ends with
  // column own(lr)'s sums in a[0] / b[0], the bits every lane of the butterfly would hold.
  static __device__ __forceinline__ void scatter2(float (&a)[C], float (&b)[C], int lr) {
#pragma unroll
    for (int level = 0, off = LR / 2; off > 0; ++level, off >>= 1) {
      const int w = C >> level;  // columns still held (>= 1)
      if (w > 1) {
        const bool hi = (lr & off) != 0;
#pragma unroll
        for (int i = 0; i < w / 2; ++i) {
          const float sa = hi ? a[i] : a[i + w / 2], sb = hi ? b[i] : b[i + w / 2];
          const float ka = hi ? a[i + w / 2] : a[i], kb = hi ? b[i + w / 2] : b[i];
          const float ra = __shfl_xor_sync(0xffffffffu, sa, off * LC), rb = __shfl_xor_sync(0xffffffffu, sb, off * LC);
          a[i] = __fadd_rn(ka, ra);
          b[i] = __fadd_rn(kb, rb);
        }
      } else {
        const float ra = __shfl_xor_sync(0xffffffffu, a[0], off * LC), rb = __shfl_xor_sync(0xffffffffu, b[0], off * LC);
        a[0] = __fadd_rn(a[0], ra);
        b[0] = __fadd_rn(b[0], rb);
      }
    }
  }
  // out[c] = sum_i x[i] S[i, c] in the fixed order (every lr lane of the warp gets the same bits):
  // per thread its rows ascending (partial), then the xor butterfly over lr (butterfly).
  __device__ __forceinline__ void partial(const float* x, float (&out)[C], int lr) const {
#pragma unroll
    for (int c = 0; c < C; ++c) out[c] = __fmul_rn(x[lr], s[0][c]);
#pragma unroll
    for (int r = 1; r < R; ++r) {
      const float k = x[lr + LR * r];
#pragma unroll
      for (int c = 0; c < C; ++c) out[c] = __fmaf_rn(k, s[r][c], out[c]);
    }
  }
  static __device__ __forceinline__ void butterfly(float (&out)[C]) {
#pragma unroll
    for (int off = LR / 2; off > 0; off >>= 1)
#pragma unroll
      for (int c = 0; c < C; ++c) out[c] = __fadd_rn(out[c], __shfl_xor_sync(0xffffffffu, out[c], off * LC));
  }
  __device__ __forceinline__ void load(const float* S, int dv, int lr, int j0, bool live) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) s[r][c] = 0.f;  // absent columns (dv not a multiple of COLS) stay 0
    if (!live) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {  // 16- / 8-byte loads: the runtime checks S is 16-byte aligned, dv % 4 == 0
      const float* at = S + (long long)(lr + LR * r) * dv + j0;
      if constexpr (C == 4) {
        const float4 x = *reinterpret_cast<const float4*>(at);
        s[r][0] = x.x, s[r][1] = x.y, s[r][2] = x.z, s[r][3] = x.w;
      } else {
        const float2 x = *reinterpret_cast<const float2*>(at);
        s[r][0] = x.x, s[r][1] = x.y;
      }
    }
  }
  __device__ __forceinline__ void store(float* S, int dv, int lr, int j0, bool live) const {
    if (!live) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float* at = S + (long long)(lr + LR * r) * dv + j0;
      if constexpr (C == 4)
        *reinterpret_cast<float4*>(at) = make_float4(s[r][0], s[r][1], s[r][2], s[r][3]);
      else
        *reinterpret_cast<float2*>(at) = make_float2(s[r][0], s[r][1]);
    }
  }
};

// Copies `count` elements into shared memory with CHUNK loads per thread in flight before the first
// store: a plain load -> store loop pays a whole memory round trip per iteration (the store waits
// for its load and a warp issues in order), T * DK / THREADS round trips per launch.
template <int THREADS, int CHUNK = 8, class Load, class Store>
__device__ __forceinline__ void stage(int count, Load&& load, Store&& store) {
  for (int base = threadIdx.x; base < count; base += CHUNK * THREADS) {
    float r[CHUNK];
#pragma unroll
    for (int i = 0; i < CHUNK; ++i) r[i] = base + i * THREADS < count ? load(base + i * THREADS) : 0.f;
#pragma unroll
    for (int i = 0; i < CHUNK; ++i)
      if (base + i * THREADS < count) store(base + i * THREADS, r[i]);
  }
}

template <int WARPS, int C = CPT>
struct Layout {
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int COLS = WARPS * LC * C;  // columns per CTA
  int lr, j0;  // this thread's first row and first column
  bool live;   // its columns exist (dv % 4 == 0: all C or none)
  __device__ __forceinline__ Layout(int dv) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    lr = lane >> 1;
    j0 = blockIdx.x * COLS + w * (LC * C) + (lane & 1) * C;
    live = j0 < dv;
  }
};

// Dynamic shared memory of a step launch: qs [T][DK], ks [T][DK], vs [T][COLS], bs [T], ds [T] floats,
// in that order (runtime/gdn_kernel.py launches with step_smem_bytes(T); gdn_family.py puts the per-position
// bytes in the manifest). Sized for the launch's T, not MAXT: T = 8 needs half of T = 16's footprint.
// A replaying step adds an advance's region (kp [T][DK], up [T][COLS], dp [T]) at the next 16-byte boundary.
template <int DK, int COLS>
__host__ __device__ constexpr int step_smem_floats_per_t() { return 2 * DK + COLS + 2; }
template <int DK, int COLS>
__device__ __forceinline__ int step_replay_offset(int T) { return (T * step_smem_floats_per_t<DK, COLS>() + 3) & ~3; }

// Rows [0, rows) of a value-head row block (positions Hv * dv apart, from `from`: this CTA's first
// column of position 0) into dst[t * COLS ...] as float4 copies; absent columns (dv not a multiple of
// COLS; dv % 4 == 0, so a float4 of columns is all there or all absent) are zeroed. All loads issued
// at once (cp.async on sm_80+; copy16_wait + sync before use).
template <int MAXT, int THREADS, int COLS>
__device__ __forceinline__ void stage_cols(float* dst, const float* from, long long pos_stride, int jc, int dv,
                                           int rows) {
  constexpr int C4 = COLS / 4;
#pragma unroll
  for (int m = 0; m < (MAXT * C4 + THREADS - 1) / THREADS; ++m) {
    const int e = threadIdx.x + m * THREADS, t = e / C4, j4 = 4 * (e % C4);
    if (t < rows) {
      if (jc + j4 < dv)
        copy16(dst + t * COLS + j4, from + t * pos_stride + j4);
      else
        zero16(dst + t * COLS + j4);
    }
  }
}

// k_out rows [0, T) of key head kh (positions Hk * DK apart, from `to`) from the staged ks [T][DK] (no
// second global load): float4 i4 of every RPR-th row per thread, as stage_rows.
template <int DK, int THREADS>
__device__ __forceinline__ void write_k_out(float* to, const float* ks, int Hk, int T) {
  constexpr int V4 = DK / 4, RPR = THREADS / V4;
  const int i4 = threadIdx.x % V4;
  int t = threadIdx.x / V4;
  to += t * (long long)Hk * DK + 4 * i4;
  const float* from = ks + t * DK + 4 * i4;
#pragma unroll 1
  for (; t < T; t += RPR, to += RPR * (long long)Hk * DK, from += RPR * DK)
    *reinterpret_cast<float4*>(to) = *reinterpret_cast<const float4*>(from);
}

// q, k [B, T, Hk, DK] contiguous, 16-byte aligned; v element (b, t, h * dv + j) at b * vs_b + t * vs_t +
// (h * dv + j) * vs_c (copied as float4 when vs_c == 1, v is 16-byte aligned and vs_b, vs_t are multiples
// of 4, else element by element); beta, log_decay [B, T, Hv] contiguous. Outputs: o, u [B, T, Hv, dv]
// (16-byte aligned); decay [B, T, Hv]; k_out [B, T, Hk, DK] (a copy of k for advance, 16-byte aligned;
// nullptr: none). S0 [B, Hv, DK, dv]. The runtime checks every alignment named here.
template <int DK, int MAXT, int WARPS, bool REPLAY>
__device__ __forceinline__ void step(float* s0, const float* __restrict__ q, const float* __restrict__ k,
                                     const float* __restrict__ v, long long vs_b, long long vs_t, long long vs_c,
                                     const float* __restrict__ beta, const float* __restrict__ log_decay, int T,
                                     int Hk, int Hv, int dv, float* __restrict__ o, float* __restrict__ u,
                                     float* __restrict__ decay, float* __restrict__ k_out, float* commit,
                                     const long long* __restrict__ n, const long long* __restrict__ replay_n,
                                     int* __restrict__ arrive) {
  using L = Layout<WARPS>;
  extern __shared__ __align__(16) float smem[];
  float* const qs = smem;
  float* const ks = qs + T * DK;
  float* const vs = ks + T * DK;
  float* const bs = vs + T * L::COLS;
  float* const ds = bs + T;
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (Hv / Hk);
  const L lay(dv);
  const long long bt = (long long)b * T;
  const long long sbase = ((long long)b * Hv + h) * DK * dv;
  Col<DK> col;
  col.load(s0 + sbase, dv, lay.lr, lay.j0, lay.live);  // issued first: overlaps the staging below
  const long long qk0 = (bt * Hk + kh) * DK;          // q / k row of (b, t = 0, kh); rows Hk * DK apart
  const int jc = blockIdx.x * L::COLS;  // the CTA's first column
  // replay: the deferred advance's terms (the previous step's k_out / u / decay), staged before anything
  // of this step overwrites them (the group's last CTA writes k_out / decay at its end). All T rows,
  // whatever replay_n[b] is: no load waits on that one, so every copy is issued at once.
  const long long rn_ll = REPLAY ? replay_n[b] : 0;  // read after the barrier (the replay's trip count)
  float* const kp = smem + step_replay_offset<DK, L::COLS>(T);  // (REPLAY only)
  if constexpr (REPLAY) {
    float* const up = kp + T * DK;
    float* const dp = up + T * L::COLS;
    stage_rows<DK, L::THREADS, 3>({kp, qs, ks}, {k_out + qk0, q + qk0, k + qk0}, (long long)Hk * DK, T);
    stage_cols<MAXT, L::THREADS, L::COLS>(up, u + (bt * Hv + h) * dv + jc, (long long)Hv * dv, jc, dv, T);
    if (threadIdx.x < T) copy4(dp + threadIdx.x, decay + (bt + threadIdx.x) * Hv + h);
  } else {
    stage_rows<DK, L::THREADS, 2>({qs, ks}, {q + qk0, k + qk0}, (long long)Hk * DK, T);
  }
  if (vs_c == 1 && ((reinterpret_cast<unsigned long long>(v) & 15) | ((vs_b | vs_t) & 3)) == 0) {
    stage_cols<MAXT, L::THREADS, L::COLS>(vs, v + b * vs_b + (long long)h * dv + jc, vs_t, jc, dv, T);
  } else {  // any other v layout: element by element (4 loads in flight: few registers beside the state)
    stage<L::THREADS, 4>(
        T * L::COLS,
        [&](int e) {
          const int t = e / L::COLS, j = jc + e % L::COLS;
          return j < dv ? v[b * vs_b + t * vs_t + ((long long)h * dv + j) * vs_c] : 0.f;
        },
        [&](int e, float x) { vs[e] = x; });
  }
  if (threadIdx.x < T) {
    const long long at = (bt + threadIdx.x) * Hv + h;
    bs[threadIdx.x] = beta[at];
    ds[threadIdx.x] = expf(log_decay[at]);
    if (!REPLAY && blockIdx.x == 0) decay[at] = ds[threadIdx.x];
  }
  copy16_wait();
  __syncthreads();
  // REPLAY: this CTA's staging is done; count it on arrive[b, kh] now and read the ticket at the end
  // (the round trip overlaps the positions). The group's gridDim.x x Hv / Hk CTAs all arrive after
  // their copies of the old terms landed, so the last to arrive may overwrite them (and resets the
  // counter to 0 for the next launch).
  int ticket = 0;
  if (REPLAY && threadIdx.x == 0) ticket = atomicAdd(arrive + (long long)b * Hk + kh, 1);
  const int rn = clamp_steps(rn_ll, T);
  if (REPLAY && rn > 0) {  // the deferred advance (advance's update, same order), committed to S0
    const float* const up = kp + T * DK + (lay.j0 - jc);
    const float* const dp = kp + T * (DK + L::COLS);
    for (int t = 0; t < rn; ++t) {
      const float4 u4 = *reinterpret_cast<const float4*>(up + t * L::COLS);
      const float ut[CPT] = {u4.x, u4.y, u4.z, u4.w};
      col.decay(dp[t]);
      col.add(kp + t * DK, ut, lay.lr);
    }
    col.store(s0 + sbase, dv, lay.lr, lay.j0, lay.live);
  }
  // Who writes this step's k_out / decay terms (at the end): column block 0 of key head kh's first
  // value head for k_out; with REPLAY, the last of the group's CTAs to arrive (both).
  if (!REPLAY && k_out != nullptr && blockIdx.x == 0 && h % (Hv / Hk) == 0)
    write_k_out<DK, L::THREADS>(k_out + qk0, ks, Hk, T);

  // positions to commit: S after `keep` steps is stored (0: S0 stays; -1: no commit)
  // (a replaying step never commits: the runtime refuses commit with replay_n)
  const int keep = REPLAY || commit == nullptr ? -1 : (n != nullptr ? clamp_steps(n[b], T) : T);
  const int jl = lay.j0 - jc;
  const long long ou = (bt * Hv + h) * dv + lay.j0;  // o / u offset of (b, t, h, j0), advancing by Hv * dv
  float qp[CPT] = {};  // the pipelined q dot (Col::enter / leave): o_t is stored at position t + 1
  const int own = Col<DK>::own(lay.lr);  // the column this lane's reduced o / u belong to
  const bool writes = lay.live && Col<DK>::stores(lay.lr);
  const long long pos = (long long)Hv * dv;  // o / u elements from one position to the next
  long long at = ou + own;  // position t's o / u element of that column
  for (int t = 0; t < T; ++t, at += pos) {
    float kv[CPT];
    col.enter(ds[t], ks + t * DK, lay.lr, kv, qp);
    if (t > 0 && writes) o[at - pos] = qp[0];
    const float uo = col.leave(bs[t], ks + t * DK, qs + t * DK, vs[t * L::COLS + jl + own], lay.lr, kv, qp);
    if (writes) u[at] = uo;
    if constexpr (!REPLAY)
      if (t + 1 == keep) col.store(commit + sbase, dv, lay.lr, lay.j0, lay.live);
  }
  if (T > 0) {  // the last position's q dot: a full butterfly (the same additions), lr = 0 stores
    Col<DK>::butterfly(qp);
    if (lay.live && lay.lr == 0)
      *reinterpret_cast<float4*>(o + (at - pos)) = make_float4(qp[0], qp[1], qp[2], qp[3]);
  }
  if constexpr (REPLAY) {
    __shared__ int last;
    if (threadIdx.x == 0) {
      last = ticket == (int)gridDim.x * (Hv / Hk) - 1;
      if (last) arrive[(long long)b * Hk + kh] = 0;
    }
    __syncthreads();
    if (last) {  // the group's value heads' decay (expf as above: the same bits), then k from shared memory
      for (int e = threadIdx.x; e < T * (Hv / Hk); e += L::THREADS) {
        const long long at = (bt + e / (Hv / Hk)) * Hv + kh * (Hv / Hk) + e % (Hv / Hk);
        decay[at] = expf(log_decay[at]);
      }
      write_k_out<DK, L::THREADS>(k_out + qk0, ks, Hk, T);
    }
  }
}

// Dynamic shared memory of an advance launch: ks [T][DK], us [T][COLS], ds [T] floats, in that order
// (runtime/gdn_kernel.py: T * advance_smem_floats_per_t floats).
template <int DK, int COLS>
constexpr int advance_smem_floats_per_t() { return DK + COLS + 1; }

// S [L, B, Hv, DK, dv] (layer stride s_l, batch-contiguous inside a layer); k [L, B, T, Hk, DK],
// u [L, B, T, Hv, dv], decay [L, B, T, Hv] (layer strides k_l, u_l, d_l); n [B] in [0, T] (clamped).
// k and u 16-byte aligned in every layer (copied as float4; the runtime checks).
template <int DK, int MAXT, int WARPS>
__device__ __forceinline__ void advance(float* s, long long s_l, const float* __restrict__ k, long long k_l,
                                        const float* __restrict__ u, long long u_l, const float* __restrict__ decay,
                                        long long d_l, const long long* __restrict__ n, int B, int T, int Hk,
                                        int Hv, int dv) {
  using L = Layout<WARPS>;
  extern __shared__ __align__(16) float smem[];
  float* const ks = smem;
  float* const us = ks + T * DK;
  float* const ds = us + T * L::COLS;
  const int h = blockIdx.y, layer = blockIdx.z / B, b = blockIdx.z % B, kh = h / (Hv / Hk);
  const int steps = clamp_steps(n[b], T);
  if (steps == 0) return;
  const L lay(dv);
  const long long bt = (long long)b * T;
  float* S = s + layer * s_l + ((long long)b * Hv + h) * DK * dv;
  Col<DK> col;
  col.load(S, dv, lay.lr, lay.j0, lay.live);  // issued first: overlaps the staging below
  k += layer * k_l;
  u += layer * u_l;
  decay += layer * d_l;
  stage_rows<DK, L::THREADS, 1>({ks}, {k + (bt * Hk + kh) * DK}, (long long)Hk * DK, steps);
  const int jc = blockIdx.x * L::COLS;
  stage_cols<MAXT, L::THREADS, L::COLS>(us, u + (bt * Hv + h) * dv + jc, (long long)Hv * dv, jc, dv, steps);
  if (threadIdx.x < steps) ds[threadIdx.x] = decay[(bt + threadIdx.x) * Hv + h];
  copy16_wait();
  __syncthreads();
  const int jl = lay.j0 - jc;
  for (int t = 0; t < steps; ++t) {
    const float4 u4 = *reinterpret_cast<const float4*>(us + t * L::COLS + jl);
    const float ut[CPT] = {u4.x, u4.y, u4.z, u4.w};
    col.decay(ds[t]);
    col.add(ks + t * DK, ut, lay.lr);
  }
  col.store(S, dv, lay.lr, lay.j0, lay.live);
}

// prefill: the step's recurrence over any T in one launch, commit only (a prefill that is not armed for
// rollback): no u / decay outputs. Positions are staged CHUNK at a time into one of two buffers while
// the other's positions run: q / k by 16-byte async copies (sm_80+; the runtime checks q and k are
// 16-byte aligned), the values, betas and log decays loaded into registers at the same time and
// stored (decays as expf) once this chunk's positions are done. Each position goes through the same
// Col update / dots as step, so the state and outputs are bitwise those of T one-position steps.
// S [B, Hv, DK, dv] is read and updated in place: the state after n[b] positions (n = nullptr: all T;
// n[b] <= 0: S untouched). Inputs and o as for step. grid (ceil(dv / COLS), Hv, B).
template <int DK, int CHUNK, int WARPS, int C = CPT>
__device__ __forceinline__ void prefill(float* s, const float* __restrict__ q, const float* __restrict__ k,
                                        const float* __restrict__ v, long long vs_b, long long vs_t,
                                        long long vs_c, const float* __restrict__ beta,
                                        const float* __restrict__ log_decay, int T, int Hk, int Hv, int dv,
                                        float* __restrict__ o, const long long* __restrict__ n) {
  using L = Layout<WARPS, C>;
  constexpr int V4 = DK / 4;                      // float4 per (position, key head)
  constexpr int QK4 = CHUNK * V4 / L::THREADS;    // float4 of q (and of k) per thread per chunk
  constexpr int VS = CHUNK * L::COLS / L::THREADS;  // values per thread per chunk
  static_assert(CHUNK * V4 % L::THREADS == 0 && CHUNK * L::COLS % L::THREADS == 0 && CHUNK <= L::THREADS,
                "the staging loops assume whole rounds over the CTA");
  __shared__ __align__(16) float qs[2][CHUNK][DK];
  __shared__ __align__(16) float ks[2][CHUNK][DK];
  __shared__ float vs[2][CHUNK][L::COLS], bs[2][CHUNK], ds[2][CHUNK];
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (Hv / Hk);
  const L lay(dv);
  const long long bt = (long long)b * T;
  float* S = s + ((long long)b * Hv + h) * DK * dv;
  const int keep = n != nullptr ? clamp_steps(n[b], T) : T;
  Col<DK, C> col;
  col.load(S, dv, lay.lr, lay.j0, lay.live);
  const int jl = lay.j0 - blockIdx.x * L::COLS;
  float vr[VS], br = 0.f, lg = 0.f;  // the next chunk's values, beta and log decay (this thread's)
  // chunk [t0, t0 + tc) into buffer `buf`: q / k copies issued and committed as one group, the rest
  // loaded into vr / br / lg (rows past T: zero values, no q / k)
  auto fetch = [&](int t0, int buf) {
    const int tc = T - t0 < CHUNK ? T - t0 : CHUNK;
#pragma unroll
    for (int m = 0; m < QK4; ++m) {
      const int e = threadIdx.x + m * L::THREADS, t = e / V4, i4 = e % V4;
      if (t < tc) {
        const long long at = ((bt + t0 + t) * Hk + kh) * DK + 4 * i4;
        copy16(&qs[buf][t][4 * i4], q + at);
        copy16(&ks[buf][t][4 * i4], k + at);
      }
    }
    cp_async_commit();  // (decode.cuh: a commit group of this thread's copy16s)
#pragma unroll
    for (int m = 0; m < VS; ++m) {
      const int e = threadIdx.x + m * L::THREADS, t = e / L::COLS, j = blockIdx.x * L::COLS + e % L::COLS;
      vr[m] = t < tc && j < dv ? v[b * vs_b + (t0 + t) * vs_t + ((long long)h * dv + j) * vs_c] : 0.f;
    }
    if (threadIdx.x < tc) {
      const long long at = (bt + t0 + threadIdx.x) * Hv + h;
      br = beta[at];
      lg = log_decay[at];
    }
  };
  auto put = [&](int t0, int buf) {
#pragma unroll
    for (int m = 0; m < VS; ++m) {
      const int e = threadIdx.x + m * L::THREADS;
      vs[buf][e / L::COLS][e % L::COLS] = vr[m];
    }
    if (threadIdx.x < T - t0 && threadIdx.x < CHUNK) {
      bs[buf][threadIdx.x] = br;
      ds[buf][threadIdx.x] = expf(lg);
    }
  };
  const int own = Col<DK, C>::own(lay.lr);  // the column this lane's reduced o belongs to
  const bool writes = lay.live && Col<DK, C>::stores(lay.lr);
  float* o_at = o + ((bt * Hv + h) * dv + lay.j0 + own);  // o of the next position to store; Hv * dv apart
  const long long o_step = (long long)Hv * dv;
  float qp[C] = {};  // the pipelined q dot (Col::enter / leave): o_t is stored at position t + 1
  if (T > 0) fetch(0, 0), put(0, 0);
#pragma unroll 1
  for (int t0 = 0, buf = 0; t0 < T; t0 += CHUNK, buf ^= 1) {
    const int tc = T - t0 < CHUNK ? T - t0 : CHUNK;
    const bool next = t0 + CHUNK < T;
    __syncthreads();  // the previous chunk's positions are done with buffer buf ^ 1; put(t0) is visible
    if (next) {
      fetch(t0 + CHUNK, buf ^ 1);
      cp_async_wait<1>();  // this chunk's copies have landed (the next one's may still fly)
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // this buffer's rows, walked by pointer (indexing [buf][tt] re-derived each shared address per position)
    const float *kt = ks[buf][0], *qt = qs[buf][0], *vt = &vs[buf][0][jl], *bet = bs[buf], *dec = ds[buf];
#pragma unroll 1
    for (int tt = 0; tt < tc; ++tt, kt += DK, qt += DK, vt += L::COLS) {  // step's position (o only)
      float kv[C];
      col.enter(dec[tt], kt, lay.lr, kv, qp);
      if (t0 + tt > 0) {
        if (writes) *o_at = qp[0];
        o_at += o_step;
      }
      col.leave(bet[tt], kt, qt, vt[own], lay.lr, kv, qp);
      if (t0 + tt + 1 == keep) col.store(S, dv, lay.lr, lay.j0, lay.live);
    }
    if (next) put(t0 + CHUNK, buf ^ 1);
  }
  if (T > 0) {
    Col<DK, C>::butterfly(qp);  // the last position's q dot: a full butterfly, lr = 0 stores (own = 0)
    if (lay.live && lay.lr == 0) {
#pragma unroll
      for (int c = 0; c < C; ++c) o_at[c] = qp[c];
    }
  }
}

}  // namespace gdn
}  // namespace dflashgen
