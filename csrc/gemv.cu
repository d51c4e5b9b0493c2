// Small-M GEMV: out[M, N] = x[M, K] . weight[N, K]^T (+ bias[N]), 1 <= M <= 16, bf16 in and out,
// fp32 accumulation, (sum + bias) rounded once to bf16.
//
// Layouts: x [M, K], weight [N, K] (torch Linear), out [M, N], all row-major; bias [N].
// gemv_silu_mul, the gated MLP's gate_up projection with its activation in the epilogue:
// out[M, inter] = silu(gate) * up over weight [2 * inter, K] (gate rows, then up rows), gate and
// up each rounded to bf16 first; see gemv_kernel's kSiluMul for how rows map to lanes.
// gemv_fp8 and gemv_silu_mul_fp8: the weight is e4m3 with a float32 scale per 8 rows x 128
// columns (fp8.h), x and out bf16 as above; see gemv_kernel's kFp8. dequantize_fp8 writes such a
// weight as bf16, for cuBLASLt above 16 rows.
//
// Why: at decode the whole weight (4-300 MB) is read once per step and nothing is reused, so the
// kernel is bound by how many bytes are in flight across all SMs, not by arithmetic. Every weight
// element is loaded exactly once, as 16-byte non-L1-allocating loads, kUnroll of them in flight
// per thread; x is tiny and is read through L1/L2 for all M rows at once.
//
// Math: one mma.m16n8k16 (bf16 in, fp32 accumulate) takes x as A (16 rows = the M rows, zero
// beyond M) and 8 weight rows as B, so M = 1..16 all cost the same weight traffic and issue slots,
// with no bf16->fp32 conversions. A sum over K may visit K in any order as long as x and weight
// use the same one, so the fragments come from plain 16-byte loads: lane (g = lane / 4,
// c = lane % 4) of a warp step at k0 loads weight row n0 + g and x rows g, g + 8 at
// k0 + 8c .. k0 + 8c + 7; elements {0,1,2,3} feed the first MMA and {4,5,6,7} the second
// (fragment k = 2c, 2c+1, 2c+8, 2c+9 <-> k0 + 8c + 0..3, resp. + 4..7, in both operands).
// The accumulator lands in lane (g, c) as out[m = g, g + 8][n = n0 + 2c, n0 + 2c + 1].
//
// Launch: a warp owns one group of 8 weight rows and one of `splits` contiguous K ranges; a CTA
// of kWarps warps holds kWarps / splits row groups with all of their splits, and sums the splits
// in shared memory in a fixed order (deterministic; no atomics and no workspace but
// gemv_argmax's keys, below). The host doubles
// splits (up to kMaxSplits) while the launch stays within kTargetWarps warps (one wave) and
// every split keeps more than one load batch, so that small-N matrices (o_proj, down: 128 row
// groups) still spread over the SMs with a whole matrix in flight. CTAs have 8 warps (2 per SM),
// or 16 (1 per SM, the same warps per SM) when a row group takes 16 splits: down (K = 3,072) in
// 8-warp CTAs would hold 12 steps per warp, more than one batch, in half of the resident warp
// slots. Larger matrices, with more than two load batches per warp of a full wave (Qwen3-8B's
// projections, any lm_head), stream through several waves instead: there splits double (up to 8,
// in 8-warp CTAs, each split keeping at least 16 steps) until the grid has 8 waves of CTAs, so
// that the last, partial wave is short (8B gate_up: 8 splits in 3,072 CTAs, where one 1.45-wave
// launch without splits leaves the GPU part-idle at its end). Grid and splits depend only on
// (M, N, K), so a captured graph is valid for any data.
// gemv_argmax (lm_head at a greedy decode step) adds the row's argmax to the epilogue: each CTA
// reduces its columns' (value, index) pairs, packed as 64-bit keys whose unsigned order is
// torch.argmax's (argmax_key in argmax_order.cuh), in shared memory and sends one max reduction
// per row to a global key; a one-warp kernel launched behind it (PDL) decodes and clears the keys.
// The separate argmax kernel would re-read the 300 KB of logits after the GEMV has completed.
#include "gemv.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "argmax_order.cuh"
#include "e4m3.cuh"
#include "fp8.h"
#include "launch.h"
#include "silu_mul.cuh"

#include <algorithm>
#include <string>

namespace nanograph {

namespace {

constexpr int kRowsPerGroup = 8;   // the n of one mma.m16n8k16
constexpr int kStepK = 32;         // K per warp step: 4 lanes x 8 elements
constexpr int kStepKFp8 = 64;      // the same 16 bytes per lane of an FP8 weight: 16 elements
constexpr int kUnroll = 8;         // warp steps whose weight loads are in flight together
constexpr int kWarpsPerCta = 8;    // the usual CTA; 16 when a row group takes 16 splits
constexpr int kMaxSplits = 16;
// Resident warps per SM the launch bounds allow: 2 CTAs of 8 or 1 of 16. This caps registers at
// 128, which is what holds a whole batch of loads in flight: without a minimum, ptxas trades
// them for occupancy and issues each load just before its MMA.
constexpr int kWarpsPerSm = 16;
constexpr int kTargetWarps = 2048;  // one full wave: 132 SMs x kWarpsPerSm
constexpr int kAlignmentBytes = 16;
// Matrices of more than two load batches per warp of a full wave stream through several waves.
constexpr int kStreamSteps = 16;  // the least warp steps per split there: two load batches
constexpr int kStreamWaves = 8;   // waves of CTAs at which splitting stops there

// 16 bytes from global memory, or zeros where !pred. The predicate sits inside the asm (no
// branch), so a batch of these is one basic block that the compiler issues back to back.
#define GEMV_LOAD_16B(QUALIFIERS)                                           \
  "{\n"                                                                    \
  "  .reg .pred p;\n"                                                      \
  "  setp.ne.b32 p, %5, 0;\n"                                              \
  "  mov.b32 %0, 0;\n"                                                     \
  "  mov.b32 %1, 0;\n"                                                     \
  "  mov.b32 %2, 0;\n"                                                     \
  "  mov.b32 %3, 0;\n"                                                     \
  "  @p ld.global.nc" QUALIFIERS ".v4.u32 {%0, %1, %2, %3}, [%4];\n"      \
  "}\n"

// The weight is streamed once: kept out of L1 so that x, which every warp reads, stays there.
__device__ __forceinline__ uint4 load_weight(const void* ptr, bool pred) {
  uint4 v;
  asm volatile(GEMV_LOAD_16B(".L1::no_allocate")
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

__device__ __forceinline__ uint4 load_x(const bf16* ptr, bool pred) {
  uint4 v;
  asm volatile(GEMV_LOAD_16B("")
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

#undef GEMV_LOAD_16B

// 16 e4m3 values as 8 bf16x2: out[j] holds elements 2j (low half) and 2j + 1.
__device__ __forceinline__ void fp8x16_to_bf16(const uint4& v, uint32_t (&out)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = e4m3x2_to_bf16x2(words[i]);
    out[2 * i + 1] = e4m3x2_to_bf16x2(words[i] >> 16);
  }
}

// d += a (16x16, row-major) . b (16x8, column-major); bf16 operands, fp32 accumulator.
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                            uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// gemv_kernel's store for gemv_argmax: the warp's sums (nullptr for a warp whose split was
// summed by another) are stored like gemv's, and each row's best key goes to the CTA's keys, then
// to the global ones. Every warp of the CTA calls it (it has a barrier).
__device__ __forceinline__ void argmax_epilogue(const float* sum, const bf16* bias, bf16* out,
                                                int M, int N, int n0, int g, int c,
                                                unsigned long long* cta_keys,
                                                unsigned long long* keys) {
  unsigned long long best[2] = {0, 0};  // rows g and g + 8
  if (sum != nullptr) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = g + (i >= 2 ? 8 : 0);
      const int n = n0 + 2 * c + (i & 1);
      if (m < M && n < N) {
        const bf16 value = __float2bfloat16_rn(bias ? sum[i] + __bfloat162float(bias[n]) : sum[i]);
        out[static_cast<int64_t>(m) * N + n] = value;
        best[i / 2] = max(best[i / 2], argmax_key(__bfloat162float(value), n));
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // the 4 lanes of a row hold its 8 columns
    best[h] = max(best[h], __shfl_xor_sync(0xffffffffu, best[h], 1));
    best[h] = max(best[h], __shfl_xor_sync(0xffffffffu, best[h], 2));
  }
  __syncthreads();  // cta_keys are initialised
  if (c == 0) {
    if (best[0] != 0) atomicMax(&cta_keys[g], best[0]);
    if (best[1] != 0) atomicMax(&cta_keys[g + 8], best[1]);
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

// kWideM: M > 8, so x rows g + 8 exist. kWarps: warps per CTA. steps_per_split: warp steps in
// each split's K range. kSiluMul: the gated MLP's epilogue (gemv_silu_mul): weight holds 2N rows,
// gate rows [0, N) then up rows [N, 2N), and out[m, j] = silu(gate) * up. A row group then
// covers 4 output columns, its 8 rows alternating gate and up (row g is the gate of column
// g / 2 for even g, its up for odd g), so that the lane holding accumulator columns 2c and 2c + 1
// holds the gate and the up of one output column.
// kArgmax: gemv_argmax's epilogue (keys: [M] argmax keys, see argmax_key).
// kFp8: the weight is e4m3 with block scales (fp8.h). A warp step then covers kStepKFp8 = 64
// columns, 16 per lane (the same 16-byte load), converted exactly to bf16 for four MMAs into a
// fresh step sum, which is multiplied by the scale of its rows' block and added to the
// accumulator: a step never crosses a 128-column scale block. The scale of accumulator column
// 2c + j is that of its weight row's 8-row group, the same for the whole row group except in the
// SiLU layout, where even columns are gate rows and odd ones up rows (N a multiple of 8 there).
template <bool kWideM, int kWarps, bool kSiluMul, bool kArgmax, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32, kWarpsPerSm / kWarps)
    gemv_kernel(const bf16* __restrict__ x, const void* __restrict__ weight,
                const float* __restrict__ scale, const bf16* __restrict__ bias,
                bf16* __restrict__ out, int M, int N, int K, int splits, int steps_per_split,
                unsigned long long* __restrict__ keys) {
  static_assert(!(kSiluMul && kArgmax), "the argmax epilogue is lm_head's, which has no SiLU");
  static_assert(!(kFp8 && kArgmax), "lm_head stays bf16");
  constexpr int kElems = kFp8 ? 16 : 8;  // weight elements per lane per step
  constexpr int kStep = 4 * kElems;
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
  const char* w_row = static_cast<const char*>(weight) +
                     (static_cast<int64_t>(row) * K + kElems * c) * (kFp8 ? 1 : sizeof(bf16));
  const int steps = (K + kStep - 1) / kStep;
  const int begin = split * steps_per_split;
  const int end = n0 < N ? min(begin + steps_per_split, steps) : begin;
  // FP8: the scale rows of accumulator columns 2c (lo) and 2c + 1 (hi), read as each step is
  // summed (L1 hits: a 128-column block spans two steps).
  const int scale_cols = static_cast<int>(fp8_scale_cols(K));
  const float* scale_lo = scale + static_cast<int64_t>(n0 / kFp8ScaleRows) * scale_cols;
  const float* scale_hi =
      kSiluMul ? scale + static_cast<int64_t>((N + n0) / kFp8ScaleRows) * scale_cols : scale_lo;
  uint4 w[kUnroll];
  // Steps step0 + u for u in [first, last) into w[u].
  auto load_weights = [&](int step0, int first = 0, int last = kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u < first || u >= last) continue;
      const int k = (step0 + u) * kStep;
      const int64_t offset = static_cast<int64_t>(k) * (kFp8 ? 1 : sizeof(bf16));
      w[u] = load_weight(w_row + offset, step0 + u < end && k + kElems * c < K);
    }
  };
  // The weight does not come from the previous kernel: its first batch is in flight before the
  // wait for x (PDL, launch.h).
  load_weights(begin);
  wait_for_producers_after_loads();
  allow_dependents();

  // Two accumulators (first and second MMA of a step) halve the dependent MMA chain.
  float acc[2][4] = {};
  if (n0 < N) {
    const bf16* x_lo = x + static_cast<int64_t>(g) * K + kElems * c;
    const bf16* x_hi = x_lo + static_cast<int64_t>(8) * K;
    const bool has_lo = g < M, has_hi = kWideM && g + 8 < M;
    for (int step0 = begin; step0 < end; step0 += kUnroll) {
      // FP8 steps take several times the instructions of bf16 ones (the conversions): each half of
      // the next batch is loaded as soon as its registers are free, so that half a batch is in
      // flight while the other is converted, rather than none.
      if (!kFp8 && step0 != begin) load_weights(step0);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = (step0 + u) * kStep;
        const bool in_range = step0 + u < end && k + kElems * c < K;
        const uint4 lo = load_x(x_lo + k, in_range && has_lo);
        const uint4 hi = load_x(x_hi + k, in_range && has_hi);
        if constexpr (kFp8) {
          // Elements 0-7 of the lane's 16 pair with lo/hi, 8-15 with lo2/hi2, in the same order.
          const uint4 lo2 = load_x(x_lo + k + 8, in_range && has_lo);
          const uint4 hi2 = load_x(x_hi + k + 8, in_range && has_hi);
          // The MMA sums the step over all four lanes of a row: every lane scales it, including one
          // whose own columns lie past K.
          const bool step_in_range = step0 + u < end;
          const float s_lo = step_in_range ? __ldg(scale_lo + k / kFp8ScaleCols) : 0.0f;
          const float s_hi = kSiluMul && step_in_range ? __ldg(scale_hi + k / kFp8ScaleCols) : s_lo;
          uint32_t b[8];
          fp8x16_to_bf16(w[u], b);
          float part[4] = {};
          mma_16x8x16(part, lo.x, hi.x, lo.y, hi.y, b[0], b[1]);
          mma_16x8x16(part, lo.z, hi.z, lo.w, hi.w, b[2], b[3]);
          mma_16x8x16(part, lo2.x, hi2.x, lo2.y, hi2.y, b[4], b[5]);
          mma_16x8x16(part, lo2.z, hi2.z, lo2.w, hi2.w, b[6], b[7]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[i % 2][i] += (i & 1 ? s_hi : s_lo) * part[i];
          }
          constexpr int kHalf = kUnroll / 2;
          if (u == kHalf - 1) load_weights(step0 + kUnroll, 0, kHalf);
          if (u == kUnroll - 1) load_weights(step0 + kUnroll, kHalf, kUnroll);
        } else {
          mma_16x8x16(acc[0], lo.x, hi.x, lo.y, hi.y, w[u].x, w[u].y);
          mma_16x8x16(acc[1], lo.z, hi.z, lo.w, hi.w, w[u].z, w[u].w);
        }
      }
    }
  }

  float sum[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) sum[i] = acc[0][i] + acc[1][i];

  if (splits > 1) {
    __shared__ float partial[kWarps][4][32];
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][i][lane] = sum[i];
    __syncthreads();
    if constexpr (!kArgmax) {
      if (split != 0) return;
    }
    // The group's splits are warps warp .. warp + splits - 1; summed in that order.
    for (int s = 1; split == 0 && s < splits; ++s) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sum[i] += partial[warp + s][i][lane];
    }
  }

  if constexpr (kArgmax) {
    // Every warp takes part (the epilogue has barriers); the group's other splits store nothing.
    argmax_epilogue(split == 0 ? sum : nullptr, bias, out, M, N, n0, g, c, cta_keys, keys);
  } else if constexpr (kSiluMul) {
    // Gate and up rounded to bf16, as the unfused gemv stores them, then silu_mul's formula.
    const int n = n0 + c;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = g + 8 * half;
      if (m < M && n < N) {
        const float gate = __bfloat162float(__float2bfloat16_rn(sum[2 * half]));
        const float up = __bfloat162float(__float2bfloat16_rn(sum[2 * half + 1]));
        out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(silu_mul_value(gate, up));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = g + (i >= 2 ? 8 : 0);
      const int n = n0 + 2 * c + (i & 1);
      if (m < M && n < N) {
        const float value = bias ? sum[i] + __bfloat162float(bias[n]) : sum[i];
        out[static_cast<int64_t>(m) * N + n] = __float2bfloat16_rn(value);
      }
    }
  }
}

std::string shape_str(int M, int N, int K) {
  return "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K);
}

void require_aligned(const void* ptr, const char* name) {
  require(reinterpret_cast<uintptr_t>(ptr) % kAlignmentBytes == 0,
          std::string("gemv: ") + name + " must be " + std::to_string(kAlignmentBytes) +
              "-byte aligned; pass a contiguous copy instead of an offset view");
}

// K splits per row group; see "Launch" above.
int choose_splits(int row_groups, int steps) {
  int splits = 1;
  const bool streaming = static_cast<int64_t>(row_groups) * steps > 2LL * kUnroll * kTargetWarps;
  if (!streaming) {
    // Doubled only while the whole launch still fits one wave, so no matrix ends in a partial
    // second wave (gate_up at N = 6,144 would take 1.5 waves with 4 splits), and while a split
    // holds more than one load batch: below that, more splits add warps but no bytes in flight
    // (o_proj, 64 steps: 8 splits in 8-warp CTAs took 3.3 us, 16 in 16-warp CTAs 3.6 us).
    while (splits < kMaxSplits && 2 * row_groups * splits <= kTargetWarps && 2 * splits <= steps &&
           ceil_div(steps, splits) > kUnroll) {
      splits *= 2;
    }
    return splits;
  }
  // Doubled, in 8-warp CTAs, while the launch has fewer than kStreamWaves waves of CTAs and
  // every split keeps kStreamSteps steps.
  auto ctas = [&](int s) { return ceil_div(row_groups * s, kWarpsPerCta); };
  while (2 * splits <= kWarpsPerCta && 2 * splits * kStreamSteps <= steps &&
         ctas(splits) * kWarpsPerCta < kStreamWaves * kTargetWarps) {
    splits *= 2;
  }
  return splits;
}

}  // namespace

bool gemv_supported(int M, int N, int K) {
  return M >= 1 && M <= kGemvMaxM && N >= 1 && K >= 8 && K % 8 == 0;
}

bool gemv_fp8_supported(int M, int N, int K) { return gemv_supported(M, N, K) && K % 16 == 0; }

namespace {

// N: out's width (gemv's N, or gemv_silu_mul's inter).
// kArgmax: gemv_argmax's epilogue into argmax_keys. kFp8: an e4m3 weight with block scales.
template <bool kSiluMul, bool kArgmax = false, bool kFp8 = false>
void launch_gemv(const bf16* x, const void* weight, const float* scale, const bf16* bias,
                 bf16* out, int M, int N, int K, cudaStream_t stream, const char* op,
                 unsigned long long* argmax_keys = nullptr) {
  const bool supported = kFp8 ? gemv_fp8_supported(M, kSiluMul ? 2 * N : N, K)
                              : gemv_supported(M, kSiluMul ? 2 * N : N, K);
  require(supported, std::string(op) + ": unsupported " + shape_str(M, N, K) +
                         "; it takes 1 <= M <= " + std::to_string(kGemvMaxM) + ", N >= 1 and K a " +
                         "positive multiple of " + (kFp8 ? "16" : "8") +
                         " (use Gemm::linear for other shapes)");
  require_aligned(x, "x");
  require_aligned(weight, "weight");
  if constexpr (kFp8) {
    require(scale != nullptr, std::string(op) + ": an FP8 weight needs its block scales");
    require(!kSiluMul || N % kFp8ScaleRows == 0,
            std::string(op) + ": inter must be a multiple of " + std::to_string(kFp8ScaleRows) +
                " (the up rows' scales start a block), got " + std::to_string(N));
  }

  const int row_groups = ceil_div(N, kSiluMul ? kRowsPerGroup / 2 : kRowsPerGroup);
  const int steps = ceil_div(K, kFp8 ? kStepKFp8 : kStepK);
  const int splits = choose_splits(row_groups, steps);
  const int warps = splits > kWarpsPerCta ? splits : kWarpsPerCta;
  const int grid = ceil_div(row_groups, warps / splits);
  const int steps_per_split = ceil_div(steps, splits);
  auto kernel = warps == kWarpsPerCta
                    ? (M > 8 ? gemv_kernel<true, kWarpsPerCta, kSiluMul, kArgmax, kFp8>
                             : gemv_kernel<false, kWarpsPerCta, kSiluMul, kArgmax, kFp8>)
                    : (M > 8 ? gemv_kernel<true, kMaxSplits, kSiluMul, kArgmax, kFp8>
                             : gemv_kernel<false, kMaxSplits, kSiluMul, kArgmax, kFp8>);
  launch_pdl(kernel, dim3(grid), dim3(warps * 32), 0, stream, x, weight, scale, bias, out, M, N,
             K, splits, steps_per_split, argmax_keys);
}

}  // namespace

void gemv(const bf16* x, const bf16* weight, const bf16* bias, bf16* out, int M, int N, int K,
          cudaStream_t stream) {
  launch_gemv<false>(x, weight, nullptr, bias, out, M, N, K, stream, "gemv");
}

void gemv_silu_mul(const bf16* x, const bf16* gate_up_weight, bf16* out, int M, int inter, int K,
                   cudaStream_t stream) {
  launch_gemv<true>(x, gate_up_weight, nullptr, nullptr, out, M, inter, K, stream,
                    "gemv_silu_mul");
}

void gemv_argmax(const bf16* x, const bf16* weight, const bf16* bias, bf16* logits, int M, int N,
                 int K, uint64_t* keys, int32_t* out, int32_t* host_out, cudaStream_t stream) {
  require(keys != nullptr && out != nullptr, "gemv_argmax: keys and out are required");
  auto* key_words = reinterpret_cast<unsigned long long*>(keys);
  launch_gemv<false, true>(x, weight, nullptr, bias, logits, M, N, K, stream, "gemv_argmax",
                           key_words);
  launch_pdl(argmax_keys_kernel, dim3(1), dim3(32), 0, stream, key_words, M, out, host_out);
}

void gemv_fp8(const bf16* x, const void* weight, const float* scale, const bf16* bias, bf16* out,
              int M, int N, int K, cudaStream_t stream) {
  launch_gemv<false, false, true>(x, weight, scale, bias, out, M, N, K, stream, "gemv_fp8");
}

void gemv_silu_mul_fp8(const bf16* x, const void* gate_up_weight, const float* scale, bf16* out,
                       int M, int inter, int K, cudaStream_t stream) {
  launch_gemv<true, false, true>(x, gate_up_weight, scale, nullptr, out, M, inter, K, stream,
                                 "gemv_silu_mul_fp8");
}

namespace {

// 16 elements per thread: one 16-byte load of e4m3, two 16-byte stores of bf16.
__global__ void dequantize_fp8_kernel(const uint4* __restrict__ weight,
                                      const float* __restrict__ scale, uint4* __restrict__ out,
                                      int N, int K) {
  const int chunks_per_row = K / 16;
  const int64_t chunks = static_cast<int64_t>(N) * chunks_per_row;
  const int scale_cols = static_cast<int>(fp8_scale_cols(K));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int n = static_cast<int>(i / chunks_per_row);
    const int k = static_cast<int>(i % chunks_per_row) * 16;
    const float s = scale[static_cast<int64_t>(n / kFp8ScaleRows) * scale_cols + k / kFp8ScaleCols];
    uint32_t pairs[8];
    fp8x16_to_bf16(weight[i], pairs);
    uint32_t scaled[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pairs[j]));
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * s, f.y * s);
      scaled[j] = *reinterpret_cast<const uint32_t*>(&b);
    }
    out[2 * i] = make_uint4(scaled[0], scaled[1], scaled[2], scaled[3]);
    out[2 * i + 1] = make_uint4(scaled[4], scaled[5], scaled[6], scaled[7]);
  }
}

}  // namespace

void dequantize_fp8(const void* weight, const float* scale, bf16* out, int N, int K,
                    cudaStream_t stream) {
  require(N >= 1 && K >= 16 && K % 16 == 0,
          "dequantize_fp8: needs N >= 1 and K a positive multiple of 16, got N=" +
              std::to_string(N) + " K=" + std::to_string(K));
  require(scale != nullptr, "dequantize_fp8: scale is required");
  require_aligned(weight, "weight");
  require_aligned(out, "out");
  const int64_t chunks = static_cast<int64_t>(N) * (K / 16);
  const int threads = 256;
  const int grid = static_cast<int>(std::min<int64_t>((chunks + threads - 1) / threads, 4096));
  dequantize_fp8_kernel<<<grid, threads, 0, stream>>>(static_cast<const uint4*>(weight), scale,
                                                     reinterpret_cast<uint4*>(out), N, K);
  CUDA_CHECK_LAUNCH();
}

}  // namespace nanograph
