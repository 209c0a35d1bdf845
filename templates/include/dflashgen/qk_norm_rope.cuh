// dflashgen: a full-attention layer's inputs in one launch, replacing ~20 torch launches per layer
// (casts, two RMSNorms, the RoPE's multiplies and adds, the KV-cache writes):
//   q = rope(rms_norm(float(q head), q_norm)) * q_scale -> q_out[b, t, h, :] FP32, or FP16 (q_half)
//   k = half(rope(rms_norm(float(k head), k_norm)))     -> kc[b, pos[b, t], h, :]
//   v = the v head (FP16, copied)                       -> vc[b, pos[b, t], h, :]
// q_out has element strides (q_sb, q_st, q_sh) for (request, position, head), channels contiguous: the
// target's verify attention takes q [B, T, Hq, D] FP16 as written (q_scale 1: the product is exact, so
// the bits of the FP32 q's cast); the drafter's batched products take it grouped by KV head and
// pre-scaled by D^-0.5 ([B, Hq, T, D]: torch's `mul(q, scale, out=fp16)`, one rounding).
// RoPE on the first `rd` channels, half by half (cos / sin repeat over the halves):
// a' = a c - b s, b' = b c + a s, one rounding per mul and add (no FMA), as the torch path does.
// grid (B * T, ceil((Hq + 2 Hkv) / WARPS)), WARPS warps: one warp per (position, head). Each head's sum
// of squares runs in one order (per lane over its channels, then an xor butterfly): a position's bits
// do not depend on B or T. The projection output is FP16 rows of `row` elements:
// [q heads (D each, or D + D gate when gated) | k heads | v heads]; the caches are FP16 with
// request stride kv_b, position stride kv_l and head stride kv_h (elements), channels contiguous
// (the target's [B, L, Hkv, D]: kv_h = D; the drafter's head-major [B, Hkv, L, D]: kv_l = D).
#pragma once
#include <cuda_fp16.h>

namespace dflashgen {
namespace qk_rope {

constexpr int MAX_D = 256;
constexpr int PER_LANE = MAX_D / 32;

template <int WARPS>
__device__ __forceinline__ void qk_norm_rope(const __half* __restrict__ qkv, long long row, int t_len, int hq,
                                             int hkv, int d, int gated, int rd, const float* __restrict__ q_w,
                                             const float* __restrict__ k_w, float eps,
                                             const float* __restrict__ cos, const float* __restrict__ sin,
                                             const long long* __restrict__ pos, void* __restrict__ q_out,
                                             int q_half, float q_scale, long long q_sb, long long q_st,
                                             long long q_sh, __half* __restrict__ kc, __half* __restrict__ vc,
                                             long long kv_b, long long kv_l, long long kv_h) {
  __shared__ float buf[WARPS][MAX_D];
  const int p = blockIdx.x;  // b * T + t
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int unit = blockIdx.y * WARPS + warp;
  if (unit >= hq + 2 * hkv) return;
  const long long q_span = static_cast<long long>(hq) * d * (gated ? 2 : 1);
  const __half* __restrict__ src = qkv + p * row;
  // this position's cache row: request p / T at position pos[p]
  const long long cache = (p / t_len) * kv_b + pos[p] * kv_l;
  if (unit >= hq + hkv) {  // v: a copy into the cache
    const int h = unit - hq - hkv;
    const __half* __restrict__ x = src + q_span + static_cast<long long>(hkv + h) * d;
    __half* __restrict__ dst = vc + cache + h * kv_h;
    for (int ch = lane; ch < d; ch += 32) dst[ch] = x[ch];
    return;
  }
  const bool is_q = unit < hq;
  const int h = is_q ? unit : unit - hq;
  const __half* __restrict__ x = is_q ? src + static_cast<long long>(h) * d * (gated ? 2 : 1)
                                      : src + q_span + static_cast<long long>(h) * d;
  const float* __restrict__ w = is_q ? q_w : k_w;
  float val[PER_LANE];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int ch = lane + 32 * i;
    val[i] = ch < d ? __half2float(x[ch]) : 0.f;
    ss = __fadd_rn(ss, __fmul_rn(val[i], val[i]));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(d)), eps));
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int ch = lane + 32 * i;
    if (ch < d) buf[warp][ch] = __fmul_rn(__fmul_rn(val[i], inv), w[ch]);
  }
  __syncwarp();
  // this head's output row: q_out's (FP32, or FP16 with q_half), or the k cache's (FP16, scale 1: exact)
  const bool f32 = is_q && !q_half;
  const float scale = is_q ? q_scale : 1.f;
  const long long qo = (p / t_len) * q_sb + (p % t_len) * q_st + h * q_sh;
  char* const dst = is_q ? static_cast<char*>(q_out) + qo * (f32 ? 4 : 2)
                         : reinterpret_cast<char*>(kc + cache + h * kv_h);
  const int half_rd = rd / 2;
  const float* __restrict__ cs = cos + static_cast<long long>(p) * rd;  // [B, T, rd]: the halves repeat
  const float* __restrict__ sn = sin + static_cast<long long>(p) * rd;
  for (int ch = lane; ch < d; ch += 32) {
    float y = buf[warp][ch];
    if (ch < half_rd) {
      y = __fsub_rn(__fmul_rn(y, cs[ch]), __fmul_rn(buf[warp][ch + half_rd], sn[ch]));
    } else if (ch < rd) {
      const int j = ch - half_rd;
      y = __fadd_rn(__fmul_rn(y, cs[j]), __fmul_rn(buf[warp][j], sn[j]));
    }
    y = __fmul_rn(y, scale);
    if (f32) {
      reinterpret_cast<float*>(dst)[ch] = y;
    } else {
      reinterpret_cast<__half*>(dst)[ch] = __float2half_rn(y);
    }
  }
}

}  // namespace qk_rope
}  // namespace dflashgen
