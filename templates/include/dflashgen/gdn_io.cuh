// dflashgen: the glue around the gated delta rule step as two kernels (GDN layers, decode / verify /
// sequential prefill), replacing ~20 torch launches per layer:
//
// inputs  (<name>) grid (B * T, ceil((2 Hk + Hv) / WARPS)), WARPS warps: per position one warp per head unit
//         (Hk q heads, Hk k heads, Hv v heads): the causal depthwise conv as an explicit W-tap sum
//         (tap 0 the oldest position; one rounding per mul and add, no FMA: __fmul_rn / __fadd_rn),
//         SiLU, and for q / k the L2 norm (x * rsqrt(sum(x^2) / d + eps / d) * factor); the blocks
//         with blockIdx.y == 0 also write beta = sigmoid(b) and log_decay = -exp(A_log) * softplus(a +
//         dt_bias) per value head. Reads the conv inputs time-major ([B, W - 1 + T, C] FP32, the
//         rollback buffer's layout) and b / a from the in_proj output (FP16 rows of `zba_row`).
// gate    (<name>_gate) grid (B * T, ceil(Hv / WARPS)), WARPS warps: per (position, value head) one warp:
//         half(rms_norm(o) * w * silu(z)), the out_proj input.
//
// Every per-head sum runs in one fixed order: per lane over its channels (lane, lane + 32, ...),
// then an xor butterfly (every lane ends with the same sum). Nothing depends on B or T, so a
// position's bits are those of a one-position launch: verify + rollback and the sequential prefill
// stay bitwise one-token steps.
#pragma once
#include <cuda_fp16.h>

#include "gdn.cuh"  // copy16: the step kernels' 16-byte staging copy

namespace dflashgen {
namespace gdn_io {

constexpr int MAX_D = 256;        // head dims up to 32 lanes x PER_LANE channels
constexpr int PER_LANE = MAX_D / 32;

__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.f, expf(-x))); }
__device__ __forceinline__ float sigmoid(float x) { return __fdiv_rn(1.f, __fadd_rn(1.f, expf(-x))); }
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }  // torch's threshold

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
  return s;
}

// What both inputs kernels share: the in_proj output's b / a segment, the conv weight [C, W], the
// decay parameters, head counts and dims, the L2-norm terms and the outputs (q, k [B, T, Hk, dk],
// v [B, T, Hv, dv], beta / log_decay [B, T, Hv], FP32).
struct Terms {
  const __half* __restrict__ zba;
  long long zba_row;
  const float* __restrict__ conv_w;
  const float* __restrict__ dt_bias;
  const float* __restrict__ neg_a;
  int nk, dk, nv, dv;
  float l2_eps, q_factor, k_factor;
  float* __restrict__ q;
  float* __restrict__ k;
  float* __restrict__ v;
  float* __restrict__ beta;
  float* __restrict__ log_decay;
};

// One head unit's channels at one position: q heads, then k heads (L2-normalised, times `factor`),
// then v heads (as they are).
struct Unit {
  int ch0, d;
  float* __restrict__ out;  // this position's head row
  float factor;
  bool norm;
};

__device__ __forceinline__ Unit unit_at(int unit, long long pos, const Terms& a) {
  if (unit < 2 * a.nk) {
    const int head = unit < a.nk ? unit : unit - a.nk;
    return {unit * a.dk, a.dk, (unit < a.nk ? a.q : a.k) + (pos * a.nk + head) * a.dk,
            unit < a.nk ? a.q_factor : a.k_factor, true};
  }
  const int head = unit - 2 * a.nk;
  return {2 * a.nk * a.dk + head * a.dv, a.dv, a.v + (pos * a.nv + head) * a.dv, 0.f, false};
}

// SiLU'd conv outputs `val` (lane's channels lane, lane + 32, ...; ss = their sum of squares in
// that order) -> the L2 norm for q / k, then this position's row of the unit.
template <int PL>
__device__ __forceinline__ void store_unit(float (&val)[PL], float ss, const Unit& u, float l2_eps, int lane) {
  if (u.norm) {
    const float fd = static_cast<float>(u.d);
    const float inv = rsqrtf(__fadd_rn(__fdiv_rn(warp_sum(ss), fd), __fdiv_rn(l2_eps, fd)));
#pragma unroll
    for (int i = 0; i < PL; ++i) val[i] = __fmul_rn(__fmul_rn(val[i], inv), u.factor);
  }
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int ch = lane + 32 * i;
    if (ch < u.d) u.out[ch] = val[i];
  }
}

// beta = sigmoid(b), log_decay = -exp(A_log) * softplus(a + dt_bias) of value head h at position pos.
__device__ __forceinline__ void gate_terms(long long pos, int h, const Terms& a) {
  const __half* __restrict__ row = a.zba + pos * a.zba_row + static_cast<long long>(a.nv) * a.dv;  // [b | a]
  a.beta[pos * a.nv + h] = sigmoid(__half2float(row[h]));
  const float x = __fadd_rn(__half2float(row[a.nv + h]), a.dt_bias[h]);
  a.log_decay[pos * a.nv + h] = __fmul_rn(a.neg_a[h], softplus(x));
}

// val[i] = SiLU(conv(i, ch)) for the lane's channels ch = lane + 32 i < d (0 beyond), and their sum of
// squares in that order (the L2 norm's per-lane part): both inputs kernels' per-position body.
template <int PL, typename Conv>
__device__ __forceinline__ float silu_conv(float (&val)[PL], int d, int lane, Conv conv) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int ch = lane + 32 * i;
    val[i] = 0.f;
    if (ch < d) {
      val[i] = silu(conv(i, ch));
      ss = __fadd_rn(ss, __fmul_rn(val[i], val[i]));
    }
  }
  return ss;
}

template <int WARPS>
__device__ __forceinline__ void inputs(const float* __restrict__ cat, int width, int c, int t_len, const Terms& a) {
  const int pos = blockIdx.x;  // b * T + t
  const int b = pos / t_len, t = pos - b * t_len;
  const int lane = threadIdx.x & 31;
  const int unit = blockIdx.y * WARPS + (threadIdx.x >> 5);
  const int span = width - 1 + t_len;
  // position t's taps are cat rows t .. t + W - 1 (the W - 1 rows before T are the conv state)
  const float* __restrict__ x0 = cat + (static_cast<long long>(b) * span + t) * c;
  if (unit < 2 * a.nk + a.nv) {
    const Unit u = unit_at(unit, pos, a);
    float val[PER_LANE];
    const float ss = silu_conv(val, u.d, lane, [&](int, int ch) {
      const float* __restrict__ wc = a.conv_w + static_cast<long long>(u.ch0 + ch) * width;
      float acc = __fmul_rn(x0[u.ch0 + ch], wc[0]);
      for (int j = 1; j < width; ++j) acc = __fadd_rn(acc, __fmul_rn(x0[static_cast<long long>(j) * c + u.ch0 + ch], wc[j]));
      return acc;
    });
    store_unit(val, ss, u, a.l2_eps, lane);
  }
  if (blockIdx.y == 0) {
    for (int h = threadIdx.x; h < a.nv; h += WARPS * 32) gate_terms(pos, h, a);
  }
}

// inputs of an armed verify / decode forward, without torch's cat: tap r of request b (cat row r) comes
// from the conv state `conv` ([B, C, W - 1] FP32) for r < W - 1, else from the in_proj output's FP16
// row r - (W - 1) (`mixed`, row stride `mixed_row`; the upcast is exact), so the taps -- and every
// position's arithmetic, `inputs`' own -- are the values `inputs` reads from the cat: the same bits.
// The cat itself goes to `cat_out` ([B, W - 1 + T, C] FP32, the rollback buffer), each element once:
// position t's warps write row W - 1 + t of their channels, position 0's also the W - 1 state rows.
// The conv state is only read.
template <int WARPS>
__device__ __forceinline__ void split_inputs(const float* __restrict__ conv, const __half* __restrict__ mixed,
                                             long long mixed_row, float* __restrict__ cat_out, int width, int c,
                                             int t_len, const Terms& a) {
  const int pos = blockIdx.x;  // b * T + t
  const int b = pos / t_len, t = pos - b * t_len;
  const int lane = threadIdx.x & 31;
  const int unit = blockIdx.y * WARPS + (threadIdx.x >> 5);
  const int hold = width - 1;
  const auto tap = [&](int r, int ch) -> float {  // cat row r, channel ch
    return r < hold ? conv[(static_cast<long long>(b) * c + ch) * hold + r]
                    : __half2float(mixed[(static_cast<long long>(b) * t_len + (r - hold)) * mixed_row + ch]);
  };
  if (unit < 2 * a.nk + a.nv) {
    const Unit u = unit_at(unit, pos, a);
    float val[PER_LANE];
    const float ss = silu_conv(val, u.d, lane, [&](int, int ch) {
      const int cc = u.ch0 + ch;
      const float* __restrict__ wc = a.conv_w + static_cast<long long>(cc) * width;
      float acc = __fmul_rn(tap(t, cc), wc[0]);
      for (int j = 1; j < width; ++j) acc = __fadd_rn(acc, __fmul_rn(tap(t + j, cc), wc[j]));
      return acc;
    });
    store_unit(val, ss, u, a.l2_eps, lane);
    float* __restrict__ rows = cat_out + static_cast<long long>(b) * (hold + t_len) * c;
    for (int ch = u.ch0 + lane; ch < u.ch0 + u.d; ch += 32) {
      rows[static_cast<long long>(hold + t) * c + ch] = tap(hold + t, ch);
      if (t == 0) {
        for (int r = 0; r < hold; ++r) rows[static_cast<long long>(r) * c + ch] = tap(r, ch);
      }
    }
  }
  if (blockIdx.y == 0) {
    for (int h = threadIdx.x; h < a.nv; h += WARPS * 32) gate_terms(pos, h, a);
  }
}

// inputs for a prefill, without the FP32 conv-input tensor: the W - 1 oldest taps of the first
// positions come from the conv state `conv` ([B, C, W - 1] FP32), the rest from the in_proj output's
// FP16 rows (`mixed`, row stride `mixed_row`; upcast exactly, so the taps are the values `inputs`
// reads from the cat). Grid (B x ceil(T / TT), ceil(units / WARPS)): a warp stages its unit's TT rows
// in shared memory (every copy in flight at once), then walks the positions keeping the last W - 1
// taps and the conv weights in registers (each input read once); lane channels lane, lane + 32, ... (PL of them)
// and every position's arithmetic are `inputs`', in its order, so the bits are. The warps of a
// request's first TT positions, the only readers of the conv state, then overwrite it (in place,
// each lane its channels, every read of an entry before its write) with the W - 1 taps after n[b]
// positions (T where n is null): the state a commit after n[b] positions keeps.
template <int WARPS, int TT, int W, int PL>
__device__ __forceinline__ void prefill_inputs_w(__half* stage, float* conv, const __half* __restrict__ mixed,
                                                 long long mixed_row, int c, int t_len, const long long* __restrict__ n,
                                                 const Terms& a) {
  static_assert(TT >= W - 1, "only a request's first tile may read the conv state");
  constexpr int H = W > 1 ? W - 1 : 1;  // taps held from earlier positions
  const int tiles = (t_len + TT - 1) / TT;
  const int b = blockIdx.x / tiles, t0 = (blockIdx.x - b * tiles) * TT;
  const int t1 = min(t0 + TT, t_len);
  const int lane = threadIdx.x & 31;
  const int unit = blockIdx.y * WARPS + (threadIdx.x >> 5);
  const long long row0 = static_cast<long long>(b) * t_len;  // position index of (b, 0)
  if (unit < 2 * a.nk + a.nv) {
    const Unit u0 = unit_at(unit, 0, a);
    float* state = conv + (static_cast<long long>(b) * c + u0.ch0) * (W - 1);  // [ch][W - 1] of this unit
    const __half* __restrict__ in = mixed + row0 * mixed_row + u0.ch0;  // position 0's row, this unit
    // cat row r of request b (r < W - 1: the conv state, else position r - (W - 1))
    auto tap = [&](int r, int ch) -> float {
      return r < W - 1 ? state[ch * (W - 1) + r] : __half2float(in[(r - (W - 1)) * mixed_row + ch]);
    };
    // this warp's TT rows of the unit's channels, all in flight at once: 16-byte copies (cp.async on
    // sm_80+) where the rows allow, else 2-byte loads; then read back lane channel by lane channel
    __half(*rows)[PL * 32] = reinterpret_cast<__half(*)[PL * 32]>(stage + (threadIdx.x >> 5) * TT * PL * 32);
    const bool vec = ((reinterpret_cast<unsigned long long>(in) | static_cast<unsigned long long>(mixed_row) * 2 |
                       static_cast<unsigned>(u0.d) * 2) & 15) == 0;
    if (vec) {
      const int chunks = u0.d / 8;  // 16-byte chunks per row
      for (int e = lane; e < (t1 - t0) * chunks; e += 32) {
        const int r = e / chunks, j = e - r * chunks;
        gdn::copy16(reinterpret_cast<float*>(&rows[r][8 * j]),
                    reinterpret_cast<const float*>(in + static_cast<long long>(t0 + r) * mixed_row + 8 * j));
      }
      gdn::copy16_wait();
    } else {
      for (int r = 0; r < t1 - t0; ++r) {
#pragma unroll
        for (int i = 0; i < PL; ++i) {
          const int ch = lane + 32 * i;
          if (ch < u0.d) rows[r][ch] = in[static_cast<long long>(t0 + r) * mixed_row + ch];
        }
      }
    }
    float wt[PL][W], hold[PL][H];
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int ch = lane + 32 * i;
#pragma unroll
      for (int j = 0; j < W; ++j) wt[i][j] = ch < u0.d ? a.conv_w[static_cast<long long>(u0.ch0 + ch) * W + j] : 0.f;
#pragma unroll
      for (int j = 0; j < W - 1; ++j) hold[i][j] = ch < u0.d ? tap(t0 + j, ch) : 0.f;
    }
    __syncwarp();
    for (int t = t0; t < t1; ++t) {
      float x[PL], val[PL];
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        const int ch = lane + 32 * i;
        x[i] = ch < u0.d ? __half2float(rows[t - t0][ch]) : 0.f;
      }
      const float ss = silu_conv(val, u0.d, lane, [&](int i, int) {
        float acc = __fmul_rn(W > 1 ? hold[i][0] : x[i], wt[i][0]);
#pragma unroll
        for (int j = 1; j < W - 1; ++j) acc = __fadd_rn(acc, __fmul_rn(hold[i][j], wt[i][j]));
        if (W > 1) acc = __fadd_rn(acc, __fmul_rn(x[i], wt[i][W - 1]));
#pragma unroll
        for (int j = 0; j + 1 < W - 1; ++j) hold[i][j] = hold[i][j + 1];
        if (W > 1) hold[i][W - 2] = x[i];
        return acc;
      });
      store_unit(val, ss, unit_at(unit, row0 + t, a), a.l2_eps, lane);
    }
    if (t0 == 0 && W > 1) {  // the new conv state: cat rows n[b] .. n[b] + W - 2, ascending (reads first)
      const int nb = n != nullptr ? static_cast<int>(n[b]) : t_len;
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        const int ch = lane + 32 * i;
        if (ch >= u0.d) continue;
#pragma unroll
        for (int j = 0; j < W - 1; ++j) state[ch * (W - 1) + j] = tap(nb + j, ch);
      }
    }
  }
  if (blockIdx.y == 0) {
    for (int e = threadIdx.x; e < (t1 - t0) * a.nv; e += WARPS * 32) {
      const int t = t0 + e / a.nv;
      gate_terms(row0 + t, e - (t - t0) * a.nv, a);
    }
  }
}

constexpr int PREFILL_MAX_W = 4;  // conv widths the prefill inputs take (Qwen3.8: 4); wider ones use `inputs`
constexpr int PREFILL_NARROW_D = 128;  // head dims the narrow entry takes (PL = 4: half the registers of MAX_D's 8)

template <int WARPS, int TT, int PL>
__device__ __forceinline__ void prefill_inputs(float* conv, const __half* __restrict__ mixed, long long mixed_row,
                                               int width, int c, int t_len, const long long* __restrict__ n,
                                               const Terms& a) {
  __shared__ __align__(16) __half stage[WARPS * TT * PL * 32];  // [warp][TT rows][PL * 32 channels]
#define DFG_GDN_PREFILL_INPUTS(W) \
  prefill_inputs_w<WARPS, TT, W, PL>(stage, conv, mixed, mixed_row, c, t_len, n, a)
  switch (width) {  // uniform: one instantiation runs
    case 1: DFG_GDN_PREFILL_INPUTS(1); break;
    case 2: DFG_GDN_PREFILL_INPUTS(2); break;
    case 3: DFG_GDN_PREFILL_INPUTS(3); break;
    case 4: DFG_GDN_PREFILL_INPUTS(4); break;
    default: break;  // the host refuses these (runtime/gdn_io.py)
  }
#undef DFG_GDN_PREFILL_INPUTS
}

template <int WARPS>
__device__ __forceinline__ void gate(const float* __restrict__ o, const __half* __restrict__ z, long long z_row,
                                     const float* __restrict__ w, float eps, int nv, int dv,
                                     __half* __restrict__ out) {
  const int pos = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const int head = blockIdx.y * WARPS + (threadIdx.x >> 5);
  if (head >= nv) return;
  const float* __restrict__ x = o + (static_cast<long long>(pos) * nv + head) * dv;
  const __half* __restrict__ zr = z + pos * z_row + static_cast<long long>(head) * dv;
  __half* __restrict__ y = out + (static_cast<long long>(pos) * nv + head) * dv;
  float val[PER_LANE];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int ch = lane + 32 * i;
    val[i] = ch < dv ? x[ch] : 0.f;
    ss = __fadd_rn(ss, __fmul_rn(val[i], val[i]));
  }
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(warp_sum(ss), static_cast<float>(dv)), eps));
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int ch = lane + 32 * i;
    if (ch < dv) y[ch] = __float2half_rn(__fmul_rn(__fmul_rn(__fmul_rn(val[i], inv), w[ch]), silu(__half2float(zr[ch]))));
  }
}

}  // namespace gdn_io
}  // namespace dflashgen
