// dflashgen: a prepacked weight back to FP16 [N, K] in logical row order -- the dequantize half of the
// dequantize + cuBLAS path (more rows than the GEMM kernels take: a prefill; buckets no kernel wins).
//
// One warp per (warp tile, K group) chunk of the packed stream, the unit the GEMM kernels load: the
// warp decodes it with the GEMM's own decoder (Traits::decode: the A fragments its MMAs would get,
// value / decode_scale, exact), multiplies each value by its row's col_scale (= channel or global
// scale x decode_scale) in FP32 -- one rounding, the product torch's dequantize_packed forms -- and
// rounds once to FP16 (nearest even, torch's .to(float16)). So the output is bitwise
// dequantize_packed(packed).to(float16). The tile goes through shared memory so every row is stored
// as whole 16-byte runs.
//
// Where fragment element (k-step ks, register r, half e) sits (mirrors dflashgen/prepack.py):
//   sm80 traits (m16n8k16): tile row g + 8 (r & 1) (g = lane / 4), group K 32 (ks / 2) + 8 t + 4 (ks & 1)
//                           + 2 (r >> 1) + e (t = lane % 4): the MMA's K permutation, inverted;
//   sm70 traits (m8n8k4):   tile row 8 qp + i (qp, i: the lane's quad pair and thread in it), group K
//                           4 ks + 2 r + e (a lane holds KG consecutive K of one row).
// Fused gate|up layouts interleave rows (prepack._silu_view): layout row (c * 2 + s) * B + j holds
// logical row s * N / 2 + c * B + j (s = 0 gate, 1 up; B = 8 on sm80, 2 on sm70).
#pragma once

#include <dflashgen/mma_traits.cuh>

namespace dflashgen {
namespace dequant {

template <class T>
struct FragMap;

template <Format F, int ARCH>
struct FragMap<Sm80Traits<F, ARCH>> {
  static constexpr int KSTEPS = 2 * Sm80Traits<F, ARCH>::KSUB;
  static constexpr int REGS = 4;
  static constexpr int SILU_BLOCK = 8;
  __device__ static int row(int lane, int r) { return lane / 4 + 8 * (r & 1); }
  __device__ static int k(int lane, int ks, int r) { return 32 * (ks / 2) + 8 * (lane % 4) + 4 * (ks & 1) + 2 * (r >> 1); }
};

template <Format F, int ARCH>
struct FragMap<Sm70Traits<F, ARCH>> {
  static constexpr int KSTEPS = Sm70Traits<F, ARCH>::KSTEPS;
  static constexpr int REGS = 2;
  static constexpr int SILU_BLOCK = 2;
  __device__ static int row(int lane, int) {
    return 8 * ((lane >> 2) & 3) + (lane & 3) + 4 * (lane >> 4);
  }
  __device__ static int k(int, int ks, int r) { return 4 * ks + 2 * r; }
};

// Layout row -> logical row (or -1: zero padding past N).
__device__ __forceinline__ int logical_row(int lr, int n, bool silu, int block) {
  if (!silu) return lr < n ? lr : -1;
  const int j = lr % block, q = lr / block;
  return (q & 1) * (n / 2) + (q >> 1) * block + j;
}

// WARPS warps per CTA, one chunk each, staged in shared memory.
template <Format F, class T, int WARPS>
struct Dequant {
  static constexpr int ROWS = T::TILE_ROWS, KG = T::KG;
  static constexpr int CHUNKS = ROWS * KG / 8;  // 16-byte runs of one decoded chunk
  static_assert(CHUNKS % 32 == 0, "a chunk is whole 16-byte runs per lane");
  using Map = FragMap<T>;

  // packed: the stream of `tiles` x `groups` chunks (32 lanes x 16 B each), scales: SCALE_WORDS per
  // chunk (NVFP4), col: FP32 [n]. out: [n, k] FP16, row stride k.
  __device__ static void run(const uint4* __restrict__ packed, const typename T::Scale* __restrict__ scales,
                             const float* __restrict__ col, int n, int k, int silu, int tiles,
                             __half* __restrict__ out) {
    __shared__ __align__(16) __half tile[WARPS][ROWS][KG];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int groups = k / KG;
    const long long chunk = static_cast<long long>(blockIdx.x) * WARPS + warp;
    if (chunk >= static_cast<long long>(tiles) * groups) return;
    const int t = static_cast<int>(chunk / groups), g = static_cast<int>(chunk % groups);
    typename T::Frag f;
    typename T::Scale sc{};
    if constexpr (F == Format::NVFP4) sc = scales[chunk * T::SCALE_WORDS + T::scale_index()];
    T::decode(packed[chunk * 32 + lane], sc, f);
    __half(&st)[ROWS][KG] = tile[warp];
#pragma unroll
    for (int ks = 0; ks < Map::KSTEPS; ++ks)
#pragma unroll
      for (int r = 0; r < Map::REGS; ++r) {
        const int row = Map::row(lane, r), lr = logical_row(t * ROWS + row, n, silu, Map::SILU_BLOCK);
        const float s = lr >= 0 ? col[lr] : 0.f;
        const __half2 v = *reinterpret_cast<const __half2*>(&f.a[ks][r]);
        const __half2 o = __floats2half2_rn(__fmul_rn(__low2float(v), s), __fmul_rn(__high2float(v), s));
        *reinterpret_cast<__half2*>(&st[row][Map::k(lane, ks, r)]) = o;
      }
    __syncwarp();
    constexpr int RUNS = KG / 8;  // 16-byte runs per row
#pragma unroll
    for (int c = lane; c < CHUNKS; c += 32) {
      const int row = c / RUNS, run = c % RUNS;
      const int lr = logical_row(t * ROWS + row, n, silu, Map::SILU_BLOCK);
      if (lr >= 0)
        *reinterpret_cast<uint4*>(out + static_cast<long long>(lr) * k + g * KG + 8 * run) =
            *reinterpret_cast<const uint4*>(&st[row][8 * run]);
    }
  }
};

}  // namespace dequant
}  // namespace dflashgen
