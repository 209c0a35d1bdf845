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

template <int WARPS>
__device__ __forceinline__ void inputs(const float* __restrict__ cat, int width, int c, int t_len,
                                       const __half* __restrict__ zba, long long zba_row,
                                       const float* __restrict__ conv_w, const float* __restrict__ dt_bias,
                                       const float* __restrict__ neg_a, int nk, int dk, int nv, int dv,
                                       float l2_eps, float q_factor, float k_factor,
                                       float* __restrict__ q, float* __restrict__ k, float* __restrict__ v,
                                       float* __restrict__ beta, float* __restrict__ log_decay) {
  const int pos = blockIdx.x;  // b * T + t
  const int b = pos / t_len, t = pos - b * t_len;
  const int lane = threadIdx.x & 31;
  const int unit = blockIdx.y * WARPS + (threadIdx.x >> 5);
  const int span = width - 1 + t_len;
  // position t's taps are cat rows t .. t + W - 1 (the W - 1 rows before T are the conv state)
  const float* __restrict__ x0 = cat + (static_cast<long long>(b) * span + t) * c;
  if (unit < 2 * nk + nv) {
    int ch0, d, head;
    float* __restrict__ out;
    float factor = 0.f;
    if (unit < 2 * nk) {
      head = unit < nk ? unit : unit - nk;
      d = dk;
      ch0 = unit * dk;  // q heads, then k heads
      out = (unit < nk ? q : k) + (static_cast<long long>(pos) * nk + head) * dk;
      factor = unit < nk ? q_factor : k_factor;
    } else {
      head = unit - 2 * nk;
      d = dv;
      ch0 = 2 * nk * dk + head * dv;
      out = v + (static_cast<long long>(pos) * nv + head) * dv;
    }
    float val[PER_LANE];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int ch = lane + 32 * i;
      val[i] = 0.f;
      if (ch < d) {
        const float* __restrict__ wc = conv_w + static_cast<long long>(ch0 + ch) * width;
        float acc = __fmul_rn(x0[ch0 + ch], wc[0]);
        for (int j = 1; j < width; ++j) acc = __fadd_rn(acc, __fmul_rn(x0[static_cast<long long>(j) * c + ch0 + ch], wc[j]));
        val[i] = silu(acc);
        ss = __fadd_rn(ss, __fmul_rn(val[i], val[i]));
      }
    }
    if (unit < 2 * nk) {
      const float fd = static_cast<float>(d);
      const float inv = rsqrtf(__fadd_rn(__fdiv_rn(warp_sum(ss), fd), __fdiv_rn(l2_eps, fd)));
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) val[i] = __fmul_rn(__fmul_rn(val[i], inv), factor);
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int ch = lane + 32 * i;
      if (ch < d) out[ch] = val[i];
    }
  }
  if (blockIdx.y == 0) {
    const __half* __restrict__ row = zba + pos * zba_row + static_cast<long long>(nv) * dv;  // [b | a]
    for (int h = threadIdx.x; h < nv; h += WARPS * 32) {
      beta[static_cast<long long>(pos) * nv + h] = sigmoid(__half2float(row[h]));
      const float a = __fadd_rn(__half2float(row[nv + h]), dt_bias[h]);
      log_decay[static_cast<long long>(pos) * nv + h] = __fmul_rn(neg_a[h], softplus(a));
    }
  }
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
