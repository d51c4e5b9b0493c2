// Small-M linear layers (decode at batch 1..kGemvMaxM, FP8 weights 1..kGemvFp8MaxM): y = x . W^T
// (+ bias), streaming the weight from memory once at close to full bandwidth, where cuBLASLt's tiles
// leave most SMs idle.
#pragma once
#include "common.h"

namespace nanograph {

// Rows of x one call takes. Tensor-core MMAs make 16 rows cost the same weight traffic and
// issue slots as one; 17..32 rows take a second MMA tile against the same weight fragments (the
// weight still read once). Where that beats an M-tiled GEMM depends on the weight's size:
// gemv_preferred.
constexpr int kGemvMaxM = 32;
// The FP8 GEMV's limit (gemv_fp8.cu: two MMA tiles of x rows 0..15); above it the block-scaled
// FP8 GEMM (Gemm::linear).
constexpr int kGemvFp8MaxM = 16;

// True when gemv() takes this shape: 1 <= M <= kGemvMaxM, N >= 1, K a positive multiple of 8.
bool gemv_supported(int M, int N, int K);

// True when a bf16 linear layer of M rows over an [N, K] weight should take the GEMV rather than
// cuBLASLt: Gemm::linear's choice, and the decode step's for its fused gate_up (gemv_silu_mul) and
// lm_head (gemv_argmax). Up to 8 rows always (where the GEMV supports the shape); the GEMV's time
// then grows with M, while cuBLASLt's sits at a floor of a few microseconds on small weights and
// streams large ones near bandwidth, so 9 to 16 rows take it for weights of at most
// kGemvMidElements elements and 17 to 32 rows for at most kGemvWideElements.
bool gemv_preferred(int M, int N, int K);
constexpr int64_t kGemvMidElements = 8 << 20;    // Qwen3-0.6B's projections; not Qwen3-8B's
constexpr int64_t kGemvWideElements = 7 << 19;   // Qwen3-0.6B's o and down, not its qkv

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
// gemv. True when gemv_fp8 takes the shape: 1 <= M <= kGemvFp8MaxM, N >= 1 and K a positive
// multiple of 16.
bool gemv_fp8_supported(int M, int N, int K);

void gemv_fp8(const bf16* x, const void* weight, const float* scale, const bf16* bias, bf16* out,
              int M, int N, int K, cudaStream_t stream);

// gemv_silu_mul over an FP8 gate_up weight; inter must be a multiple of 8 (kFp8ScaleRows).
void gemv_silu_mul_fp8(const bf16* x, const void* gate_up_weight, const float* scale, bf16* out,
                       int M, int inter, int K, cudaStream_t stream);

}  // namespace nanograph
