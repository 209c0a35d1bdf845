// dflashgen compact rejection sampling for uniform decode batches (B requests x D drafts + 1).
//
// Reproduces runtime/sampling.py::verify (the dense torch reference) bit for bit from the same
// uniforms. Both work on integer weights w = floor(expf(x - max) * 2^32) of the kept set (x = logit /
// temperature, float32): sums and prefix sums of integers are exact in any order, and every
// comparison with a uniform is the same float64 expression, so only expf itself must agree.
//   kept set: top-k then top-p in the order (scaled logit desc, token id asc); greedy = weight 1 at
//     the argmax (lowest id among ties);
//   accept draft x iff u * z < w(x) (no draft probs) or w(x) > 0 && (u * q(x)) * z <= w(x);
//   at the first rejection sample w without x (or max(w - floor(q * z), 0)), else a bonus from w at D;
//   categoricals: the first id whose cumulative weight exceeds floor(u * total) (ids ascending).
//
// A token's key is (order-preserving bits of its scaled logit, V-1-id): keys are unique and ordered
// exactly like the reference's stable sort, and the scaled logit is recovered exactly from the key.
//
// Candidate path (rows with 0 < top_k <= CAP, and greedy rows as top_k = 1; K = that top_k), three
// kernels, no sorting of the vocabulary:
//   prefilter (grid chunks x (D+1) x B, CHUNK tokens per CTA): each chunk's K largest keys (radix
//     select of the chunk's K-th key, early exit once a bin holds exactly the rest; for K <= 32 only
//     over the keys above a bound from the warps' lane maxima) into K slots of cand (0 = empty).
//     A key in the row's top-K has fewer than K larger keys in its chunk, so the union of the
//     chunks' top-K holds the row's top-K, hence the kept set.
//   describe (grid D+1 x B): over the K x chunks candidates only: max, radix select of the k-th key,
//     the (<= CAP) top-k keys sorted descending by rank counting, top-p by one warp prefix scan. The
//     cut it stores is always an exact key (the k-th or the last top-p key, never a radix prefix), so
//     comparing any token with it (the draft's weight) is the reference's kept test.
//   decide (grid B): accepted length, then the kept keys of the emitting position (<= CAP) sorted by
//     id ascending, their residual weights and one warp inverse-CDF scan.
// Full path (top_k = 0 or > CAP; chosen per row on the device from top_k / temperature, the prefilter
//   CTAs of such rows return at once): describe radix-selects over the whole vocabulary (histogram
//   atomics aggregated per warp, hist_add) and decide scans the vocabulary block-wide.
// Either path evaluates the same weight() of the same floats and sums integers, so both give the
// reference's decisions; the candidate path only changes which tokens are looked at.
#pragma once

namespace dflashgen {
namespace rejection {

constexpr int THREADS = 512;  // 128 registers per thread: no spills on sm_70..sm_90
constexpr int BINS = 256;
constexpr int CAP = 128;           // largest top_k served by the candidate path
constexpr int CHUNK = 4096;        // tokens per prefilter CTA
constexpr int PF_THREADS = 256;    // prefilter CTA: CHUNK / PF_THREADS logits per thread, in registers
constexpr int PF_PER = CHUNK / PF_THREADS;
static_assert(PF_THREADS == BINS && CHUNK % PF_THREADS == 0 && CAP % 32 == 0 && CAP <= THREADS && CAP < CHUNK,
              "prefilter clears one bin per thread; warp scans hold CAP / 32 entries per lane");
constexpr unsigned FULL = 0xffffffffu;
typedef unsigned long long u64;

__host__ __device__ constexpr int num_chunks(int vocab) { return (vocab + CHUNK - 1) / CHUNK; }

// Candidates per chunk for a row: greedy rows need only the maximum; 0 = the row takes the full path.
__device__ __forceinline__ int cand_k(float temperature, int top_k) {
  return temperature == 0.0f ? 1 : (top_k > 0 && top_k <= CAP ? top_k : 0);
}

struct Desc {     // one (request, position)
  u64 cut;        // kept <=> key >= cut
  u64 z;          // total weight of the kept set
  u64 w_draft;    // weight of this position's draft token (0 at the bonus position)
  float vmax;     // max scaled logit (always kept)
  int argmax;     // lowest id among the maximal logits
};

__device__ __forceinline__ unsigned int ordered_bits(float v) {
  const unsigned int b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <int ID_BITS, int PAD>
__device__ __forceinline__ u64 make_key(float v, int id, int vocab) {
  return ((((u64)ordered_bits(v)) << ID_BITS) | (u64)(vocab - 1 - id)) << PAD;
}

template <int ID_BITS, int PAD>
__device__ __forceinline__ int key_id(u64 key, int vocab) {
  return vocab - 1 - (int)((key >> PAD) & ((1ull << ID_BITS) - 1));
}

// The scaled logit a key was made from (ordered_bits inverted: exact).
template <int ID_BITS, int PAD>
__device__ __forceinline__ float key_value(u64 key) {
  const unsigned int o = (unsigned int)(key >> (ID_BITS + PAD));
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// The reference's float32 ops: x = logit / t (t = 1 for greedy rows), w = floor(expf(x - max) * 2^32).
// x / 1 is exactly x in IEEE division (nvcc / NVRTC default -prec-div=true): temperature 1 and greedy
// rows skip the division's slow path with identical results.
__device__ __forceinline__ float scaled(const float* row, int id, float div) {
  return div == 1.0f ? row[id] : row[id] / div;
}
__device__ __forceinline__ u64 weight(float v, float vmax) { return (u64)(expf(v - vmax) * 4294967296.0f); }

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? scratch[lane] : identity;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  const T r = scratch[0];
  __syncthreads();
  return r;
}

struct MaxU64 { __device__ u64 operator()(u64 a, u64 b) const { return a > b ? a : b; } };
struct SumU64 { __device__ u64 operator()(u64 a, u64 b) const { return a + b; } };

// hist[bin] += val for every participating lane, aggregated per warp: the few most common bins of a
// warp step go in with one atomic each (the top key digit puts nearly every token in 2-4 bins, which
// per-lane atomics would serialise); lanes left over hold spread-out bins and add directly.
// Warp-uniform: every lane of the warp must call it.
__device__ __forceinline__ void hist_add(u64* hist, bool part, int bin, u64 val) {
  const int lane = threadIdx.x & 31;
  unsigned todo = __ballot_sync(0xffffffffu, part);
  for (int it = 0; it < 4 && todo != 0u; ++it) {
    const int leader = __ffs(todo) - 1;
    const int lb = __shfl_sync(0xffffffffu, bin, leader);
    const bool mine = part && bin == lb;
    u64 v = mine ? val : 0ull;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == leader) atomicAdd(&hist[lb], v);
    todo &= ~__ballot_sync(0xffffffffu, mine);
  }
  if ((todo >> lane) & 1u) atomicAdd(&hist[bin], val);
}

// Radix select over the keys >= lo: by count (the key of 0-based descending rank `rank`) or by
// weight (the first key, descending, whose inclusive cumulative weight reaches `target`).
template <int ID_BITS, int PAD, int DIGITS, bool BY_WEIGHT>
__device__ __forceinline__ u64 radix_select(const float* row, int vocab, float div, float vmax, u64 lo, u64 rank,
                                            double target, u64* hist, u64* shared_state) {
  u64 prefix = 0, mask = 0, above = 0;
#pragma unroll 1  // unrolled, ptxas spills the 64-bit prefix state
  for (int d = DIGITS - 1; d >= 0; --d) {
    const int shift = 8 * d;
    for (int i = threadIdx.x; i < BINS; i += THREADS) hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < vocab; base += THREADS) {  // uniform trip count: hist_add is warp-wide
      const int id = base + threadIdx.x;
      bool part = false;
      int bin = 0;
      u64 val = 1;
      if (id < vocab) {
        const float v = scaled(row, id, div);
        const u64 key = make_key<ID_BITS, PAD>(v, id, vocab);
        part = key >= lo && (key & mask) == prefix;
        bin = (int)((key >> shift) & (BINS - 1));
        if (BY_WEIGHT && part) val = weight(v, vmax);
      }
      hist_add(hist, part, bin, val);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int bin = 0;
      for (int b = BINS - 1; b >= 0; --b) {
        const u64 h = hist[b];
        if (BY_WEIGHT ? ((double)(above + h) >= target) : (above + h > rank)) { bin = b; break; }
        above += h;
      }
      shared_state[0] = (u64)bin;
      shared_state[1] = above;
    }
    __syncthreads();
    prefix |= shared_state[0] << shift;
    above = shared_state[1];
    mask |= (u64)(BINS - 1) << shift;
    __syncthreads();
  }
  return prefix;
}

template <int ID_BITS, int PAD>
__device__ __forceinline__ u64 kept_weight(const float* row, int vocab, float div, float vmax, u64 cut, u64* scratch) {
  u64 s = 0;
  for (int id = threadIdx.x; id < vocab; id += THREADS) {
    const float v = scaled(row, id, div);
    if (make_key<ID_BITS, PAD>(v, id, vocab) >= cut) s += weight(v, vmax);
  }
  return block_reduce(s, SumU64(), 0ull, scratch);  // integers: exact in any order
}

// ------------------------------------------------------------------------------ candidate path

// hist[bin] += 1 for every participating lane, one atomic per common bin of the warp step (as hist_add).
// Warp-uniform: every lane of the warp must call it.
__device__ __forceinline__ void hist_count(unsigned int* hist, bool part, int bin) {
  const int lane = threadIdx.x & 31;
  unsigned todo = __ballot_sync(FULL, part);
#pragma unroll 1
  for (int it = 0; it < 4 && todo != 0u; ++it) {
    const int leader = __ffs(todo) - 1;
    const int lb = __shfl_sync(FULL, bin, leader);
    const unsigned m = __ballot_sync(FULL, part && bin == lb);
    if (lane == leader) atomicAdd(&hist[lb], (unsigned)__popc(m));
    todo &= ~m;
  }
  if ((todo >> lane) & 1u) atomicAdd(&hist[bin], 1u);
}

// Warp 0: the first bin, descending, where `above` + the counts so far exceed `rank`;
// state = {bin, count above it, count in it}. Each lane owns 8 consecutive bins, one warp scan.
__device__ __forceinline__ void find_rank_bin(const unsigned int* hist, unsigned int above, unsigned int rank,
                                              unsigned int* state) {
  const int lane = threadIdx.x & 31;
  unsigned int own[8], s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) { own[j] = hist[BINS - 1 - 8 * lane - j]; s += own[j]; }
  unsigned int incl = s;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned int t = __shfl_up_sync(FULL, incl, o);
    if (lane >= o) incl += t;
  }
  const unsigned hit = __ballot_sync(FULL, above + incl > rank);
  if (hit == 0u) {  // rank beyond the count: cannot happen (callers pass rank < count)
    if (lane == 0) { state[0] = 0; state[1] = above; state[2] = 0; }
    return;
  }
  if (lane == __ffs(hit) - 1) {
    unsigned int run = above + incl - s;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (run + own[j] > rank) { state[0] = BINS - 1 - 8 * lane - j; state[1] = run; state[2] = own[j]; break; }
      run += own[j];
    }
  }
}

// After find_rank_bin: fold the chosen digit into (prefix, mask, above); true when the keys >= prefix
// (lower digits 0) are exactly rank + 1, i.e. prefix is already the threshold. Block-uniform.
__device__ __forceinline__ bool fold_digit(const unsigned int* state, int shift, unsigned int rank, u64& prefix,
                                           u64& mask, unsigned int& above) {
  prefix |= (u64)state[0] << shift;
  mask |= (u64)(BINS - 1) << shift;
  above = state[1];
  return above + state[2] == rank + 1;
}

struct Reaches {  // inclusive prefix weight >= target (top-p: the last kept key)
  double target;
  __device__ bool operator()(u64 s) const { return (double)s >= target; }
};
struct Exceeds {  // inclusive prefix weight > thr (inverse CDF)
  u64 thr;
  __device__ bool operator()(u64 s) const { return s > thr; }
};

// Warp-wide (call from one whole warp): over w[0..n), n <= CAP, the first index whose inclusive
// prefix sum satisfies the monotone `hit`, and that sum in `sum`; n and the total when none does.
template <typename Hit>
__device__ __forceinline__ int warp_first_prefix(const u64* w, int n, Hit hit, u64& sum) {
  constexpr int PER = CAP / 32;
  const int lane = threadIdx.x & 31;
  u64 own[PER], s = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = lane * PER + j;
    own[j] = i < n ? w[i] : 0ull;
    s += own[j];
  }
  u64 incl = s;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 t = __shfl_up_sync(FULL, incl, o);
    if (lane >= o) incl += t;
  }
  const unsigned lanes = __ballot_sync(FULL, hit(incl));
  if (lanes == 0u) { sum = __shfl_sync(FULL, incl, 31); return n; }
  const int l = __ffs(lanes) - 1;
  u64 run = incl - s;
  int idx = 0;
  if (lane == l) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      run += own[j];
      if (hit(run)) { idx = lane * PER + j; break; }  // padding adds 0: the hit is a real entry
    }
  }
  sum = __shfl_sync(FULL, run, l);
  return __shfl_sync(FULL, idx, l);
}

// prefilter: one PF_THREADS block per (chunk, position, request); writes the chunk's K largest keys
// to cand[row][j][chunk], j < K (0 where the chunk has fewer than K tokens).
template <int ID_BITS, int PAD, int DIGITS>
__device__ __forceinline__ void prefilter(const float* __restrict__ logits, const float* __restrict__ temperature,
                                          const int* __restrict__ top_k, int vocab, int num_drafts,
                                          u64* __restrict__ cand) {
  __shared__ unsigned int hist[BINS];
  __shared__ unsigned int state[3];
  __shared__ unsigned int count;
  __shared__ u64 bound[PF_THREADS / 32];
  const int c = blockIdx.x, pos = blockIdx.y, b = blockIdx.z, chunks = gridDim.x;
  const float t = temperature[b];
  const int K = cand_k(t, top_k[b]);
  if (K == 0) return;  // full path row
  const float div = t == 0.0f ? 1.0f : t;
  const long long rowi = (long long)b * (num_drafts + 1) + pos;
  const float* row = logits + rowi * vocab;
  u64* out = cand + rowi * CAP * chunks + c;
  const int base = c * CHUNK;
  u64 keys[PF_PER];  // 0 past the vocabulary (real keys are never 0)
#pragma unroll
  for (int i = 0; i < PF_PER; ++i) {
    const int id = base + i * PF_THREADS + threadIdx.x;
    keys[i] = id < vocab ? make_key<ID_BITS, PAD>(scaled(row, id, div), id, vocab) : 0ull;
  }
  u64 cut = 1, low = 1;  // every real key (keys are never 0)
  if (vocab - base > K) {
    if (K <= 32) {
      // A lower bound for the chunk's K-th key: in each warp the K-th largest of the lanes' maxima
      // (K distinct keys are >= it), the largest over the warps. The keys below it (nearly all) cannot
      // be in the chunk's top K and skip the radix passes' atomics.
      const int lane = threadIdx.x & 31;
      u64 mx = 0;
#pragma unroll
      for (int i = 0; i < PF_PER; ++i) mx = max(mx, keys[i]);
      int r = 0;  // descending rank among the warp's maxima (ties only between empty lanes' zeros)
#pragma unroll 1
      for (int l = 0; l < 32; ++l) r += __shfl_sync(FULL, mx, l) > mx;
      const unsigned who = __ballot_sync(FULL, r == K - 1);
      const u64 wb = who != 0u ? __shfl_sync(FULL, mx, __ffs(who) - 1) : 0ull;
      if (lane == 0) bound[threadIdx.x >> 5] = wb;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < PF_THREADS / 32; ++w) low = max(low, bound[w]);
    }
    const unsigned int rank = (unsigned int)(K - 1);
    u64 prefix = 0, mask = 0;
    unsigned int above = 0;
#pragma unroll 1
    for (int d = DIGITS - 1; d >= 0; --d) {
      const int shift = 8 * d;
      hist[threadIdx.x] = 0;  // PF_THREADS == BINS
      __syncthreads();
#pragma unroll
      for (int i = 0; i < PF_PER; ++i) {
        const u64 key = keys[i];
        hist_count(hist, key >= low && (key & mask) == prefix, (int)((key >> shift) & (BINS - 1)));
      }
      __syncthreads();
      if (threadIdx.x < 32) find_rank_bin(hist, above, rank, state);
      __syncthreads();
      const bool done = fold_digit(state, shift, rank, prefix, mask, above);
      __syncthreads();  // state and hist are rewritten by the next digit
      if (done) break;
    }
    cut = prefix;
  }
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < PF_PER; ++i) {
    const u64 key = keys[i];
    if (key >= cut && key >= low) out[(long long)atomicAdd(&count, 1u) * chunks] = key;  // exactly min(K, n)
  }
  __syncthreads();
  for (int j = (int)count + threadIdx.x; j < K; j += PF_THREADS) out[(long long)j * chunks] = 0;
}

// describe's top-k over the candidates: the key of descending rank `rank` (count radix select).
template <int DIGITS>
__device__ __forceinline__ u64 select_candidates(const u64* __restrict__ cb, int n, unsigned int rank,
                                                 unsigned int* hist, unsigned int* state) {
  u64 prefix = 0, mask = 0;
  unsigned int above = 0;
#pragma unroll 1
  for (int d = DIGITS - 1; d >= 0; --d) {
    const int shift = 8 * d;
    for (int i = threadIdx.x; i < BINS; i += THREADS) hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += THREADS) {  // uniform trip count: hist_count is warp-wide
      const int i = base + threadIdx.x;
      const u64 key = i < n ? cb[i] : 0ull;
      hist_count(hist, key != 0ull && (key & mask) == prefix, (int)((key >> shift) & (BINS - 1)));
    }
    __syncthreads();
    if (threadIdx.x < 32) find_rank_bin(hist, above, rank, state);
    __syncthreads();
    const bool done = fold_digit(state, shift, rank, prefix, mask, above);
    __syncthreads();
    if (done) break;
  }
  return prefix;
}

// The candidates >= cut (at most CAP: the kept set lies in the top-k set) into list; returns how many.
__device__ __forceinline__ int gather_kept(const u64* __restrict__ cb, int n, u64 cut, u64* list,
                                           unsigned int* count) {
  if (threadIdx.x == 0) *count = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += THREADS) {
    const u64 key = cb[i];
    if (key != 0ull && key >= cut) {
      const unsigned int slot = atomicAdd(count, 1u);
      if (slot < CAP) list[slot] = key;
    }
  }
  __syncthreads();
  const int m = min((int)*count, CAP);
  __syncthreads();
  return m;
}

// describe on the candidates of one row (block-uniform): fills cut, z, vmax, argmax.
template <int ID_BITS, int PAD, int DIGITS>
__device__ __forceinline__ void describe_candidates(const u64* __restrict__ cb, int n, bool greedy, int k, float p,
                                                    int vocab, u64& cut, u64& z, float& vmax, int& argmax) {
  __shared__ unsigned int hist[BINS];
  __shared__ unsigned int state[3];
  __shared__ unsigned int count;
  __shared__ u64 list[CAP], keys[CAP], ws[CAP], red[32], out[2];
  u64 kmax = 0;
  for (int i = threadIdx.x; i < n; i += THREADS) kmax = max(kmax, cb[i]);
  kmax = block_reduce(kmax, MaxU64(), 0ull, red);
  argmax = key_id<ID_BITS, PAD>(kmax, vocab);
  vmax = key_value<ID_BITS, PAD>(kmax);
  cut = kmax;
  z = 1;
  if (greedy) return;
  // k >= vocab: top-k is off and every token is a candidate (K = k >= any chunk's size).
  cut = k < vocab ? select_candidates<DIGITS>(cb, n, (unsigned int)(k - 1), hist, state) : 1ull;
  const int m = gather_kept(cb, n, cut, list, &count);
  if (threadIdx.x < m) {  // descending rank among unique keys: a permutation
    const u64 key = list[threadIdx.x];
    int r = 0;
    for (int j = 0; j < m; ++j) r += list[j] > key;
    keys[r] = key;
    ws[r] = weight(key_value<ID_BITS, PAD>(key), vmax);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    u64 total;
    warp_first_prefix(ws, m, Exceeds{~0ull}, total);
    // The exact k-th key, not select_candidates' early-exit prefix: a token outside the candidates
    // can lie between the two, and w_draft compares every token with cut.
    u64 zz = total, cc = keys[m - 1];
    if (p < 1.0f) {  // the last kept key: the first whose inclusive weight reaches p * (top-k weight)
      const int i = warp_first_prefix(ws, m, Reaches{(double)p * (double)total}, zz);
      if (i < m) cc = keys[i];
    }
    if (threadIdx.x == 0) { out[0] = cc; out[1] = zz; }
  }
  __syncthreads();
  cut = out[0];
  z = out[1];
}

// describe: one block per (position, request).
template <int ID_BITS, int PAD, int DIGITS>
__device__ __forceinline__ void describe(const float* __restrict__ logits, const long long* __restrict__ drafts,
                                         const float* __restrict__ temperature, const int* __restrict__ top_k,
                                         const float* __restrict__ top_p, int vocab, int num_drafts,
                                         const u64* __restrict__ cand, Desc* __restrict__ out) {
  __shared__ u64 hist[BINS];
  __shared__ u64 state[2];
  __shared__ u64 red[32];
  const int pos = blockIdx.x, b = blockIdx.y;
  const long long rowi = (long long)b * (num_drafts + 1) + pos;
  const float* row = logits + rowi * vocab;
  const float t = temperature[b];
  const bool greedy = t == 0.0f;
  const float div = greedy ? 1.0f : t;
  const int K = cand_k(t, top_k[b]);

  u64 cut, z;
  float vmax;
  int argmax;
  if (K > 0) {  // block-uniform
    const int chunks = num_chunks(vocab);
    describe_candidates<ID_BITS, PAD, DIGITS>(cand + rowi * CAP * chunks, K * chunks, greedy, top_k[b], top_p[b],
                                              vocab, cut, z, vmax, argmax);
  } else {
    u64 kmax = 0;
    for (int id = threadIdx.x; id < vocab; id += THREADS) {
      const u64 key = make_key<ID_BITS, PAD>(scaled(row, id, div), id, vocab);
      kmax = key > kmax ? key : kmax;
    }
    kmax = block_reduce(kmax, MaxU64(), 0ull, red);
    argmax = key_id<ID_BITS, PAD>(kmax, vocab);
    vmax = scaled(row, argmax, div);

    cut = kmax;
    z = 1;
    if (!greedy) {
      cut = 0;
      const int k = top_k[b];
      if (k > 0 && k < vocab)
        cut = radix_select<ID_BITS, PAD, DIGITS, false>(row, vocab, div, vmax, 0, (u64)(k - 1), 0.0, hist, state);
      const float p = top_p[b];
      if (p < 1.0f) {
        const double target = (double)p * (double)kept_weight<ID_BITS, PAD>(row, vocab, div, vmax, cut, red);
        cut = radix_select<ID_BITS, PAD, DIGITS, true>(row, vocab, div, vmax, cut, 0, target, hist, state);
      }
      z = kept_weight<ID_BITS, PAD>(row, vocab, div, vmax, cut, red);
    }
  }
  if (threadIdx.x == 0) {
    u64 wd = 0;
    if (pos < num_drafts) {
      const long long x = drafts[(long long)b * num_drafts + pos];
      if (x >= 0 && x < vocab) {  // an out-of-range draft has weight 0 (and is never the argmax)
        const float v = scaled(row, (int)x, div);
        if (make_key<ID_BITS, PAD>(v, (int)x, vocab) >= cut) wd = greedy ? 1ull : weight(v, vmax);
      }
    }
    Desc d;
    d.cut = cut; d.z = z; d.w_draft = wd; d.vmax = vmax; d.argmax = argmax;
    out[(long long)b * (num_drafts + 1) + pos] = d;
  }
}

// Residual weight of token `id` at the emitting position (see the header comment).
template <int ID_BITS, int PAD>
__device__ __forceinline__ u64 residual_weight(const float* row, int id, int vocab, float div, u64 cut, float vmax,
                                               u64 z, bool residual, const float* q, int excluded) {
  const float v = scaled(row, id, div);
  u64 w = make_key<ID_BITS, PAD>(v, id, vocab) >= cut ? weight(v, vmax) : 0ull;
  if (residual) {
    if (q != nullptr) {
      const long long r = (long long)w - (long long)floor((double)q[id] * (double)z);
      w = r > 0 ? (u64)r : 0ull;
    } else if (id == excluded) {
      w = 0;
    }
  }
  return w;
}

// decide's recovered / bonus token on the candidates (block-uniform): the kept keys (<= CAP) of the
// emitting position sorted by id ascending, their residual weights, one warp inverse-CDF scan.
template <int ID_BITS, int PAD>
__device__ __forceinline__ int decide_candidates(const float* row, const u64* __restrict__ cb, int nc, int vocab,
                                                 float div, u64 cut, float vmax, u64 z, bool residual, const float* q,
                                                 int excluded, float u) {
  __shared__ unsigned int count;
  __shared__ u64 list[CAP], w_res[CAP], w_p[CAP];
  __shared__ int ids[CAP];
  __shared__ int pick;
  const int m = gather_kept(cb, nc, cut, list, &count);
  if (threadIdx.x < m) {  // ascending id rank among unique ids: a permutation
    const int id = key_id<ID_BITS, PAD>(list[threadIdx.x], vocab);
    int r = 0;
    for (int j = 0; j < m; ++j) r += key_id<ID_BITS, PAD>(list[j], vocab) < id;
    ids[r] = id;
    const u64 wp = residual_weight<ID_BITS, PAD>(row, id, vocab, div, cut, vmax, z, false, q, excluded);
    w_p[r] = wp;
    w_res[r] = residual ? residual_weight<ID_BITS, PAD>(row, id, vocab, div, cut, vmax, z, true, q, excluded) : wp;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    u64 total, at;
    const u64* w = w_res;
    warp_first_prefix(w, m, Exceeds{~0ull}, total);
    if (total == 0ull) {  // the residual has no weight: sample p itself
      w = w_p;
      warp_first_prefix(w, m, Exceeds{~0ull}, total);
    }
    const u64 thr = (u64)floor((double)u * (double)total);
    const int i = warp_first_prefix(w, m, Exceeds{thr}, at);  // thr < total: i < m
    if (threadIdx.x == 0) pick = ids[min(i, m - 1)];
  }
  __syncthreads();
  return pick;
}

// decide: one block per request.
template <int ID_BITS, int PAD>
__device__ __forceinline__ void decide(const float* __restrict__ logits, const long long* __restrict__ drafts,
                                       const float* __restrict__ draft_probs, const float* __restrict__ temperature,
                                       const int* __restrict__ top_k, const float* __restrict__ u_accept,
                                       const float* __restrict__ u_sample,
                                       const unsigned char* __restrict__ accept_override, int vocab, int num_drafts,
                                       const u64* __restrict__ cand, const Desc* __restrict__ desc,
                                       long long* __restrict__ accepted_out, long long* __restrict__ tokens_out) {
  __shared__ u64 red[32];
  __shared__ u64 scan[THREADS];
  __shared__ unsigned int pick;
  const int b = blockIdx.x, D = num_drafts;
  const float t = temperature[b];
  const bool greedy = t == 0.0f;
  const float div = greedy ? 1.0f : t;
  const Desc* dd = desc + (long long)b * (D + 1);
  const long long* xs = drafts + (long long)b * D;

  int n = 0;  // leading run of accepted drafts (every thread computes it: D is small)
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
  for (; n < D; ++n) {
    const long long x = xs[n];
    const double u = (double)u_accept[(long long)b * D + n], z = (double)dd[n].z, w = (double)dd[n].w_draft;
    bool ok;
    if (greedy) {
      ok = x == dd[n].argmax;
    } else if (accept_override != nullptr) {
      ok = accept_override[(long long)b * D + n] != 0;
    } else if (draft_probs == nullptr) {
      ok = u * z < w;
    } else {  // w_draft is 0 for an out-of-range draft, so q is read only in range
      ok = dd[n].w_draft > 0 && u * (double)draft_probs[((long long)b * D + n) * vocab + x] * z <= w;
    }
    if (!ok) break;
  }
  const u64 cut = dd[n].cut, zn = dd[n].z;  // fields, not a struct copy: keeps them in registers
  const float vmax = dd[n].vmax;
  int token = dd[n].argmax;
  if (!greedy) {
    const float* row = logits + ((long long)b * (D + 1) + n) * vocab;
    const float* q = (draft_probs != nullptr && n < D) ? draft_probs + ((long long)b * D + n) * vocab : nullptr;
    const int excluded = (n < D && q == nullptr) ? (int)xs[n] : -1;
    const int K = cand_k(t, top_k[b]);
    if (K > 0) {  // block-uniform
      const int chunks = num_chunks(vocab);
      token = decide_candidates<ID_BITS, PAD>(row, cand + ((long long)b * (D + 1) + n) * CAP * chunks, K * chunks,
                                              vocab, div, cut, vmax, zn, n < D, q, excluded,
                                              u_sample[(long long)b * (D + 1) + n]);
    } else {
      const int chunk = (vocab + THREADS - 1) / THREADS;
      const int lo = min(threadIdx.x * chunk, vocab), hi = min(lo + chunk, vocab);
      bool residual = n < D;  // recovery: the residual, unless it has no weight (then p itself)
      u64 part = 0, total = 0;
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
      for (int pass = 0; pass < 2; ++pass) {
        part = 0;
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
        for (int id = lo; id < hi; ++id)
          part += residual_weight<ID_BITS, PAD>(row, id, vocab, div, cut, vmax, zn, residual, q, excluded);
        total = block_reduce(part, SumU64(), 0ull, red);
        if (!residual || total > 0) break;
        residual = false;
      }
      // Exclusive scan of the per-thread sums in thread (= id) order; integers, so exact.
      scan[threadIdx.x] = part;
      __syncthreads();
      if (threadIdx.x == 0) {
        u64 run = 0;
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
        for (int i = 0; i < THREADS; ++i) { const u64 p = scan[i]; scan[i] = run; run += p; }
        pick = 0xffffffffu;
      }
      __syncthreads();
      const u64 thr = (u64)floor((double)u_sample[(long long)b * (D + 1) + n] * (double)total);
      const u64 before = scan[threadIdx.x];
      if (before <= thr && thr < before + part) {  // the owner of the crossing scans its range
        u64 run = before;
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
        for (int id = lo; id < hi; ++id) {
          run += residual_weight<ID_BITS, PAD>(row, id, vocab, div, cut, vmax, zn, residual, q, excluded);
          if (run > thr) { pick = (unsigned int)id; break; }
        }
      }
      __syncthreads();
      token = (int)pick;  // thr < total (u < 1, total >= 2^32): exactly one owner picked
    }
  }
  if (threadIdx.x == 0) {
    accepted_out[b] = n;
    long long* tk = tokens_out + (long long)b * (D + 1);
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
    for (int i = 0; i <= D; ++i) tk[i] = i < n ? xs[i] : (i == n ? token : -1);
  }
}

}  // namespace rejection
}  // namespace dflashgen
