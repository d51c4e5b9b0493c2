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

// The MLP's down projection with the activation folded in: out[M, N] = act . weight[N, K]^T with
// act = silu(gate) * up, gate_up [M, 2K] (gate in columns [0, K), up in [K, 2K)), act rounded to
// bf16 exactly as silu_mul() (activation.h) rounds it, so the result equals silu_mul then gemv.
void gemv_silu_mul(const bf16* gate_up, const bf16* weight, bf16* out, int M, int N, int K,
                   cudaStream_t stream);

}  // namespace nanograph
