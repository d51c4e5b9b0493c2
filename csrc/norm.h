// RMSNorm and fused residual-add + RMSNorm, fp32 statistics, bf16 in and out.
#pragma once
#include "common.h"

namespace nanograph {

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
