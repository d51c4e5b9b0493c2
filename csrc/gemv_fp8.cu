// Small-M GEMV over FP8 weights: out[M, N] = x[M, K] . dequant(weight)[N, K]^T (+ bias[N]),
// 1 <= M <= 16, x and out bf16, the weight e4m3 with a float32 scale per 8 rows x 128 columns
// (fp8.h); fp32 accumulation, (sum + bias) rounded once to bf16. gemv_silu_mul_fp8 is
// gemv_silu_mul (gemv.cu) over such a weight. dequantize_fp8 writes the weight as bf16, for
// cuBLASLt above 16 rows.
//
// Layouts: x [M, K], weight [N, K] (torch Linear), out [M, N], all row-major; bias [N].
//
// Why its own kernel: an e4m3 weight is half the bytes of bf16, but each value must be widened
// before the bf16 MMA (four instructions per pair), so the kernel runs out of issue slots before
// it runs out of bandwidth unless every other instruction per weight byte goes. Here the weight is
// the MMA's A operand (16 rows), and x its B operand (8 columns = the M rows): one MMA covers twice
// the weight of gemv.cu's layout, and x's fragment serves two weight rows per lane.
//
// Math: a warp step at k0 covers 16 weight rows x 64 columns. Lane (g = lane / 4, c = lane % 4)
// loads 16 e4m3 (16 bytes) of weight rows g and g + 8 of its row group at k0 + 16c .. k0 + 16c + 15,
// and 16 bf16 of x row g at the same columns; lane element 4j + {0, 1, 2, 3} feeds MMA j as
// fragment k = 2c, 2c + 1, 2c + 8, 2c + 9 in both operands (a sum over K may visit K in any order
// as long as x and weight use the same one). The four MMAs sum the step into a fresh fp32 partial;
// a step never crosses a 128-column scale block, so the partial of row r is multiplied by its
// row's block scale and added to the accumulator. Lane (g, c) ends with
// out[m = 2c, 2c + 1][n = row g and row g + 8 of the group]; for M > 8 a second set of MMAs takes
// x rows 8 + g (m + 8). x rows past M read row M - 1 (their sums are not stored); columns past K
// load a zero weight against x clamped into the row, so no x load needs a bound (a non-finite
// x in the row's last 16 columns then also reaches the lanes past K: NaN where the sum is +-Inf).
// SiLU layout: a row group covers 8 output columns n0 .. n0 + 7, rows g the gate rows and rows
// g + 8 the up rows of column n0 + g, so one lane holds both halves of the gated product.
//
// Launch: as gemv.cu (one row group and one K split per warp, splits summed in shared memory in
// a fixed order; the grid from gemv_fp8_grid), with kUnroll steps of two 16-byte weight loads per
// lane in flight, the next batch's halves issued as soon as their registers are free. A grid of
// more than one wave at 2 CTAs per SM runs at 3, and one-wave grids split further (gemv_fp8_grid,
// gemv_plan.h); at M <= 8, where every split is at most one load batch, it is widened before the
// PDL wait (kWidenEarly).
#include "gemv.h"

#include "e4m3.cuh"
#include "fp8.h"
#include "gemv_common.cuh"
#include "launch.h"
#include "silu_mul.cuh"

#include <algorithm>
#include <string>

namespace nanograph {

namespace {

using namespace gemv_detail;

constexpr int kRows = 16;  // weight rows per group: the m of one mma.m16n8k16
constexpr int kStep = 64;  // K per warp step: 4 lanes x 16 e4m3
constexpr int kUnroll = 4;  // warp steps whose weight loads are in flight together
constexpr int kHalf = kUnroll / 2;

// 16 e4m3 values as 8 bf16x2: out[j] holds elements 2j (low half) and 2j + 1.
__device__ __forceinline__ void fp8x16_to_bf16(const uint4& v, uint32_t (&out)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = e4m3x2_to_bf16x2(words[i]);
    out[2 * i + 1] = e4m3x2_to_bf16x2(words[i] >> 16);
  }
}

// fp8x16_to_bf16 in asm volatile, so that it stays ahead of the PDL wait (asm volatile too) where a
// kernel widens its weights before it: the same conversions, e4m3 -> fp16 -> fp32 -> bf16, exact.
// Before sm_89 (no e4m3 conversion instruction, and no PDL wait) it is fp8x16_to_bf16.
__device__ __forceinline__ void fp8x16_to_bf16_before_wait(const uint4& v, uint32_t (&out)[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  fp8x16_to_bf16(v, out);
#else
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    asm volatile(
        "{\n"
        ".reg .b16 b0, b1, h0, h1, h2, h3;\n"
        ".reg .b32 p0, p1;\n"
        ".reg .f32 f0, f1, f2, f3;\n"
        "mov.b32 {b0, b1}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 p0, b0;\n"
        "cvt.rn.f16x2.e4m3x2 p1, b1;\n"
        "mov.b32 {h0, h1}, p0;\n"
        "mov.b32 {h2, h3}, p1;\n"
        "cvt.f32.f16 f0, h0;\n"
        "cvt.f32.f16 f1, h1;\n"
        "cvt.f32.f16 f2, h2;\n"
        "cvt.f32.f16 f3, h3;\n"
        "cvt.rn.bf16x2.f32 %0, f1, f0;\n"
        "cvt.rn.bf16x2.f32 %1, f3, f2;\n"
        "}\n"
        : "=r"(out[2 * i]), "=r"(out[2 * i + 1])
        : "r"(words[i]));
  }
#endif
}

// One step's partial sums of weight rows g (d[0], d[1]) and g + 8 (d[2], d[3]) against the x
// row whose 16 values are xa (elements 0-7) and xb (8-15).
__device__ __forceinline__ void step_mma(float (&d)[4], const uint32_t (&lo)[8],
                                         const uint32_t (&hi)[8], const uint4& xa, const uint4& xb) {
  mma_16x8x16(d, lo[0], hi[0], lo[1], hi[1], xa.x, xa.y);
  mma_16x8x16(d, lo[2], hi[2], lo[3], hi[3], xa.z, xa.w);
  mma_16x8x16(d, lo[4], hi[4], lo[5], hi[5], xb.x, xb.y);
  mma_16x8x16(d, lo[6], hi[6], lo[7], hi[7], xb.z, xb.w);
}

// acc += one step's sums of rows g (times their block scale s_lo) and g + 8 (times s_hi): the
// step is summed into a fresh fp32 partial, which is then scaled.
__device__ __forceinline__ void add_scaled_step(float (&acc)[4], const uint32_t (&lo)[8],
                                                const uint32_t (&hi)[8], const uint4& xa,
                                                const uint4& xb, float s_lo, float s_hi) {
  float part[4] = {};
  step_mma(part, lo, hi, xa, xb);
  acc[0] += s_lo * part[0];
  acc[1] += s_lo * part[1];
  acc[2] += s_hi * part[2];
  acc[3] += s_hi * part[3];
}

// kWideM: M > 8 (a second set of MMAs for x rows 8..15). kWarps: warps per CTA. kSiluMul: the
// gated MLP's epilogue over weight [2N, K] (gate rows, then up rows; N a multiple of 8).
// kWidenEarly: every split is at most one load batch (steps_per_split <= kUnroll), x at most 8
// rows, 16 resident warps; the batch is widened to bf16 before the PDL wait, so that what the wait
// leaves is loading x and the MMAs, as in the bf16 GEMV.
template <bool kWideM, int kWarps, bool kSiluMul, int kResidentWarps, bool kWidenEarly>
__global__ void __launch_bounds__(kWarps * 32, kResidentWarps / kWarps)
    gemv_fp8_kernel(const bf16* __restrict__ x, const uint8_t* __restrict__ weight,
                    const float* __restrict__ scale, const bf16* __restrict__ bias,
                    bf16* __restrict__ out, int M, int N, int K, int splits,
                    int steps_per_split) {
  constexpr int kTiles = kWideM ? 2 : 1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, c = lane % 4;
  const int split = warp % splits;
  const int group = blockIdx.x * (kWarps / splits) + warp / splits;
  // The lane's two weight rows; rows past N read row N - 1 and are not stored.
  int n0, row_lo, row_hi;
  if constexpr (kSiluMul) {
    n0 = group * (kRows / 2);
    const int column = min(n0 + g, N - 1);
    row_lo = column;
    row_hi = N + column;
  } else {
    n0 = group * kRows;
    row_lo = min(n0 + g, N - 1);
    row_hi = min(n0 + 8 + g, N - 1);
  }
  const uint8_t* w_lo = weight + static_cast<int64_t>(row_lo) * K + 16 * c;
  const uint8_t* w_hi = weight + static_cast<int64_t>(row_hi) * K + 16 * c;
  const int steps = (K + kStep - 1) / kStep;
  const int begin = split * steps_per_split;
  const int end = n0 < N ? min(begin + steps_per_split, steps) : begin;
  const int scale_cols = static_cast<int>(fp8_scale_cols(K));
  const float* scale_lo = scale + static_cast<int64_t>(row_lo / kFp8ScaleRows) * scale_cols;
  const float* scale_hi = scale + static_cast<int64_t>(row_hi / kFp8ScaleRows) * scale_cols;

  // The block scales of a step's rows. They were last read a whole decode step ago, so they come
  // from DRAM: at 16 resident warps (x at most 8 rows) they are loaded with the weights, and the
  // first batch's before the wait; at 24, or with 16 x rows, those registers would spill, and each
  // step loads its own.
  constexpr bool kScalesWithWeights = !kWideM && kResidentWarps == kWarpsPerSm;
  // Steps past the split: where the split is one batch (kWidenEarly), nothing is loaded (0);
  // elsewhere the block is clamped into the row (a predicate on every load made Qwen3-8B's
  // multi-batch splits slower than these few wasted loads).
  auto block_scales = [&](int step, float& s_lo, float& s_hi) {
    const int block = min(step * kStep, K - 1) / kFp8ScaleCols;
    if constexpr (kWidenEarly) {
      s_lo = load_scale(scale_lo + block, step < end);
      s_hi = load_scale(scale_hi + block, step < end);
    } else {
      s_lo = load_scale(scale_lo + block);
      s_hi = load_scale(scale_hi + block);
    }
  };
  uint4 w[kUnroll][2];
  float s[kUnroll][2];
  // Steps step0 + u for u in [first, last) into w[u] (and s[u]).
  auto load_weights = [&](int step0, int first, int last) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u < first || u >= last) continue;
      const int k = (step0 + u) * kStep;
      const bool pred = step0 + u < end && k + 16 * c < K;
      w[u][0] = load_weight(w_lo + k, pred);
      w[u][1] = load_weight(w_hi + k, pred);
      if constexpr (kScalesWithWeights) block_scales(step0 + u, s[u][0], s[u][1]);
    }
  };
  // The weight does not come from the previous kernel: its first batch is in flight before the
  // wait for x (PDL, launch.h).
  load_weights(begin, 0, kUnroll);
  static_assert(!kWidenEarly || (!kWideM && kScalesWithWeights), "kWidenEarly: M <= 8, 16 warps");
  uint32_t wide[kWidenEarly ? kUnroll : 1][2][8];
  const bf16* x_at[kWidenEarly ? kUnroll : 1];  // where each step's x columns start
  if constexpr (kWidenEarly) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      fp8x16_to_bf16_before_wait(w[u][0], wide[u][0]);
      fp8x16_to_bf16_before_wait(w[u][1], wide[u][1]);
    }
    const bf16* x_row = x + static_cast<int64_t>(min(g, M - 1)) * K;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) x_at[u] = x_row + min((begin + u) * kStep + 16 * c, K - 16);
  }
  wait_for_producers_after_loads();
  allow_dependents();

  float acc[kTiles][4] = {};
  if constexpr (kWidenEarly) {
    if (n0 < N) {
      // x of all the split's steps at once, then one MMA chain per step.
      uint4 xs[kUnroll][2];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        xs[u][0] = load_x(x_at[u], begin + u < end);
        xs[u][1] = load_x(x_at[u] + 8, begin + u < end);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (begin + u < end) {
          add_scaled_step(acc[0], wide[u][0], wide[u][1], xs[u][0], xs[u][1], s[u][0], s[u][1]);
        }
      }
    }
  } else if (n0 < N) {
    const bf16* x_rows[kTiles];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) x_rows[t] = x + static_cast<int64_t>(min(8 * t + g, M - 1)) * K;
    // At 16 resident warps x is loaded one step ahead, so that its load (an L1 or, often, an L2
    // hit) overlaps the widening and the MMAs of the step before instead of stalling the step that
    // reads it; at 24 the registers this holds would spill.
    constexpr bool kXAhead = kResidentWarps == kWarpsPerSm;
    uint4 x_next[kTiles][2];
    auto load_x_step = [&](int step) {
      const int kx = min(step * kStep + 16 * c, K - 16);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        x_next[t][0] = load_x(x_rows[t] + kx);
        x_next[t][1] = load_x(x_rows[t] + kx + 8);
      }
    };
    if constexpr (kXAhead) load_x_step(begin);
    for (int step0 = begin; step0 < end; step0 += kUnroll) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (step0 + u < end) {
          float s_lo, s_hi;
          if constexpr (kScalesWithWeights) {
            s_lo = s[u][0];
            s_hi = s[u][1];
          } else {
            block_scales(step0 + u, s_lo, s_hi);
          }
          if constexpr (!kXAhead) load_x_step(step0 + u);
          uint4 xs[kTiles][2];
#pragma unroll
          for (int t = 0; t < kTiles; ++t) {
            xs[t][0] = x_next[t][0];
            xs[t][1] = x_next[t][1];
          }
          // In bounds past the split too: the column is clamped.
          if constexpr (kXAhead) load_x_step(step0 + u + 1);
          uint32_t lo[8], hi[8];
          fp8x16_to_bf16(w[u][0], lo);
          fp8x16_to_bf16(w[u][1], hi);
#pragma unroll
          for (int t = 0; t < kTiles; ++t) {
            add_scaled_step(acc[t], lo, hi, xs[t][0], xs[t][1], s_lo, s_hi);
          }
        }
        if (u == kHalf - 1) load_weights(step0 + kUnroll, 0, kHalf);
        if (u == kUnroll - 1) load_weights(step0 + kUnroll, kHalf, kUnroll);
      }
    }
  }

  if (splits > 1) {
    __shared__ float partial[kWarps][kTiles * 4][32];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][4 * t + i][lane] = acc[t][i];
    }
    __syncthreads();
    if (split != 0) return;
    // The group's splits are warps warp .. warp + splits - 1; summed in that order.
    for (int s = 1; s < splits; ++s) {
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] += partial[warp + s][4 * t + i][lane];
      }
    }
  }

#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int m = 8 * t + 2 * c + j;
      if (m >= M) continue;
      bf16* out_row = out + static_cast<int64_t>(m) * N;
      if constexpr (kSiluMul) {
        // Gate and up rounded to bf16, as the unfused gemv_fp8 stores them, then silu_mul's formula.
        const int n = n0 + g;
        if (n < N) {
          const float gate = __bfloat162float(__float2bfloat16_rn(acc[t][j]));
          const float up = __bfloat162float(__float2bfloat16_rn(acc[t][2 + j]));
          out_row[n] = __float2bfloat16_rn(silu_mul_value(gate, up));
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = n0 + 8 * h + g;
          if (n < N) {
            const float sum = acc[t][2 * h + j];
            out_row[n] = __float2bfloat16_rn(bias ? sum + __bfloat162float(bias[n]) : sum);
          }
        }
      }
    }
  }
}

// N: out's width (gemv_fp8's N, or gemv_silu_mul_fp8's inter).
template <bool kSiluMul>
void launch_gemv_fp8(const bf16* x, const void* weight, const float* scale, const bf16* bias,
                     bf16* out, int M, int N, int K, cudaStream_t stream, const char* op) {
  require_gemv_shape(gemv_fp8_supported(M, kSiluMul ? 2 * N : N, K), op, M, N, K, 16,
                     kGemvFp8MaxM);
  require_aligned(op, "x", x);
  require_aligned(op, "weight", weight);
  require(scale != nullptr, std::string(op) + ": an FP8 weight needs its block scales");
  require(!kSiluMul || N % kFp8ScaleRows == 0,
          std::string(op) + ": inter must be a multiple of " + std::to_string(kFp8ScaleRows) +
              ", got " + std::to_string(N));

  const int row_groups = ceil_div(N, kSiluMul ? kRows / 2 : kRows);
  const int steps = ceil_div(K, kStep);
  const int sms = device_props().sm_count;
  const GemvGrid g = gemv_fp8_grid(row_groups, steps, kUnroll, M, sms);
  const bool widen_early = gemv_fp8_widens_early(g, kUnroll, M);
  constexpr int k16 = kWarpsPerSm, k24 = kThreeCtaWarpsPerSm;
  auto kernel =
      g.resident_warps == k24 ? gemv_fp8_kernel<false, kWarpsPerCta, kSiluMul, k24, false>
      : g.warps == kWarpsPerCta
          ? (M > 8         ? gemv_fp8_kernel<true, kWarpsPerCta, kSiluMul, k16, false>
             : widen_early ? gemv_fp8_kernel<false, kWarpsPerCta, kSiluMul, k16, true>
                           : gemv_fp8_kernel<false, kWarpsPerCta, kSiluMul, k16, false>)
          : (M > 8         ? gemv_fp8_kernel<true, kMaxSplits, kSiluMul, k16, false>
             : widen_early ? gemv_fp8_kernel<false, kMaxSplits, kSiluMul, k16, true>
                           : gemv_fp8_kernel<false, kMaxSplits, kSiluMul, k16, false>);
  launch_pdl(kernel, dim3(g.ctas), dim3(g.warps * 32), 0, stream, x,
             static_cast<const uint8_t*>(weight), scale, bias, out, M, N, K, g.splits,
             g.steps_per_split);
}

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

bool gemv_fp8_supported(int M, int N, int K) {
  return M >= 1 && M <= kGemvFp8MaxM && N >= 1 && K >= 16 && K % 16 == 0;
}

void gemv_fp8(const bf16* x, const void* weight, const float* scale, const bf16* bias, bf16* out,
              int M, int N, int K, cudaStream_t stream) {
  launch_gemv_fp8<false>(x, weight, scale, bias, out, M, N, K, stream, "gemv_fp8");
}

void gemv_silu_mul_fp8(const bf16* x, const void* gate_up_weight, const float* scale, bf16* out,
                       int M, int inter, int K, cudaStream_t stream) {
  launch_gemv_fp8<true>(x, gate_up_weight, scale, nullptr, out, M, inter, K, stream,
                        "gemv_silu_mul_fp8");
}

void dequantize_fp8(const void* weight, const float* scale, bf16* out, int N, int K,
                    cudaStream_t stream) {
  require(N >= 1 && K >= 16 && K % 16 == 0,
          "dequantize_fp8: needs N >= 1 and K a positive multiple of 16, got N=" +
              std::to_string(N) + " K=" + std::to_string(K));
  require(scale != nullptr, "dequantize_fp8: scale is required");
  require_aligned("dequantize_fp8", "weight", weight);
  require_aligned("dequantize_fp8", "out", out);
  const int64_t chunks = static_cast<int64_t>(N) * (K / 16);
  const int threads = 256;
  const int grid = static_cast<int>(std::min<int64_t>((chunks + threads - 1) / threads, 4096));
  dequantize_fp8_kernel<<<grid, threads, 0, stream>>>(static_cast<const uint4*>(weight), scale,
                                                     reinterpret_cast<uint4*>(out), N, K);
  CUDA_CHECK_LAUNCH();
}

}  // namespace nanograph
