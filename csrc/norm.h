// RMSNorm and fused residual-add + RMSNorm, fp32 statistics, bf16 in and out.
#pragma once
#include "common.h"

namespace nanograph {

// Rows of up to kRmsNormMaxDim elements, a multiple of 8 (16-byte vectors).
constexpr int kRmsNormMaxDim = 8192;

// How the norm kernels cut one row of `dim` elements into threads, which fixes the order of the
// fp32 sum of squares: thread i of `threads` sums the squares of its 16-byte vectors i,
// i + threads, ... (at most `vectors_per_thread`) in order, elements in order; each warp's 32 sums
// are added by an xor-shuffle tree, and the warps' sums in warp order, starting from 0. Rows of
// up to 64 vectors take one warp, wider rows at most 256 threads. The GEMV's fused input norm
// (GemvInputNorm, gemv.h) cuts rows the same way, so its statistics are bit-equal.
struct RmsNormCut {
  int threads;
  int vectors_per_thread;
};

__host__ __device__ inline RmsNormCut rmsnorm_cut(int dim) {
  const int vecs = dim / 8;
  if (vecs <= 64) return {32, (vecs + 31) / 32};
  const int per_thread = (vecs + 255) / 256;
  const int threads = ((vecs + per_thread - 1) / per_thread + 31) / 32 * 32;
  return {threads, per_thread};
}

// x, out: [rows, dim]; weight: [dim]. out = x * rsqrt(mean(x^2) + eps) * weight.
void rmsnorm(const bf16* x, const bf16* weight, bf16* out, int rows, int dim, float eps,
             cudaStream_t stream);

// In place, as in HF transformers' decoder layers:
//   residual = bf16(x + residual);  x = rmsnorm(residual) * weight.
// x, residual: [rows, dim]; weight: [dim].
void add_rmsnorm(bf16* x, bf16* residual, const bf16* weight, int rows, int dim, float eps,
                 cudaStream_t stream);

// The first decoder layer's input in one kernel: residual = embedding(ids) (embedding()'s rows,
// id resolution and zero rows for ids outside [0, vocab)) and out = rmsnorm(residual) * weight,
// bit-equal to the two kernels. ids, id_src, sampled as embedding() takes them; table
// [vocab, dim]; residual, out [rows, dim]. Launched with PDL; it waits before it reads the ids.
void embedding_rmsnorm(const int32_t* ids, const bf16* table, int vocab, bf16* residual,
                       const bf16* weight, bf16* out, int rows, int dim, float eps,
                       cudaStream_t stream, const int32_t* id_src = nullptr,
                       const int32_t* sampled = nullptr);

}  // namespace nanograph
