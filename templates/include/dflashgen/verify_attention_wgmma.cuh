// dflashgen: grouped verification attention with sm_90a warpgroup MMA (wgmma.mma_async, HGMMA),
// FA3-style. Rendered for schedules with `wg: 1` (built for compute_90a / sm_90a only); the
// mma.sync kernels (verify_attention.cuh) never see this header.
//
// Same contract as VerifyAttention (verify_attention.cuh): one CTA = one (request, KV head, split),
// grid (HKV, B, max_splits) with the split index slowest, split sizes from the request's own
// length (Cfg::split_for: batch-invariant), the same causal rule, the same per-split (max, sum, O)
// partials and error bits, and VerifyAttention's merge kernel unchanged.
//
// One warpgroup (128 threads, 4 warps) owns all ROWS = GROUP x QROWS (<= 64) query rows of the KV
// group, padded to the wgmma M of 64 (padded rows: zero Q, every token visible, finite, never
// written); KVG = 2 runs two such warpgroups on alternate tiles (token groups, each with its own
// softmax state, combined at the end of the split). Per tile of T tokens:
//   S[64 x T]   = Q K^T   wgmma m64nTk16, A = Q and B = K both from shared memory (K-major),
//   online softmax on the S accumulator in registers (FP32, exp2 domain, quad shuffles),
//   O[64 x 256] += P V    wgmma m64n256k16, A = P (FP16) from registers (the S accumulator layout is
//                         the A fragment layout), B = V from shared memory (MN-major: D contiguous).
// Every K/V byte is read from shared memory once (by the tensor cores), not once per 16-row block.
//
// Shared-memory tiles (Q: 64 rows; K and V: T token rows) use the canonical 128-byte swizzle
// (CuTe GMMA::Layout_K_SW128_Atom / Layout_MN_SW128_Atom for 16-bit types): a row of D = 256 halves
// is 4 atoms of 64 halves (128 B); atom a of every row of the tile is one block of rows x 128 B
// (block a at a * rows * 128 B), and in it 16-byte chunk c of row r sits at chunk c ^ (r & 7). Every
// block starts 1024-byte aligned (the swizzle is on address bits [4, 7) ^ [7, 10)).
// Descriptors (PTX ISA "Matrix Descriptor Format"; CuTe make_gmma_desc, layout SWIZZLE_128B):
// - K-major (Q as A, K as B, 16 halves of D per k-step): start = block (ks / 4) + 32 B x (ks % 4),
//   SBO = 1024 B (8-row groups), LBO unused (1).
// - MN-major (V as B, 16 tokens per k-step): start = token 16 ks (16 x 128 B), LBO = rows x 128 B
//   (the next 64-column atom along N = D), SBO = 1024 B (the next 8 tokens along K).
// (Checked against CuTe on the host: tests/wgmma_attention_layout.cpp.)
// K/V tiles are copied global -> shared with 16-byte cp.async into the swizzled positions, STAGES
// tiles in the ring; each thread fences its completed copies to the async proxy
// (fence.proxy.async) before the barrier that precedes the wgmmas reading them.
// Pipelines: STAGES == 2: QK -> softmax -> PV of each tile in order (the next tile's copies issue
// under the QK); STAGES >= 3: FA3's intra-warpgroup overlap (QK of tile i, copies, PV of tile i - 1,
// then the softmax of tile i under that PV), STAGES - 2 stages of copies ahead. ptxas (12.9, 13.0) keeps the
// wgmmas unserialized only if no instruction between a wgmma and its wait writes its input
// registers or reads its accumulators, and the softmax runs under the PV only if the P packing
// (FP32 -> FP16 A fragments) follows the PV's wait: both checked on the SASS (no C7513 / C7514;
// WARPGROUP.DEPBAR.LE gsb0 0x1 ... MUFU.EX2 ... 0x0).
//
// TMA variant (schedule `tma: 1`, `_wg1_tma1_` in the name; VerifyAttentionWg<Cfg, true>; FP16 KV,
// whole 16-token pages per tile; session-7 helper, written before any GPU run). Only the copy
// mechanism changes: the same tiles in the same order, the same QK / softmax / rescale / PV sequence,
// partials, merge and error bits as the cp.async kernel of the same tile / stages / kvg / split rule,
// so the outputs are bitwise equal to that twin. One extra warp (the producer, warp 4 x KVG: the
// consumer warpgroups keep warps 0 .. 4 KVG - 1 and their thread indexing) stages the page ids with
// everyone, then its lane 0 issues every K/V copy as cp.async.bulk.tensor.4d from two tensor maps
// (kernel parameters, const __grid_constant__, built on the host by cuTensorMapEncodeTiled over the K
// and V pools: dims (D, Hkv, page, num_blocks), SWIZZLE_128B, box (64, 1, PAGE, 1) = one 64-column
// atom of one KV head's page = one 16-row x 128-byte swizzled block of the wgmma tile, so the TMA
// writes exactly the layout the descriptors read). Ring stage s has a full mbarrier (count 1: the
// producer's arrive.expect_tx of the stage's bytes, completed by the copies) and an empty mbarrier
// (count 128 KVG: every consumer thread arrives once its PV of the stage was waited for); the producer
// refills a slot as soon as it is released, up to STAGES stages ahead of the consumers (the cp.async
// loops keep STAGES - 2 (overlapped) / 1 (in order) ahead). The consumers issue no copy instructions
// and no CTA barrier per tile. Masking is kept exact: an invalid page id (-1 from stage_pages, which
// flags ATTN_ERR_PAGE) and a page wholly past `end` are loaded from page index num_blocks, outside the
// map: zero-filled, no global read, the whole box still counted; the tokens past `end` of the last,
// partial page are zeroed by the consumers (K and V; then fence.proxy.async and a consumer barrier)
// on the split's last stage only, so shared memory holds what the cp.async zero-fill gives.
#pragma once

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/numeric/integer_sequence.hpp>

#include "verify_attention.cuh"
#include "verify_attention_wgmma_layout.cuh"
#include "mbarrier.cuh"

namespace dflashgen {

namespace wgattn {

namespace GMMA = cute::SM90::GMMA;

template <int N>
struct QkAtom;
template <>
struct QkAtom<16> {
  using type = GMMA::MMA_64x16x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>;
};
template <>
struct QkAtom<32> {
  using type = GMMA::MMA_64x32x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>;
};
template <>
struct QkAtom<64> {
  using type = GMMA::MMA_64x64x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>;
};
using PvAtom = GMMA::MMA_64x256x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>;

// A SWIZZLE_128B descriptor of the tile at shared address `addr` (1024-byte aligned block starts).
__device__ __forceinline__ uint64_t desc_sw128(u32 addr, int lbo, int sbo) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>((addr & 0x3FFFF) >> 4);
  d.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo >> 4);
  d.bitfield.stride_byte_offset_ = static_cast<uint16_t>(sbo >> 4);
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = static_cast<uint8_t>(GMMA::LayoutType::B128);
  return d.desc_;
}

// S (+)= A(desc) B(desc)^T for one k-step; s is the thread's T / 2 accumulators.
template <int N, size_t... I>
__device__ __forceinline__ void qk_step(uint64_t da, uint64_t db, float (&s)[N / 2], GMMA::ScaleOut sc,
                                        cute::index_sequence<I...>) {
  QkAtom<N>::type::fma(da, db, s[I]..., sc);
}
// O += P(regs) V(desc) for one k-step; o is the thread's 128 accumulators.
template <size_t... I>
__device__ __forceinline__ void pv_step(const u32 (&a)[4], uint64_t db, float (&o)[128], cute::index_sequence<I...>) {
  PvAtom::fma(a[0], a[1], a[2], a[3], db, o[I]..., GMMA::ScaleOut::One);
}

template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(r[i]);
}
template <int K>
__device__ __forceinline__ void fence_regs(u32 (&r)[K][4]) {
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(r[k][i]);
}

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const u32*>(&h);
}

// TMA (tma: 1): the kernel's CUtensorMap parameters (an opaque 128-byte, 64-byte aligned struct built on
// the host by cuTensorMapEncodeTiled; NVRTC has no <cuda.h>), mbarriers and the tiled bulk copy.
struct alignas(64) TmaMap {
  unsigned long long opaque[16];
};
// mbarriers: dflashgen/mbarrier.cuh
using dflashgen::mbar_arrive;
using dflashgen::mbar_arrive_tx;
using dflashgen::mbar_init;
using dflashgen::mbar_init_fence;
using dflashgen::mbar_wait;
// Box {c0, c1, c2, c3} of the 4-d map at generic address `map` -> shared `dst`; completes `bytes` of
// the mbarrier's transaction count (the whole box, zero-filled where it leaves the map).
__device__ __forceinline__ void tma_load_4d(u32 dst, const void* map, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

}  // namespace wgattn

template <class Cfg, bool TMA_ = false>
struct VerifyAttentionWg {
  using Base = VerifyAttention<Cfg>;  // the merge kernel, length check
  static constexpr int GROUP = Cfg::GROUP, QROWS = Cfg::QROWS, HKV = Cfg::HKV, HQ = GROUP * HKV;
  static constexpr int D = Cfg::D, T = Cfg::TILE, STAGES = Cfg::STAGES, SPLIT = Cfg::SPLIT, PAGE = Cfg::PAGE;
  // HS row parts (CTAs) per (request, KV head, split), as VerifyAttention's: part p takes rows
  // p ROWS .. (p + 1) ROWS - 1 of the group's ROWS_ALL, padded to the wgmma M. A row's arithmetic is
  // the same in any part (each accumulator row is its own dot products and softmax), so HS only moves
  // work: HS = 3 triples the CTAs of a small batch (TP1 16K B1: 256 -> 768), each re-reading the
  // split's K / V (from L2 after the first).
  static constexpr int HS = Cfg::HS, ROWS_ALL = GROUP * QROWS;
  static constexpr int ROWS = ROWS_ALL / HS;  // real query rows of this CTA
  static constexpr int M = 64;                // wgmma M: rows ROWS .. 63 are padding
  // KVG token groups = warpgroups: a ring stage holds KVG tiles, warpgroup g takes tile g of every stage
  // with its own softmax state; the groups' (max, sum, O) are combined in group order at the end.
  static constexpr int KVG = Cfg::KVG, TT = KVG * T;
  static constexpr int THREADS = 128 * KVG;  // the consumer warpgroups (all of them without TMA)
  // TMA: one more warp (the producer; its lane 0 issues every K/V copy), after the warpgroups
  static constexpr bool TMA = TMA_;
  static constexpr int NTHREADS = THREADS + (TMA ? 32 : 0);
  static constexpr int CH = D / 8;            // 16-byte chunks per FP16 row
  static_assert((KVG == 1 || KVG == 2) && Cfg::DS == 1, "wgmma kernel: kvg 1 or 2, no ds");
  static_assert(ROWS_ALL % HS == 0, "row parts of equal size");
  static_assert(D == 256, "O accumulator: 64 x 256 FP32 = 128 registers per thread");
  static_assert(ROWS <= M && ROWS % 8 == 0, "one warpgroup of 64 rows per KV group");
  static_assert(T == 16 || T == 32 || T == 64, "tile: wgmma N of the QK step");
  static_assert(SPLIT % T == 0 && Cfg::MIN_SPLIT % T == 0 && STAGES >= 2, "tile shape / ring");
  static_assert((PAGE & (PAGE - 1)) == 0, "page size must be a power of two");
  static_assert(!TMA || (Cfg::KV == KvType::FP16 && T % PAGE == 0 && PAGE <= 256),
                "TMA: FP16 KV, whole pages per tile (a box is one page of one 64-column atom)");

  // FP8 KV (E5M2 / E4M3): the ring holds the tiles as stored (rows of RAW_CH 16-byte chunks, chunk c
  // of token t at c ^ (t & 7)); each tile is decoded exactly to FP16 (E4M3: value x 2^-8, the runtime
  // folds 2^8 into the scales) into the swizzled K / V layout wgmma reads, NCVT such buffers (the
  // overlapped loop reads tile i's K and tile i - 1's V at once).
  static constexpr bool FP8 = Cfg::KV != KvType::FP16;
  static constexpr int KV_BYTES = FP8 ? 1 : 2;
  static constexpr int RAW_CH = D * KV_BYTES / 16;  // 16-byte chunks per stored row

  // Shared memory: [1 KB alignment slack] Q (64 x D) | STAGES x (K tile, V tile) as stored |
  // NCVT x (K, V) decoded to FP16 (FP8 only) | page ids.
  static constexpr int Q_BYTES = M * D * 2;
  // A stage: the K of its KVG tiles, then their V. FP16: tile g's K at + g x KV_TILE in the wgmma
  // layout, V at + RAW_TILE + g x KV_TILE. FP8: TT token rows as stored; decoded (the same layout as an
  // FP16 stage) into a CVT buffer.
  static constexpr int KV_TILE = T * D * 2;           // one FP16 K or V tile, as wgmma reads it
  static constexpr int RAW_TILE = TT * D * KV_BYTES;  // the K (or V) of a stage as stored
  static constexpr int STAGE_BYTES = 2 * RAW_TILE;
  static constexpr int NCVT = FP8 ? (STAGES == 2 ? 1 : 2) : 0;
  static constexpr int CVT_BYTES = NCVT * 2 * KVG * KV_TILE;
  static constexpr int NPG = (SPLIT + PAGE - 1) / PAGE + 1;
  static constexpr int TB_BYTES = (NPG * 4 + 15) / 16 * 16;
  static constexpr int ALIGN = 1024;
  static constexpr int BAR_BYTES = TMA ? 2 * 8 * STAGES : 0;  // TMA: full[STAGES], empty[STAGES] mbarriers
  static constexpr int SMEM = ALIGN + Q_BYTES + STAGES * STAGE_BYTES + CVT_BYTES + TB_BYTES + BAR_BYTES;
  static_assert(Q_BYTES % ALIGN == 0 && KV_TILE % ALIGN == 0 && RAW_TILE % ALIGN == 0,
                "swizzle blocks stay 1024-byte aligned");
  // Group combine: group 1 parks O (128 floats per thread) and (max, sum) per row in the idle ring.
  static constexpr int X_BYTES = KVG > 1 ? 128 * 128 * 4 + M * 2 * 4 : 0;
  static_assert(X_BYTES <= STAGES * STAGE_BYTES + CVT_BYTES, "group combine buffer exceeds the ring");

  __device__ static void copy16(u32 dst, const char* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
  }
  __device__ static void commit() {
    if constexpr (!TMA) asm volatile("cp.async.commit_group;" ::: "memory");
  }
  template <int N>
  __device__ static void wait() {
    if constexpr (!TMA) asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
  }
  // A barrier of the consumer warpgroups (TMA: the producer warp has left; named barrier 1).
  __device__ static void consumer_sync() {
    if constexpr (TMA) asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
    else __syncthreads();
  }
  __device__ static void fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

  // K and V tokens [t0, t0 + T) of this request (zeros past `end` or on a bad page) into the stage
  // at shared address `st` (K tile, then V tile), swizzled. Thread i copies chunk i % RAW_CH of tokens
  // i / RAW_CH, + THREADS / RAW_CH, ...; the K and V chunks of a token share one offset. (A page index
  // pos / PAGE - pg0 < NPG for every position of the split's tiles: a stale id past the split's pages
  // is never used.) Branch-free: a masked chunk's copy reads 0 bytes (from the pool base).
  __device__ static void load_tile(u32 st, int t0, int end, const int* pages, int pg0, const char* kb,
                                   const char* vb, long long block_stride, int kh) {
    constexpr int TSTEP = THREADS / RAW_CH;  // tokens per round
    static_assert(THREADS % RAW_CH == 0 && TT % TSTEP == 0 && T % TSTEP == 0, "whole rounds of copies");
    const int c = threadIdx.x % RAW_CH, tok0 = threadIdx.x / RAW_CH;
    constexpr long long ROW = static_cast<long long>(HKV) * D * KV_BYTES;  // bytes per token row of a page
    const long long row0 = static_cast<long long>(kh) * D * KV_BYTES + 16 * c;
    auto copy_kv = [&](int tok, bool ok, long long off) {  // tok: 0 .. TT - 1 (tile tok / T)
      const u32 dst = st + (FP8 ? 16 * swz<RAW_CH>(tok, c) : (tok / T) * KV_TILE + wgattn::sw128_off<T>(tok % T, c));
      copy16(dst, kb + (ok ? off : 0), ok);
      copy16(dst + RAW_TILE, vb + (ok ? off : 0), ok);
    };
    if constexpr (T % PAGE == 0 && PAGE % TSTEP == 0) {
      // t0 is a multiple of TT, so of PAGE: the stage is TT / PAGE whole pages, and this thread's tokens
      // tok0 + TSTEP k sit in page k / KP at row tok0 + TSTEP (k % KP): one page id and one 64-bit
      // base per page, compile-time row offsets.
      constexpr int KP = PAGE / TSTEP;  // this thread's tokens per page
      const int pg_first = t0 / PAGE - pg0;
#pragma unroll
      for (int p = 0; p < TT / PAGE; ++p) {
        const int blk = pages[pg_first + p];
        const long long base = blk * block_stride * KV_BYTES + tok0 * ROW + row0;
#pragma unroll
        for (int kk = 0; kk < KP; ++kk) {
          const int tok = tok0 + TSTEP * (p * KP + kk);
          copy_kv(tok, t0 + tok < end && blk >= 0, base + TSTEP * kk * ROW);
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < TT / TSTEP; ++k) {
        const int tok = tok0 + TSTEP * k, pos = t0 + tok;
        const int blk = pages[pos / PAGE - pg0];
        copy_kv(tok, pos < end && blk >= 0, blk * block_stride * KV_BYTES + (pos % PAGE) * ROW + row0);
      }
    }
  }

  // FP8 stage `raw` -> FP16 K and V tiles at `cvt` in the wgmma layout (exact). Then, by every writing
  // thread: fence.proxy.async (st.shared -> wgmma) before the barrier.
  __device__ static void decode_tile(const char* raw, char* cvt) {
    constexpr int N = 2 * TT * RAW_CH;
    static_assert(N % THREADS == 0, "whole rounds of decodes");
#pragma unroll 4
    for (int idx = threadIdx.x; idx < N; idx += THREADS) {
      const int which = idx / (TT * RAW_CH), rem = idx % (TT * RAW_CH);
      const int tok = rem / RAW_CH, c = rem % RAW_CH;
      const uint4 w = *reinterpret_cast<const uint4*>(raw + which * RAW_TILE + 16 * swz<RAW_CH>(tok, c));
      uint4 lo, hi;
      fp8x16_to_half<Cfg::KV>(w, lo, hi);
      char* dst = cvt + (which * KVG + tok / T) * KV_TILE;
      *reinterpret_cast<uint4*>(dst + wgattn::sw128_off<T>(tok % T, 2 * c)) = lo;
      *reinterpret_cast<uint4*>(dst + wgattn::sw128_off<T>(tok % T, 2 * c + 1)) = hi;
    }
  }

  __device__ static void run(const __half* __restrict__ q, int nq, const char* __restrict__ kpool,
                             const char* __restrict__ vpool, long long block_stride, int num_blocks,
                             const int* __restrict__ block_tables, int table_stride, const int* __restrict__ lengths,
                             float qk_scale, __half* __restrict__ part_o, float* __restrict__ part_ml,
                             int max_splits, int* __restrict__ err, char* smem_raw, const void* kmap = nullptr,
                             const void* vmap = nullptr) {
    const int part = blockIdx.x % HS, kh = blockIdx.x / HS, b = blockIdx.y, split = blockIdx.z;
    const int* table = block_tables + static_cast<long long>(b) * table_stride;
    int cand[Cfg::NSIZES];  // the split's page id under each split size, loaded with the length
    Base::page_candidates(table, table_stride, split, cand);
    const int len = lengths[b];
    if (!Base::length_ok(len, nq, table_stride * PAGE)) {
      if (split == 0 && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(err, ATTN_ERR_LENGTH);
      return;
    }
    const int size = Cfg::split_for(len), begin = split * size;
    if (begin >= len) return;
    const int end = min(begin + size, len), tiles = (end - begin + TT - 1) / TT;  // stages of KVG tiles

    // 1024-byte aligned base (the 128-byte swizzle pattern is on absolute shared addresses).
    const u32 raw_addr = smem_addr(smem_raw);
    const int pad = static_cast<int>((ALIGN - (raw_addr & (ALIGN - 1))) & (ALIGN - 1));
    char* smem = smem_raw + pad;
    const u32 sq = raw_addr + pad, sst = sq + Q_BYTES;
    int* spages = reinterpret_cast<int*>(smem + Q_BYTES + STAGES * STAGE_BYTES + CVT_BYTES);
    // TMA: mbarriers full[s] (the producer's arrive + the stage's bytes) and empty[s] (every consumer
    // thread once it is done with the stage), after the page ids
    const u32 sbar = sq + Q_BYTES + STAGES * STAGE_BYTES + CVT_BYTES + TB_BYTES;
    auto full_bar = [&](int tile) { return sbar + 8 * (tile % STAGES); };
    auto empty_bar = [&](int tile) { return sbar + 8 * (STAGES + tile % STAGES); };

    const int pg0 = begin / PAGE, npg = (end - 1) / PAGE - pg0 + 1;
    Base::template stage_pages<NTHREADS>(cand, size, table, pg0, npg, num_blocks, err, spages);
    if constexpr (TMA) {
      if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
          wgattn::mbar_init(full_bar(s), 1);
          wgattn::mbar_init(empty_bar(s), THREADS);
        }
        wgattn::mbar_init_fence();
      }
    }
    __syncthreads();
    if constexpr (TMA) {
      // The producer warp: lane 0 fills stage after stage (tile t waits for the consumers' release of
      // tile t - STAGES), one box per (page, 64-column atom) of K and of V, straight into the swizzled
      // wgmma layout (the map's SWIZZLE_128B applies the same chunk ^ (row & 7) on the shared address;
      // every box lands 1024-byte aligned: 16 rows x 128 B). Pages wholly past `end` and invalid page ids
      // (-1, flagged by stage_pages) load from page index num_blocks: outside the map, so zero-filled,
      // no global read, and the transaction count still gets the whole box.
      if (threadIdx.x >= THREADS) {
        if (threadIdx.x == THREADS) {
          wgattn::tma_prefetch(kmap);
          wgattn::tma_prefetch(vmap);
          for (int tile = 0; tile < tiles; ++tile) {
            if (tile >= STAGES) wgattn::mbar_wait(empty_bar(tile), ((tile / STAGES) - 1) & 1);
            const u32 st = sst + (tile % STAGES) * STAGE_BYTES, fb = full_bar(tile);
            wgattn::mbar_arrive_tx(fb, STAGE_BYTES);
            const int t0 = begin + tile * TT;
#pragma unroll
            for (int p = 0; p < TT / PAGE; ++p) {
              const int blk = t0 + p * PAGE < end ? spages[t0 / PAGE - pg0 + p] : -1;
              const int page = blk >= 0 ? blk : num_blocks;
              const u32 dst = st + (p * PAGE / T) * KV_TILE;  // tile p PAGE / T of the stage
#pragma unroll
              for (int a = 0; a < D / 64; ++a) {
                const u32 box = dst + wgattn::tma_box_off<T>(p * PAGE % T, a);
                wgattn::tma_load_4d(box, kmap, fb, 64 * a, kh, 0, page);
                wgattn::tma_load_4d(box + RAW_TILE, vmap, fb, 64 * a, kh, 0, page);
              }
            }
          }
        }
        return;
      }
    }

    // Pipeline prologue, then Q (zeros for padded rows and rows past nq) while the copies fly.
    if constexpr (!TMA) {
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) load_tile(sst + s * STAGE_BYTES, begin + s * TT, end, spages, pg0, kpool, vpool, block_stride, kh);
        commit();
      }
    }
    for (int idx = threadIdx.x; idx < M * CH; idx += THREADS) {
      const int r = idx / CH, c = idx % CH, rr = part * ROWS + r, i = rr % QROWS, h = kh * GROUP + rr / QROWS;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < ROWS && i < nq)
        v = __ldg(reinterpret_cast<const uint4*>(q + ((static_cast<long long>(b) * nq + i) * HQ + h) * D) + c);
      *reinterpret_cast<uint4*>(smem + wgattn::sw128_off<M>(r, c)) = v;
    }
    fence_async();  // Q's st.shared -> visible to wgmma (the loop's first barrier orders it)
    if constexpr (TMA) consumer_sync();  // (TMA: the loop has no CTA barrier per tile)

    // Thread (warp w, g = lane / 4, t = lane % 4) holds accumulator rows 16 w + g (j = 0) and
    // 16 w + g + 8 (j = 1), columns 8 n + 2 t, + 1 of every 8-column block n.
    const int grp = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2,
              tq = lane & 3;  // token group (warpgroup), warp in it
    int limit[2];  // last visible position of each row (padded rows: all; rows past nq as VerifyAttention)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = 16 * warp + g + 8 * j, qi = (part * ROWS + r) % QROWS;
      limit[j] = r < ROWS && qi < nq ? len - nq + qi : len - 1;
    }
    float m_run[2] = {-DFG_INF, -DFG_INF}, l_run[2] = {0.0f, 0.0f};
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;

    // Descriptors with the tile bases; k-steps add (byte offset >> 4) to the start-address field.
    const uint64_t dq = wgattn::desc_sw128(sq, wgattn::KMAJOR_LBO, wgattn::KMAJOR_SBO);
    auto stage = [&](int tile) { return sst + (tile % STAGES) * STAGE_BYTES; };
    // (`tile` below: a stage of KVG tiles; this warpgroup's is tile grp of it.)
    auto load = [&](int tile) {  // the stage's K and V into its ring slot (nothing past the split)
      if constexpr (!TMA)
        if (tile < tiles) load_tile(stage(tile), begin + tile * TT, end, spages, pg0, kpool, vpool, block_stride, kh);
    };
    // The FP16 K tiles wgmma reads (then the V tiles): the ring slot, or (FP8) the decode buffer.
    constexpr int CVT_OFF = Q_BYTES + STAGES * STAGE_BYTES;
    auto kv = [&](int tile) -> u32 {
      if constexpr (FP8) return sq + CVT_OFF + (NCVT > 1 ? tile % NCVT : 0) * 2 * KVG * KV_TILE;
      else return stage(tile);
    };
    // Tile `tile` landed (this thread's copies: the caller waited) -> visible to every thread and to
    // wgmma; FP8: decoded first (its buffer's previous tile was waited for before the caller's wait).
    auto ready = [&](int tile) {
      if constexpr (TMA) {
        // The stage's bytes landed. Tokens past `end` of a partial page were loaded as stored: zero
        // them (K and V, as the cp.async kernel's zero-fill leaves them) before any wgmma reads them.
        wgattn::mbar_wait(full_bar(tile), (tile / STAGES) & 1);
        const int t0 = begin + tile * TT;
        if (t0 + TT > end) {  // the split's last stage only (uniform)
          for (int idx = threadIdx.x; idx < 2 * TT * CH; idx += THREADS) {
            const int which = idx / (TT * CH), tok = (idx / CH) % TT, c = idx % CH;
            if (t0 + tok >= end)
              *reinterpret_cast<uint4*>(smem + (stage(tile) - sq) + which * RAW_TILE + (tok / T) * KV_TILE +
                                        wgattn::sw128_off<T>(tok % T, c)) = make_uint4(0u, 0u, 0u, 0u);
          }
          fence_async();
          consumer_sync();
        }
        return;
      }
      fence_async();
      __syncthreads();
      if constexpr (FP8) {
        decode_tile(smem + Q_BYTES + (tile % STAGES) * STAGE_BYTES, smem + (kv(tile) - sq));
        fence_async();
        __syncthreads();
      }
    };
    // TMA: this thread is done with tile `tile`'s stage (its PV waited): the producer may refill it.
    auto release = [&](int tile) {
      if constexpr (TMA) wgattn::mbar_arrive(empty_bar(tile));
    };
    // S = Q K^T (FP32) of tile `tile`: 16 k-steps of 16 halves of D, one commit group.
    auto qk_issue = [&](int tile, float (&s)[T / 2]) {
      const uint64_t dk = wgattn::desc_sw128(kv(tile) + grp * KV_TILE, wgattn::KMAJOR_LBO, wgattn::KMAJOR_SBO);
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint64_t a = dq + static_cast<uint64_t>(wgattn::kmajor_kstep<M>(ks) >> 4);
        const uint64_t bk = dk + static_cast<uint64_t>(wgattn::kmajor_kstep<T>(ks) >> 4);
        wgattn::qk_step<T>(a, bk, s, ks == 0 ? wgattn::GMMA::ScaleOut::Zero : wgattn::GMMA::ScaleOut::One,
                           cute::make_index_sequence<T / 2>{});
      }
      cute::warpgroup_commit_batch();
    };
    // O = O * alpha (per row), then O += P V of tile `tile`: T / 16 k-steps of 16 tokens, one commit group.
    // (x 1.0 is exact: a warp whose rows' maxima did not move skips the 128 multiplies, same bits.)
    auto pv_issue = [&](int tile, const u32 (&pa)[T / 16][4], const float (&alpha)[2]) {
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          o[4 * n] *= alpha[0];
          o[4 * n + 1] *= alpha[0];
          o[4 * n + 2] *= alpha[1];
          o[4 * n + 3] *= alpha[1];
        }
      }
      const uint64_t dv =
          wgattn::desc_sw128(kv(tile) + (KVG + grp) * KV_TILE, wgattn::mnmajor_lbo<T>(), wgattn::MNMAJOR_SBO);
      wgattn::fence_regs(o);
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < T / 16; ++ks)
        wgattn::pv_step(pa[ks], dv + static_cast<uint64_t>(wgattn::mnmajor_kstep(ks) >> 4), o,
                        cute::make_index_sequence<128>{});
      cute::warpgroup_commit_batch();
    };
    // Online softmax of tile `tile` (exp2 domain) on its S accumulator: scale, causal mask (and the tile's
    // tail), row max / sum over the quad; P (FP32) in place of S, alpha = the O rescale.
    auto softmax = [&](int tile, float (&s)[T / 2], float (&alpha)[2]) {
      const int t0 = begin + tile * TT + grp * T;
      float mx[2] = {-DFG_INF, -DFG_INF}, base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int n = 0; n < T / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = e >> 1, pos = t0 + 8 * n + 2 * tq + (e & 1);
          float x = s[4 * n + e] * qk_scale;
          if (pos > limit[j]) x = -DFG_INF;
          s[4 * n + e] = x;
          mx[j] = fmaxf(mx[j], x);
        }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 1));
        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 2));
        const float m_new = fmaxf(m_run[j], mx[j]);
        base[j] = m_new == -DFG_INF ? 0.0f : m_new;  // all masked so far: exp2 gives 0, not NaN
        alpha[j] = exp2f(m_run[j] - base[j]);
        m_run[j] = m_new;
      }
#pragma unroll
      for (int n = 0; n < T / 8; ++n) {
        s[4 * n] = exp2f(s[4 * n] - base[0]);
        s[4 * n + 1] = exp2f(s[4 * n + 1] - base[0]);
        s[4 * n + 2] = exp2f(s[4 * n + 2] - base[1]);
        s[4 * n + 3] = exp2f(s[4 * n + 3] - base[1]);
        sum[0] += s[4 * n];
        sum[0] += s[4 * n + 1];
        sum[1] += s[4 * n + 2];
        sum[1] += s[4 * n + 3];
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], 1);
        sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], 2);
        l_run[j] = l_run[j] * alpha[j] + sum[j];
      }
    };
    // P (FP32, the S accumulator layout) -> FP16 A fragments of the PV wgmma: the accumulator of
    // 8-column block n is the A fragment's half (n & 1) of k-step n / 2 (FA3's register reuse).
    auto pack = [&](const float (&p)[T / 2], u32 (&pa)[T / 16][4]) {
#pragma unroll
      for (int n = 0; n < T / 8; ++n) {
        pa[n >> 1][2 * (n & 1)] = wgattn::pack_half2(p[4 * n], p[4 * n + 1]);
        pa[n >> 1][2 * (n & 1) + 1] = wgattn::pack_half2(p[4 * n + 2], p[4 * n + 3]);
      }
    };

    if constexpr (STAGES == 2) {
      // In order: QK -> softmax -> PV, each waited; the next tile's copies issue under the QK.
      for (int it = 0; it < tiles; ++it) {
        wait<0>();  // this thread's copies of tile `it` landed
        ready(it);  // everyone's copies of tile `it`; everyone done with tile it - 1 (its slot refills)
        float s[T / 2];
        qk_issue(it, s);
        load(it + 1);
        commit();
        cute::warpgroup_wait<0>();
        wgattn::fence_regs(s);
        u32 pa[T / 16][4];
        float alpha[2];
        softmax(it, s, alpha);
        pack(s, pa);
        pv_issue(it, pa, alpha);
        cute::warpgroup_wait<0>();
        wgattn::fence_regs(o);
        release(it);
      }
    } else {
      // FA3's intra-warpgroup overlap: iteration `it` issues QK of tile `it`, then PV of tile it - 1 (its
      // P and rescale from the previous softmax), and the softmax of tile `it` runs while that PV does.
      // Copies: iteration it >= 1 refills tile it - 2's slot (every warp waited for PV(it - 2) before
      // this iteration's barrier) with tile it + STAGES - 2: STAGES - 2 tiles ahead of the compute.
      // Commit groups: STAGES - 1 in the prologue (tiles 0 .. STAGES - 2), then one per iteration
      // (iteration 0's empty); tile `it` is in group it + 1 (or it): wait until <= STAGES - 3 pending.
      static_assert(STAGES >= 3, "the overlapped loop keeps tiles it - 1 and `it` resident while it refills");
      u32 pa[T / 16][4];
      float alpha[2];
      {
        wait<STAGES - 2>();
        ready(0);
        float s[T / 2];
        qk_issue(0, s);
        commit();  // (empty: keeps one group per iteration)
        cute::warpgroup_wait<0>();
        wgattn::fence_regs(s);
        softmax(0, s, alpha);
        pack(s, pa);
      }
      for (int it = 1; it < tiles; ++it) {
        wait<STAGES - 3>();
        ready(it);
        float s[T / 2];
        qk_issue(it, s);
        load(it + STAGES - 2);
        commit();
        pv_issue(it - 1, pa, alpha);
        cute::warpgroup_wait<1>();  // QK of tile `it` (PV of tile it - 1 may still run)
        wgattn::fence_regs(s);
        float an[2];
        softmax(it, s, an);  // in the S registers: PV(it - 1) still reads pa
        cute::warpgroup_wait<0>();  // PV of tile it - 1: its slot is free after the next barrier
        wgattn::fence_regs(o);
        release(it - 1);
        pack(s, pa);  // (packing before this wait made ptxas wait for PV(it - 1) before the softmax)
        alpha[0] = an[0];
        alpha[1] = an[1];
      }
      pv_issue(tiles - 1, pa, alpha);
      cute::warpgroup_wait<0>();
      wgattn::fence_regs(o);
    }
    wait<0>();
    if constexpr (KVG > 1) {
      // Group 1 hands its (max, sum, O) to group 0 through the idle ring; group 0 combines them. Thread
      // i of either group holds the same accumulator elements (rows, columns).
      consumer_sync();  // every warpgroup's last PV done: the ring is idle
      float* xo = reinterpret_cast<float*>(smem + Q_BYTES);  // [128 elements][128 threads]
      float* xml = xo + 128 * 128;                           // [64 rows][max, sum]
      const int ti = threadIdx.x & 127;
      if (grp == 1) {
#pragma unroll
        for (int i = 0; i < 128; ++i) xo[i * 128 + ti] = o[i];
        if (tq == 0)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            xml[(16 * warp + g + 8 * j) * 2] = m_run[j];
            xml[(16 * warp + g + 8 * j) * 2 + 1] = l_run[j];
          }
      }
      consumer_sync();
      if (grp > 0) return;
      float w0[2], w1[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float m1 = xml[(16 * warp + g + 8 * j) * 2], l1 = xml[(16 * warp + g + 8 * j) * 2 + 1];
        const float mx = fmaxf(m_run[j], m1);
        const float base = mx == -DFG_INF ? 0.0f : mx;  // a row neither group saw stays at -inf
        w0[j] = exp2f(m_run[j] - base);
        w1[j] = exp2f(m1 - base);
        l_run[j] = l_run[j] * w0[j] + l1 * w1[j];
        m_run[j] = mx;
      }
#pragma unroll
      for (int i = 0; i < 128; ++i) {
        const int j = (i >> 1) & 1;
        o[i] = o[i] * w0[j] + xo[i * 128 + ti] * w1[j];
      }
    }

    // Partial results of this split (real rows only): O / sum in FP16 (0 for a row the split does not
    // reach), (max, sum) per row (log2 units); the merge is the base kernel's.
    const long long slot = (static_cast<long long>(b) * HKV + kh) * max_splits + split;
    __half* po = part_o + (slot * ROWS_ALL + part * ROWS) * D;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = 16 * warp + g + 8 * j;
      if (r < ROWS) {
        const float inv = l_run[j] > 0.0f ? 1.0f / l_run[j] : 0.0f;
#pragma unroll
        for (int n = 0; n < 32; ++n)
          *reinterpret_cast<__half2*>(po + r * D + 8 * n + 2 * tq) =
              __floats2half2_rn(o[4 * n + 2 * j] * inv, o[4 * n + 2 * j + 1] * inv);
        if (tq == 0) {
          float* pml = part_ml + (slot * ROWS_ALL + part * ROWS + r) * 2;
          pml[0] = m_run[j];
          pml[1] = l_run[j];
        }
      }
    }
  }

  __device__ static void merge(const __half* __restrict__ part_o, const float* __restrict__ part_ml, int nq,
                               const int* __restrict__ lengths, int capacity, int max_splits, float v_scale,
                               float* __restrict__ out) {
    Base::merge(part_o, part_ml, nq, lengths, capacity, max_splits, v_scale, out);
  }
};

}  // namespace dflashgen
