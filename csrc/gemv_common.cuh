// Building blocks of the bf16 GEMV (gemv.cu) and the FP8 GEMV (gemv_fp8.cu): the launch constants,
// the 16-byte streaming loads, the bf16 MMA, and how a matrix's K range is split over warps. See
// gemv.cu's header for why the kernels are built this way.
#pragma once
#include "bf16x8.cuh"
#include "common.h"
#include "gemv.h"
#include "norm.h"
#include "rmsnorm.cuh"

#include <string>

namespace nanograph::gemv_detail {

constexpr int kWarpsPerCta = 8;  // the usual CTA; 16 when a row group takes 16 splits
constexpr int kMaxSplits = 16;
// Resident warps per SM the launch bounds allow: 2 CTAs of 8 or 1 of 16. This caps registers at
// 128, which is what holds a whole batch of loads in flight: without a minimum, ptxas trades
// them for occupancy and issues each load just before its MMA.
constexpr int kWarpsPerSm = 16;
constexpr int kTargetWarps = 2048;  // one full wave: 132 SMs x kWarpsPerSm
constexpr int kAlignmentBytes = 16;
constexpr int kStreamWaves = 8;  // waves of CTAs at which splitting stops for streamed matrices

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

// 16 bytes of x from an address known to be valid.
__device__ __forceinline__ uint4 load_x(const bf16* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// 16 bytes of shared memory, or zeros where !pred (the predicate inside the asm, as above).
__device__ __forceinline__ uint4 load_shared(const bf16* ptr, bool pred) {
  uint4 v;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %5, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  mov.b32 %1, 0;\n"
      "  mov.b32 %2, 0;\n"
      "  mov.b32 %3, 0;\n"
      "  @p ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))), "r"(static_cast<int>(pred)));
  return v;
}

// x's rows as a kernel reads them: from global memory (row stride K), or, with a fused input norm,
// from the CTA's shared memory (row stride K + kNormRowPad).
template <bool kShared>
__device__ __forceinline__ uint4 load_x_row(const bf16* ptr, bool pred) {
  if constexpr (kShared) {
    return load_shared(ptr, pred);
  } else {
    return load_x(ptr, pred);
  }
}

template <bool kShared>
__device__ __forceinline__ uint4 load_x_row(const bf16* ptr) {
  if constexpr (kShared) {
    return load_shared(ptr, true);
  } else {
    return load_x(ptr);
  }
}

// Shared-memory rows of a fused input norm are padded by 16 bytes, so that the 8 rows a warp
// reads at one column start in different banks.
constexpr int kNormRowPad = 8;

__host__ __device__ inline int norm_row_stride(int K) { return K + kNormRowPad; }

// Rows at once of a fused input norm: the CTA's threads cut into groups of rmsnorm_cut's threads.
__host__ __device__ inline int norm_rows_per_round(int cta_threads, int K) {
  return cta_threads / rmsnorm_cut(K).threads;
}

// 16-byte vectors per thread of a fused input norm's row (rmsnorm_cut): rows of up to 4,096.
constexpr int kNormMaxVectors = 2;

// Whether a fused input norm takes M rows of K: at most 8 rows (one MMA's x rows), K of at most
// kNormMaxVectors vectors per thread, and at most two rounds of an 8-warp CTA's thread groups.
inline bool input_norm_fits(int M, int K) {
  return M >= 1 && M <= 8 && K >= 8 && K % 8 == 0 && K <= kRmsNormMaxDim &&
         rmsnorm_cut(K).vectors_per_thread <= kNormMaxVectors &&
         M <= 2 * norm_rows_per_round(kWarpsPerCta * 32, K);
}

// A fused input norm's weight vectors of this thread (those stage_input_norm multiplies by), loaded
// before the PDL wait: no kernel writes the weight.
__device__ __forceinline__ void load_input_norm_weight(const GemvInputNorm& norm, int K,
                                                       uint4 (&weight)[kNormMaxVectors]) {
  const RmsNormCut cut = rmsnorm_cut(K);
  const int j = threadIdx.x % cut.threads;
#pragma unroll
  for (int i = 0; i < kNormMaxVectors; ++i) {
    const int v = j + i * cut.threads;
    weight[i] = i < cut.vectors_per_thread && v < K / 8
                    ? *reinterpret_cast<const uint4*>(norm.weight + v * 8)
                    : make_uint4(0, 0, 0, 0);
  }
}

// The fused input norm (GemvInputNorm): rows [0, M) of rmsnorm(bf16(x + residual)) * weight into
// s_rows (row stride norm_row_stride(K)), bit-equal to add_rmsnorm: thread j of each group of
// rmsnorm_cut(K).threads threads plays the norm kernel's thread j, with the same vectors, sums and
// roundings. `weight` from load_input_norm_weight. CTA 0 also stores bf16(x + residual) into
// residual_out. Every thread of the CTA calls it (barriers); the rows are in s_rows when it
// returns. After the PDL wait.
template <int kThreads>
__device__ __forceinline__ void stage_input_norm(const bf16* __restrict__ x, const GemvInputNorm& norm,
                                                 const uint4 (&weight)[kNormMaxVectors], int M,
                                                 int K, bf16* s_rows) {
  constexpr int kMaxVectorsPerThread = kNormMaxVectors;
  __shared__ float warp_sums[kThreads / 32];
  const RmsNormCut cut = rmsnorm_cut(K);
  const int vecs = K / 8, stride = norm_row_stride(K);
  const int group = threadIdx.x / cut.threads, j = threadIdx.x % cut.threads;
  const int groups = kThreads / cut.threads, group_warps = cut.threads / 32;
  const int warp = threadIdx.x / 32;
  for (int m0 = 0; m0 < M; m0 += groups) {
    const int m = m0 + group;
    const bool active = group < groups && m < M;
    const int64_t row = static_cast<int64_t>(m) * K;
    bf16* s_row = s_rows + m * stride;
    // bf16(x + residual) goes to s_row as it is (exact: it is rounded to bf16), and is read back
    // by the same thread once the row's statistics are known.
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxVectorsPerThread; ++i) {
      const int v = j + i * cut.threads;
      if (!active || i >= cut.vectors_per_thread || v >= vecs) break;
      Float8 h = load_bf16x8(x + row + v * 8);
      const Float8 r = load_bf16x8(norm.residual + row + v * 8);
#pragma unroll
      for (int k = 0; k < 8; ++k) h.v[k] += r.v[k];
      round_to_bf16(h);
      store_bf16x8(s_row + v * 8, h);
      if (blockIdx.x == 0) store_bf16x8(norm.residual_out + row + v * 8, h);
#pragma unroll
      for (int k = 0; k < 8; ++k) sum_sq += h.v[k] * h.v[k];
    }
    sum_sq = warp_sum(sum_sq);
    if (threadIdx.x % 32 == 0) warp_sums[warp] = sum_sq;
    __syncthreads();
    if (active) {
      float total = 0.f;
      for (int w = 0; w < group_warps; ++w) total += warp_sums[group * group_warps + w];
      const float rstd = rsqrtf(total / K + norm.eps);
#pragma unroll
      for (int i = 0; i < kMaxVectorsPerThread; ++i) {
        const int v = j + i * cut.threads;
        if (i >= cut.vectors_per_thread || v >= vecs) break;
        Float8 h = load_bf16x8(s_row + v * 8);
        const Float8 w = bf16x8_to_float8(weight[i]);
#pragma unroll
        for (int k = 0; k < 8; ++k) h.v[k] *= rstd;
        round_to_bf16(h);
#pragma unroll
        for (int k = 0; k < 8; ++k) h.v[k] *= w.v[k];
        store_bf16x8(s_row + v * 8, h);
      }
    }
    __syncthreads();  // the rows are stored; warp_sums may be written again
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

inline std::string shape_str(int M, int N, int K) {
  return "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K);
}

inline void require_aligned(const void* ptr, const char* name) {
  require(reinterpret_cast<uintptr_t>(ptr) % kAlignmentBytes == 0,
          std::string("gemv: ") + name + " must be " + std::to_string(kAlignmentBytes) +
              "-byte aligned; pass a contiguous copy instead of an offset view");
}

// A launcher's checks of a GemvInputNorm (gemv.h) for M rows of K.
// supported: the kernel's gemv_input_norm_supported (or its FP8 one) for the weight's N rows.
inline void require_input_norm(const GemvInputNorm& norm, bool supported, const bf16* x, int M,
                               int N, int K, const char* op) {
  require(supported, std::string(op) + ": a fused input norm takes " + shape_str(M, N, K) +
                         " (N: the weight's rows) only where gemv_input_norm_supported (for an FP8 "
                         "weight gemv_fp8_input_norm_supported) is true; run add_rmsnorm, then the "
                         "GEMV without it");
  require(norm.residual != nullptr && norm.residual_out != nullptr && norm.weight != nullptr,
          std::string(op) + ": a fused input norm needs residual, residual_out and weight");
  require(norm.residual_out != norm.residual && norm.residual_out != x,
          std::string(op) + ": the fused input norm's residual_out must be another buffer than "
                            "residual and x (every CTA reads them while CTA 0 writes it)");
  require_aligned(norm.residual, "norm residual");
  require_aligned(norm.residual_out, "norm residual_out");
  require_aligned(norm.weight, "norm weight");
}

inline size_t input_norm_smem_bytes(int M, int K) {
  return static_cast<size_t>(M) * norm_row_stride(K) * sizeof(bf16);
}

// K splits per row group, for a kernel whose warps keep `unroll` steps of loads in flight: a
// warp owns one row group and one of `splits` contiguous ranges of its `steps` warp steps.
// Matrices of at most two load batches per warp of a full wave fit one wave: splits double while
// the launch stays within it (so that no matrix ends in a partial second wave) and while a split
// holds more than one load batch (below that, more splits add warps but no bytes in flight).
// Larger ones (Qwen3-8B's projections, any lm_head) stream through several waves of 8-warp CTAs:
// splits double (up to 8, each split keeping two load batches) until the grid has kStreamWaves
// waves, so that the last, partial wave is short against the whole launch.
// Whether a matrix streams through several waves (see choose_splits).
inline bool streams(int row_groups, int steps, int unroll) {
  return static_cast<int64_t>(row_groups) * steps > 2LL * unroll * kTargetWarps;
}

inline int choose_splits(int row_groups, int steps, int unroll) {
  int splits = 1;
  if (!streams(row_groups, steps, unroll)) {
    while (splits < kMaxSplits && 2 * row_groups * splits <= kTargetWarps && 2 * splits <= steps &&
           ceil_div(steps, splits) > unroll) {
      splits *= 2;
    }
    return splits;
  }
  auto ctas = [&](int s) { return ceil_div(row_groups * s, kWarpsPerCta); };
  while (2 * splits <= kWarpsPerCta && 2 * splits * 2 * unroll <= steps &&
         ctas(splits) * kWarpsPerCta < kStreamWaves * kTargetWarps) {
    splits *= 2;
  }
  return splits;
}

}  // namespace nanograph::gemv_detail
