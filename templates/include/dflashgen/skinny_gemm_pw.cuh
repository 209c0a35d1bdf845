// dflashgen: the producer-warp skinny GEMM (PRODUCER tiles, names `_pw1`; sm_90), for M = 32-64.
//
// Why: every other tile streams its weights into registers or issues its own copies, so a warp waits
// for its loads between its MMAs, and at M = 32-64 only other warps hide that (the serial tiles ran
// flat in M at about one memory round trip per K group; session 13). Here one extra warp (the
// producer) does all the copying, up to STAGES K groups ahead, into a shared-memory ring of stages
// that each hold one K group of the CTA's weight tiles (every lane's 16-byte word, as the register
// path loads it), their block scales and the CTA's activation rows (the x_smem layout); the
// WARPS_N consumer warps only wait on a stage's mbarrier, decode and issue MMAs, and release the
// stage on another. Completion: each producer lane's cp.async.mbarrier.arrive.noinc on `full`
// (count 32); each consumer warp's arrive on `empty` (count WARPS_N).
//
// Bits: a SERIAL tile's (skinny_gemm.cuh): one CTA walks all of its K plan's SPLIT_K x WARPS_K
// workers' ranges in order, each worker's groups ascending with the x_smem loop's MMA order, and
// folds each worker's sums where its range ends -- per split in warp order, then the splits from
// 0.0f -- so every row equals the plan's anchor bit for bit (dflashgen verify checks it).
//
// WGC tiles (names `_wc1`, sm_90a): the consumers are warpgroups (4 warps, one 16-row weight tile
// each) that decode into the wgmma A fragments and issue wgmma.m64nROWSk16 with B from the stage,
// asynchronously: group a's MMAs run while the warps decode group a + 1, which removes the mma.sync
// consumers' dependent LDS -> decode -> HMMA chain (session 14's limit). The stage's activations
// are in the wgmma B layout (WgmmaBLayout: 4-byte words placed by the prepack's K permutation, so
// every k-step sums the same products as the mma.sync path's), staged by PRODUCERS warps into an
// activation ring of X_RING groups; the weights and scales have a ring of their own, STAGES groups
// deep, filled with cp.async by one more warp (weight bytes in flight are what a CTA needs to hide
// DRAM latency, and a weight group is a quarter of an activation group's bytes at 64 rows; session
// 16's ncu of the shared ring: both sides waiting, the ring all in flight). Bits: on the H200 wgmma
// and mma.sync plans of the same K order agree bit for bit (the verify twins), and dflashgen verify
// holds every WGC tile to its plan's anchor.
#pragma once

#include "mbarrier.cuh"
#include "skinny_gemm.cuh"

namespace dflashgen {

// A WGC tile's optional X_RING (its activation ring), W_SELF, Z_SPLIT and W_WARPS (its weight warps;
// skinny_gemm.cuh's optional members are the others), and the view of its Cfg the base class gets: the base's register ring, which reads up to
// STAGES groups past a worker's range into the prepack's padding, is not used here, and a WGC weight
// ring may be deeper than that padding (it copies exactly the groups there are).
DFLASHGEN_CFG_MEMBER(CfgXRing, X_RING, int, 0)
DFLASHGEN_CFG_MEMBER(CfgWSelf, W_SELF, bool, false)
DFLASHGEN_CFG_MEMBER(CfgZSplit, Z_SPLIT, bool, false)
DFLASHGEN_CFG_MEMBER(CfgWWarps, W_WARPS, int, 1)
DFLASHGEN_CFG_MEMBER(CfgPersist, PERSIST, int, 0)
DFLASHGEN_CFG_MEMBER(CfgPair, PAIR, bool, false)
template <class Cfg>
struct PwBaseCfg : Cfg {
  static constexpr int STAGES = Cfg::STAGES < PAD_GROUPS ? Cfg::STAGES : PAD_GROUPS;
  static constexpr bool L2_AHEAD = false;  // a WGC tile's L2_AHEAD is its weight warp's (produce_weights)
};

template <class Cfg>
struct SkinnyGemmPw {
  using Base = SkinnyGemm<PwBaseCfg<Cfg>>;  // the fragment shapes, accumulator walk and epilogue
  using T = typename Base::T;
  using Scale = typename T::Scale;
  static constexpr int WN = Cfg::WARPS_N, NT = Cfg::WARP_NT, NT8 = Base::NT8, ACC = Base::ACC;
  static constexpr int ST = Cfg::STAGES, G = Base::G, WORKERS = Base::WORKERS, TILES = Base::TILES;
  static constexpr bool NVFP4 = Base::NVFP4;
  static constexpr bool WGC = CfgWgc<Cfg>::value;
  static constexpr int PW = CfgProducers<Cfg>::value;  // producer warps (WGC: of the activations)
  static constexpr int XR = CfgXRing<Cfg>::value;      // WGC: the activation ring's depth
  // WGC: the weight warp also prefetches into L2 each warp tile's next PF_GROUPS groups past the ring
  static constexpr bool PF = CfgL2Ahead<Cfg>::value;
  static constexpr int PF_GROUPS = 8;
  // WGC: the weight warps, each copying WN / WW of the warp tiles' words per K group (one warp for 12
  // tiles left the consumers waiting on weights: session 18, one per warpgroup 11% faster at wn12)
  // WGC W_SELF (names `_wsf1`): no weight warps; each consumer warp copies its own tile's words (and
  // lanes 0-3 its scales) into the weight ring with cp.async, STAGES - 1 groups ahead, and waits for
  // them with cp.async.wait_group: no full / empty barriers, and the copies spread over the consumers
  // instead of queueing behind one warp (session 18: the consumers waited on the weight warp)
  static constexpr bool WSELF = WGC && CfgWSelf<Cfg>::value;
  static constexpr int WW = !WGC || WSELF ? 0 : CfgWWarps<Cfg>::value;
  // WGC Z_SPLIT (names `_zs1`): one CTA per split of the plan (grid z), walking only its split's
  // WARPS_K workers; the splits' sums meet through FP32 partials, summed by the last of the SPLIT_K
  // warps holding the same outputs in split order from 0.0f: the plan's split-K combine, so the same
  // bits as the CTA that walks every split, on SPLIT_K times the CTAs (n5120 problems: 40 CTAs of
  // 128 rows otherwise)
  static constexpr bool ZS = CfgZSplit<Cfg>::value;
  static_assert(!ZS || (WGC && Cfg::SPLIT_K > 1), "Z_SPLIT: wgc tiles of split-K plans");
  // WGC PERSIST = P (names `_ps<P>`): P CTAs (grid y; the SMs of the GPU the schedule names) for the
  // NCB column blocks of WN warp tiles. CTA c walks column block c whole (every K worker, folded in
  // registers: the plain tile's arithmetic) and then, for c < REST x WORKERS, K worker c % WORKERS of
  // rest column block P + c / WORKERS (the blocks a grid of one CTA per block would run as a second,
  // mostly empty wave): those sums go to partial slot c % WORKERS, and the last of the block's WORKERS
  // warps holding the same outputs adds the slots in worker order (combine_workers: the fold's
  // additions, so the plan's bits) and runs the epilogue. A warpgroup then walks at most
  // G + G / WORKERS groups instead of 2 G; its rings run on across the two walks (ring positions
  // G .. G + LW - 1 are the rest item's groups).
  static constexpr int PS = CfgPersist<Cfg>::value;
  // WGC PAIR (names `_pr1`; W_SELF, not PS): the consumers take K groups in pairs -- the copies of both
  // landed, both decoded in one basic block (two independent LDS -> decode chains the scheduler can
  // interleave, where one group's chain left the warp waiting on its own latencies: session 26's
  // one-warpgroup CTA took as long per group as three), then their wgmmas as one batch, retired one pair
  // later. The same MMAs into the same accumulators in the same order: the plan's bits. Four A fragment
  // buffers; an activation ring of >= 8 slots (two groups in flight, two decoded, the next staging).
  static constexpr bool PAIR = CfgPair<Cfg>::value;
  static constexpr int NCB = (TILES + WN - 1) / WN, REST = PS > 0 ? NCB - PS : 0, LW = G / WORKERS;
  static_assert(!PAIR || (WGC && WSELF && !PS && XR >= 8 && ST >= 4), "PAIR: self-copying wgc tiles, not persist");
  static_assert(!PS || (WGC && WSELF && !ZS && Cfg::SPLIT_K == 1 && WORKERS >= 2 && G % WORKERS == 0 && REST > 0 &&
                        REST * WORKERS <= PS && LW >= ST),
                "PERSIST: self-copying wgc tiles of a one-split plan of >= 2 K workers, one rest item per CTA");
  // the consumers, the producer warps, and (WGC) the weight warps
  static constexpr int THREADS = 32 * WN + 32 * PW + 32 * WW;
  static_assert(!WGC || (WN % 4 == 0 && NT == 1 && (Cfg::ROWS == 16 || Cfg::ROWS == 32 || Cfg::ROWS == 64)),
                "WGC: whole warpgroups of warp_nt = 1 warps, wgmma N = rows in {16, 32, 64}");
  static_assert(WGC ? XR >= 2 : PW == 1 && XR == 0, "mma.sync producer tiles: one producer warp, one ring");
  // each activation warp owns slots pw, pw + PW, ... and waits on them in order (a slot two warps share
  // could be waited on two phases ahead, which a parity wait cannot tell from the phase before)
  static_assert(!WGC || XR % PW == 0, "the activation ring: a multiple of the activation warps");
  static_assert(WGC || !PF, "L2_AHEAD producer tiles: the WGC weight warp's prefetch");
  static_assert(!WGC || WSELF || (WW >= 1 && WN % WW == 0), "the weight warps split the warp tiles evenly");
  static_assert(!WSELF || ST >= 2, "W_SELF: a ring of >= 2 groups (ST - 1 in flight)");
  static_assert(Cfg::SERIAL && Cfg::X_SMEM && Base::WK_CTA == 1 && Base::SPLITS == 1,
                "a producer tile is a serial x_smem tile: one CTA walks every K worker");
  static_assert(T::HAS_X_SMEM && ST >= 2, "m16n8k16 x_smem fragments, a ring of >= 2 stages");
  static_assert(!NVFP4 || T::SCALE_WORDS * sizeof(Scale) == 64, "NVFP4 scales: 64 bytes per tile and group");

  // A group's weights W[WN][NT][32] 16-byte words | S[WN][NT][SCALE_WORDS] (NVFP4), its activations
  // X[XCHUNKS] chunks. The ring: ST stages of W | S | X; WGC: ST stages of W | S, then XR of X.
  static constexpr int XCHUNKS = Base::XCHUNKS;
  static constexpr int W_OFF = 0, S_OFF = W_OFF + WN * NT * 32 * 16;
  static constexpr int W_BYTES = S_OFF + (NVFP4 ? WN * NT * 64 : 0), X_BYTES = XCHUNKS * 16;
  static constexpr int STAGE = WGC ? W_BYTES : W_BYTES + X_BYTES;
  // Then the running sums (Base's fold layout: tot, and spl with split-K; none for a WGC tile without
  // split-K or with Z_SPLIT, whose consumers keep them in registers), then the mbarriers: full[ST],
  // empty[ST] (WGC: of the weight ring, then xfull[XR], xempty[XR]).
  static constexpr int SPL = ZS ? 0 : Base::SPL;
  static constexpr int FOLD_OFF = ST * STAGE + XR * X_BYTES, FOLD = WN * ACC * 32 * 4;
  static constexpr int BAR_OFF = FOLD_OFF + (WGC && !SPL ? 0 : 1 + SPL) * FOLD;
  static constexpr int SMEM = BAR_OFF + 16 * (ST + XR);
  static_assert(STAGE % 16 == 0 && FOLD % 16 == 0, "16-byte aligned stage and fold blocks");
  // The fold region viewed as Base::fold_worker's `smem.x` (tot, and spl only with split-K); sums(): the
  // plan's result once every worker is folded.
  struct FoldTot {
    float tot[WN][ACC][32];
    __device__ const float (&sums() const)[WN][ACC][32] { return tot; }
  };
  struct FoldSpl {
    float tot[WN][ACC][32];
    float spl[WN][ACC][32];
    __device__ const float (&sums() const)[WN][ACC][32] { return spl; }
  };
  struct FoldView {
    typename Select<SPL, FoldSpl, FoldTot>::type x;
  };
  // the running sums as Base::fold_worker addresses them (smem.x.tot / .spl [warp][element][lane])
  __device__ static FoldView& fold_view(char* smem) { return *reinterpret_cast<FoldView*>(smem + FOLD_OFF); }
  // the mbarriers of ring slot s (`sb`: the shared-window address of the dynamic shared memory)
  __device__ static unsigned full(unsigned sb, int s) { return sb + BAR_OFF + 8 * s; }
  __device__ static unsigned empty(unsigned sb, int s) { return sb + BAR_OFF + 8 * (ST + s); }
  __device__ static unsigned xfull(unsigned sb, int s) { return sb + BAR_OFF + 8 * (2 * ST + s); }
  __device__ static unsigned xempty(unsigned sb, int s) { return sb + BAR_OFF + 8 * (2 * ST + XR + s); }
  // the offset of a stage's activations: in the stage, or (WGC) slot s of the activation ring
  __device__ static int x_at(int s) { return WGC ? ST * STAGE + s * X_BYTES : s * STAGE + W_BYTES; }

  // The K groups this CTA walks, [a0, a0 + GN): all of them, or (ZS) split blockIdx.z's workers'. Ring
  // slots and phases count from a0.
  // (PS: ring positions: the whole block's G groups, then the rest item's LW.)
  __device__ static int split_begin() { return ZS ? blockIdx.z * Cfg::WARPS_K * G / WORKERS : 0; }
  __device__ static int split_end() {
    if constexpr (PS) return G + (has_rest() ? LW : 0);
    return ZS ? (blockIdx.z + 1) * Cfg::WARPS_K * G / WORKERS : G;
  }
  // PS: whether this CTA has a rest item; its column block among the rest (0 .. REST - 1) and K worker
  __device__ static bool has_rest() { return static_cast<int>(blockIdx.y) < REST * WORKERS; }
  __device__ static int rest_block() { return blockIdx.y / WORKERS; }
  __device__ static int rest_worker() { return blockIdx.y % WORKERS; }

  __device__ static void run(const __half* __restrict__ x, int M, const uint4* __restrict__ wq,
                             const void* __restrict__ wscale, const float* __restrict__ col_scale,
                             __half* __restrict__ out, float* __restrict__ partial, unsigned int* __restrict__ tickets,
                             char* smem) {
    // the warp index broadcast from lane 0: ptxas then knows it is warp-uniform, so the role branches
    // are uniform and each role's ring indices, slots and descriptors can live in uniform registers
    const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
    const int m0 = blockIdx.x * Cfg::ROWS;
    const unsigned sb = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    if (threadIdx.x == 0) {
      for (int s = 0; s < ST; ++s) {
        mbar_init(full(sb, s), WGC && WW > 0 ? 32 * WW : 32);  // weight warps' cp.async arrivals
        mbar_init(empty(sb, s), WGC ? 32 * WN : WN);  // WGC: every consumer lane
      }
      for (int s = 0; s < XR; ++s) {
        mbar_init(xfull(sb, s), 32);       // the group's activation warp, every lane
        mbar_init(xempty(sb, s), 32 * WN);  // every consumer lane
      }
      mbar_init_fence();
    }
    __syncthreads();
#ifdef DFLASHGEN_WGMMA
    if constexpr (WGC) {
      // The weights are never written on the GPU: their warp starts before the programmatic-launch
      // wait, under the previous kernel's tail.
      if constexpr (WSELF)  // the consumers' first ST - 1 groups, as early as the weight warps' would be
        if (warp < WN) self_weights_prologue(wq, wscale, smem, warp, lane);
      if (warp >= WN + PW) {  // weight warp ww: its tiles and stage offsets are compile-time
        static_for<WW>([&](auto ww_c) {
          if (warp - WN - PW == decltype(ww_c)::value) produce_weights<decltype(ww_c)::value>(wq, wscale, smem, sb, lane);
        });
        return;
      }
    }
#endif
    // Activations, outputs (and under programmatic dependent launch the previous kernel's writes):
    // only after the wait.
    pdl_wait();
    if (warp >= WN) {
      produce(x, M, m0, wq, wscale, smem, sb, warp - WN, lane);
      return;
    }
#ifdef DFLASHGEN_WGMMA
    if constexpr (WGC) {
      consume_wg(M, m0, wq, wscale, col_scale, out, partial, tickets, smem, sb, warp, lane);
    } else  // (consume is not instantiated for a WGC tile: its fold view may lack the split sums)
#endif
    {
      consume(M, m0, col_scale, out, smem, sb, warp, lane);
    }
  }

  // WGC weight warp ww (of WW): its 32 lanes copy each group's 16-byte weight words (and 4 lanes the
  // 64-byte scale blocks) of its WN / WW warp tiles with cp.async, `stages` groups ahead, completing on
  // `full` (which counts every weight warp's lanes). A tile's
  // groups are consecutive 512-byte (64-byte) blocks, so each tile's source is computed once and
  // advanced per group (session 16's first weight warp spent ~130 instructions per group on 64-bit
  // address math, and ncu had the consumers waiting on weights with the ring never full; 1-D bulk
  // copies instead were slower still). PF (names `_pf1`): every PF_GROUPS groups, lane t < WT also
  // prefetches its warp tile t's weights and scales of the PF_GROUPS groups after the ring's reach into L2
  // (one contiguous range each), so the ring's copies meet L2 rather than DRAM latency.
  template <int WWI>
  __device__ static void produce_weights(const uint4* __restrict__ wq, const void* __restrict__ wscale, char* smem,
                                         unsigned sb, int lane) {
    constexpr int WT = WN / WW, st0 = WWI * WT;  // warp tiles per weight warp; its first in the stage
    const int tile0 = blockIdx.y * WN + st0;     // and in the grid
    // per warp tile, this lane's weight word and (lanes < 4) scale chunk at group 0; tiles past N copy the
    // last tile's (in bounds, never stored)
    const char* w[WT];
    const char* sc[WT];
#pragma unroll
    for (int t = 0; t < WT; ++t) {
      const size_t tg = static_cast<size_t>(min(tile0 + t, TILES - 1)) * G;
      w[t] = reinterpret_cast<const char*>(wq + tg * 32) + 16 * lane;
      sc[t] = static_cast<const char*>(wscale) + tg * 64 + 16 * (lane & 3);
    }
    // PF: lane t < WT's warp tile, group 0 (its weights and scales are contiguous over the groups)
    const size_t pf_tg = static_cast<size_t>(min(tile0 + lane, TILES - 1)) * G;
    const char* pf_w = reinterpret_cast<const char*>(wq + pf_tg * 32);
    const char* pf_s = static_cast<const char*>(wscale) + pf_tg * 64;
    if constexpr (PF)  // the ring's first reach: groups [a0, a0 + ST) of every tile
      if (lane < WT) {
        const int a0 = split_begin(), n = min(ST, split_end() - a0);
        prefetch_l2(pf_w + a0 * 512, n * 512);
        if constexpr (NVFP4) prefetch_l2(pf_s + a0 * 64, n * 64);
      }
    const int a0 = split_begin(), a1 = split_end();
#pragma unroll 1
    for (int a = a0; a < a1; ++a) {
      const unsigned r = a - a0;  // ring position
      const int s = r % ST;
      if constexpr (PF)
        if (r % PF_GROUPS == 0 && lane < WT && a + ST < a1) {
          const int n = min(PF_GROUPS, a1 - a - ST);  // groups a + ST .. a + ST + n - 1 of tile `lane`
          prefetch_l2(pf_w + (a + ST) * 512, n * 512);
          if constexpr (NVFP4) prefetch_l2(pf_s + (a + ST) * 64, n * 64);
        }
      if (r >= ST) mbar_wait(empty(sb, s), (r / ST - 1) & 1);
      char* st = smem + s * STAGE;
#pragma unroll
      for (int t = 0; t < WT; ++t) {
        cp_async16(st + W_OFF + (st0 + t) * 512 + 16 * lane, w[t] + a * 512);
        if constexpr (NVFP4)
          if (lane < 4) cp_async16(st + S_OFF + (st0 + t) * 64 + 16 * lane, sc[t] + a * 64);
      }
      mbar_arrive_cp_async(full(sb, s));
    }
    cp_async_wait<0>();  // every copy landed before the warp leaves (its arrivals are tied to them)
  }

  // The mma.sync tiles' producer warp: stage after stage, K group a into slot a % ST once the consumers
  // released the slot's previous group (a - ST): its weight words, scales and the CTA's activation rows
  // (the x_smem layout), with cp.async. Warp tiles past N copy the last tile's words (in bounds, never
  // stored); activation rows at or past M are not copied (their B columns feed outputs never stored).
  __device__ static void produce(const __half* __restrict__ x, int M, int m0, const uint4* __restrict__ wq,
                                 const void* __restrict__ wscale, char* smem, unsigned sb, int pw, int lane) {
#ifdef DFLASHGEN_WGMMA
    if constexpr (WGC) {
      produce_wg(x, M, m0, smem, sb, pw, lane);
      return;
    }
#endif
    const char* wsc = static_cast<const char*>(wscale);
    const int tile0 = blockIdx.y * WN * NT;
    for (int a = 0; a < G; ++a) {
      const int s = a % ST;
      if (a >= ST) mbar_wait(empty(sb, s), (a / ST - 1) & 1);
      char* st = smem + s * STAGE;
#pragma unroll
      for (int w = 0; w < WN; ++w)
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          const int t = min(tile0 + w * NT + i, TILES - 1);
          const size_t tg = static_cast<size_t>(t) * G + a;
          cp_async16(st + W_OFF + ((w * NT + i) * 32 + lane) * 16, wq + tg * 32 + lane);
          if constexpr (NVFP4)
            if (lane < 4) cp_async16(st + S_OFF + (w * NT + i) * 64 + 16 * lane, wsc + tg * 64 + 16 * lane);
        }
      char* xs = smem + x_at(s);
#pragma unroll
      for (int c = lane; c < XCHUNKS; c += 32) {
        const int r = c / T::XCPR, cc = c % T::XCPR;
        const __half* src = x + static_cast<size_t>(m0 + r) * Cfg::K + static_cast<size_t>(a) * T::KG + 8 * cc;
        cp_async16_if(xs + 16 * (r * T::XCPR + (cc ^ T::xs_swizzle(r))), src, m0 + r < M);
      }
      mbar_arrive_cp_async(full(sb, s));
    }
    cp_async_wait<0>();  // every copy landed before the warp leaves (its arrivals are tied to them)
  }

  __device__ static void consume(int M, int m0, const float* __restrict__ col_scale, __half* __restrict__ out,
                                 char* smem, unsigned sb, int wn, int lane) {
    float acc[NT][NT8][T::NACC];
    Base::each_acc([&](int i, int j, int e) { acc[i][j][e] = 0.0f; });
    int xoff[T::KSUB];
    Base::xs_lane_offsets(xoff);
    int v = 0, vend = G / WORKERS;  // the worker whose range the walk is in, and where that range ends
#pragma unroll 1
    for (int a = 0; a < G; ++a) {
      const int s = a % ST;
      mbar_wait(full(sb, s), (a / ST) & 1);
      const char* st = smem + s * STAGE;
      typename T::Frag frag[NT];
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const uint4 wv = lds128(reinterpret_cast<const uint4*>(st + W_OFF) + (wn * NT + i) * 32 + lane);
        Scale sc = 0;
        if constexpr (NVFP4) sc = reinterpret_cast<const Scale*>(st + S_OFF + (wn * NT + i) * 64)[T::scale_index()];
        T::decode(wv, sc, frag[i]);
      }
      Base::mma_xs_stage(frag, reinterpret_cast<const uint4*>(smem + x_at(s)), xoff, acc);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty(sb, s));  // the MMAs consumed every read of the stage
      if (a + 1 == vend) {  // worker v's last group: fold its sums in the plan's order
        Base::fold_worker(acc, v, wn, lane, fold_view(smem));
        ++v;
        vend = (v + 1) * G / WORKERS;
      }
    }
    pdl_launch_dependents();
    const float(&sums)[WN][ACC][32] = fold_view(smem).x.sums();
    Base::each_acc([&](int i, int j, int e) { acc[i][j][e] = sums[wn][Base::acc_index(i, j, e)][lane]; });
    const int tile0 = (blockIdx.y * WN + wn) * NT;
    if (tile0 < TILES) Base::epilogue(acc, tile0, m0, M, col_scale, out);
  }

#ifdef DFLASHGEN_WGMMA
  using L = WgmmaBLayout<Cfg::ROWS>;
  template <int OFF>
  __device__ __forceinline__ static void sts32(unsigned addr, unsigned v) {
    asm volatile("st.shared.u32 [%0+%2], %1;" ::"r"(addr), "r"(v), "n"(OFF) : "memory");
  }
  // WGC activation warp pw takes whole K groups a = pw, pw + PW, ...: its lanes load the group's
  // activation chunks (batch row n = 8 nb + lane / 4, physical K 32p + 8t .. + 7, t = lane % 4) with
  // LDG.128 before waiting for the slot a % XR, store each chunk's four 4-byte words with STS.32 into
  // the wgmma B layout (WgmmaBLayout: word w to k-step 2p + (w >> 1), K half w & 1 -- the prepack's K
  // permutation; lane (n % 8, t) -> bank 4 (n % 8) + t: conflict-free), make them visible to the async
  // proxy, and arrive on `xfull` (count 32). Rows at or past M are neither loaded nor stored (their B
  // columns feed outputs never stored). Why not 4-byte cp.async straight into the layout: each such
  // warp copy touches 8 rows, 8 L1 wavefronts per 128 B, and saturated L1TEX (session 15 ncu: 84%, 2x
  // slower than this).
  __device__ static void produce_wg(const __half* __restrict__ x, int M, int m0, char* smem, unsigned sb, int pw,
                                    int lane) {
    static_assert(STAGE % 16 == 0 && X_BYTES % 16 == 0 && X_BYTES == T::KG / 16 * L::KSTEP, "ring layout");
    constexpr int NB = Cfg::ROWS / 8, KS = T::KSUB;
    const int t = lane & 3, r = lane >> 2;
    const int xrows = M - m0 - r;
    const __half* src0 = x + static_cast<size_t>(m0 + r) * Cfg::K + 8 * t;
    const int a0 = split_begin(), a1 = split_end();
    // PS: a rest position's K group minus its position (K worker rest_worker()'s groups from position G)
    const int roff = PS ? rest_worker() * LW - G : 0;
#pragma unroll 1
    for (int a = a0 + pw; a < a1; a += PW) {
      const unsigned q = a - a0;  // ring position
      const int s = q % XR;
      uint4 v[NB][KS];
      const __half* src = src0 + static_cast<size_t>(PS && a >= G ? a + roff : a) * T::KG;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int p = 0; p < KS; ++p) ld_act_if(v[nb][p], src + nb * 8 * Cfg::K + 32 * p, 8 * nb < xrows);
      if (q >= XR) mbar_wait(xempty(sb, s), (q / XR - 1) & 1);
      const unsigned xs = sb + x_at(s) + L::offset(0, r, 0, t);
      static_for<NB>([&](auto nb_c) {
        constexpr int nb = decltype(nb_c)::value;
        if (8 * nb < xrows) {
          static_for<KS>([&](auto p_c) {
            constexpr int p = decltype(p_c)::value, o = L::offset(2 * p, 8 * nb, 0, 0);
            sts32<o>(xs, v[nb][p].x);
            sts32<o + L::LBO>(xs, v[nb][p].y);
            sts32<o + L::KSTEP>(xs, v[nb][p].z);
            sts32<o + L::KSTEP + L::LBO>(xs, v[nb][p].w);
          });
        }
      });
      fence_proxy_async_smem();
      mbar_arrive(xfull(sb, s));
    }
  }

  // WGC consumer warp `wn` (warpgroup wn / 4; the CTA's 16-row weight tile wn). Worker by worker
  // (the plan's order), per group a of its range: its wgmmas (KG / 16 k-steps, ascending) on
  // frag[a % 2], commit; retire group a - 1 (wait_group 1) and release its activation slot; then wait
  // for group a + 1's weights, decode them into the other fragment buffer (releasing their slot: they
  // are in registers) and wait for its activations, while group a runs. At the range's end everything
  // retires and the worker's sums fold in the plan's order (Base::fold_worker's additions; without
  // split-K in registers, not through shared memory: 8 folds per CTA on the wk8 plans cost ~20% of
  // the main loop's instructions there, session 16 ncu), as in consume. Control
  // flow around the wgmmas is warp-uniform by construction (every lane arrives on the barriers; no
  // per-group branch on the fold), else ptxas serializes them (C7518).
  // W_SELF: this lane's weight word and (lanes < 4) scale chunk of consumer warp wn's tile at group 0
  // (a tile past N copies the last tile's: in bounds, never stored), and group a's copy into ring slot
  // `slot`; each lane reads back its own word, lanes 0-3's scale chunks after a __syncwarp
  // (column block `cb`: blockIdx.y, or a PERSIST tile's rest block PS + rest_block())
  __device__ static void self_src(const uint4* __restrict__ wq, const void* __restrict__ wscale, int cb, int wn,
                                  int lane, const char*& w, const char*& sc) {
    const size_t tg = static_cast<size_t>(min(cb * WN + wn, TILES - 1)) * G;
    w = reinterpret_cast<const char*>(wq + tg * 32) + 16 * lane;
    sc = static_cast<const char*>(wscale) + tg * 64 + 16 * (lane & 3);
  }
  // (predicated copies, not branches: a branch around them cost ~15 instructions per group of the
  // consumers' issue-bound loop, session 24)
  __device__ static void self_copy(char* smem, int slot, const char* w, const char* sc, int wn, int lane,
                                   bool pred) {
    char* st = smem + slot * STAGE;
    cp_async16_if(st + W_OFF + wn * 512 + 16 * lane, w, pred);
    if constexpr (NVFP4) cp_async16_if(st + S_OFF + wn * 64 + 16 * (lane & 3), sc, pred && lane < 4);
  }
  // the ring's first ST - 1 groups, one committed cp.async group each (empty past the range), so that
  // before decoding ring position r exactly ST - 2 newer groups may still be in flight
  __device__ static void self_weights_prologue(const uint4* __restrict__ wq, const void* __restrict__ wscale,
                                               char* smem, int wn, int lane) {
    const char *w, *sc;
    self_src(wq, wscale, blockIdx.y, wn, lane, w, sc);
    const int a0 = split_begin(), a1 = split_end();
#pragma unroll 1
    for (int r = 0; r < ST - 1; ++r) {
      const size_t a = a0 + r;
      self_copy(smem, r, w + a * 512, sc + a * 64, wn, lane, a0 + r < a1);
      cp_async_commit();
    }
  }

  __device__ static void consume_wg(int M, int m0, const uint4* __restrict__ wq, const void* __restrict__ wscale,
                                    const float* __restrict__ col_scale, __half* __restrict__ out,
                                    float* __restrict__ partial, unsigned int* __restrict__ tickets, char* smem,
                                    unsigned sb, int wn, int lane) {
    constexpr int KSTEPS = T::KG / 16;
    float acc[1][NT8][T::NACC], tot[1][NT8][T::NACC];  // tot: the running sums without split-K
    Base::each_acc([&](int i, int j, int e) { acc[i][j][e] = tot[i][j][e] = 0.0f; });
    // A slot's descriptors differ from slot 0's in the start address field (bits 0-13, 16-byte units)
    // alone, which no offset inside shared memory carries out of: only the low word is computed.
    const uint64_t desc0 = L::desc_base() + (((sb + x_at(0)) >> 4) & 0x3FFF);
    const uint32_t desc0_lo = static_cast<uint32_t>(desc0);
    const uint64_t desc0_hi = desc0 & ~uint64_t{0xFFFFFFFFu};
    typename T::Frag frag[PAIR ? 4 : 2];
    // (ring slots and phases from unsigned group positions in the CTA's range: a shift and a mask where
    // the depth is a power of 2)
    // W_SELF: this lane's sources of ring position ST - 1; load(a) copies position a + ST - 1
    // (PS: positions from G on come from the rest item's tile, K group rest_worker() x LW at position G:
    // the sources + dw / ds, warp-uniform offsets, so no per-thread registers across the walks)
    const char *wnext = nullptr, *snext = nullptr;
    long long dw = 0, ds = 0;
    if constexpr (WSELF) {
      self_src(wq, wscale, blockIdx.y, wn, lane, wnext, snext);
      const size_t a = split_begin() + ST - 1;
      wnext += a * 512;
      snext += a * 64;
    }
    if constexpr (PS) {
      const long long tiles = min((PS + rest_block()) * WN + wn, TILES - 1) - min(static_cast<int>(blockIdx.y) * WN + wn, TILES - 1);
      const long long groups = tiles * G + rest_worker() * LW - G;
      dw = groups * 512;
      ds = groups * 64;
    }
    (void)wq;
    (void)wscale;
    // (src_c, PS only: where the refill's position a + ST - 1 lies -- 0: column block blockIdx.y's
    // groups, 1: the rest item's, 2: either, chosen per position (the few groups before G); a select
    // per group in the whole walk cost ~14 SASS per two groups of the issue-bound loop)
    auto load = [&](auto src_c, const unsigned a, typename T::Frag& f) {
      constexpr int src = decltype(src_c)::value;
      const unsigned s = a % ST;
      if constexpr (WSELF) {
        cp_async_wait<ST - 2>();  // this lane's copies of ring position a have landed ...
        __syncwarp();             // ... and lanes 0-3's scale chunks; every lane is past position a - 1
      } else {
        mbar_wait(full(sb, s), (a / ST) & 1);
      }
      const char* st = smem + s * STAGE;
      const uint4 wv = lds128(reinterpret_cast<const uint4*>(st + W_OFF) + wn * 32 + lane);
      Scale sc = 0;
      if constexpr (NVFP4) sc = reinterpret_cast<const Scale*>(st + S_OFF + wn * 64)[T::scale_index()];
      T::decode(wv, sc, f);
      if constexpr (WSELF) {  // refill the slot of position a - 1 with position a + ST - 1
        const bool rest = src == 1 || (src == 2 && static_cast<int>(a) + ST - 1 >= G);
        self_copy(smem, (a + ST - 1) % ST, at_wide<512>(rest ? wnext + dw : wnext, a),
                  at_wide<64>(rest ? snext + ds : snext, a), wn, lane,
                  static_cast<int>(a) + ST - 1 < (src == 0 ? G : split_end()) - split_begin());
        cp_async_commit();
      } else {
        mbar_arrive(empty(sb, s));  // after the decode that consumed the loads: the weight slot is free
      }
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int q = 0; q < 4; ++q) cute::warpgroup_fence_operand(f.a[ks][q]);
      // the slot's STS writes reach the async proxy through their writers' fence.proxy.async before
      // the xfull arrival (produce_wg), acquired here: no fence on this side (it cost a MEMBAR.ALL.CTA
      // per group, session 17)
      mbar_wait(xfull(sb, a % XR), (a / XR) & 1);
    };
    auto fence_acc = [&]() {
#pragma unroll
      for (int j = 0; j < NT8; ++j)
#pragma unroll
        for (int e = 0; e < T::NACC; ++e) cute::warpgroup_fence_operand(acc[0][j][e]);
    };
    // group a's MMAs on frag[CUR]; then group a - 1 is retired (LAST: everything is) and its stage
    // released (each group's stage is released one step later, by every consumer lane)
    auto step = [&](auto cur_c, auto last_c, auto src_c, const unsigned a) {
      constexpr int cur = decltype(cur_c)::value;
      constexpr bool last = decltype(last_c)::value;
      const uint32_t lo = desc0_lo + (a % XR) * (X_BYTES >> 4);
      fence_acc();
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
        wgmma_rs<Cfg::ROWS>(frag[cur].a[ks], desc0_hi | (lo + ks * (L::KSTEP >> 4)), acc[0]);
      cute::warpgroup_commit_batch();
      if constexpr (last) cute::warpgroup_wait<0>();
      else cute::warpgroup_wait<1>();
      fence_acc();
      if (a > 0) mbar_arrive(xempty(sb, (a - 1) % XR));
      if constexpr (!last) load(src_c, a + 1, frag[cur ^ 1]);
    };
    // ring positions [gb, ge) (>= 2 groups, schedule) into acc, everything retired at the end
    // (src_c: the refills' source as in load; 2: refills from the own block's groups while the pair's
    // both are below G, then chosen per position)
    auto walk = [&](auto src_c, const int gb, const int ge) {
      constexpr int src = decltype(src_c)::value, first = src == 1 ? 1 : 0;
      load(IntC<first>{}, gb, frag[0]);  // (PS: gb + ST - 1 < G unless in the rest item: LW >= ST)
      int a = gb;
      if constexpr (src == 2) {
#pragma unroll 1
        for (; a + 2 < ge && a + ST + 1 < G; a += 2) {
          step(IntC<0>{}, IntC<false>{}, IntC<0>{}, a);
          step(IntC<1>{}, IntC<false>{}, IntC<0>{}, a + 1);
        }
      }
#pragma unroll 1
      for (; a + 2 < ge; a += 2) {
        step(IntC<0>{}, IntC<false>{}, src_c, a);
        step(IntC<1>{}, IntC<false>{}, src_c, a + 1);
      }
      if (a + 1 < ge) {
        step(IntC<0>{}, IntC<false>{}, src_c, a);
        step(IntC<1>{}, IntC<true>{}, src_c, a + 1);
      } else {
        step(IntC<0>{}, IntC<true>{}, src_c, a);
      }
    };
    // PAIR: positions [a, a + 1) both landed (copies and activations), decoded into f0 / f1 in one
    // basic block; refills positions a + ST - 1 and a + ST (one commit group each, as two loads would)
    auto load2 = [&](const unsigned a, typename T::Frag& f0, typename T::Frag& f1) {
      cp_async_wait<ST - 3>();  // this lane's copies of positions a and a + 1 have landed ...
      __syncwarp();             // ... and lanes 0-3's scale chunks
      const char* st0 = smem + (a % ST) * STAGE;
      const char* st1 = smem + ((a + 1) % ST) * STAGE;
      const uint4 w0 = lds128(reinterpret_cast<const uint4*>(st0 + W_OFF) + wn * 32 + lane);
      const uint4 w1 = lds128(reinterpret_cast<const uint4*>(st1 + W_OFF) + wn * 32 + lane);
      Scale s0 = 0, s1 = 0;
      if constexpr (NVFP4) {
        s0 = reinterpret_cast<const Scale*>(st0 + S_OFF + wn * 64)[T::scale_index()];
        s1 = reinterpret_cast<const Scale*>(st1 + S_OFF + wn * 64)[T::scale_index()];
      }
      T::decode(w0, s0, f0);
      T::decode(w1, s1, f1);
      const int range = split_end() - split_begin();
#pragma unroll
      for (unsigned i = 0; i < 2; ++i) {  // slots of positions a - 1 and a (read above) <- a + ST - 1 + i
        self_copy(smem, (a + ST - 1 + i) % ST, at_wide<512>(wnext, a + i), at_wide<64>(snext, a + i), wn, lane,
                  static_cast<int>(a + i) + ST - 1 < range);
        cp_async_commit();
      }
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          cute::warpgroup_fence_operand(f0.a[ks][q]);
          cute::warpgroup_fence_operand(f1.a[ks][q]);
        }
      mbar_wait(xfull(sb, a % XR), (a / XR) & 1);
      mbar_wait(xfull(sb, (a + 1) % XR), ((a + 1) / XR) & 1);
    };
    unsigned released = 0;  // PAIR: activation slots of positions below this are released
    auto release_to = [&](const unsigned end) {
#pragma unroll 1
      for (; released < end; ++released) mbar_arrive(xempty(sb, released % XR));
    };
    // PAIR: the wgmmas of the n (1 or 2) groups from position a on frag[f], frag[f + 1] as one batch; then
    // the previous batch retired (LAST: everything) and its activation slots released
    auto issue = [&](auto f_c, auto n_c, auto last_c, const unsigned a) {
      constexpr int f = decltype(f_c)::value, n = decltype(n_c)::value;
      fence_acc();
      cute::warpgroup_arrive();
#pragma unroll
      for (int i = 0; i < n; ++i) {
        const uint32_t lo = desc0_lo + ((a + i) % XR) * (X_BYTES >> 4);
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
          wgmma_rs<Cfg::ROWS>(frag[f + i].a[ks], desc0_hi | (lo + ks * (L::KSTEP >> 4)), acc[0]);
      }
      cute::warpgroup_commit_batch();
      if constexpr (decltype(last_c)::value) cute::warpgroup_wait<0>();
      else cute::warpgroup_wait<1>();
      fence_acc();
      release_to(a);
    };
    // PAIR: positions [gb, ge) (>= 2): pairs on fragment buffers {0, 1} and {2, 3} in turn, the next pair
    // decoded while this one's wgmmas run; the tail (2-5 groups) spelled out
    auto walk_pair = [&](const int gb, const int ge) {
      unsigned a = gb;
      load2(a, frag[0], frag[1]);
#pragma unroll 1
      for (; static_cast<int>(a) + 6 <= ge; a += 4) {
        issue(IntC<0>{}, IntC<2>{}, IntC<false>{}, a);
        load2(a + 2, frag[2], frag[3]);
        issue(IntC<2>{}, IntC<2>{}, IntC<false>{}, a + 2);
        load2(a + 4, frag[0], frag[1]);
      }
      const int rest = ge - static_cast<int>(a);  // 2 .. 5, positions a and a + 1 decoded in frag[0], frag[1]
      if (rest == 2) {
        issue(IntC<0>{}, IntC<2>{}, IntC<true>{}, a);
        return;
      }
      issue(IntC<0>{}, IntC<2>{}, IntC<false>{}, a);
      if (rest == 3) {
        load(IntC<0>{}, a + 2, frag[2]);
        issue(IntC<2>{}, IntC<1>{}, IntC<true>{}, a + 2);
        return;
      }
      load2(a + 2, frag[2], frag[3]);
      if (rest == 4) {
        issue(IntC<2>{}, IntC<2>{}, IntC<true>{}, a + 2);
        return;
      }
      issue(IntC<2>{}, IntC<2>{}, IntC<false>{}, a + 2);
      load(IntC<0>{}, a + 4, frag[0]);
      issue(IntC<0>{}, IntC<1>{}, IntC<true>{}, a + 4);
    };
    // the workers this CTA walks (ZS: split blockIdx.z's), their ranges as ring positions from a0
    const int vb = ZS ? blockIdx.z * Cfg::WARPS_K : 0, ve = ZS ? vb + Cfg::WARPS_K : WORKERS, a0 = split_begin();
#pragma unroll 1
    for (int v = vb; v < ve; ++v) {
      if constexpr (PAIR) walk_pair(v * G / WORKERS - a0, (v + 1) * G / WORKERS - a0);
      else walk(IntC<PS ? 2 : 0>{}, v * G / WORKERS - a0, (v + 1) * G / WORKERS - a0);
      if constexpr (SPL) {
        Base::fold_worker(acc, v, wn, lane, fold_view(smem));
      } else {
        Base::each_acc([&](int i, int j, int e) {  // fold_worker's additions (worker v = w, one split)
          tot[i][j][e] = v == vb ? acc[i][j][e] : tot[i][j][e] + acc[i][j][e];
          acc[i][j][e] = 0.0f;
        });
      }
    }
    if constexpr (PS) {  // column block blockIdx.y is done (its tiles are all below TILES); the rest item
      if (has_rest()) {
        Base::epilogue(tot, blockIdx.y * WN + wn, m0, M, col_scale, out);
        walk(IntC<1>{}, G, G + LW);
        pdl_launch_dependents();
        const int tile = (PS + rest_block()) * WN + wn;
        if (tile >= TILES) return;  // (in every worker's CTA alike: no ticket is left waiting)
        Base::store_partials(acc, tile, m0, M, partial, rest_worker());
        if (!Base::template split_k_last<WORKERS>(tickets, rest_block(), wn, lane)) return;
        // opaque copies: keep the per-element addresses out of the slot loop (as Base's split-K combine)
        int t0 = tile, r0 = m0;
        asm volatile("" : "+r"(t0), "+r"(r0));
        Base::combine_workers(acc, t0, r0, M, partial);
        Base::epilogue(acc, t0, r0, M, col_scale, out);
        return;
      }
    }
    pdl_launch_dependents();
    if constexpr (SPL) {
      const float(&sums)[WN][ACC][32] = fold_view(smem).x.sums();
      Base::each_acc([&](int i, int j, int e) { tot[i][j][e] = sums[wn][Base::acc_index(i, j, e)][lane]; });
    }
    const int tile0 = blockIdx.y * WN + wn;
    if (tile0 >= TILES) return;  // (ZS: in every CTA along z alike, so no ticket is left waiting)
    if constexpr (ZS) {  // the split's sums meet the others' through the partials (Base's split-K combine)
      Base::store_partials(tot, tile0, m0, M, partial, blockIdx.z);
      if (!Base::template split_k_last<Cfg::SPLIT_K>(tickets, blockIdx.y, wn, lane)) return;
      Base::sum_partials(tot, tile0, m0, M, partial);
    }
    Base::epilogue(tot, tile0, m0, M, col_scale, out);
  }
#endif  // DFLASHGEN_WGMMA
};

}  // namespace dflashgen
