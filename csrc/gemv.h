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

// Memory that a kernel starts pulling into L2 for a later kernel (cp.async.bulk.prefetch, sm_90;
// a no-op elsewhere). At batch 1 a decode step streams each layer's weights in four GEMVs of
// 4-12 MB, separated by small kernels during which DRAM idles; a GEMV that prefetches the next
// GEMV's weight keeps DRAM busy through those gaps, and the next GEMV reads from L2.
// A hint only: it changes no result. bytes is rounded down to a multiple of 16; a pointer that
// is not 16-byte aligned, or bytes == 0, prefetches nothing.
struct L2Prefetch {
  const void* ptr = nullptr;
  size_t bytes = 0;
};

// x: [M, K] row-major; weight: [N, K] row-major (torch Linear layout); bias: [N] or nullptr;
// out: [M, N]. All bf16; fp32 accumulation, fp32 bias add, one rounding to bf16.
// x and weight must be 16-byte aligned. Deterministic; no allocation (graph-capturable).
// Launched with PDL (launch.h): the weight is read before the previous kernel on the stream has
// finished, so that kernel must not be the one writing the weight. Each CTA also prefetches its
// share of `prefetch` into L2 as it starts.
void gemv(const bf16* x, const bf16* weight, const bf16* bias, bf16* out, int M, int N, int K,
          cudaStream_t stream, L2Prefetch prefetch = {});

}  // namespace nanograph
