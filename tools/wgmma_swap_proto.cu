// Prototype (sm_90a, standalone, not a dflashgen kernel): the batch rows as the warpgroup-MMA A operand
// and the weights as B, for channel-FP8 weights at M <= 64 (bench/NOTES.md, session 20, "M = 32-64,
// the structural option"). One CTA per 256 weight rows: two producer warpgroups stream the FP8 weights
// (16-byte loads, two K chunks ahead in registers), convert them to FP16 into a 4-stage B ring and copy
// the activations into an A ring, both K-major core matrices; one consumer warpgroup issues
// wgmma.m64n256k16 (both operands from shared memory) per 16 K and applies the channel scale in the
// epilogue. It checks itself against an FP32 reference and times the kernel with CUDA events:
//   nvcc -std=c++17 -O3 -arch=sm_90a -I<cutlass>/include -Itemplates/include tools/wgmma_swap_proto.cu \
//     -o proto && ./proto [N K M]
// Not batch-invariant by design review (no K plan, one CTA walks all of K in order, which is the
// plan-free order), not tuned: the number it prints says whether the structure is worth a kernel
// family (served today, FP8 gate_up n34816 k5120 at M = 64: 88 us; cuBLAS FP16 ~95 us; the weight
// read alone 178 MB / ~4.25 TB/s = 42 us).
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <utility>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <dflashgen/decode.cuh>  // u32, which wgmma.cuh uses
#include <dflashgen/wgmma.cuh>
#include <dflashgen/mbarrier.cuh>

namespace gmma = cute::SM90::GMMA;
using SS256 = gmma::MMA_64x256x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;
using dflashgen::mbar_arrive;
using dflashgen::mbar_init;
using dflashgen::mbar_init_fence;
using dflashgen::mbar_wait;

constexpr int NT = 256;       // weight rows per CTA (the instruction's N)
constexpr int KC = 64;        // K per chunk (4 k-steps), one ring stage
constexpr int KS = KC / 16;
constexpr int STAGES = 4;
constexpr int A_KSTEP = 64 * 16 * 2;   // 64 batch rows x 16 K FP16
constexpr int B_KSTEP = NT * 16 * 2;   // 256 weight rows x 16 K FP16
constexpr int A_STAGE = KS * A_KSTEP;  // 8 KB
constexpr int B_STAGE = KS * B_KSTEP;  // 32 KB
constexpr int SMEM = STAGES * (A_STAGE + B_STAGE) + 2 * STAGES * 8;
constexpr int AHEAD = 2;  // weight chunks in flight per producer thread beyond the one it converts

// K-major, no swizzle: core matrices of 8 rows x 16 bytes, K half 0 -> 1 at 128 B, 8-row block -> next at
// 256 B (dflashgen's WgmmaBLayout, whose descriptor both operands use). Byte offset of (row, 8-K half h).
__device__ __forceinline__ int core_off(int row, int h) { return (row >> 3) * 256 + h * 128 + (row & 7) * 16; }
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
  return dflashgen::WgmmaBLayout<64>::desc_base() + ((addr >> 4) & 0x3FFF);
}
template <size_t... I>
__device__ __forceinline__ void ss256(uint64_t da, uint64_t db, float (&c)[128], std::index_sequence<I...>) {
  SS256::fma(da, db, c[I]..., gmma::ScaleOut::One);
}
__device__ __forceinline__ uint32_t cvt2(uint16_t two_e4m3) {  // 2 x E4M3 -> half2 bits
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two_e4m3, __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// x [M, K] FP16, w [N, K] E4M3 (row-major), scale [N] FP32 -> y [M, N] FP16. N % 256 == 0, K % 64 == 0.
__global__ void __launch_bounds__(384, 1)
swap_gemm(const __half* __restrict__ x, int M, int K, const uint8_t* __restrict__ w, const float* __restrict__ scale,
          __half* __restrict__ y, int N) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t a_ring = sbase, b_ring = sbase + STAGES * A_STAGE;
  const uint32_t bars = b_ring + STAGES * B_STAGE;  // full[s] at bars + 8 s, empty[s] at bars + 8 (STAGES + s)
  const int n0 = blockIdx.x * NT, chunks = K / KC;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8 * s, 256);            // every producer thread
      mbar_init(bars + 8 * (STAGES + s), 4);   // one lane per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x >= 128) {  // producers: 8 warps
    const int pt = threadIdx.x - 128, pw = pt >> 5, lane = pt & 31;
    const int r8 = lane & 7, q = lane >> 3;  // row in an 8-row block; k-step (B) / piece (A)
    // B: rows (4 pw + i) * 8 + r8, K bytes 16 q .. 16 q + 15 of each chunk (one k-step)
    const uint8_t* wrow[4];
    for (int i = 0; i < 4; ++i) wrow[i] = w + static_cast<size_t>(n0 + (4 * pw + i) * 8 + r8) * K + 16 * q;
    // chunks c and c + 1 in registers while chunk c + 2 loads (AHEAD = 2), rotated by moves: a
    // register array indexed by the chunk would live in local memory
    static_assert(AHEAD == 2, "the rotation below holds two chunks");
    uint4 cur[4], nxt[4], far[4];
    auto load = [&](int c, uint4 (&dst)[4]) {
      if (c < chunks) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(dst[i].x), "=r"(dst[i].y), "=r"(dst[i].z), "=r"(dst[i].w) : "l"(wrow[i] + c * KC));
      }
    };
    load(0, cur);
    load(1, nxt);
    for (int c = 0; c < chunks; ++c) {
      const int s = c % STAGES;
      load(c + 2, far);
      if (c >= STAGES) mbar_wait(bars + 8 * (STAGES + s), ((c / STAGES) + 1) & 1);
      unsigned char* bst = smem + STAGES * A_STAGE + s * B_STAGE + q * B_KSTEP;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = (4 * pw + i) * 8 + r8;
        const uint32_t v[4] = {cur[i].x, cur[i].y, cur[i].z, cur[i].w};
        uint4 h0, h1;  // K 0-7 and 8-15 of this k-step as FP16
        h0.x = cvt2(v[0] & 0xFFFF); h0.y = cvt2(v[0] >> 16); h0.z = cvt2(v[1] & 0xFFFF); h0.w = cvt2(v[1] >> 16);
        h1.x = cvt2(v[2] & 0xFFFF); h1.y = cvt2(v[2] >> 16); h1.z = cvt2(v[3] & 0xFFFF); h1.w = cvt2(v[3] >> 16);
        *reinterpret_cast<uint4*>(bst + core_off(row, 0)) = h0;
        *reinterpret_cast<uint4*>(bst + core_off(row, 1)) = h1;
      }
      // A: 64 rows x 8 pieces of 16 bytes (8 K); this thread: rows 8 rb + r8, piece p
      unsigned char* ast = smem + s * A_STAGE;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int idx = pt + 256 * j, p = (idx >> 3) & 7, rb = idx >> 6, row = rb * 8 + r8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (row < M) v = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(row) * K + c * KC + 8 * p);
        *reinterpret_cast<uint4*>(ast + (p >> 1) * A_KSTEP + core_off(row, p & 1)) = v;
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // STS -> the wgmma's async proxy
      mbar_arrive(bars + 8 * s);
#pragma unroll
      for (int i = 0; i < 4; ++i) { cur[i] = nxt[i]; nxt[i] = far[i]; }
    }
    return;
  }

  // consumer warpgroup
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("mov.b32 %0, 0;" : "=f"(acc[i]));  // not `= 0.f`: with a
  // constant the compiler rewrites the first wgmma's inputs and ptxas serializes them all (C7515)
  for (int c = 0; c < chunks; ++c) {
    const int s = c % STAGES;
    mbar_wait(bars + 8 * s, (c / STAGES) & 1);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      ss256(desc(a_ring + s * A_STAGE + ks * A_KSTEP), desc(b_ring + s * B_STAGE + ks * B_KSTEP), acc,
            std::make_index_sequence<128>{});
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();
    if (c > 0 && (threadIdx.x & 31) == 0) mbar_arrive(bars + 8 * (STAGES + (c - 1) % STAGES));
  }
  cute::warpgroup_wait<0>();
  for (float& v : acc) asm volatile("" : "+f"(v)::"memory");
  // D fragment of m64nNk16: warp wq rows 16 wq + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1)
  const int wq = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) {
    const int col = n0 + 8 * j + 2 * (lane & 3);
    const float s0 = scale[col], s1 = scale[col + 1];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = 16 * wq + (lane >> 2) + 8 * hh;
      if (row < M)
        *reinterpret_cast<__half2*>(y + static_cast<size_t>(row) * N + col) =
            __floats2half2_rn(acc[4 * j + 2 * hh] * s0, acc[4 * j + 2 * hh + 1] * s1);
    }
  }
}

__global__ void reference(const __half* x, int M, int K, const uint8_t* w, const float* scale, float* y, int N) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= N) return;
  float s = 0.f;
  for (int k = 0; k < K; ++k) {
    __nv_fp8_e4m3 v;
    v.__x = w[static_cast<size_t>(n) * K + k];
    s += __half2float(x[static_cast<size_t>(m) * K + k]) * float(v);
  }
  y[static_cast<size_t>(m) * N + n] = s * scale[n];
}

int main(int argc, char** argv) {
  const int N = argc > 1 ? std::atoi(argv[1]) : 34816, K = argc > 2 ? std::atoi(argv[2]) : 5120,
            M = argc > 3 ? std::atoi(argv[3]) : 64;
  if (N % NT || K % KC || M < 1 || M > 64) { std::printf("N %% 256, K %% 64, 1 <= M <= 64\n"); return 2; }
  std::vector<__half> hx(static_cast<size_t>(M) * K);
  std::vector<uint8_t> hw(static_cast<size_t>(N) * K);
  std::vector<float> hs(N);
  uint32_t r = 12345;
  auto rnd = [&]() { r = r * 1664525u + 1013904223u; return r; };
  for (auto& v : hx) v = __float2half((static_cast<int>(rnd() >> 9 & 2047) - 1024) / 1024.f);
  for (auto& v : hw) { v = static_cast<uint8_t>(rnd() >> 13); if ((v & 0x7F) == 0x7F) v &= 0xFE; }  // no NaN
  for (auto& v : hs) v = 1e-3f * (1 + (rnd() >> 20 & 7));
  __half *x, *y; uint8_t* w; float *s, *yr;
  cudaMalloc(&x, hx.size() * 2); cudaMalloc(&w, hw.size()); cudaMalloc(&s, N * 4);
  cudaMalloc(&y, static_cast<size_t>(M) * N * 2); cudaMalloc(&yr, static_cast<size_t>(M) * N * 4);
  cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(w, hw.data(), hw.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(s, hs.data(), N * 4, cudaMemcpyHostToDevice);
  cudaFuncSetAttribute(swap_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  swap_gemm<<<N / NT, 384, SMEM>>>(x, M, K, w, s, y, N);
  reference<<<dim3((N + 127) / 128, M), 128>>>(x, M, K, w, s, yr, N);
  cudaError_t err = cudaDeviceSynchronize();
  std::vector<__half> hy(static_cast<size_t>(M) * N);
  std::vector<float> hr(hy.size());
  cudaMemcpy(hy.data(), y, hy.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hr.data(), yr, hr.size() * 4, cudaMemcpyDeviceToHost);
  double num = 0, den = 0;
  size_t bad = 0;
  for (size_t i = 0; i < hy.size(); ++i) {
    const double d = __half2float(hy[i]) - hr[i];
    num += d * d; den += double(hr[i]) * hr[i];
    bad += !std::isfinite(__half2float(hy[i]));
  }
  const double rel = std::sqrt(num / (den > 0 ? den : 1));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  std::vector<float> t(21);
  for (auto& ms : t) {  // one weight buffer of N x K bytes: >= 3x the L2 at the default shape
    cudaEventRecord(e0);
    swap_gemm<<<N / NT, 384, SMEM>>>(x, M, K, w, s, y, N);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    cudaEventElapsedTime(&ms, e0, e1);
  }
  std::sort(t.begin(), t.end());
  const double us = t[t.size() / 2] * 1e3;
  std::printf("swap_gemm FP8 N %d K %d M %d: %s, rel L2 %.2e, non-finite %zu, median %.1f us (%.0f GB/s of weights, "
              "%.0f TFLOP/s), %d CTAs of 256 rows\n", N, K, M, cudaGetErrorString(err), rel, bad, us,
              double(N) * K / (us * 1e3), 2.0 * M * N * K / (us * 1e6), N / NT);
  return rel < 2e-3 && !bad && err == cudaSuccess ? 0 : 1;
}
