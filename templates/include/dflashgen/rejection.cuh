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
// Two kernels, no sorting:
//   describe (grid D+1 x B): per position, the kept set as one 64-bit key threshold. A token's key is
//     (order-preserving bits of its scaled logit, V-1-id), so keys are unique and ordered exactly like
//     the reference's stable sort. top-k = radix select of the k-th key (8-bit digits, counts);
//     top-p = radix select of the first key whose inclusive weight reaches top_p * (top-k weight);
//     histogram atomics are aggregated per warp (hist_add).
//     Outputs max logit, threshold, total weight z, argmax, weight of the draft token.
//   decide (grid B): accepted length from the per-position tests, then one block-wide inverse-CDF
//     scan over the residual at that position (integer partial sums per contiguous id range).
#pragma once

namespace dflashgen {
namespace rejection {

constexpr int THREADS = 512;  // 128 registers per thread: no spills on sm_70..sm_90
constexpr int BINS = 256;
typedef unsigned long long u64;

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

// The reference's float32 ops: x = logit / t (t = 1 for greedy rows), w = floor(expf(x - max) * 2^32).
__device__ __forceinline__ float scaled(const float* row, int id, float div) { return row[id] / div; }
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

// describe: one block per (position, request).
template <int ID_BITS, int PAD, int DIGITS>
__device__ __forceinline__ void describe(const float* __restrict__ logits, const long long* __restrict__ drafts,
                                         const float* __restrict__ temperature, const int* __restrict__ top_k,
                                         const float* __restrict__ top_p, int vocab, int num_drafts,
                                         Desc* __restrict__ out) {
  __shared__ u64 hist[BINS];
  __shared__ u64 state[2];
  __shared__ u64 red[32];
  const int pos = blockIdx.x, b = blockIdx.y;
  const float* row = logits + ((long long)b * (num_drafts + 1) + pos) * vocab;
  const float t = temperature[b];
  const bool greedy = t == 0.0f;
  const float div = greedy ? 1.0f : t;

  u64 kmax = 0;
  for (int id = threadIdx.x; id < vocab; id += THREADS) {
    const u64 key = make_key<ID_BITS, PAD>(scaled(row, id, div), id, vocab);
    kmax = key > kmax ? key : kmax;
  }
  kmax = block_reduce(kmax, MaxU64(), 0ull, red);
  const int argmax = vocab - 1 - (int)((kmax >> PAD) & ((1ull << ID_BITS) - 1));
  const float vmax = scaled(row, argmax, div);

  u64 cut = kmax, z = 1;
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

// decide: one block per request.
template <int ID_BITS, int PAD>
__device__ __forceinline__ void decide(const float* __restrict__ logits, const long long* __restrict__ drafts,
                                       const float* __restrict__ draft_probs, const float* __restrict__ temperature,
                                       const float* __restrict__ u_accept, const float* __restrict__ u_sample,
                                       const unsigned char* __restrict__ accept_override, int vocab, int num_drafts,
                                       const Desc* __restrict__ desc, long long* __restrict__ accepted_out,
                                       long long* __restrict__ tokens_out) {
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
    const int chunk = (vocab + THREADS - 1) / THREADS;
    const int lo = min(threadIdx.x * chunk, vocab), hi = min(lo + chunk, vocab);
    bool residual = n < D;  // recovery: the residual, unless it has no weight (then p itself)
    u64 part = 0, total = 0;
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
    for (int pass = 0; pass < 2; ++pass) {
      part = 0;
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
      for (int id = lo; id < hi; ++id) part += residual_weight<ID_BITS, PAD>(row, id, vocab, div, cut, vmax, zn, residual, q, excluded);
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
  if (threadIdx.x == 0) {
    accepted_out[b] = n;
    long long* tk = tokens_out + (long long)b * (D + 1);
#pragma unroll 1  // unrolled, ptxas spills (sm_70..sm_90)
    for (int i = 0; i <= D; ++i) tk[i] = i < n ? xs[i] : (i == n ? token : -1);
  }
}

}  // namespace rejection
}  // namespace dflashgen
