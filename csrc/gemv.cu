// Small-M GEMV: out[M, N] = x[M, K] . weight[N, K]^T (+ bias[N]), 1 <= M <= 32, bf16 in and out,
// fp32 accumulation, (sum + bias) rounded once to bf16.
//
// Layouts: x [M, K], weight [N, K] (torch Linear), out [M, N], all row-major; bias [N].
// gemv_silu_mul, the gated MLP's gate_up projection with its activation in the epilogue:
// out[M, inter] = silu(gate) * up over weight [2 * inter, K] (gate rows, then up rows), gate and
// up each rounded to bf16 first; see gemv_kernel's kSiluMul for how rows map to lanes.
// The FP8-weight GEMVs are in gemv_fp8.cu; gemv_common.cuh holds what both files share.
//
// Why: at decode the whole weight (4-300 MB) is read once per step and nothing is reused, so the
// kernel is bound by how many bytes are in flight across all SMs, not by arithmetic. Every weight
// element is loaded exactly once, as 16-byte non-L1-allocating loads, kUnroll of them in flight
// per thread; x is tiny and is read through L1/L2 for all M rows at once.
//
// Math: one mma.m16n8k16 (bf16 in, fp32 accumulate) takes x as A (16 rows = the M rows, zero
// beyond M) and 8 weight rows as B, so M = 1..16 all cost the same weight traffic and issue slots,
// with no bf16->fp32 conversions; M = 17..32 take a second A tile (x rows 16..31) against the same
// weight fragment, the weight still loaded once. A sum over K may visit K in any order as long as x and weight
// use the same one, so the fragments come from plain 16-byte loads: lane (g = lane / 4,
// c = lane % 4) of a warp step at k0 loads weight row n0 + g and x rows g, g + 8 at
// k0 + 8c .. k0 + 8c + 7; elements {0,1,2,3} feed the first MMA and {4,5,6,7} the second
// (fragment k = 2c, 2c+1, 2c+8, 2c+9 <-> k0 + 8c + 0..3, resp. + 4..7, in both operands).
// The accumulator lands in lane (g, c) as out[m = g, g + 8][n = n0 + 2c, n0 + 2c + 1] (tile t:
// m + 16t).
//
// Launch: a warp owns one group of 8 weight rows and one of `splits` contiguous K ranges
// (choose_splits in gemv_plan.h says how many); a CTA of kWarps warps holds kWarps / splits
// row groups with all of their splits, and sums the splits in shared memory in a fixed order
// (deterministic; no atomics and no workspace but gemv_argmax's keys, below). CTAs have 8 warps
// (2 per SM), or 16 (1 per SM, the same warps per SM) when a row group takes 16 splits: down
// (K = 3,072) in 8-warp CTAs would hold 12 steps per warp, more than one batch, in half of the
// resident warp slots. A warp keeps kUnroll steps of weight loads in flight, and requests its
// next batch either whole, before the batch's first step, or (up to 8 rows of x) by halves, each
// as soon as the steps holding its registers are summed (gemv_reloads_by_halves in gemv_plan.h
// says which). Grid, splits and reloads depend only on (M, N, K) and the device's SM count, so a
// captured graph is valid for any data.
// gemv_argmax (lm_head at a greedy decode step) adds the row's argmax to the epilogue: each CTA
// reduces its columns' (value, index) pairs, packed as 64-bit keys whose unsigned order is
// torch.argmax's (argmax_key in argmax_order.cuh), in shared memory and sends one max reduction
// per row to a global key; a one-warp kernel launched behind it (PDL) decodes and clears the keys.
// The separate argmax kernel would re-read the 300 KB of logits after the GEMV has completed.
#include "gemv.h"

#include "argmax_order.cuh"
#include "gemv_common.cuh"
#include "launch.h"
#include "silu_mul.cuh"

#include <string>
#include <type_traits>

namespace nanograph {

namespace {

using namespace gemv_detail;

constexpr int kRowsPerGroup = 8;  // the n of one mma.m16n8k16
constexpr int kElems = 8;         // weight elements per lane per step (one 16-byte load)
constexpr int kStepK = 32;        // K per warp step: 4 lanes x 8 elements
constexpr int kUnroll = 8;        // warp steps whose weight loads are in flight together

// gemv_kernel's store for gemv_argmax: the warp's sums (kTiles x 4; none where !has_sum, a warp whose
// split was summed by another) are stored like gemv's, and each row's best key goes to the CTA's keys,
// then to the global ones. Every warp of the CTA calls it (it has a barrier).
template <int kTiles>
__device__ __forceinline__ void argmax_epilogue(const float (&sum)[kTiles][4], bool has_sum,
                                                const bf16* bias, bf16* out, int M, int N, int n0,
                                                int g, int c,
                                                unsigned long long* cta_keys,
                                                unsigned long long* keys) {
  unsigned long long best[kTiles][2] = {};  // rows 16t + g and 16t + g + 8
  if (has_sum) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 16 * t + g + (i >= 2 ? 8 : 0);
        const int n = n0 + 2 * c + (i & 1);
        if (m < M && n < N) {
          const float s = sum[t][i];
          const bf16 value = __float2bfloat16_rn(bias ? s + __bfloat162float(bias[n]) : s);
          out[static_cast<int64_t>(m) * N + n] = value;
          best[t][i / 2] = max(best[t][i / 2], argmax_key(__bfloat162float(value), n));
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the 4 lanes of a row hold its 8 columns
      best[t][h] = max(best[t][h], __shfl_xor_sync(0xffffffffu, best[t][h], 1));
      best[t][h] = max(best[t][h], __shfl_xor_sync(0xffffffffu, best[t][h], 2));
    }
  }
  __syncthreads();  // cta_keys are initialised
  if (c == 0) {
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      if (best[t][0] != 0) atomicMax(&cta_keys[16 * t + g], best[t][0]);
      if (best[t][1] != 0) atomicMax(&cta_keys[16 * t + g + 8], best[t][1]);
    }
  }
  __syncthreads();
  if (threadIdx.x < M && cta_keys[threadIdx.x] != 0) atomicMax(&keys[threadIdx.x], cta_keys[threadIdx.x]);
}

// gemv_argmax's second kernel: each row's key to its index, into out and host_out, and the key
// cleared for the next call.
__global__ void argmax_keys_kernel(unsigned long long* keys, int M, int32_t* out,
                                   int32_t* host_out) {
  wait_for_producers();
  const int m = threadIdx.x;
  if (m >= M) return;
  const int32_t index = argmax_key_index(keys[m]);
  keys[m] = 0;
  out[m] = index;
  if (host_out != nullptr) host_out[m] = index;
}

// kMaxRows: the M this instance takes: 8 (x rows g only), 16 (rows g + 8 too) or 32 (a second MMA
// tile of rows g + 16, g + 24, against the same weight fragments). kWarps: warps per CTA. steps_per_split: warp steps in
// each split's K range. kSiluMul: the gated MLP's epilogue (gemv_silu_mul): weight holds 2N rows,
// gate rows [0, N) then up rows [N, 2N), and out[m, j] = silu(gate) * up. A row group then
// covers 4 output columns, its 8 rows alternating gate and up (row g is the gate of column
// g / 2 for even g, its up for odd g), so that the lane holding accumulator columns 2c and 2c + 1
// holds the gate and the up of one output column.
// kArgmax: gemv_argmax's epilogue (keys: [M] argmax keys, see argmax_key).
// kHalves (8 rows only): each half of the next load batch is requested as soon as the steps
// holding its registers are summed (gemv_reloads_by_halves says when); otherwise the whole next
// batch is requested at once, before its first step.
template <int kMaxRows, int kWarps, bool kSiluMul, bool kArgmax, bool kHalves>
__global__ void __launch_bounds__(kWarps * 32, kWarpsPerSm / kWarps)
    gemv_kernel(const bf16* __restrict__ x, const bf16* __restrict__ weight,
                const bf16* __restrict__ bias, bf16* __restrict__ out, int M, int N, int K,
                int splits, int steps_per_split, unsigned long long* __restrict__ keys) {
  static_assert(!(kSiluMul && kArgmax), "the argmax epilogue is lm_head's, which has no SiLU");
  static_assert(kMaxRows == 8 || kMaxRows == 16 || kMaxRows == 32, "8, 16 or 32 rows of x");
  static_assert(kMaxRows <= kGemvMaxM, "the argmax keys hold kGemvMaxM rows");
  static_assert(!kHalves || kMaxRows == 8, "wider tiles keep whole batches (registers)");
  constexpr bool kWideM = kMaxRows > 8;
  constexpr int kTiles = kMaxRows > 16 ? 2 : 1;
  __shared__ unsigned long long cta_keys[kArgmax ? kGemvMaxM : 1];
  if constexpr (kArgmax) {
    if (threadIdx.x < kGemvMaxM) cta_keys[threadIdx.x] = 0;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, c = lane % 4;
  const int split = warp % splits;
  const int group = blockIdx.x * (kWarps / splits) + warp / splits;
  // The group's first output column; columns past N load those of column N - 1 and are not
  // stored; x rows past M are zero.
  const int n0 = group * (kSiluMul ? kRowsPerGroup / 2 : kRowsPerGroup);
  int row;
  if constexpr (kSiluMul) {
    const int column = min(n0 + g / 2, N - 1);
    row = g % 2 == 0 ? column : N + column;
  } else {
    row = min(n0 + g, N - 1);
  }
  const bf16* w_row = weight + static_cast<int64_t>(row) * K + kElems * c;
  const int steps = (K + kStepK - 1) / kStepK;
  const int begin = split * steps_per_split;
  const int end = n0 < N ? min(begin + steps_per_split, steps) : begin;
  // The lane's steps end at `end` or where its 8 columns pass K, whichever is first: one compare
  // per step. Addresses are a batch's base pointer plus a constant offset per step.
  const int lane_end = min(end, (K - kElems * c + kStepK - 1) / kStepK);
  uint4 w[kUnroll];
  // Steps step0 + u for u in [first, last) into w[u].
  auto load_weights = [&](int step0, int first = 0, int last = kUnroll) {
    const bf16* batch = w_row + static_cast<int64_t>(step0) * kStepK;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u < first || u >= last) continue;
      w[u] = load_weight(batch + u * kStepK, step0 + u < lane_end);
    }
  };
  // The weight does not come from the previous kernel: its first batch is in flight before the
  // wait for x (PDL, launch.h).
  load_weights(begin);
  wait_for_producers_after_loads();
  allow_dependents();

  // Two accumulators per tile (first and second MMA of a step) halve the dependent MMA chain.
  float acc[kTiles][2][4] = {};
  if (n0 < N) {
    const bf16* x_lo = x + static_cast<int64_t>(g) * K + kElems * c;
    for (int step0 = begin; step0 < end; step0 += kUnroll) {
      if (!kHalves && step0 != begin) load_weights(step0);
      const bf16* x_batch = x_lo + static_cast<int64_t>(step0) * kStepK;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool in_range = step0 + u < lane_end;
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
          const int m = 16 * t + g;  // x rows m (lo) and m + 8 (hi)
          const bf16* x_row = x_batch + static_cast<int64_t>(16 * t) * K + u * kStepK;
          const uint4 lo = load_x(x_row, in_range && m < M);
          const uint4 hi = load_x(x_row + static_cast<int64_t>(8) * K, in_range && kWideM && m + 8 < M);
          mma_16x8x16(acc[t][0], lo.x, hi.x, lo.y, hi.y, w[u].x, w[u].y);
          mma_16x8x16(acc[t][1], lo.z, hi.z, lo.w, hi.w, w[u].z, w[u].w);
        }
        if (kHalves && (u + 1) % (kUnroll / 2) == 0 && step0 + kUnroll < end) {
          load_weights(step0 + kUnroll, u + 1 - kUnroll / 2, u + 1);
        }
      }
    }
  }

  float sum[kTiles][4];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sum[t][i] = acc[t][0][i] + acc[t][1][i];
  }

  if (splits > 1) {
    __shared__ float partial[kWarps][kTiles * 4][32];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][4 * t + i][lane] = sum[t][i];
    }
    __syncthreads();
    if constexpr (!kArgmax) {
      if (split != 0) return;
    }
    // The group's splits are warps warp .. warp + splits - 1; summed in that order.
    for (int s = 1; split == 0 && s < splits; ++s) {
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sum[t][i] += partial[warp + s][4 * t + i][lane];
      }
    }
  }

  if constexpr (kArgmax) {
    // Every warp takes part (the epilogue has barriers); the group's other splits store nothing.
    argmax_epilogue<kTiles>(sum, split == 0, bias, out, M, N, n0, g, c, cta_keys, keys);
  } else if constexpr (kSiluMul) {
    // Gate and up rounded to bf16, as the unfused gemv stores them, then silu_mul's formula.
    const int n = n0 + c;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = 16 * t + g + 8 * half;
        if (m < M && n < N) {
          const float gate = __bfloat162float(__float2bfloat16_rn(sum[t][2 * half]));
          const float up = __bfloat162float(__float2bfloat16_rn(sum[t][2 * half + 1]));
          out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(silu_mul_value(gate, up));
        }
      }
    }
  } else {
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 16 * t + g + (i >= 2 ? 8 : 0);
        const int n = n0 + 2 * c + (i & 1);
        if (m < M && n < N) {
          const float value = bias ? sum[t][i] + __bfloat162float(bias[n]) : sum[t][i];
          out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(value);
        }
      }
    }
  }
}

}  // namespace

bool gemv_supported(int M, int N, int K) {
  return M >= 1 && M <= kGemvMaxM && N >= 1 && K >= 8 && K % 8 == 0;
}

bool gemv_preferred(int M, int N, int K) {
  if (!gemv_supported(M, N, K)) return false;
  const int64_t elements = static_cast<int64_t>(N) * K;
  return M <= 8 || elements <= (M <= 16 ? kGemvMidElements : kGemvWideElements);
}

namespace {

// N: out's width (gemv's N, or gemv_silu_mul's inter).
// kArgmax: gemv_argmax's epilogue into argmax_keys.
template <bool kSiluMul, bool kArgmax = false>
void launch_gemv(const bf16* x, const bf16* weight, const bf16* bias, bf16* out, int M, int N,
                 int K, cudaStream_t stream, const char* op,
                 unsigned long long* argmax_keys = nullptr) {
  require_gemv_shape(gemv_supported(M, kSiluMul ? 2 * N : N, K), op, M, N, K, 8, kGemvMaxM);
  require_aligned(op, "x", x);
  require_aligned(op, "weight", weight);

  const int row_groups = ceil_div(N, kSiluMul ? kRowsPerGroup / 2 : kRowsPerGroup);
  const int steps = ceil_div(K, kStepK);
  const GemvGrid g = gemv_grid(row_groups, steps, kUnroll, device_props().sm_count);
  auto pick = [&](auto warps, auto halves) {
    constexpr int kWarps = decltype(warps)::value;
    constexpr bool kHalves = decltype(halves)::value;
    return M > 16  ? gemv_kernel<32, kWarps, kSiluMul, kArgmax, false>
           : M > 8 ? gemv_kernel<16, kWarps, kSiluMul, kArgmax, false>
                   : gemv_kernel<8, kWarps, kSiluMul, kArgmax, kHalves>;
  };
  // 16 and 32 rows of x keep whole batches: their fragments fill the 128 registers, and the
  // halves loop spilled there.
  auto pick_halves = [&](auto warps) {
    return M <= 8 && gemv_reloads_by_halves(g, device_props().sm_count)
               ? pick(warps, std::true_type{})
               : pick(warps, std::false_type{});
  };
  auto kernel = g.warps == kWarpsPerCta ? pick_halves(std::integral_constant<int, kWarpsPerCta>{})
                                        : pick_halves(std::integral_constant<int, kMaxSplits>{});
  launch_pdl(kernel, dim3(g.ctas), dim3(g.warps * 32), 0, stream, x, weight, bias, out, M, N, K,
             g.splits, g.steps_per_split, argmax_keys);
}

}  // namespace

void gemv(const bf16* x, const bf16* weight, const bf16* bias, bf16* out, int M, int N, int K,
          cudaStream_t stream) {
  launch_gemv<false>(x, weight, bias, out, M, N, K, stream, "gemv");
}

void gemv_silu_mul(const bf16* x, const bf16* gate_up_weight, bf16* out, int M, int inter, int K,
                   cudaStream_t stream) {
  launch_gemv<true>(x, gate_up_weight, nullptr, out, M, inter, K, stream, "gemv_silu_mul");
}

void gemv_argmax(const bf16* x, const bf16* weight, const bf16* bias, bf16* logits, int M, int N,
                 int K, uint64_t* keys, int32_t* out, int32_t* host_out, cudaStream_t stream) {
  require(keys != nullptr && out != nullptr, "gemv_argmax: keys and out are required");
  auto* key_words = reinterpret_cast<unsigned long long*>(keys);
  launch_gemv<false, true>(x, weight, bias, logits, M, N, K, stream, "gemv_argmax", key_words);
  launch_pdl(argmax_keys_kernel, dim3(1), dim3(32), 0, stream, key_words, M, out, host_out);
}

}  // namespace nanograph
