// dflashgen: weight-streaming skinny GEMM, y[M, N] = x[M, K] W^T, FP16 in/out, FP32 accumulation.
//
// Grid: x = ceil(M / ROWS) row blocks, y = N tiles (WARPS_N * WARP_NT warp tiles per CTA),
// z = SPLIT_K. Row blocks vary fastest, so the CTAs that share a weight tile run together and all
// but the first find it in L2: weights cross DRAM once whatever M is.
// Batch invariance: the K range is cut into G = K / KG groups and dealt to W = SPLIT_K * WARPS_K
// workers in fixed contiguous ranges; each worker accumulates its groups in ascending order; the
// WARPS_K workers of a CTA are summed in warp order through shared memory and the SPLIT_K CTA
// partials in split order, in the same launch, by the last of the SPLIT_K CTAs to finish them
// (split_k_last). None of that depends on M, ROWS, WARP_NT or WARPS_N, so a row's result is
// bitwise the same whatever batch it came in. The one atomic (split-K) only elects who sums; it
// never adds data.
// WSPLIT tiles place the same plan differently: each of the SPLIT_K * WARPS_K workers is a CTA of
// its own (WARPS_N warps sharing one activation ring, no in-CTA K reduction), every CTA writes its
// FP32 partials, and the last one sums them in the plan's order -- per split, its WARPS_K workers in
// warp order, then the splits from 0.0f in split order -- so its rows are bitwise those of the
// in-CTA tiles of the plan. What it buys at large M: a CTA of few warps can take all 64 batch rows
// (each weight decoded once) while the SM keeps many warps resident.
// SERIAL tiles place it in time instead: one CTA walks ALL of the plan's SPLIT_K * WARPS_K workers'
// ranges with one pipeline over the whole K, and where a worker's range ends folds its accumulators
// into running sums in shared memory -- per split its workers in warp order, then the splits from
// 0.0f in split order (fold_worker): again the plan's additions in the plan's order, so the same
// bits. No partials leave the SM, and a K group's activations are staged once per CTA for all its
// rows (not once per K worker).
#pragma once

#include "mma_traits.cuh"
#ifdef DFLASHGEN_WGMMA
#include "wgmma.cuh"
#endif

namespace dflashgen {

// void_t for the optional Cfg members (DFLASHGEN_CFG_MEMBER below).
template <class...>
using void_t = void;
__host__ __device__ constexpr int gcd_c(int a, int b) { return b == 0 ? a : gcd_c(b, a % b); }
template <bool B, class A, class C>
struct Select {
  using type = A;
};
template <class A, class C>
struct Select<false, A, C> {
  using type = C;
};
template <int V>
struct IntC {
  static constexpr int value = V;
};
// f(IntC<0>{}), ..., f(IntC<N - 1>{}): compile-time step indices for lambdas.
template <int N, int I = 0, class F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (I < N) {
    f(IntC<I>{});
    static_for<N, I + 1>(f);
  }
}
// Programmatic dependent launch (sm_90; no-ops before): the runtime launches sm_90 GEMMs with
// programmatic stream serialization, so a launch may start while the previous kernel in the stream
// is still finishing. Everything a kernel reads before pdl_wait() must be independent of earlier
// kernels (the prepacked weights and scales are); pdl_wait() returns once they have completed and
// their memory is visible. pdl_launch_dependents() lets the next such launch start its own weight
// prefetch while this grid's last CTAs run their epilogues.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// pdl_wait() once `dep` (nonzero) has its value. ptxas schedules loads next to their first use, so
// the weight loads a kernel issues before a plain pdl_wait() were found after ACQBULK in the SASS
// (all of them in the TP4 kernels): the ramp never overlapped the previous kernel. Predicating the
// wait on a value that ORs the loaded words with M (>= 1 in any running CTA, unknown to ptxas) keeps
// those loads ahead of it and never skips it. Only coherent loads may follow: ptxas hoisted
// ld.global.nc activation loads above this wait (see ld_act), and tools/pdl_order.py checks the SASS.
__device__ __forceinline__ void pdl_wait_after(unsigned dep) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %0, 0;\n\t@p griddepcontrol.wait;\n\t}" :: "r"(dep) : "memory");
#else
  (void)dep;
#endif
}
// The kernels' last argument (`prefetch_groups` in the generated signatures; run's `launch_opts`):
// bits 0-15 the L2 prefetch groups;
// LAUNCH_PDL_EARLY releases the next GEMM right after this kernel's own wait (it may then start as soon
// as this grid's last CTAs are placed and load its weights under this grid's last wave) instead of
// after the main loop. Never before that wait: at most one grid runs ahead.
constexpr int LAUNCH_PREFETCH_MASK = 0xFFFF, LAUNCH_PDL_EARLY = 1 << 16;
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// `bytes` (a multiple of 16) from a 16-byte aligned global address into L2: a hint, no registers,
// no effect on results (sm_90 bulk prefetch; a no-op before).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// The 128-byte line holding `p` into L2 (a per-lane hint, no registers, no effect on results).
// Per lane, not one bulk prefetch from lane 0: its uniform-register operands made ptxas wrap a bulk
// prefetch in a loop over the lanes (~15 instructions each).
__device__ __forceinline__ void prefetch_l2_line(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Optional Cfg members: Cfg::MEMBER where a kernel's Cfg declares it, DEFAULT where it does not (only
// the kernels of a wgmma K plan declare WGMMA, wsplit tiles WSPLIT, w_async tiles W_ASYNC, l2_ahead
// tiles L2_AHEAD; producer tiles WGC and PRODUCERS), so the sources of the other kernels never
// mention them.
#define DFLASHGEN_CFG_MEMBER(TRAIT, MEMBER, TYPE, DEFAULT) \
  template <class C, class = void>                         \
  struct TRAIT {                                           \
    static constexpr TYPE value = DEFAULT;                 \
  };                                                       \
  template <class C>                                       \
  struct TRAIT<C, void_t<decltype(C::MEMBER)>> {           \
    static constexpr TYPE value = C::MEMBER;               \
  };
DFLASHGEN_CFG_MEMBER(CfgWgmma, WGMMA, bool, false)
DFLASHGEN_CFG_MEMBER(CfgWsplit, WSPLIT, bool, false)
DFLASHGEN_CFG_MEMBER(CfgWasync, W_ASYNC, bool, false)
DFLASHGEN_CFG_MEMBER(CfgL2Ahead, L2_AHEAD, bool, false)
DFLASHGEN_CFG_MEMBER(CfgSerial, SERIAL, bool, false)
DFLASHGEN_CFG_MEMBER(CfgWgc, WGC, bool, false)           // producer tiles: wgmma consumer warpgroups
DFLASHGEN_CFG_MEMBER(CfgProducers, PRODUCERS, int, 1)    // producer tiles: copy warps
// (DFLASHGEN_CFG_MEMBER stays defined: skinny_gemm_pw.cuh declares its tiles' members with it)

template <class Cfg>
struct SkinnyGemm {
  using T = typename Cfg::Traits;
  static constexpr int NT8 = Cfg::ROWS / 8;
  static constexpr int G = Cfg::K / T::KG;
  static constexpr int WORKERS = Cfg::SPLIT_K * Cfg::WARPS_K;
  static constexpr bool WSPLIT = CfgWsplit<Cfg>::value;
  static constexpr bool SERIAL = CfgSerial<Cfg>::value;
  static constexpr int WK_CTA = WSPLIT || SERIAL ? 1 : Cfg::WARPS_K;       // K workers per CTA at once
  static constexpr int SPLITS = WSPLIT ? WORKERS : SERIAL ? 1 : Cfg::SPLIT_K;  // CTAs along K (grid z)
  static constexpr int TILES = Cfg::N_PAD / T::TILE_ROWS;
  static constexpr int ACC = Cfg::WARP_NT * NT8 * T::NACC;
  static constexpr int THREADS = 32 * Cfg::WARPS_N * WK_CTA + (CfgWgmma<Cfg>::value ? 32 : 0);
  static constexpr bool NVFP4 = Cfg::FORMAT == Format::NVFP4;
  static constexpr bool SILU = Cfg::EPILOGUE == Epilogue::SiluMul;
  static constexpr int N_OUT = SILU ? Cfg::N / 2 : Cfg::N;
  static_assert(Cfg::K % T::KG == 0, "K must be a multiple of the group size");
  static_assert(G >= WORKERS, "more K workers than K groups");
  static_assert(Cfg::ROWS % 8 == 0, "ROWS must be a multiple of 8");
  // WGMMA (sm_90a): a warpgroup (4 consecutive warps, one 16-row weight tile each) issues
  // wgmma.m64nROWSk16 with A from the warps' decoded fragments and B from its shared-memory ring.
  static constexpr bool WG = CfgWgmma<Cfg>::value;
  static_assert(!(WG && WSPLIT), "WSPLIT tiles are mma.sync tiles");
  static_assert(!WG || (Cfg::WARPS_N == 4 && Cfg::WARP_NT == 1 && Cfg::X_SMEM && Cfg::ROWS <= 64),
                "WGMMA: warps_n = 4 (one warpgroup per K worker), warp_nt = 1, x_smem, rows <= 64");

  // X_SMEM: each K worker (the WARPS_N warps that share its K range) stages its groups' activations
  // in a shared-memory ring of XST stages, copied once by the worker's threads with cp.async XST - 1
  // groups ahead, and every warp reads its B fragments from there (LDS.128): no activation
  // registers held across groups and no load-to-use stall on L1/L2 per group. The ring is dead by
  // the time the K reduction needs `red`, so they share the storage.
  // WGMMA keeps one more stage: a stage is rewritten only once the wgmma group that read it has
  // retired (wait_group 1 keeps the newest in flight), so the copy runs XST - 2 groups ahead.
  // mma.sync keeps 3 (copies two groups ahead) whatever the depth of the weight register ring
  // (STAGES = 2: the warp_nt = 2 tiles, whose second weight tile costs the registers; STAGES > 3:
  // more weight bytes in flight per warp, the activations need not run further ahead).
  static constexpr int XST = !Cfg::X_SMEM ? 1 : WG ? Cfg::STAGES + 1 : 3;
  static constexpr int XCHUNKS = Cfg::ROWS * T::XCPR;      // 16-byte chunks per stage
  static constexpr int XTHR = 32 * Cfg::WARPS_N;            // copiers: the worker's threads
  static constexpr int XPER = (XCHUNKS + XTHR - 1) / XTHR;  // chunks per copier and stage
  static constexpr int XRSTEP = XTHR / T::XCPR;             // rows between a copier's chunks

  // W_ASYNC (register-path tiles, sm_80+): the weight ring of STAGES groups lives in shared memory
  // and is filled with cp.async, each lane copying (and later reading) only its own 16-byte weight
  // word and its own block-scale word, so no lane waits for another and cp.async.wait_group is the
  // only synchronisation. Why: the register ring's refills (ld.global.nc into the registers a
  // group was just decoded from) were all scheduled by ptxas at the end of the unrolled trip, so
  // the first group of every trip waited a full DRAM round trip (SASS of the served M = 8 gate_up
  // tile, session 11); copies have no destination register to keep live, and stay where issued.
  // The same words reach the same decode and MMAs: bitwise the register path's results.
  static constexpr bool W_ASYNC = CfgWasync<Cfg>::value;
  static constexpr int WRW = W_ASYNC ? THREADS / 32 : 1;  // warps with a ring
  struct WRing {
    uint4 w[WRW][W_ASYNC ? Cfg::STAGES : 1][W_ASYNC ? Cfg::WARP_NT : 1][32];
    typename T::Scale s[WRW][W_ASYNC ? Cfg::STAGES : 1][W_ASYNC ? Cfg::WARP_NT : 1][32];
  };

  // the activation ring of an X_SMEM tile, and beside it the weight ring of an X_SMEM W_ASYNC one
  struct XsRing {
    uint4 xs[Cfg::X_SMEM ? WK_CTA : 1][XST][Cfg::X_SMEM ? XCHUNKS : 1];
  };
  struct XsWRing : XsRing {
    WRing w;
  };
  using XsBase = typename Select<W_ASYNC, XsWRing, XsRing>::type;
  // SERIAL: beside the activation (and W_ASYNC weight) ring, each lane's running sums: of the current
  // split's workers (tot) and, with split-K, of the finished splits (spl). Lane-private slots: no
  // barriers. In registers they cost 32-64 registers (1-3 CTAs per SM); a __noinline__ fold kept acc
  // in local memory.
  static constexpr int SPL = Cfg::SPLIT_K > 1 ? 1 : 0;
  struct XsFold : XsBase {
    float tot[Cfg::WARPS_N][ACC][32];
  };
  struct XsFoldSplit : XsFold {
    float spl[Cfg::WARPS_N][ACC][32];
  };
  using Fold = typename Select<SPL, XsFoldSplit, XsFold>::type;
  struct alignas(16) Smem {
    union {
      // the K reduction's slots (a CTA with one K worker has none: a placeholder element)
      float red[WK_CTA > 1 ? WK_CTA - 1 : 1][WK_CTA > 1 ? Cfg::WARPS_N : 1][WK_CTA > 1 ? ACC : 1][WK_CTA > 1 ? 32 : 1];
      typename Select<SERIAL, Fold, XsBase>::type x;
      typename Select<W_ASYNC && !Cfg::X_SMEM, WRing, char>::type wr;  // a placeholder byte for other tiles
    };
  };
  static_assert(!W_ASYNC || (!WG && !WSPLIT), "W_ASYNC is an in-CTA mma.sync tile");
  static_assert(!SERIAL || (Cfg::X_SMEM && !WG && !WSPLIT && WORKERS > 1),
                "SERIAL: an mma.sync x_smem tile of a plan with >= 2 K workers");
  static_assert(!W_ASYNC || !Cfg::X_SMEM || Cfg::STAGES >= 3,
                "X_SMEM W_ASYNC: a weight refill joins the next step's commit group, so it must be >= 3 groups ahead");
  static_assert(!W_ASYNC || sizeof(typename T::Scale) == 4, "W_ASYNC copies 4-byte scale words (cp.async.ca)");
  static_assert(!Cfg::X_SMEM || T::HAS_X_SMEM, "X_SMEM needs a trait with a shared-memory B fragment order");
  static_assert(!Cfg::X_SMEM || Cfg::STAGES >= 2, "X_SMEM needs >= 2 stages");
  static_assert(!Cfg::X_SMEM || XTHR % T::XCPR == 0, "a copier's chunks must share one column");
  static_assert(!Cfg::X_SMEM || T::XCPR != 8 || XRSTEP % 2 == 0, "the swizzle must be the same for all of a copier's rows");

  static_assert(Cfg::STAGES <= PAD_GROUPS, "prefetch past a worker's range must stay in the padded stream");

  // L2_AHEAD (register-path tiles): ptxas puts every register-ring refill of an unrolled trip at the
  // trip's end, so the first decode of each trip waits for a DRAM round trip (PC sampling, session
  // 12: 34% of the served M = 8 gate_up tile's stall samples on that one instruction). The refills
  // stay where they are (a consumer waits for them wherever they sit); instead, at each trip's top
  // every lane asks L2 for its words of the groups the NEXT trip refills, so those refills hit L2.
  static constexpr bool L2A = CfgL2Ahead<Cfg>::value;
  static_assert(!L2A || (!Cfg::X_SMEM && !W_ASYNC && !WG && !WSPLIT), "L2_AHEAD is for register-path tiles");

  // Groups at .. at + COUNT - 1 past the running pointers of this lane's weight (and scale) words
  // into L2, those before `left` (the groups the worker has from the running pointers on: never
  // past its range). All in range (every full trip but the last ones): immediate offsets, no
  // address arithmetic; else a short loop over the ones that are.
  __device__ __forceinline__ static void l2_line(const uint4* const (&wp)[Cfg::WARP_NT],
                                                 const typename T::Scale* const (&sp)[Cfg::WARP_NT], const int g) {
#pragma unroll
    for (int i = 0; i < Cfg::WARP_NT; ++i) {
      prefetch_l2_line(wp[i] + g * 32);
      if constexpr (NVFP4) prefetch_l2_line(sp[i] + g * T::SCALE_WORDS);
    }
  }
  template <int COUNT>
  __device__ __forceinline__ static void l2_ahead(const uint4* const (&wp)[Cfg::WARP_NT],
                                                  const typename T::Scale* const (&sp)[Cfg::WARP_NT],
                                                  const int at, const int left) {
    if (at + COUNT <= left) {
#pragma unroll
      for (int c = 0; c < COUNT; ++c) l2_line(wp, sp, at + c);
    } else {
#pragma unroll 1
      for (int g = at; g < left; ++g) l2_line(wp, sp, g);
    }
  }

  // W_ASYNC: this lane's words of its warp's weight ring (slot s, warp tile i): the copy that fills
  // them and the decode that reads them. Only the lane that copied a word reads it.
  __device__ static WRing& wring(Smem& sm) {
    if constexpr (Cfg::X_SMEM) return sm.x.w;
    else return sm.wr;
  }
  __device__ static void wring_fill(Smem& sm, int warp, int lane, int s, int i, const uint4* w,
                                    const typename T::Scale* sc) {
    WRing& r = wring(sm);
    cp_async16(&r.w[warp][s][i][lane], w);
    if constexpr (NVFP4) cp_async4(&r.s[warp][s][i][lane], sc);
  }
  __device__ static void wring_decode(Smem& sm, int warp, int lane, int s, int i, typename T::Frag& f) {
    WRing& r = wring(sm);
    T::decode(r.w[warp][s][i][lane], NVFP4 ? r.s[warp][s][i][lane] : 0, f);
  }
  // Group u of a trip (ring slot u % STAGES): decode each warp tile's weights into frag and refill the
  // slot with group u + STAGES -- from / into the register ring, or (W_ASYNC) this lane's words of
  // the shared-memory ring.
  __device__ __forceinline__ static void decode_refill(const int u, const uint4* (&wp)[Cfg::WARP_NT],
                                                       const typename T::Scale* (&sp)[Cfg::WARP_NT],
                                                       uint4 (&wbuf)[Cfg::STAGES][Cfg::WARP_NT],
                                                       typename T::Scale (&sbuf)[Cfg::STAGES][Cfg::WARP_NT],
                                                       typename T::Frag (&frag)[Cfg::WARP_NT], Smem& sm,
                                                       const int warp, const int lane) {
    const int s = u % Cfg::STAGES;
#pragma unroll
    for (int i = 0; i < Cfg::WARP_NT; ++i) {
      if constexpr (W_ASYNC) {
        wring_decode(sm, warp, lane, s, i, frag[i]);
        wring_fill(sm, warp, lane, s, i, wp[i] + (u + Cfg::STAGES) * 32, sp[i] + (u + Cfg::STAGES) * T::SCALE_WORDS);
      } else {
        T::decode(wbuf[s][i], sbuf[s][i], frag[i]);
        wbuf[s][i] = ld_stream(wp[i] + (u + Cfg::STAGES) * 32);
        if constexpr (NVFP4) sbuf[s][i] = __ldg(sp[i] + (u + Cfg::STAGES) * T::SCALE_WORDS);
      }
    }
  }

  __device__ static void run(const __half* __restrict__ x, int M, const uint4* __restrict__ wq,
                             const void* __restrict__ wscale, const float* __restrict__ col_scale,
                             __half* __restrict__ out, float* __restrict__ partial, Smem& smem,
                             unsigned int* __restrict__ tickets, int launch_opts) {
    const int prefetch_groups = launch_opts & LAUNCH_PREFETCH_MASK;
    const bool pdl_early = (launch_opts & LAUNCH_PDL_EARLY) != 0;
#ifdef DFLASHGEN_WGMMA
    if constexpr (WG) {
      if (threadIdx.x >= 32 * Cfg::WARPS_N * Cfg::WARPS_K) {  // the activation producer warp
        pdl_wait();
        if (pdl_early) pdl_launch_dependents();
        produce_wgmma(x, M, smem);
        pdl_launch_dependents();
        return;
      }
    }
#endif
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wn = warp % Cfg::WARPS_N, wk = warp / Cfg::WARPS_N;
    const int tile0 = (blockIdx.y * Cfg::WARPS_N + wn) * Cfg::WARP_NT;
    const int worker = blockIdx.z * WK_CTA + wk;  // WSPLIT: wk = 0, one worker per CTA
    // SERIAL: the CTA walks every worker's range, i.e. all of K
    const int gb = SERIAL ? 0 : worker * G / WORKERS, ge = SERIAL ? G : (worker + 1) * G / WORKERS;
    const int m0 = blockIdx.x * Cfg::ROWS;
    const bool active = tile0 < TILES;  // TILES % WARP_NT == 0 (checked by the schedule)
    // X_SMEM: warps past N still copy and meet the ring's barriers; they stream the last tile's
    // weights (in bounds) and never store.
    const int tile_w = Cfg::X_SMEM && !active ? TILES - Cfg::WARP_NT : tile0;

    float acc[Cfg::WARP_NT][NT8][T::NACC];
    each_acc([&](int i, int j, int e) { acc[i][j][e] = 0.0f; });

    // Batch rows past M read row M - 1 instead: an MMA's output column depends only on its own
    // B column, and those columns are never stored, so no per-row predicate is needed in the loop.
    const __half* xrow[NT8];
#pragma unroll
    for (int j = 0; j < NT8; ++j) {
      const int m = m0 + 8 * j + T::b_mrow();
      xrow[j] = x + static_cast<size_t>(m < M ? m : M - 1) * Cfg::K + T::x_lane_offset();
    }

    if (active || Cfg::X_SMEM) {
      // Running pointers: per group the weights advance 32 x 16 B, the scales SCALE_WORDS, the
      // activations KG; inside the unrolled block every offset is a compile-time constant.
      const uint4* wp[Cfg::WARP_NT];
      const typename T::Scale* sp[Cfg::WARP_NT];
#pragma unroll
      for (int i = 0; i < Cfg::WARP_NT; ++i) {
        const size_t g0 = static_cast<size_t>(tile_w + i) * G + gb;
        wp[i] = wq + g0 * 32 + lane;
        if constexpr (NVFP4) sp[i] = static_cast<const typename T::Scale*>(wscale) + g0 * T::SCALE_WORDS + T::scale_index();
        else sp[i] = nullptr;
      }
      const __half* xp[NT8];
#pragma unroll
      for (int j = 0; j < NT8; ++j) xp[j] = xrow[j] + gb * T::KG;
      const int groups = ge - gb;  // >= 1: the schedule never has more K workers than groups

      // prefetch_groups > 0 (the runtime's choice, DFLASHGEN_L2_PREFETCH): lane 0 asks L2 for the
      // first that many groups of each of its weight (and scale) streams, before pdl_wait(), so
      // under programmatic dependent launch the bytes start moving while the previous kernel
      // finishes. A hint: results are the same either way.
      if (prefetch_groups > 0 && lane == 0) {
        const int pg = min(prefetch_groups, groups);
#pragma unroll
        for (int i = 0; i < Cfg::WARP_NT; ++i) {
          const size_t g0 = static_cast<size_t>(tile_w + i) * G + gb;
          prefetch_l2(wq + g0 * 32, static_cast<unsigned>(pg) * 32 * sizeof(uint4));
          if constexpr (NVFP4)
            prefetch_l2(static_cast<const typename T::Scale*>(wscale) + g0 * T::SCALE_WORDS,
                        static_cast<unsigned>(pg) * T::SCALE_WORDS * sizeof(typename T::Scale));
        }
      }

      // Register pipeline: STAGES groups of weights in flight ahead of the MMAs (W_ASYNC: in this
      // warp's shared-memory ring, one commit group per K group). Loads past this worker's range
      // stay inside the buffer (prepack pads the streams) and are never used.
      uint4 wbuf[Cfg::STAGES][Cfg::WARP_NT];
      typename T::Scale sbuf[Cfg::STAGES][Cfg::WARP_NT];
      unsigned dep = static_cast<unsigned>(M);
      if constexpr (W_ASYNC) {
#pragma unroll
        for (int s = 0; s < Cfg::STAGES; ++s) {
#pragma unroll
          for (int i = 0; i < Cfg::WARP_NT; ++i) {
            wring_fill(smem, warp, lane, s, i, wp[i] + s * 32, sp[i] + s * T::SCALE_WORDS);
          }
          cp_async_commit();
        }
      } else {
#pragma unroll
        for (int s = 0; s < Cfg::STAGES; ++s)
#pragma unroll
          for (int i = 0; i < Cfg::WARP_NT; ++i) {
            wbuf[s][i] = ld_stream(wp[i] + s * 32);
            if constexpr (NVFP4) sbuf[s][i] = __ldg(sp[i] + s * T::SCALE_WORDS);
            else sbuf[s][i] = 0;
          }
        // Only the weight stream above may run ahead of the previous kernel: activations, partials,
        // tickets and outputs below may be its outputs or inputs. The wait depends on every stage's
        // first weight word and scale, so those loads are in flight (and landed) before it.
#pragma unroll
        for (int st = 0; st < Cfg::STAGES; ++st)
#pragma unroll
          for (int i = 0; i < Cfg::WARP_NT; ++i) {
            dep |= wbuf[st][i].x;
            if constexpr (NVFP4) dep |= static_cast<unsigned>(sbuf[st][i]);
          }
      }
      // groups per trip: a multiple of STAGES and of XB (2; X_AHEAD + 1 activation buffers when
      // X_AHEAD > 1) and, for X_SMEM, of the ring's XST
      constexpr int XB = Cfg::X_AHEAD > 1 ? Cfg::X_AHEAD + 1 : 2;
      constexpr int U0 = Cfg::STAGES * XB / gcd_c(Cfg::STAGES, XB);
      constexpr int U = Cfg::X_SMEM && !WG ? U0 * XST / gcd_c(U0, XST) : U0;
      // L2_AHEAD: the first trip's refills (groups STAGES .. STAGES + U - 1), weights only, so ahead
      // of the wait; each trip then asks for the next trip's at its top.
      if constexpr (L2A) l2_ahead<U>(wp, sp, Cfg::STAGES, groups);
      pdl_wait_after(dep);
      if (pdl_early) pdl_launch_dependents();
      if constexpr (WG) {
#ifdef DFLASHGEN_WGMMA
        run_wgmma(groups, wk, wp, sp, wbuf, sbuf, acc, smem);
#endif
      } else if constexpr (Cfg::X_SMEM) {
        run_xsmem<U>(x, M, m0, gb, groups, wk, wn, lane, wp, sp, wbuf, sbuf, acc, smem);
      } else {
      // X_AHEAD = d > 0: activations for the first d groups now; later ones are fetched d groups
      // ahead of their MMAs into d + 1 rotating buffers (d = 2: the served M = 8 tiles stalled on
      // activation loads from L2 issued one group ahead, ncu session 11). Otherwise (large row
      // tiles, where the buffers cost (d + 1) x NT8 x KSUB x 4 registers and occupancy) each
      // group's activations are loaded at the top of its step and other warps hide the latency. A
      // trip covers U groups, U a multiple of the buffers and of STAGES, so the weight ring slot
      // (u % STAGES) and the activation buffer (u % XBUF) are compile-time per step and nothing is
      // copied between registers at the back edge.
      constexpr int XA = Cfg::X_AHEAD;
      constexpr int XBUF = XA + 1;
      typename T::XFrag xb[XBUF][NT8];
#pragma unroll
      for (int d = 0; d < XA; ++d)
#pragma unroll
        for (int j = 0; j < NT8; ++j) T::load_x(xp[j], d == 0 || d < groups, d * T::KG, xb[d][j]);

      // Group g + u of the running pointers' trip: decode, refill its ring slot STAGES ahead,
      // fetch activations (group g + u + XA's if X_AHEAD and `more`: that group exists), MMAs.
      auto step = [&](const int u, const bool more) {
        const int xc = u % XBUF;
        if constexpr (!XA) {
#pragma unroll
          for (int j = 0; j < NT8; ++j) T::load_x(xp[j], true, u * T::KG, xb[0][j]);
        }
        typename T::Frag frag[Cfg::WARP_NT];
        // W_ASYNC: this lane's copies of group u have landed once at most STAGES - 1 newer commit
        // groups are pending; it reads only what it copied itself
        if constexpr (W_ASYNC) cp_async_wait<Cfg::STAGES - 1>();
        decode_refill(u, wp, sp, wbuf, sbuf, frag, smem, warp, lane);
        if constexpr (W_ASYNC) cp_async_commit();
        if constexpr (XA) {
#pragma unroll
          for (int j = 0; j < NT8; ++j) T::load_x(xp[j], more, (u + XA) * T::KG, xb[(u + XA) % XBUF][j]);
        }
#pragma unroll
        for (int j = 0; j < NT8; ++j)
#pragma unroll
          for (int i = 0; i < Cfg::WARP_NT; ++i) T::mma(frag[i], xb[xc][j], acc[i][j]);
      };

      // Full trips with a group after them: no per-group bounds check, every fetch taken.
      int g = 0;
      for (; g + U < groups; g += U) {
        if constexpr (L2A) l2_ahead<U>(wp, sp, U + Cfg::STAGES, groups - g);
        // a group follows the trip, so fetches up to one group past it need no check
#pragma unroll
        for (int u = 0; u < U; ++u) step(u, u + XA <= U || g + u + XA < groups);
#pragma unroll
        for (int i = 0; i < Cfg::WARP_NT; ++i) {
          wp[i] += U * 32;
          if constexpr (NVFP4) sp[i] += U * T::SCALE_WORDS;
        }
        // Opaque to ptxas: it would otherwise fold the rows into one offset register and pay a
        // 64-bit add per activation load instead of an immediate offset.
#pragma unroll
        for (int j = 0; j < NT8; ++j) {
          xp[j] += U * T::KG;
          asm volatile("" : "+l"(xp[j]));
        }
      }
      // The last 1..U groups.
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (g + u >= groups) break;
        step(u, g + u + XA < groups);
      }
      // the ring's last copies (past this worker's range) land before `red` may reuse the storage
      if constexpr (W_ASYNC) cp_async_wait<0>();
      }  // !X_SMEM
    }

    pdl_launch_dependents();  // main loop done: the next GEMM may start streaming its weights (if not yet)
    // Intra-CTA K reduction in warp order.
    if constexpr (WK_CTA > 1) {
      if constexpr (Cfg::X_SMEM || W_ASYNC) __syncthreads();  // `red` overlays the other workers' rings
      if (wk > 0)
        each_acc([&](int i, int j, int e) { smem.red[wk - 1][wn][acc_index(i, j, e)][lane] = acc[i][j][e]; });
      __syncthreads();
      if (wk > 0) return;
#pragma unroll 1
      for (int w = 0; w < WK_CTA - 1; ++w)
        each_acc([&](int i, int j, int e) { acc[i][j][e] += smem.red[w][wn][acc_index(i, j, e)][lane]; });
    }
    if (!active) return;

    if constexpr (SPLITS > 1) {
      // Every CTA writes its FP32 partials; per warp tile, the last of the SPLIT_K warps holding
      // the same outputs (one per CTA of the tile) sums them in split order z = 0..SPLIT_K-1 from
      // 0.0f -- its own read back as well (the bits it stored) -- and runs the epilogue on the sums:
      // the additions and their order of the former separate reduce kernel.
      store_partials(acc, tile0, m0, M, partial, blockIdx.z);
      if (!split_k_last(tickets, blockIdx.y, wn, lane)) return;
      // Opaque copies: without them the compiler hoisted the per-element addresses out of the
      // split loop below (r64 wgmma tiles: ~60 more registers).
      int t0 = tile0, r0 = m0;
      asm volatile("" : "+r"(t0), "+r"(r0));
      if constexpr (WSPLIT) {
        combine_workers(acc, t0, r0, M, partial);
      } else {
        sum_partials(acc, t0, r0, M, partial);
      }
      epilogue(acc, t0, r0, M, col_scale, out);
    } else {
      epilogue(acc, tile0, m0, M, col_scale, out);
    }
  }

  // Split-K: this CTA's sums (rows below M) to its partial slot (blockIdx.z; a PERSIST tile's rest item:
  // its K worker) ...
  __device__ __forceinline__ static void store_partials(const float (&acc)[Cfg::WARP_NT][NT8][T::NACC], int tile0,
                                                        int m0, int M, float* __restrict__ partial, int slot) {
    each_acc([&](int i, int j, int e) {
      const int m = m0 + 8 * j + T::acc_mrow(e);
      const int lrow = (tile0 + i) * T::TILE_ROWS + T::acc_wrow(e);
      if (m < M) partial[(static_cast<size_t>(slot) * M + m) * Cfg::N_PAD + lrow] = acc[i][j][e];
    });
  }
  // ... and, by the last warp to store (split_k_last), the SPLIT_K slots summed in split order from
  // 0.0f: the additions and their order of the former separate reduce kernel.
  __device__ __forceinline__ static void sum_partials(float (&acc)[Cfg::WARP_NT][NT8][T::NACC], int t0, int r0,
                                                      int M, const float* __restrict__ partial) {
    each_acc([&](int i, int j, int e) { acc[i][j][e] = 0.0f; });
    // One split per trip (fully unrolled, every split's loads in flight at once, the r64 wgmma
    // tiles took up to 24 more registers).
#pragma unroll 1
    for (int z = 0; z < Cfg::SPLIT_K; ++z) {
      const float* pz = partial + static_cast<size_t>(z) * M * Cfg::N_PAD;
      each_acc([&](int i, int j, int e) {
        const int m = r0 + 8 * j + T::acc_mrow(e);
        const int lrow = (t0 + i) * T::TILE_ROWS + T::acc_wrow(e);
        if (m < M) acc[i][j][e] += __ldcg(pz + static_cast<size_t>(m) * Cfg::N_PAD + lrow);
      });
    }
  }

  // WSPLIT: the plan's sums from the partials of its SPLIT_K * WARPS_K worker CTAs (worker
  // z * WARPS_K + w at partial slot z * WARPS_K + w): per split z, S_z = ((p_0 + p_1) + ...) in warp
  // order, as an in-CTA tile's warp 0 adds its workers through `red`; then, with SPLIT_K > 1, the
  // splits from 0.0f in split order, as the split-K combine below. Same additions, same order, the
  // same FP32 values read back exactly: the same bits.
  __device__ static void combine_workers(float (&acc)[Cfg::WARP_NT][NT8][T::NACC], int t0, int r0, int M,
                                         const float* __restrict__ partial) {
    float tot[Cfg::SPLIT_K > 1 ? Cfg::WARP_NT : 1][Cfg::SPLIT_K > 1 ? NT8 : 1][T::NACC];
#pragma unroll 1
    for (int z = 0; z < Cfg::SPLIT_K; ++z) {
#pragma unroll 1
      for (int w = 0; w < Cfg::WARPS_K; ++w) {
        const float* pw = partial + static_cast<size_t>(z * Cfg::WARPS_K + w) * M * Cfg::N_PAD;
        each_acc([&](int i, int j, int e) {
          const int m = r0 + 8 * j + T::acc_mrow(e);
          const int lrow = (t0 + i) * T::TILE_ROWS + T::acc_wrow(e);
          if (m < M) {
            const float v = __ldcg(pw + static_cast<size_t>(m) * Cfg::N_PAD + lrow);
            acc[i][j][e] = w == 0 ? v : acc[i][j][e] + v;
          }
        });
      }
      if constexpr (Cfg::SPLIT_K > 1)
        each_acc([&](int i, int j, int e) { tot[i][j][e] = (z == 0 ? 0.0f : tot[i][j][e]) + acc[i][j][e]; });
    }
    if constexpr (Cfg::SPLIT_K > 1) each_acc([&](int i, int j, int e) { acc[i][j][e] = tot[i][j][e]; });
  }

  // f(i, j, e) for every accumulator element (warp tile i, 8-row block j, element e) in one fixed
  // order, fully unrolled; acc_index: the element's slot in a flat [WARP_NT * NT8 * NACC] array.
  template <class F>
  __device__ __forceinline__ static void each_acc(F&& f) {
#pragma unroll
    for (int i = 0; i < Cfg::WARP_NT; ++i)
#pragma unroll
      for (int j = 0; j < NT8; ++j)
#pragma unroll
        for (int e = 0; e < T::NACC; ++e) f(i, j, e);
  }
  __device__ __forceinline__ static constexpr int acc_index(int i, int j, int e) { return (i * NT8 + j) * T::NACC + e; }

  // x_smem B fragments: this lane's chunk offsets in a stage, row (8j + b_mrow) of sub-block p; and
  // one stage's MMAs for the decoded weights `frag`, B fragments (p, j) in order, each loaded one
  // ahead of the MMAs of the previous one (the order the plan's anchor sums in).
  // (KS = T::KSUB: a template parameter, as sm_70's trait has no KSUB and the class declares these anyway)
  template <int KS>
  __device__ __forceinline__ static void xs_lane_offsets(int (&xoff)[KS]) {
#pragma unroll
    for (int p = 0; p < KS; ++p) xoff[p] = T::b_mrow() * T::XCPR + T::xs_lane_chunk(p);
  }
  template <int KS>
  __device__ __forceinline__ static void mma_xs_stage(const typename T::Frag (&frag)[Cfg::WARP_NT],
                                                      const uint4* st, const int (&xoff)[KS],
                                                      float (&acc)[Cfg::WARP_NT][NT8][T::NACC]) {
    uint4 xv = lds128(st + xoff[0]);
#pragma unroll
    for (int q = 0; q < KS * NT8; ++q) {
      const int p = q / NT8, j = q % NT8;
      const uint4 cur = xv;
      if (q + 1 < KS * NT8) xv = lds128(st + xoff[(q + 1) / NT8] + 8 * ((q + 1) % NT8) * T::XCPR);
#pragma unroll
      for (int i = 0; i < Cfg::WARP_NT; ++i) T::mma_sub(frag[i], cur, p, acc[i][j]);
    }
  }

  // Column scale (and SiLU(gate) * up for the fused variant) of the CTA's final FP32 sums, FP16 out.
  __device__ static void epilogue(float (&acc)[Cfg::WARP_NT][NT8][T::NACC], int tile0, int m0, int M,
                                  const float* __restrict__ col_scale, __half* __restrict__ out) {
#pragma unroll
    for (int i = 0; i < Cfg::WARP_NT; ++i) {
      const int tile = tile0 + i;
#pragma unroll
      for (int j = 0; j < NT8; ++j)
#pragma unroll
        for (int e = 0; e < T::NACC; ++e) {
          const int m = m0 + 8 * j + T::acc_mrow(e);
          if (m >= M) continue;
          const int wrow = T::acc_wrow(e);
          const int lrow = tile * T::TILE_ROWS + wrow;  // layout row
          if constexpr (SILU) {
            if (!T::acc_is_gate(e)) continue;
            const int jc = T::gate_col(tile, wrow);
            if (jc >= N_OUT) continue;
            const float gv = acc[i][j][e] * col_scale[jc];
            const float uv = acc[i][j][e + T::SILU_PAIR] * col_scale[N_OUT + jc];
            out[static_cast<size_t>(m) * N_OUT + jc] = __float2half_rn(silu(gv) * uv);
          } else {
            if (lrow >= Cfg::N) continue;
            out[static_cast<size_t>(m) * N_OUT + lrow] = __float2half_rn(acc[i][j][e] * col_scale[lrow]);
          }
        }
    }
  }

  // Split-K: whether this warp is the last of the SPLIT_K warps that hold the same outputs (warp
  // tile wn of row block blockIdx.x and N tile blockIdx.y, one warp per CTA along z) to have
  // stored its partials, i.e. the one that sums them (`block`: blockIdx.y, or a PERSIST tile's rest
  // item's column block among the rest). Lane 0 takes a ticket from the warp tile's
  // counter with atomicInc(counter, SPLIT_K - 1): tickets 0..S-2 count up, the last one (S - 1)
  // wraps the counter back to 0. So every launch leaves every counter at 0: the runtime zeroes
  // them once, when it allocates them, and the next launch on the stream or the next replay of a
  // CUDA graph that captured this launch starts from 0 without a memset. Launches on one stream
  // run one after another; two streams get two workspaces (runtime/kernels.py), so no counter is
  // shared by launches in flight together. The ticket decides who sums, never how.
  // Per warp rather than per CTA: a CTA-wide ticket needs CTA barriers after the main loop, which
  // made ptxas spill the 64-register split-K tiles (FP8 r16) in the main loop; warps need none.
  // Fences: each lane's partial stores are visible GPU-wide before its warp takes a ticket, and
  // the last warp fences again before reading the others' partials (through L2, __ldcg: other SMs
  // wrote them).
  // (S: the warps along K holding the same outputs; a Z_SPLIT producer tile passes its SPLIT_K)
  template <int S = SPLITS>
  __device__ static bool split_k_last(unsigned int* __restrict__ tickets, int block, int wn, int lane) {
    __threadfence();
    __syncwarp();
    unsigned int t = 0;
    if (lane == 0)
      t = atomicInc(tickets + (block * gridDim.x + blockIdx.x) * Cfg::WARPS_N + wn, S - 1);
    const bool last = __shfl_sync(0xffffffffu, t, 0) == S - 1;
    if (last) __threadfence();
    return last;
  }

  // The X_SMEM main loop (see Smem): the same groups, k-steps and per-accumulator MMA order as the
  // register path (group by group, k-steps ascending), so results are bitwise the same.
  template <int U>
  __device__ static void run_xsmem(const __half* __restrict__ x, int M, int m0, int gb, int groups, int wk, int wn,
                                   int lane, const uint4* (&wp)[Cfg::WARP_NT],
                                   const typename T::Scale* (&sp)[Cfg::WARP_NT],
                                   uint4 (&wbuf)[Cfg::STAGES][Cfg::WARP_NT],
                                   typename T::Scale (&sbuf)[Cfg::STAGES][Cfg::WARP_NT],
                                   float (&acc)[Cfg::WARP_NT][NT8][T::NACC], Smem& smem) {
    static_assert(U % XST == 0, "ring slots must be compile-time per step");
    const int warp = threadIdx.x >> 5;  // W_ASYNC: this warp's weight ring
    uint4(&ring)[XST][Cfg::X_SMEM ? XCHUNKS : 1] = smem.x.xs[Cfg::X_SMEM ? wk : 0];
    // Copier: chunk i of this thread is row xr0 + i * XRSTEP, 16-byte column xc. Rows at or past M
    // are never copied: their stale B columns only feed output columns that are never stored.
    const int xt = wn * 32 + lane;
    const int xr0 = xt / T::XCPR, xc = xt % T::XCPR;
    const int xrows = M - m0;
    const int dst0 = xr0 * T::XCPR + (xc ^ T::xs_swizzle(xr0));
    const __half* xcp = x + static_cast<size_t>(m0 + xr0) * Cfg::K + static_cast<size_t>(gb) * T::KG + 8 * xc;
    auto copy = [&](const int slot, const int koff, const bool more) {
#pragma unroll
      for (int i = 0; i < XPER; ++i) {
        const int r = xr0 + i * XRSTEP;
        const bool ok = more && r < xrows && (XCHUNKS % XTHR == 0 || r < Cfg::ROWS);
        cp_async16_if(&ring[slot][dst0 + i * XRSTEP * T::XCPR], xcp + koff + i * XRSTEP * Cfg::K, ok);
      }
      cp_async_commit();
    };
    // One CTA-wide barrier per group (a named barrier per worker would make ptxas reserve all 16
    // and cap resident CTAs; warps_n = 1 tiles need only a warp barrier): the workers walk their
    // ranges for `steps` groups, the most any worker of this CTA has; one with fewer skips its MMAs
    // in that last step.
    int steps = 0;
#pragma unroll
    for (int w = 0; w < WK_CTA; ++w) {
      const int v = blockIdx.z * WK_CTA + w;
      steps = max(steps, (v + 1) * G / WORKERS - v * G / WORKERS);
    }
    if constexpr (SERIAL) steps = G;
    // SERIAL: the worker whose range the walk is in, and the group its range ends before
    [[maybe_unused]] int wcur = 0, wend = G / WORKERS;
    int xoff[T::KSUB];
    xs_lane_offsets(xoff);

#pragma unroll
    for (int s = 0; s < XST - 1; ++s) copy(s, s * T::KG, s < groups);

    // Group a = g + u: wait for its stage (all copiers), refill the slot freed by group a - 1,
    // decode the weights and refill their ring, MMAs with B from shared memory.
    auto step = [&](const int u, const int a, const bool tail) {
      cp_async_wait<XST - 2>();
      // One warp per K worker (warps_n = 1): the ring is the warp's own (its lanes copy and read it),
      // so a warp barrier orders the copies and the reads; the warps run free of each other.
      if constexpr (Cfg::WARPS_N == 1) __syncwarp(); else __syncthreads();
      copy((u + XST - 1) % XST, (u + XST - 1) * T::KG, a + XST - 1 < groups);
      if (tail && a >= groups) return;  // only in the last trip (full trips end before `groups`)
      typename T::Frag frag[Cfg::WARP_NT];
      // W_ASYNC: group a's weight words landed with commit groups older than the wait above (a
      // refill joins the commit group of the next step's activation copy, STAGES >= 3 groups ahead)
      decode_refill(u, wp, sp, wbuf, sbuf, frag, smem, warp, lane);
      mma_xs_stage(frag, ring[u % XST], xoff, acc);
      if constexpr (SERIAL) {
        if (a + 1 == wend) {  // worker wcur's last group: fold its sums, start the next from 0
          fold_worker(acc, wcur, wn, lane, smem);
          ++wcur;
          wend = (wcur + 1) * G / WORKERS;
        }
      }
    };

    int g = 0;
    for (; g + U < steps; g += U) {
#pragma unroll
      for (int u = 0; u < U; ++u) step(u, g + u, false);
#pragma unroll
      for (int i = 0; i < Cfg::WARP_NT; ++i) {
        wp[i] += U * 32;
        if constexpr (NVFP4) sp[i] += U * T::SCALE_WORDS;
      }
      xcp += U * T::KG;
      asm volatile("" : "+l"(xcp));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (g + u >= steps) break;
      step(u, g + u, true);
    }
    cp_async_wait<0>();
    if constexpr (SERIAL) {  // the plan's sums: the last split's (or the only split's) total
      if constexpr (SPL) each_acc([&](int i, int j, int e) { acc[i][j][e] = smem.x.spl[wn][acc_index(i, j, e)][lane]; });
      else each_acc([&](int i, int j, int e) { acc[i][j][e] = smem.x.tot[wn][acc_index(i, j, e)][lane]; });
    }
  }

  // SERIAL: worker v's accumulators (split z = v / WARPS_K, warp w = v % WARPS_K) into the running
  // sums: S_z = ((a_0 + a_1) + ...) as an in-CTA tile's warp 0 adds its workers through `red`, and
  // with split-K P = ((0.0f + S_0) + S_1) + ... as the split-K combine; then acc = 0 for worker v + 1.
  template <class Sm>
  __device__ __forceinline__ static void fold_worker(float (&acc)[Cfg::WARP_NT][NT8][T::NACC], const int v,
                                                     const int wn, const int lane, Sm& smem) {
    const int z = v / Cfg::WARPS_K, w = v % Cfg::WARPS_K;
    each_acc([&](int i, int j, int e) {
      float& t = smem.x.tot[wn][acc_index(i, j, e)][lane];
      const float sz = w == 0 ? acc[i][j][e] : t + acc[i][j][e];
      t = sz;
      if constexpr (SPL) {
        if (w == Cfg::WARPS_K - 1) {
          float& pz = smem.x.spl[wn][acc_index(i, j, e)][lane];
          pz = (z == 0 ? 0.0f : pz) + sz;
        }
      }
      acc[i][j][e] = 0.0f;
    });
  }

#ifdef DFLASHGEN_WGMMA
  // WGMMA. One warpgroup per K worker (4 consecutive warps, one 16-row weight tile each) streams
  // and decodes its weights exactly as the other paths, and per K group a (ascending, as in the
  // mma.sync paths) issues wgmma.fence, the group's k-steps in ascending order into the same FP32
  // accumulators (A: the decoded fragments, B: the group's activation stage in shared memory),
  // commit and wait. One extra warp per CTA (the producer, the last warp) copies every worker's
  // activations into its ring of XST stages, XST - 1 groups ahead, and alone pays the proxy fence
  // that makes them visible to wgmma: fence.proxy.async compiles to MEMBAR.ALL.CTA, which in a
  // weight-streaming warp would also wait for its weight loads in flight.
  //
  // A stage holds the activations permuted the way the sm_80/90 prepack permutes K inside each
  // 32-K sub-block p (Sm80Traits): k-step 2p + s reads logical k (8c + 2t, +1) from physical
  // 32p + 8t + 4s + 2c + {0,1}. So the 16-byte source chunk (batch row n, physical 32p + 8t..+7)
  // splits into its four 4-byte words: word w -> k-step 2p + (w >> 1), K half c = w & 1, pair t.
  // Producer lane mapping: chunk i of the lane is t = lane % 4, row n = 8 (i / KSUB) + lane / 4,
  // sub-block p = i % KSUB, so the 32 lanes write 32 consecutive 4-byte words (no bank conflicts)
  // and every offset but the lane's base is an immediate.
  static constexpr int WG_U = Cfg::STAGES * XST / gcd_c(Cfg::STAGES, XST);  // stage and ring slot compile-time

  // Groups the CTA's K workers step through in lockstep (one barrier per group): the most any has.
  __device__ static int wgmma_steps() {
    int steps = 0;
#pragma unroll
    for (int w = 0; w < Cfg::WARPS_K; ++w) {
      const int v = blockIdx.z * Cfg::WARPS_K + w;
      steps = max(steps, (v + 1) * G / WORKERS - v * G / WORKERS);
    }
    return steps;
  }

  __device__ static void produce_wgmma(const __half* __restrict__ x, int M, Smem& smem) {
    using L = WgmmaBLayout<Cfg::ROWS>;
    constexpr int SB = XCHUNKS * 16;   // bytes per stage
    constexpr int D = XST - 1;         // groups the copy runs ahead
    constexpr int CPL = XCHUNKS / 32;  // chunks per lane and stage
    static_assert(XCHUNKS % 32 == 0 && SB == T::KG / 16 * L::KSTEP, "stage layout");
    const int lane = threadIdx.x & 31;
    const int t = lane & 3, r = lane >> 2;
    const int m0 = blockIdx.x * Cfg::ROWS;
    const int xrows = M - m0;
    const __half* src[Cfg::WARPS_K];
    unsigned dst[Cfg::WARPS_K];
    int gbeg[Cfg::WARPS_K], gcnt[Cfg::WARPS_K];
#pragma unroll
    for (int w = 0; w < Cfg::WARPS_K; ++w) {
      const int v = blockIdx.z * Cfg::WARPS_K + w;
      gbeg[w] = v * G / WORKERS;
      gcnt[w] = (v + 1) * G / WORKERS - gbeg[w];
      src[w] = x + static_cast<size_t>(m0 + r) * Cfg::K + static_cast<size_t>(gbeg[w]) * T::KG + 8 * t;
      dst[w] = static_cast<unsigned>(__cvta_generic_to_shared(&smem.x.xs[w][0][0])) + L::offset(0, r, 0, t);
    }
    // Group a + (koff / KG) of every worker into stage SLOT, where the worker has it. Rows at or
    // past M are not copied: their stale B columns only feed output columns that are never stored.
    auto copy = [&](auto slot_c, auto koff_c, const int a) {
      constexpr int slot = decltype(slot_c)::value, koff = decltype(koff_c)::value;
#pragma unroll
      for (int w = 0; w < Cfg::WARPS_K; ++w) {
        if (a + koff / T::KG < gcnt[w]) {
          static_for<CPL>([&](auto i_c) {
            constexpr int i = decltype(i_c)::value, p = i % T::KSUB, nb = i / T::KSUB;
            if (8 * nb + r < xrows)
              cp_async4x4<L::LBO, L::KSTEP, 2 * (nb * 8 * Cfg::K + 32 * p + koff),
                          slot * SB + L::offset(2 * p, 8 * nb, 0, 0)>(dst[w], src[w]);
          });
        }
      }
      cp_async_commit();
    };
    const int steps = wgmma_steps();
    static_for<D>([&](auto s) { copy(s, IntC<decltype(s)::value * T::KG>{}, 0); });
    // Step a = g + u: group a's stage complete (own copies, fence, barrier: everyone's), then the
    // stage of group a - 1 (retired: its consumers waited for their wgmmas before this barrier)
    // gets group a + D.
    auto step = [&](auto u_c, const int g) {
      constexpr int u = decltype(u_c)::value;
      cp_async_wait<D - 1>();
      fence_proxy_async_smem();
      __syncthreads();
      copy(IntC<(u + D) % XST>{}, IntC<(u + D) * T::KG>{}, g);
    };
    int g = 0;
    for (; g + WG_U < steps; g += WG_U) {
      static_for<WG_U>([&](auto u) { step(u, g); });
#pragma unroll
      for (int w = 0; w < Cfg::WARPS_K; ++w) {
        src[w] += WG_U * T::KG;
        asm volatile("" : "+l"(src[w]));
      }
    }
    static_for<WG_U>([&](auto u) {
      if (g + decltype(u)::value < steps) step(u, g);
    });
    cp_async_wait<0>();
    // the consumers' K reduction: `red` overlays the rings (see run)
    if constexpr (Cfg::WARPS_K > 1) {
      __syncthreads();
      __syncthreads();
    }
  }

  // A consumer warpgroup's main loop (see above).
  __device__ static void run_wgmma(int groups, int wk, const uint4* (&wp)[Cfg::WARP_NT],
                                   const typename T::Scale* (&sp)[Cfg::WARP_NT],
                                   uint4 (&wbuf)[Cfg::STAGES][Cfg::WARP_NT],
                                   typename T::Scale (&sbuf)[Cfg::STAGES][Cfg::WARP_NT],
                                   float (&acc)[Cfg::WARP_NT][NT8][T::NACC], Smem& smem) {
    using L = WgmmaBLayout<Cfg::ROWS>;
    constexpr int KSTEPS = T::KG / 16;
    constexpr int SB = XCHUNKS * 16;
    const unsigned ring = static_cast<unsigned>(__cvta_generic_to_shared(&smem.x.xs[wk][0][0]));
    const uint64_t desc0 = L::desc_base() + ((ring >> 4) & 0x3FFF);  // 14-bit start field, as CuTe
    const int steps = wgmma_steps();

    // Two fragment buffers: group a's wgmma reads frag[a % 2] asynchronously while the warps decode
    // group a + 1 into frag[(a + 1) % 2] (its weights are already in registers), so the decode no
    // longer waits for the tensor core and the tensor core no longer waits for the decode. The
    // activation ring is unchanged: group a is retired (wait_group 0) before the next barrier.
    typename T::Frag frag[2];
    if (groups > 0) {
      T::decode(wbuf[0][0], sbuf[0][0], frag[0]);
      wbuf[0][0] = ld_stream(wp[0] + Cfg::STAGES * 32);
      if constexpr (NVFP4) sbuf[0][0] = __ldg(sp[0] + Cfg::STAGES * T::SCALE_WORDS);
    }
    auto step = [&](auto u_c, const int a) {
      constexpr int u = decltype(u_c)::value;
      constexpr int slot = u % XST;
      constexpr int cur = u % 2, nxt = (u + 1) % 2;  // WG_U = lcm(STAGES, STAGES + 1) is even
      __syncthreads();          // group a's stage is complete and visible to the async proxy
      if (a >= groups) return;  // warpgroup-uniform: only a worker with fewer groups, last step
      // Every wgmma input is defined before wgmma.fence (ptxas serializes wgmmas whose inputs a
      // non-wgmma instruction defines inside the pipeline stage, C7513).
      uint64_t desc[KSTEPS];
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        desc[ks] = desc0 + ((slot * SB + ks * L::KSTEP) >> 4);
#pragma unroll
        for (int r = 0; r < 4; ++r) cute::warpgroup_fence_operand(frag[cur].a[ks][r]);
      }
#pragma unroll
      for (int j = 0; j < NT8; ++j)
#pragma unroll
        for (int e = 0; e < T::NACC; ++e) cute::warpgroup_fence_operand(acc[0][j][e]);
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) wgmma_rs<Cfg::ROWS>(frag[cur].a[ks], desc[ks], acc[0]);
      cute::warpgroup_commit_batch();
      if (a + 1 < groups) {  // group a + 1 from its weight stage, which then takes group a + 1 + STAGES
        constexpr int s = (u + 1) % Cfg::STAGES;
        T::decode(wbuf[s][0], sbuf[s][0], frag[nxt]);
        wbuf[s][0] = ld_stream(wp[0] + (u + 1 + Cfg::STAGES) * 32);
        if constexpr (NVFP4) sbuf[s][0] = __ldg(sp[0] + (u + 1 + Cfg::STAGES) * T::SCALE_WORDS);
        // Pin the decode before the wait: it is register-only work, which ptxas would otherwise
        // sink past wgmma.wait_group (seen in the SASS), serializing it behind the tensor core again.
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
          for (int r = 0; r < 4; ++r) cute::warpgroup_fence_operand(frag[nxt].a[ks][r]);
      }
      // Retire the group before the next barrier: its stage is refilled right after it, and with
      // a group left in flight (wait_group 1) ptxas 13.0 serialized the wgmmas of some kernels
      // anyway (C7511 split-K, C7515 warps_k = 2).
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int j = 0; j < NT8; ++j)
#pragma unroll
        for (int e = 0; e < T::NACC; ++e) cute::warpgroup_fence_operand(acc[0][j][e]);
    };
    static_assert(WG_U % 2 == 0, "fragment buffer parity must be compile-time per step");

    int g = 0;
    for (; g + WG_U < steps; g += WG_U) {
      static_for<WG_U>([&](auto u) { step(u, g + decltype(u)::value); });
      wp[0] += WG_U * 32;
      if constexpr (NVFP4) sp[0] += WG_U * T::SCALE_WORDS;
    }
    static_for<WG_U>([&](auto u) {
      if (g + decltype(u)::value < steps) step(u, g + decltype(u)::value);
    });
  }
#endif  // DFLASHGEN_WGMMA
};

}  // namespace dflashgen
