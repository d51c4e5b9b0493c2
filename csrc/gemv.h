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

// The gated MLP's first half in one kernel: out[M, inter] = silu(gate) * up, where gate and up
// are x . W^T over gate_up_weight [2 * inter, K] (gate rows first, as silu_mul expects its input),
// each rounded to bf16 as gemv would store it; then silu_mul's fp32 formula and one rounding.
// Bit-equal to gemv into [M, 2 * inter] followed by silu_mul, without the intermediate tensor or
// the second kernel. Same limits and launch as gemv (gemv_supported(M, 2 * inter, K)).
void gemv_silu_mul(const bf16* x, const bf16* gate_up_weight, bf16* out, int M, int inter, int K,
                   cudaStream_t stream);

// lm_head at a greedy step: gemv into logits [M, N], and out[m] = argmax of logits row m as
// stored (bf16), in torch.argmax's order (NaN first, then larger values, ties to the lower
// index), also into host_out when given (the GPU's address of mapped pinned memory). keys:
// kGemvMaxM zeroed words of device workspace, left zeroed; one call at a time may use them.
// Two kernels on PDL; bit-equal logits to gemv's. Same limits as gemv.
void gemv_argmax(const bf16* x, const bf16* weight, const bf16* bias, bf16* logits, int M, int N,
                 int K, uint64_t* keys, int32_t* out, int32_t* host_out, cudaStream_t stream);

// FP8 weights (fp8.h: e4m3 with block scales), in gemv_fp8.cu: each e4m3 value widened exactly to
// bf16, each 64-column step's sum scaled by its rows' block scale in fp32; the same PDL launch as
// gemv. True when gemv_fp8 takes the shape: gemv_supported and K a multiple of 16.
bool gemv_fp8_supported(int M, int N, int K);

void gemv_fp8(const bf16* x, const void* weight, const float* scale, const bf16* bias, bf16* out,
              int M, int N, int K, cudaStream_t stream);

// gemv_silu_mul over an FP8 gate_up weight; inter must be a multiple of 8 (kFp8ScaleRows).
void gemv_silu_mul_fp8(const bf16* x, const void* gate_up_weight, const float* scale, bf16* out,
                       int M, int inter, int K, cudaStream_t stream);

}  // namespace nanograph
