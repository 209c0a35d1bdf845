// The residual add fused with the RMSNorm that follows it, for the decoder's norm sites
// (input_layernorm, post_attention_layernorm, the final norm):
//   h_out = h + float(y)                       (FP32 residual stream; y: the sublayer's FP16 output)
//   x     = half(h_out * rsqrt(mean(h_out^2) + eps) * w)   (the next projections' FP16 input)
// One launch instead of torch's add, FP32 rms_norm and FP16 cast (three kernels per site).
//
// One CTA per row. The sum of squares has a fixed order for a given (hidden, THREADS): each thread
// accumulates its 4-element groups in index order, a warp combines its lanes by an xor butterfly
// (every lane ends with the same sum: FP addition is commutative) and the warp sums are added in
// warp order. No value depends on the number of rows, so a row's bits are batch-invariant.
// Requires hidden % 4 == 0 and 16-byte aligned rows of h / h_out, 8-byte aligned rows of y / x
// (the launcher checks). y == nullptr: no add (h_out may be nullptr then).
#pragma once
#include <cuda_fp16.h>

namespace dflashgen {
namespace norm {

__device__ __forceinline__ float4 add_half4(float4 v, const uint2* __restrict__ y4, int i) {
  if (y4 != nullptr) {
    const uint2 raw = y4[i];
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    v.x += a.x; v.y += a.y; v.z += b.x; v.w += b.y;
  }
  return v;
}

// H_CT > 0: the hidden size fixed at compile time (loops unrolled); 0: hidden_rt at run time.
template <int THREADS, int H_CT>
__device__ __forceinline__ void add_rmsnorm(const float* __restrict__ h, const __half* __restrict__ y,
                                            const float* __restrict__ w, float eps, int hidden_rt,
                                            float* __restrict__ h_out, __half* __restrict__ x) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
  constexpr int WARPS = THREADS / 32;
  const int hidden = H_CT > 0 ? H_CT : hidden_rt;
  const int groups = hidden / 4;
  const long long base = static_cast<long long>(blockIdx.x) * hidden;
  const float4* __restrict__ h4 = reinterpret_cast<const float4*>(h + base);
  const uint2* __restrict__ y4 = y != nullptr ? reinterpret_cast<const uint2*>(y + base) : nullptr;
  float4* __restrict__ o4 = h_out != nullptr ? reinterpret_cast<float4*>(h_out + base) : nullptr;

  float ss = 0.f;
#pragma unroll 4
  for (int i = threadIdx.x; i < groups; i += THREADS) {
    const float4 v = add_half4(h4[i], y4, i);
    if (o4 != nullptr) o4[i] = v;
    ss = fmaf(v.x, v.x, ss);
    ss = fmaf(v.y, v.y, ss);
    ss = fmaf(v.z, v.z, ss);
    ss = fmaf(v.w, v.w, ss);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  __shared__ float warp_ss[WARPS];
  if ((threadIdx.x & 31) == 0) warp_ss[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < WARPS; ++i) total += warp_ss[i];
  const float rstd = rsqrtf(total / static_cast<float>(hidden) + eps);

  const float4* __restrict__ w4 = reinterpret_cast<const float4*>(w);
  uint2* __restrict__ x4 = reinterpret_cast<uint2*>(x + base);
#pragma unroll 4
  for (int i = threadIdx.x; i < groups; i += THREADS) {
    const float4 v = add_half4(h4[i], y4, i);  // the same sum as above (L1 / L2 hit), not a re-read of o4
    const float4 g = w4[i];
    const __half2 a = __floats2half2_rn((v.x * rstd) * g.x, (v.y * rstd) * g.y);
    const __half2 b = __floats2half2_rn((v.z * rstd) * g.z, (v.w * rstd) * g.w);
    uint2 out;
    out.x = *reinterpret_cast<const unsigned int*>(&a);
    out.y = *reinterpret_cast<const unsigned int*>(&b);
    x4[i] = out;
  }
}

}  // namespace norm
}  // namespace dflashgen
