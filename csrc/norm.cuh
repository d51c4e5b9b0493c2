// The row arithmetic of RMSNorm and residual-add + RMSNorm (norm.cu), shared with the GEMVs that
// end in add_rmsnorm (gemv_add_rmsnorm, gemv.h): the same threads hold the same elements and sum
// them in the same order, so both give the same bits.
#pragma once
#include "bf16x8.cuh"

namespace nanograph::norm_detail {

constexpr int kMaxDim = 8192;
constexpr int kMaxWarpRowVecs = 64;  // rows of <= 512 elements: one warp per row
constexpr int kMaxCtaThreads = 256;
constexpr int kMaxVectorsPerThread = kMaxDim / 8 / kMaxCtaThreads;

// How a row of `dim` elements (a multiple of 8) is spread over threads: thread t holds the
// 16-byte vectors t, t + threads, t + 2 * threads, ... below dim / 8, at most vectors_per_thread
// of them (one warp for rows of up to 512 elements, else up to 256 threads).
struct RowThreads {
  int vectors_per_thread;
  int threads;
};

__host__ __device__ inline RowThreads row_threads(int dim) {
  const int vecs = dim / 8;
  if (vecs <= kMaxWarpRowVecs) return {(vecs + 31) / 32, 32};
  const int per_thread = (vecs + kMaxCtaThreads - 1) / kMaxCtaThreads;
  return {per_thread, ((vecs + per_thread - 1) / per_thread + 31) / 32 * 32};
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The row's sum from its threads' partial sums (threads [0, threads) of the CTA along x): within
// each warp, then the warps' sums in order. Over more than one warp every thread of the CTA calls
// it (a barrier), and warp_sums (kMaxCtaThreads / 32 floats of shared memory) is read until every
// thread has returned.
__device__ __forceinline__ float row_sum(float partial, int threads, float* warp_sums) {
  float sum = warp_sum(partial);
  if (threads > 32) {
    if (threadIdx.x % 32 == 0 && threadIdx.x < threads) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < threads / 32; ++w) sum += warp_sums[w];
  }
  return sum;
}

// out's 8 values: h * rstd rounded to bf16, times the weight, rounded again.
__device__ __forceinline__ void store_normalized(bf16* dst, Float8 h, const uint4& weight_raw,
                                                 float rstd) {
  const Float8 w = bf16x8_to_float8(weight_raw);
#pragma unroll
  for (int k = 0; k < 8; ++k) h.v[k] *= rstd;
  round_to_bf16(h);
#pragma unroll
  for (int k = 0; k < 8; ++k) h.v[k] *= w.v[k];
  store_bf16x8(dst, h);
}

// add_rmsnorm (norm.h) of rows [0, rows) by one CTA of at least row_threads(dim).threads threads,
// every thread calling: residual = bf16(x + residual); x = rmsnorm(residual) * weight. x and
// residual are read through L2 only, so rows that other CTAs of the same grid wrote are seen once
// their writes are (a fence on both sides, as in gemv's last-CTA epilogue).
__device__ inline void cta_add_rmsnorm(bf16* x, bf16* residual, const bf16* weight, int rows,
                                       int dim, float eps) {
  __shared__ float warp_sums[kMaxCtaThreads / 32];
  const RowThreads layout = row_threads(dim);
  const int vecs = dim / 8;
  const bool holds = threadIdx.x < layout.threads;
  // The weight is read after the row's sum: fetched into L1 now, it is not held in registers
  // meanwhile (the caller's register budget may be tight).
#pragma unroll
  for (int i = 0; i < kMaxVectorsPerThread; ++i) {
    const int v = threadIdx.x + i * layout.threads;
    if (!holds || v >= vecs) break;
    asm volatile("prefetch.global.L1 [%0];" ::"l"(weight + v * 8));
  }
  for (int row = 0; row < rows; ++row) {
    const int64_t row_offset = static_cast<int64_t>(row) * dim;
    // The sum bf16(x + residual), as stored into residual: 8 bf16 per vector hold it exactly.
    uint4 h[kMaxVectorsPerThread];
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxVectorsPerThread; ++i) {
      const int v = threadIdx.x + i * layout.threads;
      if (!holds || v >= vecs) break;
      const int64_t offset = row_offset + v * 8;
      Float8 sum = bf16x8_to_float8(__ldcg(reinterpret_cast<const uint4*>(x + offset)));
      const Float8 r = bf16x8_to_float8(__ldcg(reinterpret_cast<const uint4*>(residual + offset)));
#pragma unroll
      for (int k = 0; k < 8; ++k) sum.v[k] += r.v[k];
      h[i] = pack_bf16x8(sum);
      *reinterpret_cast<uint4*>(residual + offset) = h[i];
      const Float8 rounded = bf16x8_to_float8(h[i]);
#pragma unroll
      for (int k = 0; k < 8; ++k) sum_sq += rounded.v[k] * rounded.v[k];
    }
    const float rstd = rsqrtf(row_sum(sum_sq, layout.threads, warp_sums) / dim + eps);
#pragma unroll
    for (int i = 0; i < kMaxVectorsPerThread; ++i) {
      const int v = threadIdx.x + i * layout.threads;
      if (!holds || v >= vecs) break;
      store_normalized(x + row_offset + v * 8, bf16x8_to_float8(h[i]),
                       *reinterpret_cast<const uint4*>(weight + v * 8), rstd);
    }
    if (layout.threads > 32) __syncthreads();  // the next row rewrites warp_sums
  }
}

}  // namespace nanograph::norm_detail
