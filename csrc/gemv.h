// Small-M linear layers (decode at batch 1..kGemvMaxM): y = x . W^T (+ bias), streaming the weight
// from memory once at close to full bandwidth, where cuBLASLt's tiles leave most SMs idle.
#pragma once
#include "common.h"

namespace nanograph {

// Rows of x one call takes. Tensor-core MMAs make 16 rows cost the same weight traffic and
// issue slots as one, so the limit is where an M-tiled GEMM takes over, not the kernel's cost.
constexpr int kGemvMaxM = 16;

// True when gemv() takes this shape: 1 <= M <= kGemvMaxM, N >= 1, K a positive multiple of 8.
bool gemv_supported(int M, int N, int K);

// x: [M, K] row-major; weight: [N, K] row-major (torch Linear layout); bias: [N] or nullptr;
// out: [M, N]. All bf16; fp32 accumulation, fp32 bias add, one rounding to bf16.
// x and weight must be 16-byte aligned. Deterministic; no allocation (graph-capturable).
// Launched with PDL (launch.h): the weight is read before the previous kernel on the stream has
// finished, so that kernel must not be the one writing the weight.
void gemv(const bf16* x, const bf16* weight, const bf16* bias, bf16* out, int M, int N, int K,
          cudaStream_t stream);

}  // namespace nanograph
