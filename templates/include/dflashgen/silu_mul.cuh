// dflashgen: elementwise glue. SiLU(gate) * up over a projection's [gate | up] output, for the projections served by
// dequantize + cuBLAS (more rows than the generated kernels take, e.g. a long prefill's MLP): one pass
// over y (FP16) instead of torch's upcast copy, SiLU and multiply through FP32 tensors in memory.
// Torch's arithmetic op for op: x / (1 + exp(-x)) in FP32 (IEEE division, expf), times up in FP32,
// rounded once to FP16 -- (silu(gate.float()) * up.float()).to(float16) (tests/test_gpu_norm.py).
// Elementwise: a row's bits never depend on the other rows.
#pragma once

#include <cuda_fp16.h>

namespace dflashgen {
namespace glue {

__device__ __forceinline__ float silu_exact(float x) { return __fdiv_rn(x, __fadd_rn(1.f, expf(-x))); }

__device__ __forceinline__ __half2 silu_mul2(__half2 g, __half2 u) {
  const float2 gf = __half22float2(g), uf = __half22float2(u);
  return __halves2half2(__float2half_rn(__fmul_rn(silu_exact(gf.x), uf.x)),
                        __float2half_rn(__fmul_rn(silu_exact(gf.y), uf.y)));
}

// y [rows, 2 cols] with row stride ld halves (gate: columns [0, cols), up: [cols, 2 cols)), out [rows, cols]
// contiguous; cols % 8 == 0, y / out 16-byte aligned and ld % 8 == 0 (the runtime checks): 8 columns of
// gate and up per thread per step as 16-byte loads, a grid-stride loop.
template <int THREADS>
__device__ __forceinline__ void silu_mul(const __half* __restrict__ y, long long ld, int rows, int cols,
                                         __half* __restrict__ out) {
  const int v8 = cols / 8;
  const long long total = static_cast<long long>(rows) * v8;
  for (long long i = static_cast<long long>(blockIdx.x) * THREADS + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * THREADS) {
    const long long r = i / v8;
    const int c = static_cast<int>(i - r * v8) * 8;
    const uint4 g = *reinterpret_cast<const uint4*>(y + r * ld + c);
    const uint4 u = *reinterpret_cast<const uint4*>(y + r * ld + cols + c);
    uint4 o;
    const __half2* gh = reinterpret_cast<const __half2*>(&g);
    const __half2* uh = reinterpret_cast<const __half2*>(&u);
    __half2* oh = reinterpret_cast<__half2*>(&o);
#pragma unroll
    for (int j = 0; j < 4; ++j) oh[j] = silu_mul2(gh[j], uh[j]);
    *reinterpret_cast<uint4*>(out + r * cols + c) = o;
  }
}

// The gated attention's output gate: out = o * sigmoid(gate), o FP32 (the verify attention's result),
// gate FP16 (a strided view into the q|gate projection output), torch's ops op for op -- sigmoid as
// 1 / (1 + exp(-x)) in FP32 (IEEE division, expf), the product in FP32, rounded once to FP16:
// (o * sigmoid(gate.float())).half(), one pass instead of an upcast copy, a sigmoid and a multiply.
__device__ __forceinline__ float sigmoid_exact(float x) { return __fdiv_rn(1.f, __fadd_rn(1.f, expf(-x))); }

// o [rows, heads, d] FP32 contiguous; gate rows g_ld and heads g_hs halves apart, channels contiguous;
// out [rows, heads, d] FP16 contiguous; d % 4 == 0, gate 8-byte aligned, g_ld / g_hs % 4 == 0 (the
// runtime checks): 4 channels per thread per step, a grid-stride loop.
template <int THREADS>
__device__ __forceinline__ void sigmoid_mul(const float* __restrict__ o, const __half* __restrict__ gate,
                                            long long g_ld, long long g_hs, int rows, int heads, int d,
                                            __half* __restrict__ out) {
  const int v4 = d / 4, per_row = heads * v4;
  const long long total = static_cast<long long>(rows) * per_row;
  for (long long i = static_cast<long long>(blockIdx.x) * THREADS + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * THREADS) {
    const long long r = i / per_row;
    const int rem = static_cast<int>(i - r * per_row);
    const int h = rem / v4, c = (rem - h * v4) * 4;
    const long long at = (r * heads + h) * d + c;
    const float4 ov = *reinterpret_cast<const float4*>(o + at);
    const uint2 gv = *reinterpret_cast<const uint2*>(gate + r * g_ld + h * g_hs + c);
    const float2 g01 = __half22float2(*reinterpret_cast<const __half2*>(&gv.x));
    const float2 g23 = __half22float2(*reinterpret_cast<const __half2*>(&gv.y));
    __half2 lo = __halves2half2(__float2half_rn(__fmul_rn(ov.x, sigmoid_exact(g01.x))),
                                __float2half_rn(__fmul_rn(ov.y, sigmoid_exact(g01.y))));
    __half2 hi = __halves2half2(__float2half_rn(__fmul_rn(ov.z, sigmoid_exact(g23.x))),
                                __float2half_rn(__fmul_rn(ov.w, sigmoid_exact(g23.y))));
    uint2 res;
    res.x = *reinterpret_cast<unsigned*>(&lo);
    res.y = *reinterpret_cast<unsigned*>(&hi);
    *reinterpret_cast<uint2*>(out + at) = res;
  }
}

}  // namespace glue
}  // namespace dflashgen
