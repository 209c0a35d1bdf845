// Which warpgroup-MMA shape can an M = 32-64 skinny GEMM feed? (sm_90a probe, no dflashgen kernels.)
//
// Every wgmma kernel in dflashgen puts the decoded weights in A (registers, 64 weight rows) and the
// batch rows in N: m64n64k16 RS at M = 64. The alternative puts the batch rows in A (shared memory)
// and FP16 weights, written to shared memory by decode warps, in B: m64n256k16 SS. This probe times
// both from shared memory only (no DRAM), one CTA per SM, with 1-3 MMA warpgroups per CTA, alone and
// beside a warpgroup that stores 16-byte words to shared memory flat out (the decode warps' STS):
//   nvcc -std=c++17 -O3 -arch=sm_90a -I<cutlass>/include -Itemplates/include tools/wgmma_roles_probe.cu -o probe && ./probe
// Prints per configuration the MMA rate in TFLOP/s over the grid, cycles per wgmma per warpgroup, and
// the storing warpgroup's bytes per cycle. Operand contents are constant (the rate does not depend on
// them); results are never checked: this measures issue and pipe rates only.
#include <cstdio>
#include <cstdint>
#include <utility>

#include <cuda_runtime.h>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <dflashgen/decode.cuh>  // u32, which wgmma.cuh uses
#include <dflashgen/wgmma.cuh>

namespace gmma = cute::SM90::GMMA;
using RS64 = gmma::MMA_64x64x16_F32F16F16_RS<gmma::Major::K, gmma::Major::K>;
using SS256 = gmma::MMA_64x256x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;

constexpr int KSTEPS = 4;             // wgmmas per commit group (one 64-K group)
constexpr int A_BYTES = 64 * 16 * 2;  // one k-step of A: 64 rows x 16 K FP16
constexpr int B_ROWS = 256;
constexpr int B_BYTES = B_ROWS * 16 * 2;
constexpr int STORE_BYTES = 32 * 1024;  // the storing warpgroup's own region

// K-major, no swizzle: core matrices of 8 rows x 16 bytes (dflashgen's WgmmaBLayout descriptor).
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
  return dflashgen::WgmmaBLayout<64>::desc_base() + ((addr >> 4) & 0x3FFF);
}
template <size_t... I>
__device__ __forceinline__ void rs64(const uint32_t (&a)[4], uint64_t db, float (&c)[32], std::index_sequence<I...>) {
  RS64::fma(a[0], a[1], a[2], a[3], db, c[I]..., gmma::ScaleOut::One);
}
template <size_t... I>
__device__ __forceinline__ void ss256(uint64_t da, uint64_t db, float (&c)[128], std::index_sequence<I...>) {
  SS256::fma(da, db, c[I]..., gmma::ScaleOut::One);
}

struct Out {
  unsigned long long mma_cycles;   // summed over MMA warpgroups
  unsigned long long store_cycles;
  unsigned long long store_bytes;
};

// MODE 0: m64n64k16 RS; MODE 1: m64n256k16 SS. STORE: one more warpgroup stores to shared memory.
template <int MODE, int WG, bool STORE>
__global__ void __launch_bounds__(128 * (WG + 1)) probe(int iters, Out* out, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int wg = threadIdx.x / 128;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  for (int i = threadIdx.x; i < (KSTEPS * (A_BYTES + B_BYTES) + STORE_BYTES) / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x3C003C00u;  // FP16 1.0 pairs
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (wg == WG) {  // the storing warpgroup (STORE), else idle
    if (!STORE) return;
    uint4* st = reinterpret_cast<uint4*>(smem + KSTEPS * (A_BYTES + B_BYTES));
    const long long t0 = clock64();
    const int words = STORE_BYTES / 16;
    uint4 v = make_uint4(threadIdx.x, 1, 2, 3);
    // as many stores as an MMA warpgroup's run would need for 8 KB per SS-equivalent instruction
    const int rounds = iters * KSTEPS * B_BYTES / STORE_BYTES;
    for (int r = 0; r < rounds; ++r) {
#pragma unroll 8
      for (int w = threadIdx.x % 128; w < words; w += 128) st[w] = v;
      v.x += 1;
    }
    const long long t1 = clock64();
    if (threadIdx.x % 128 == 0) {
      atomicAdd(&out->store_cycles, static_cast<unsigned long long>(t1 - t0));
      atomicAdd(&out->store_bytes, static_cast<unsigned long long>(rounds) * STORE_BYTES);
    }
    return;
  }
  const uint32_t a_base = base, b_base = base + KSTEPS * A_BYTES;
  const long long t0 = clock64();
  // `iters` rounds of KSTEPS instructions into the accumulators c, one commit group per round, one
  // round in flight; the sum keeps the accumulators live
  auto run = [&](auto& c, auto&& issue) {
    for (float& x : c) x = 0.f;
    for (int it = 0; it < iters; ++it) {
      for (float& x : c) asm volatile("" : "+f"(x)::"memory");
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) issue(ks, c);
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();
    }
    cute::warpgroup_wait<0>();
    float s = 0.f;
    for (float x : c) s += x;
    if (s == 12345.f) sink[0] = s;
  };
  if constexpr (MODE == 0) {
    float c[32];
    const uint32_t a[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};
    run(c, [&](int ks, float (&acc)[32]) {
      rs64(a, desc(b_base + ks * (64 * 16 * 2)), acc, std::make_index_sequence<32>{});
    });
  } else {
    float c[128];
    run(c, [&](int ks, float (&acc)[128]) {
      ss256(desc(a_base + ks * A_BYTES), desc(b_base + ks * B_BYTES), acc, std::make_index_sequence<128>{});
    });
  }
  const long long t1 = clock64();
  if (threadIdx.x % 128 == 0) atomicAdd(&out->mma_cycles, static_cast<unsigned long long>(t1 - t0));
}

template <int MODE, int WG, bool STORE>
void run(int sms, int iters, Out* d_out, float* sink) {
  // at least 120 KB, so that the grid of one CTA per SM cannot double up on any SM
  const int smem = KSTEPS * (A_BYTES + B_BYTES) + STORE_BYTES > 120 * 1024 ? KSTEPS * (A_BYTES + B_BYTES) + STORE_BYTES
                                                                          : 120 * 1024;
  auto k = probe<MODE, WG, STORE>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaMemset(d_out, 0, sizeof(Out));
  k<<<sms, 128 * (WG + 1), smem>>>(iters / 10, d_out, sink);  // warm-up
  cudaMemset(d_out, 0, sizeof(Out));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<<<sms, 128 * (WG + 1), smem>>>(iters, d_out, sink);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  Out h{};
  cudaMemcpy(&h, d_out, sizeof(Out), cudaMemcpyDeviceToHost);
  const int n = MODE == 0 ? 64 : 256;
  const double flop = 2.0 * 64 * n * 16 * KSTEPS * double(iters) * WG * sms;
  const double cyc = double(h.mma_cycles) / (double(WG) * sms);  // per warpgroup
  std::printf("%-14s warpgroups %d %-7s  %7.1f TFLOP/s  %6.1f cycles / wgmma / warpgroup  store %5.1f B/cycle  (%s)\n",
              MODE == 0 ? "m64n64k16 RS" : "m64n256k16 SS", WG, STORE ? "+store" : "", flop / (ms * 1e-3) / 1e12,
              cyc / (double(iters) * KSTEPS),
              h.store_cycles ? double(h.store_bytes) / (double(h.store_cycles) / sms) / sms : 0.0,
              cudaGetErrorString(cudaGetLastError()));
}

int main() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, dev);
  std::printf("%s, %d SMs\n", p.name, sms);
  Out* d_out;
  float* sink;
  cudaMalloc(&d_out, sizeof(Out));
  cudaMalloc(&sink, 4);
  const int iters = 20000;
  run<0, 1, false>(sms, iters, d_out, sink);
  run<0, 2, false>(sms, iters, d_out, sink);
  run<0, 3, false>(sms, iters, d_out, sink);
  run<0, 3, true>(sms, iters, d_out, sink);
  run<1, 1, false>(sms, iters / 4, d_out, sink);
  run<1, 2, false>(sms, iters / 4, d_out, sink);
  run<1, 1, true>(sms, iters / 4, d_out, sink);
  run<1, 2, true>(sms, iters / 4, d_out, sink);
  return 0;
}
