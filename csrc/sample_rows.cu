// Sampling of one token per row from logits, with temperature, top-k, top-p and min_p, in one
// kernel (see sampling.h for the arguments and the semantics).
//
// Launch: one CTA of 512 threads per row; the CTA streams its row from global memory once per
// pass, with 16-byte loads, four per thread in flight. Passes of a row, by what it asks:
//   greedy:                        argmax, in torch.argmax's order (argmax_order.cuh) (1 pass)
//   temperature only:              draw (1)
//   top-k up to kGatherTopK:       max/min (1), gather (1); then top-k, top-p, min_p and the draw
//                                  among the gathered candidates, in shared memory
//   other truncations:             max/min (1), top-k select (up to 3), top-p select (up to 3),
//                                  draw (1); a select whose target lies among at most kCandidates
//                                  elements gathers them (1) and ends as the gathering rows do
// Gathering: the k-th largest of the threads' maxima (the max/min pass finds them) is at most the
// row's k-th largest logit, as k elements of the row reach it; the elements at or above it (and
// above the min_p floor) hold every token the truncations can keep, about k of them in rows of
// independent logits. Up to kCandidates are copied to shared memory and ranked by key, and the
// thresholds and the race are found among them: the same as the select way finds over the row
// (the same tokens). More candidates, and the row goes the select way.
// A select finds the threshold element by refining a histogram over the elements'
// order-preserving 32-bit keys: 2048 bins of equal key width over the range still in question,
// the bin where the running count (top-k) or probability mass (top-p) crosses its target, then
// 2048 bins over that bin, until a bin is one key wide (at most three passes).
// Masses are whole numbers, floor(exp(x - x_max) * 2^s) with s = 52 - bit_length(vocab), summed
// exactly in 64-bit integers: the threshold does not depend on the order of the additions.
// The draw is an exponential race: among the kept tokens, the one with the largest
// x - log(E), E ~ Exp(1) drawn from Philox-4x32-10 keyed by the row's key and counted by the
// token id. That picks token i with probability exp(x_i) / sum over kept exp(x), needs no prefix
// sum, and makes a row's token a function of its logits, parameters and key alone. A token
// too far below the best score the row's threads have computed so far (shared in the CTA) to win
// whatever its draw is skipped, random numbers included: with peaked logits almost all are; of
// the rest, a token whose random number is too large to win skips its score's two logarithms:
// with flat logits almost all do (race_skip_from). Rows that ask for logprobs then get two or more passes over
// their raw logits: log-sum-exp and rank, then a select and collection of the top n.
// prepare_overrides copies the rows with biases, penalties or masked tokens to float32 and modifies
// them (16 CTAs per row), for sample_rows to read instead.
#include <climits>

#include "argmax_order.cuh"
#include "sampling.h"

namespace nanograph {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kLoadsInFlight = 4;
constexpr int kBins = 2048;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kTopCapacity = kMaxTopLogprobs + 256;  // room for ties at the n-th logit
// Top-k rows up to this k gather their candidates (at most kCandidates; see the file comment).
constexpr int kGatherTopK = 256;
constexpr int kCandidates = 1024;
constexpr int kCandidatesPerThread = kCandidates / kThreads;
static_assert(kGatherTopK <= kThreads && kCandidates % kThreads == 0 && kThreads <= kBins,
              "the candidates' bound is a rank among the threads' maxima, kept in count");

// Order-preserving map of floats to unsigned keys (-inf lowest, +inf highest). -0 and +0 are one
// logit, +0's key: a row's maximum, its min_p floor or a threshold may be either.
__device__ __forceinline__ uint32_t ordered_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? 0x80000000u - (u & 0x7fffffffu) : (u | 0x80000000u);
}

// The logit of a key (+0 for zero).
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key ^ 0x80000000u) : 0x80000000u | (0x80000000u - key));
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

// Calls f(first_index, x[4], count) for the row's elements in aligned groups of four (count < 4
// only at the end of the row), each thread taking every kThreads-th group, in increasing order.
template <typename T, typename F>
__device__ __forceinline__ void for_each_quad(const T* row, int vocab, F&& f) {
  constexpr int kPerVec = 16 / sizeof(T);
  if (reinterpret_cast<uintptr_t>(row) % 16 == 0 && vocab % kPerVec == 0) {
    const uint4* vecs = reinterpret_cast<const uint4*>(row);
    const int num_vecs = vocab / kPerVec;
    auto emit = [&](const uint4& raw, int first) {
      const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int q = 0; q < kPerVec / 4; ++q) {
        const float quad[4] = {to_float(x[4 * q]), to_float(x[4 * q + 1]), to_float(x[4 * q + 2]),
                               to_float(x[4 * q + 3])};
        f(first + 4 * q, quad, 4);
      }
    };
    int v = threadIdx.x;
    for (; v + (kLoadsInFlight - 1) * kThreads < num_vecs; v += kLoadsInFlight * kThreads) {
      uint4 raw[kLoadsInFlight];
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) raw[i] = __ldg(vecs + v + i * kThreads);
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) emit(raw[i], (v + i * kThreads) * kPerVec);
    }
    for (; v < num_vecs; v += kThreads) emit(__ldg(vecs + v), v * kPerVec);
  } else {
    for (int first = 4 * threadIdx.x; first < vocab; first += 4 * kThreads) {
      const int count = min(4, vocab - first);
      float quad[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) quad[e] = e < count ? to_float(row[first + e]) : -INFINITY;
      f(first, quad, count);
    }
  }
}

// Philox-4x32 with 10 rounds (Salmon et al., SC'11): four 32-bit random words per counter.
__device__ __forceinline__ uint4 philox(uint64_t key, uint32_t counter) {
  uint32_t c0 = counter, c1 = 0, c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

// logit - temperature * log(E) for E ~ Exp(1) from 32 random bits: E = -log(1 - v), v uniform
// in (0, 1], computed as -log1p(-v) so that the small E that win races keep their precision.
__device__ __forceinline__ float uniform_of(uint32_t bits) {
  return fmaf(static_cast<float>(bits), 0x1p-32f, 0x1p-33f);
}

__device__ __forceinline__ float race_score(float logit, float temperature, uint32_t bits) {
  return logit - temperature * logf(-log1pf(-uniform_of(bits)));
}

// A (value, index) candidate.
struct Best {
  float value;
  int index;
};

// The sampled rows' passes: larger values win, ties go to the lower index, and a NaN never wins
// (those rows treat NaN logits as absent). Among numbers, this is the order of keep_first.
__device__ __forceinline__ void keep_better(Best& best, float value, int index) {
  if (value > best.value || (value == best.value && index < best.index)) best = {value, index};
}

// torch.argmax's order (argmax_order.cuh): the greedy rows' choice and block_best's merge.
__device__ __forceinline__ void keep_first(Best& best, float value, int index) {
  if (argmax_precedes(value, index, best.value, best.index)) best = {value, index};
}

struct Shared {
  uint32_t count[kBins];
  unsigned long long mass[kBins];
  uint32_t warp_count[kWarps];
  unsigned long long warp_mass[kWarps];
  Best warp_best[kWarps];
  float warp_min[kWarps];
  Best top[kTopCapacity];  // the top logprobs' candidates
  int num_top;
  Best candidates[kCandidates];  // a gathering top-k row's, in no order
  Best ranked[kCandidates];      // the same by descending key, ties lowest index first
  int num_candidates;
  uint32_t gather_from;
  unsigned long long total_mass;
  int pick;  // the bin where a select's target is reached, and the count and mass above it
  uint32_t pick_count;
  unsigned long long pick_mass;
  uint32_t race_bound;  // ordered_key of the best race score any thread of the row has computed
};

// The first of the threads' candidates by keep_first; every thread returns it.
__device__ Best block_best(Best best, Shared& sh) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float value = __shfl_xor_sync(0xffffffffu, best.value, offset);
    const int index = __shfl_xor_sync(0xffffffffu, best.index, offset);
    keep_first(best, value, index);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // the scratch may still be read by a previous reduction
  if (lane == 0) sh.warp_best[warp] = best;
  __syncthreads();
  best = sh.warp_best[0];
  for (int w = 1; w < kWarps; ++w) keep_first(best, sh.warp_best[w].value, sh.warp_best[w].index);
  return best;
}

__device__ float block_min(float x, Shared& sh) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh.warp_min[threadIdx.x / 32] = x;
  __syncthreads();
  x = sh.warp_min[0];
  for (int w = 1; w < kWarps; ++w) x = fminf(x, sh.warp_min[w]);
  return x;
}

// Exclusive prefix sums over the threads (in thread order) of a count and a mass.
__device__ void block_exclusive_scan(uint32_t& count, unsigned long long& mass, Shared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t c = count;
  unsigned long long m = mass;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const uint32_t c_up = __shfl_up_sync(0xffffffffu, c, offset);
    const unsigned long long m_up = __shfl_up_sync(0xffffffffu, m, offset);
    if (lane >= offset) c += c_up, m += m_up;
  }
  __syncthreads();
  if (lane == 31) sh.warp_count[warp] = c, sh.warp_mass[warp] = m;
  __syncthreads();
  uint32_t c_before = 0;
  unsigned long long m_before = 0;
  for (int w = 0; w < warp; ++w) c_before += sh.warp_count[w], m_before += sh.warp_mass[w];
  count = c_before + c - count;
  mass = m_before + m - mass;
}

// A row being sampled. Its logits are compared as they are (dividing by a temperature > 0 keeps
// their order); the temperature enters the weights and the race.
template <typename T>
struct Row {
  const T* logits;
  int vocab;
  float temperature;
  float max_logit = 0.f;
  float weight_exponent = 0.f;  // log2(e) / temperature
  float weight_scale = 0.f;     // 2^s: weights are floor(exp((logit - max) / temperature) * 2^s)

  template <typename F>
  __device__ __forceinline__ void for_each(F&& f) const { for_each_quad(logits, vocab, f); }

  __device__ __forceinline__ unsigned long long weight(float logit) const {
    return __float2ull_rz(exp2f((logit - max_logit) * weight_exponent) * weight_scale);
  }
};

// The result of a select: the threshold key, and the domain's elements strictly above it.
struct Selected {
  bool found;
  uint32_t key;
  uint32_t count_above;
  unsigned long long mass_above;
  // With narrow_to: the search stopped where at most narrow_to elements, those with keys in
  // [key, hi], hold the rest of it; total_mass is the mass its target was taken of.
  bool narrowed;
  unsigned long long total_mass;
};

// Finds, among the elements whose keys lie in [lo, hi], the first in descending order at which
// the running count reaches `target_count` (mass_target <= 0) or the running mass reaches
// mass_target * (the domain's mass, or `total_mass` when nonzero). Not found: the domain holds
// less than the target. The masses above are summed only when by mass or `with_mass`. With
// narrow_to > 0, stops (narrowed) once the bin where the target is reached and the bins above it
// hold at most narrow_to elements.
template <typename T>
__device__ Selected select(const Row<T>& row, uint32_t lo, uint32_t hi, uint32_t target_count,
                          double mass_target, unsigned long long total_mass, bool with_mass,
                          Shared& sh, int narrow_to = 0) {
  const bool by_mass = mass_target > 0;
  with_mass = with_mass || by_mass;
  double target = by_mass ? 0.0 : static_cast<double>(target_count);
  Selected result = {false, 0u, 0u, 0ull, false, total_mass};
  for (bool first_level = true;; first_level = false) {
    const uint32_t range = hi - lo;
    int shift = 0;
    while ((range >> shift) >= kBins) ++shift;
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.count[b] = 0, sh.mass[b] = 0;
    __syncthreads();
    row.for_each([&](int first, const float (&x)[4], int count) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t key = ordered_key(x[e]);
        if (e < count && key >= lo && key <= hi) {
          const uint32_t bin = (hi - key) >> shift;
          atomicAdd(&sh.count[bin], 1u);
          if (with_mass) {
            const unsigned long long w = row.weight(x[e]);
            if (w) atomicAdd(&sh.mass[bin], w);
          }
        }
      }
    });
    __syncthreads();
    // Each thread owns kBinsPerThread consecutive bins, scanned from the highest keys down.
    uint32_t count = 0;
    unsigned long long mass = 0;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      count += sh.count[threadIdx.x * kBinsPerThread + j];
      mass += sh.mass[threadIdx.x * kBinsPerThread + j];
    }
    uint32_t count_before = count;
    unsigned long long mass_before = mass;
    block_exclusive_scan(count_before, mass_before, sh);
    if (first_level && by_mass) {
      unsigned long long total = total_mass;
      if (total == 0) {  // the domain's mass: the last thread's exclusive sum plus its own
        if (threadIdx.x == kThreads - 1) sh.total_mass = mass_before + mass;
        __syncthreads();
        total = sh.total_mass;
      }
      result.total_mass = total;
      target = mass_target * static_cast<double>(total);
    }
    if (threadIdx.x == 0) sh.pick = -1;
    __syncthreads();
    uint32_t c = result.count_above + count_before;
    unsigned long long m = result.mass_above + mass_before;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      const int bin = threadIdx.x * kBinsPerThread + j;
      const uint32_t c_next = c + sh.count[bin];
      const unsigned long long m_next = m + sh.mass[bin];
      const bool reached = by_mass ? static_cast<double>(m_next) >= target
                                   : static_cast<double>(c_next) >= target;
      const bool reached_before = by_mass ? static_cast<double>(m) >= target
                                          : static_cast<double>(c) >= target;
      if (reached && !reached_before) {
        sh.pick = bin;
        sh.pick_count = c;
        sh.pick_mass = m;
      }
      c = c_next;
      m = m_next;
    }
    __syncthreads();
    const int pick = sh.pick;
    if (pick < 0) return result;
    result.count_above = sh.pick_count;
    result.mass_above = sh.pick_mass;
    const uint32_t through_pick = sh.pick_count + sh.count[pick];
    __syncthreads();  // before the scratch is reused
    const uint32_t new_hi = hi - (static_cast<uint32_t>(pick) << shift);
    const int64_t bin_lo = static_cast<int64_t>(new_hi) - (int64_t{1} << shift) + 1;
    lo = static_cast<uint32_t>(max(static_cast<int64_t>(lo), bin_lo));
    hi = new_hi;
    if (narrow_to > 0 && shift > 0 && through_pick <= static_cast<uint32_t>(narrow_to)) {
      result.narrowed = true;
      result.key = lo;
      return result;
    }
    if (shift == 0) {
      result.found = true;
      result.key = hi;
      return result;
    }
  }
}

// -log(E) for E ~ Exp(1) never exceeds this: v >= 2^-33 in race_score gives E >= 2^-33.
constexpr float kMaxRaceBoost = 23.f;

// 1 / temperature for race_skip_from, or 0 where it could overflow (then nothing is skipped).
__device__ __forceinline__ float race_inverse_temperature(float temperature) {
  return temperature >= 0x1p-64f ? 1.f / temperature : 0.f;
}

// The uniform v (as race_score makes it) from which a token of logit x or below cannot reach a
// race score `bound` that some token of the row has reached: E = -log1p(-v) >= v, so
// v >= 2 exp(-(bound - x) / T) bounds its exact score by bound - T log 2. The float evaluation
// here (the product by 1 / T, __expf) moves that margin by a few parts in a million of T, and
// race_score's float32 rounding moves the score by a few ulps of |x| + 23 T; with
// 0.25 T > 1e-6 (|bound| + |x|) both are far below T log 2, so the computed score stays strictly
// below bound: the token can neither win nor tie, whatever the index of the token that reached
// bound. Returns 2 (nothing skipped) for bound = -inf, x >= bound, T below 2^-64 (inv_t = 0),
// and where bound - x might overflow or T is tiny against the logits.
__device__ __forceinline__ float race_skip_from(float bound, float x, float temperature,
                                                float inv_t) {
  if (!(0.25f * temperature > 1e-6f * (fabsf(bound) + fabsf(x))) || inv_t == 0.f) return 2.f;
  const float d = (bound - x) * inv_t;
  return d > 0.f ? 2.f * __expf(-d) : 2.f;
}

// The key at rank k - 1 (descending, ties by thread) among the threads' keys `mine`: at most the
// key of the row's k-th largest element when each thread's key is that of one of its elements.
// Kept in count (no select runs meanwhile).
__device__ uint32_t kth_thread_key(uint32_t mine, int k, Shared& sh) {
  __syncthreads();  // count may still be read by a select
  sh.count[threadIdx.x] = mine;
  __syncthreads();
  int rank = 0;
#pragma unroll 16
  for (int j = 0; j < kThreads; ++j) {
    const uint32_t other = sh.count[j];
    rank += other > mine || (other == mine && j < static_cast<int>(threadIdx.x));
  }
  if (rank == k - 1) sh.gather_from = mine;
  __syncthreads();
  return sh.gather_from;
}

// Copies the row's elements with keys in [from, hi] to sh.ranked, by descending key (ties lowest
// index first), and returns how many there are; -1 (nothing copied) if more than kCandidates.
template <typename T>
__device__ int gather_candidates(const Row<T>& row, uint32_t from, uint32_t hi, Shared& sh) {
  if (threadIdx.x == 0) sh.num_candidates = 0;
  __syncthreads();
  row.for_each([&](int first, const float (&x)[4], int count) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t key = ordered_key(x[e]);
      if (e < count && key >= from && key <= hi) {
        const int slot = atomicAdd(&sh.num_candidates, 1);
        if (slot < kCandidates) sh.candidates[slot] = {x[e], first + e};
      }
    }
  });
  __syncthreads();
  const int n = sh.num_candidates;
  if (n > kCandidates) return -1;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const Best mine = sh.candidates[i];
    const uint32_t key = ordered_key(mine.value);
    int rank = 0;
    for (int j = 0; j < n; ++j) {
      const Best other = sh.candidates[j];
      const uint32_t other_key = ordered_key(other.value);
      rank += other_key > key || (other_key == key && other.index < mine.index);
    }
    sh.ranked[rank] = mine;
  }
  __syncthreads();
  return n;
}

// The threshold (a logit) of a row whose n ranked candidates hold every element of its domain
// (keys in [lo, hi]) at or above the one where its truncations stop: the keys that select finds
// on the whole row. With top_k > 0 they hold the domain's first k (or all of it, if fewer);
// without, the nucleus of a domain of mass total_mass. Rank p belongs to thread
// p / kCandidatesPerThread. `threshold` comes in as the min_p floor (or -inf).
template <typename T>
__device__ float ranked_threshold(const Row<T>& row, int n, int top_k, float top_p, uint32_t hi,
                                  unsigned long long total_mass, float threshold, Shared& sh) {
  const bool found = top_k > 0 && n >= top_k;  // the k-th of the domain
  const uint32_t kth = found ? ordered_key(sh.ranked[top_k - 1].value) : 0u;
  if (found) threshold = key_value(kth);
  if (!(top_p < 1.f) || (found && kth == hi)) return threshold;

  // With top-k, top-p sees the first k by rank (as on the select way): the mass above the k-th's
  // key plus (k - the count above it) times its weight; with fewer than k, the domain's (all
  // candidates); without top-k, total_mass.
  const int first = threadIdx.x * kCandidatesPerThread;
  unsigned long long weight[kCandidatesPerThread];
  unsigned long long mass = 0;
#pragma unroll
  for (int j = 0; j < kCandidatesPerThread; ++j) {
    weight[j] = first + j < n ? row.weight(sh.ranked[first + j].value) : 0ull;
    mass += weight[j];
  }
  uint32_t unused = 0;
  unsigned long long before = mass;
  block_exclusive_scan(unused, before, sh);
  if (threadIdx.x == kThreads - 1) sh.total_mass = before + mass;
  if (threadIdx.x == 0) sh.pick = -1;
  unsigned long long running = before;
#pragma unroll
  for (int j = 0; j < kCandidatesPerThread; ++j) {
    const int p = first + j;
    if (found && p < n && ordered_key(sh.ranked[p].value) == kth &&
        (p == 0 || ordered_key(sh.ranked[p - 1].value) != kth)) {
      sh.pick_count = p;
      sh.pick_mass = running;
    }
    running += weight[j];
  }
  __syncthreads();
  const int limit = found ? static_cast<int>(sh.pick_count) : n;  // the ranks above the k-th's key
  const unsigned long long total =
      found ? sh.pick_mass + static_cast<unsigned long long>(top_k - limit) * row.weight(key_value(kth))
      : top_k > 0 ? sh.total_mass
                  : total_mass;
  const double target = static_cast<double>(top_p) * static_cast<double>(total);
  running = before;
#pragma unroll
  for (int j = 0; j < kCandidatesPerThread; ++j) {
    const int p = first + j;
    const unsigned long long next = running + weight[j];
    if (p < limit && static_cast<double>(next) >= target && !(static_cast<double>(running) >= target)) {
      sh.pick = p;
    }
    running = next;
  }
  __syncthreads();
  if (sh.pick >= 0) threshold = sh.ranked[sh.pick].value;
  __syncthreads();  // before the scratch is reused
  return threshold;
}

// The race of sample_row among the ranked candidates at or above `threshold`: the same winner.
__device__ Best ranked_race(int n, float threshold, float temperature, uint64_t key, Shared& sh) {
  const uint32_t kept_from = ordered_key(threshold);
  Best best = {-INFINITY, INT_MAX};
  for (int p = threadIdx.x; p < n; p += kThreads) {
    const Best c = sh.ranked[p];
    if (ordered_key(c.value) < kept_from) break;  // ranked: the rest are lower
    if (!(c.value > -INFINITY)) continue;
    const uint4 bits = philox(key, static_cast<uint32_t>(c.index) >> 2);
    const uint32_t word[4] = {bits.x, bits.y, bits.z, bits.w};
    keep_better(best, race_score(c.value, temperature, word[c.index & 3]), c.index);
  }
  return block_best(best, sh);
}

// Samples row r (its logits at `logits`); every thread returns the token.
template <typename T>
__device__ int sample_row(const T* logits, int r, const SampleRowsArgs& a, Shared& sh) {
  const float temperature = a.temperatures[r];
  Row<T> row{logits, a.vocab, temperature};
  if (!(temperature > 0.f)) {  // greedy
    // A thread visits its indices in increasing order, so a later value replaces the best only if
    // it comes strictly before it (argmax_ahead): ties keep the lower index, as keep_first would.
    Best best = {-INFINITY, INT_MAX};
    row.for_each([&](int first, const float (&x)[4], int count) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (e < count && argmax_ahead(x[e], best.value)) best = {x[e], first + e};
      }
    });
    best = block_best(best, sh);
    const int token = best.index == INT_MAX ? a.vocab : best.index;
    if (threadIdx.x == 0) {
      a.out[r] = token;
      if (a.thresholds) a.thresholds[r] = best.value;
    }
    return token;
  }

  auto finish_row = [&](const Best& best, float threshold) {
    const int token = best.index == INT_MAX ? a.vocab : best.index;
    if (threadIdx.x == 0) {
      a.out[r] = token;
      if (a.thresholds) a.thresholds[r] = threshold / temperature;
    }
    return token;
  };
  const int top_k = a.top_ks[r];
  const float top_p = a.top_ps[r], min_p = a.min_ps[r];
  const bool has_top_k = top_k > 0 && top_k < a.vocab, has_top_p = top_p < 1.f;
  const bool has_min_p = min_p > 0.f;
  float threshold = -INFINITY;  // a logit
  if (has_top_k || has_top_p || has_min_p) {
    Best max = {-INFINITY, INT_MAX};
    float min = INFINITY;
    row.for_each([&](int first, const float (&x)[4], int count) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (e < count) keep_better(max, x[e], first + e), min = fminf(min, x[e]);
      }
    });
    row.max_logit = block_best(max, sh).value;
    min = block_min(min, sh);
    row.weight_exponent = 1.4426950408889634f / temperature;
    row.weight_scale = ldexpf(1.f, 52 - (32 - __clz(a.vocab)));
    // p < min_p * p_max  <=>  logit < max + temperature * log(min_p)
    const float floor = has_min_p ? row.max_logit + temperature * logf(min_p) : min;
    const uint32_t lo = ordered_key(floor), hi = ordered_key(row.max_logit);
    threshold = has_min_p ? floor : -INFINITY;
    // The candidates' way, from the n gathered (-1: too many): top_k and total_mass as for
    // ranked_threshold.
    auto finish_ranked = [&](int n, int k, unsigned long long total_mass) {
      threshold = ranked_threshold(row, n, k, top_p, hi, total_mass, threshold, sh);
      return finish_row(ranked_race(n, threshold, temperature, a.keys[r], sh), threshold);
    };
    if (has_top_k && top_k <= kGatherTopK) {
      // `max` is still this thread's own: one element of the row.
      const uint32_t bound = kth_thread_key(ordered_key(max.value), top_k, sh);
      const int n = gather_candidates(row, bound > lo ? bound : lo, hi, sh);
      if (n >= 0) return finish_ranked(n, top_k, 0ull);
    }
    // A select narrowed to at most kCandidates elements gathers them (as many as it counted).
    Selected kth = {false, 0u, 0u, 0ull};
    if (has_top_k && lo <= hi) {
      kth = select(row, lo, hi, static_cast<uint32_t>(top_k), 0.0, 0ull, has_top_p, sh, kCandidates);
      if (kth.narrowed) return finish_ranked(gather_candidates(row, kth.key, hi, sh), top_k, 0ull);
      if (kth.found) threshold = key_value(kth.key);
    }
    // With top-k, top-p sees the first k by rank: the nucleus is searched above the k-th, with
    // the mass of the first k (ties with the k-th beyond rank k do not count); not reaching
    // top_p there, it ends at the k-th.
    if (has_top_p && lo <= hi && !(kth.found && kth.key == hi)) {
      const unsigned long long total =
          kth.found ? kth.mass_above + static_cast<unsigned long long>(top_k - kth.count_above) *
                                           row.weight(key_value(kth.key))
                    : 0ull;
      const Selected nucleus = select(row, kth.found ? kth.key + 1 : lo, hi, 0u,
                                      static_cast<double>(top_p), total, true, sh, kCandidates);
      if (nucleus.narrowed) {
        return finish_ranked(gather_candidates(row, nucleus.key, hi, sh), 0, nucleus.total_mass);
      }
      if (nucleus.found) threshold = key_value(nucleus.key);
    }
  }

  // The race, on logit - temperature * log(E) (the same winner as logit / temperature - log(E)).
  // The bound is the best score any thread has computed so far (shared, raised with atomicMax; a
  // stale read only skips less). A token whose logit plus the largest possible boost stays below
  // it cannot win or tie: its random numbers are not computed. Of the others, a token whose
  // uniform is at least race_skip_from(bound, the quad's largest logit) cannot either: its score
  // (two logarithms) is not computed. In flat rows that skips all but a few tokens of the row,
  // and a shared bound keeps the few scored ones from diverging most of the warps' quads.
  const uint32_t kept_from = ordered_key(threshold);
  const uint64_t key = a.keys[r];
  const float max_boost = temperature * kMaxRaceBoost;
  const float inv_t = race_inverse_temperature(temperature);
  Best best = {-INFINITY, INT_MAX};
  volatile uint32_t* race_bound = &sh.race_bound;
  if (threadIdx.x == 0) *race_bound = ordered_key(-INFINITY);
  __syncthreads();
  row.for_each([&](int first, const float (&x)[4], int count) {
    const float bound = fmaxf(best.value, key_value(*race_bound));
    bool contender[4], any = false;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      contender[e] = e < count && ordered_key(x[e]) >= kept_from && x[e] > -INFINITY &&
                     !(x[e] + max_boost < bound);
      any = any || contender[e];
    }
    if (!any) return;
    const uint4 bits = philox(key, static_cast<uint32_t>(first) >> 2);
    const uint32_t word[4] = {bits.x, bits.y, bits.z, bits.w};
    float top = -INFINITY;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (contender[e]) top = fmaxf(top, x[e]);
    }
    const float skip_from = race_skip_from(bound, top, temperature, inv_t);
    const float before = best.value;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (contender[e] && uniform_of(word[e]) < skip_from) {
        keep_better(best, race_score(x[e], temperature, word[e]), first + e);
      }
    }
    if (best.value > before) atomicMax(const_cast<uint32_t*>(race_bound), ordered_key(best.value));
  });
  return finish_row(block_best(best, sh), threshold);
}

// The logprobs of row r's raw logits (before overrides and temperature): the sampled token's, its
// rank (the tokens strictly more likely), and the top n (ties at the n-th: lowest ids first).
// Two passes (log-sum-exp with the rank, then the top n's select and collection).
template <typename T>
__device__ void row_logprobs(const T* logits, int r, int token, int n, const SampleRowsArgs& a,
                             Shared& sh) {
  Row<T> row{logits, a.vocab, 1.f};
  const float sampled = to_float(logits[min(token, a.vocab - 1)]);  // a.vocab: nothing to draw
  float max = -INFINITY, sum = 0.f;  // this thread's running log-sum-exp
  uint32_t above = 0;
  row.for_each([&](int, const float (&x)[4], int count) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e < count && x[e] > -INFINITY) {
        if (x[e] > max) sum = sum * expf(max - x[e]), max = x[e];
        sum += expf(x[e] - max);
        above += x[e] > sampled;
      }
    }
  });
  float row_max = block_best({max, 0}, sh).value;
  unsigned long long dummy = 0;
  uint32_t count_before = above;
  block_exclusive_scan(count_before, dummy, sh);
  if (threadIdx.x == kThreads - 1) sh.pick_count = count_before + above;
  float scaled = max > -INFINITY ? sum * expf(max - row_max) : 0.f;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) scaled += __shfl_xor_sync(0xffffffffu, scaled, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) sh.warp_min[threadIdx.x / 32] = scaled;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += sh.warp_min[w];
  const float log_sum = row_max + logf(total);
  float* values = a.logprobs + static_cast<int64_t>(r) * (1 + a.logprob_width);
  int64_t* ids = a.logprob_ids + static_cast<int64_t>(r) * (1 + a.logprob_width);
  if (threadIdx.x == 0) {
    values[0] = sampled - log_sum;
    ids[0] = sh.pick_count;  // the rank
  }
  if (n == 0) return;

  const Selected nth = select(row, ordered_key(-INFINITY), ordered_key(row_max),
                              static_cast<uint32_t>(n), 0.0, 0ull, false, sh);
  if (threadIdx.x == 0) sh.num_top = 0;
  __syncthreads();
  const uint32_t from = nth.found ? nth.key : ordered_key(-INFINITY);
  row.for_each([&](int first, const float (&x)[4], int count) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e < count && ordered_key(x[e]) >= from) {
        const int slot = atomicAdd(&sh.num_top, 1);
        if (slot < kTopCapacity) sh.top[slot] = {x[e], first + e};
      }
    }
  });
  __syncthreads();
  if (threadIdx.x == 0) {  // at most kTopCapacity candidates: sort them by (value desc, id asc)
    const int num = min(sh.num_top, kTopCapacity);
    for (int i = 1; i < num; ++i) {
      const Best item = sh.top[i];
      int j = i - 1;
      for (; j >= 0 && (sh.top[j].value < item.value ||
                        (sh.top[j].value == item.value && sh.top[j].index > item.index));
           --j) {
        sh.top[j + 1] = sh.top[j];
      }
      sh.top[j + 1] = item;
    }
    for (int i = 0; i < n; ++i) {
      values[1 + i] = i < num ? sh.top[i].value - log_sum : -INFINITY;
      ids[1 + i] = i < num ? sh.top[i].index : 0;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) sample_rows_kernel(SampleRowsArgs a) {
  __shared__ Shared sh;
  const int r = blockIdx.x;
  const int override_row = a.override_rows ? a.override_rows[r] : -1;
  const T* logits = static_cast<const T*>(a.logits) + r * a.logits_stride;
  const int token = override_row >= 0
                        ? sample_row(a.overrides + override_row * a.overrides_stride, r, a, sh)
                        : sample_row(logits, r, a, sh);
  const int num_top = a.num_logprobs ? a.num_logprobs[r] : -1;
  if (num_top >= 0) row_logprobs(logits, r, token, num_top, a, sh);
}

// Copies the source rows to float32 and applies the biases, penalties and masks, in that order (see
// sampling.h). CTA (p, c) owns the c-th of kOverrideChunks column ranges of row p, and the biased,
// seen and masked tokens that fall in it, so that no token is written by two CTAs.
constexpr int kOverrideChunks = 16;

template <typename T>
__global__ void __launch_bounds__(kThreads) prepare_overrides_kernel(OverrideArgs a) {
  const int p = blockIdx.x;
  const int chunk = ((a.vocab + kOverrideChunks - 1) / kOverrideChunks + 7) / 8 * 8;  // 16-byte aligned
  const int begin = blockIdx.y * chunk, end = min(a.vocab, begin + chunk);
  if (begin >= end) return;
  const T* src = static_cast<const T*>(a.logits) + a.source_rows[p] * a.logits_stride;
  float* dst = a.overrides + static_cast<int64_t>(p) * a.vocab;
  if (a.mask_others && a.mask_others[p]) {
    for (int i = begin + threadIdx.x; i < end; i += kThreads) dst[i] = -INFINITY;
  } else {
    for_each_quad(src + begin, end - begin, [&](int first, const float (&x)[4], int count) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (e < count) dst[begin + first + e] = x[e];
      }
    });
  }
  __syncthreads();  // another thread may have written a token this one biases
  for (int i = threadIdx.x; i < a.num_biased; i += kThreads) {
    const int token = a.biased_tokens[static_cast<int64_t>(p) * a.num_biased + i];
    if (token < begin || token >= end) continue;  // padding (-1), or another CTA's
    dst[token] = to_float(src[token]) + a.biases[static_cast<int64_t>(p) * a.num_biased + i];
  }
  __syncthreads();  // penalties apply to the biased logit
  const float presence = a.presence[p], frequency = a.frequency[p], repetition = a.repetition[p];
  for (int i = threadIdx.x; i < a.num_seen; i += kThreads) {
    const int token = a.seen_tokens[static_cast<int64_t>(p) * a.num_seen + i];
    if (token < begin || token >= end) continue;  // padding (-1), or another CTA's
    const int count = a.output_counts[static_cast<int64_t>(p) * a.num_seen + i];
    const float logit = dst[token];
    float penalised = logit > 0.f ? logit / repetition : logit * repetition;
    penalised -= frequency * static_cast<float>(count) + (count > 0 ? presence : 0.f);
    dst[token] = penalised;
  }
  __syncthreads();  // a masked token stays masked whatever its penalty
  for (int i = threadIdx.x; i < a.num_masked; i += kThreads) {
    const int token = a.masked_tokens[static_cast<int64_t>(p) * a.num_masked + i];
    if (token >= begin && token < end) dst[token] = -INFINITY;
  }
}

}  // namespace

void sample_rows(const SampleRowsArgs& args, cudaStream_t stream) {
  require(args.vocab > 0, "sample_rows: vocab must be positive, got " + std::to_string(args.vocab));
  require(args.logits_stride >= args.vocab,
          "sample_rows: the logits' row stride " + std::to_string(args.logits_stride) +
              " is smaller than vocab " + std::to_string(args.vocab));
  require(!args.override_rows || (args.overrides && args.overrides_stride >= args.vocab),
          "sample_rows: override_rows needs overrides with rows of at least vocab elements");
  if (args.rows == 0) return;
  require(!args.num_logprobs || (args.logprobs && args.logprob_ids &&
                                  args.logprob_width <= kMaxTopLogprobs),
          "sample_rows: num_logprobs needs logprobs and logprob_ids of at most " +
              std::to_string(kMaxTopLogprobs) + " top logprobs per row");
  if (args.logits_bf16) {
    sample_rows_kernel<bf16><<<args.rows, kThreads, 0, stream>>>(args);
  } else {
    sample_rows_kernel<float><<<args.rows, kThreads, 0, stream>>>(args);
  }
  CUDA_CHECK_LAUNCH();
}

void prepare_overrides(const OverrideArgs& args, cudaStream_t stream) {
  require(args.vocab > 0 && args.logits_stride >= args.vocab,
          "prepare_overrides: the logits' row stride must be at least vocab");
  if (args.num_rows == 0) return;
  if (args.logits_bf16) {
    prepare_overrides_kernel<bf16><<<dim3(args.num_rows, kOverrideChunks), kThreads, 0, stream>>>(args);
  } else {
    prepare_overrides_kernel<float><<<dim3(args.num_rows, kOverrideChunks), kThreads, 0, stream>>>(args);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace nanograph
