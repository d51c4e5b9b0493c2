// FP8 weights: e4m3 values with one float32 scale per block of kFp8ScaleRows rows x kFp8ScaleCols
// columns, w[n, k] = float(q[n, k]) * scale[n / kFp8ScaleRows][k / kFp8ScaleCols], scale
// row-major [ceil(N / kFp8ScaleRows), ceil(K / kFp8ScaleCols)]. Hugging Face's fine-grained
// checkpoints scale 128 x 128 blocks; the loader repeats each block's scale over its 8-row groups,
// so that fused projections (q|k|v, gate|up) whose parts are multiples of 8 rows but not of 128
// keep their own scales (0.4% more bytes than the weight alone).
#pragma once
#include "common.h"

namespace nanograph {

constexpr int kFp8ScaleRows = 8;
constexpr int kFp8ScaleCols = 128;

// The scale tensor's shape for a weight [N, K].
__host__ __device__ inline int64_t fp8_scale_rows(int64_t N) {
  return (N + kFp8ScaleRows - 1) / kFp8ScaleRows;
}
__host__ __device__ inline int64_t fp8_scale_cols(int64_t K) {
  return (K + kFp8ScaleCols - 1) / kFp8ScaleCols;
}

// The block-scaled FP8 GEMM (gemm.h) takes the weight's scales once per 128 x 128 block, in the
// layout of cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F for its A operand (the weight):
// K-major, the stride between 128-row blocks a multiple of 4, i.e. row-major
// [ceil(N / 128), fp8_block_scale_cols(K)], the columns past ceil(K / 128) zero.
constexpr int kFp8BlockRows = 128;
__host__ __device__ inline int64_t fp8_block_scale_rows(int64_t N) {
  return (N + kFp8BlockRows - 1) / kFp8BlockRows;
}
__host__ __device__ inline int64_t fp8_block_scale_cols(int64_t K) {
  return (fp8_scale_cols(K) + 3) / 4 * 4;
}

// A linear layer's weight [N, K], row-major (torch Linear): bf16 when scale is nullptr, else e4m3
// with its block scales. block_scale (optional, FP8 only): the same scales once per 128 x 128
// block (fp8_block_scale_rows/cols above), given where every 128-row block's 8-row scales agree;
// with it, Gemm::linear takes the block-scaled FP8 GEMM above kGemvFp8MaxM rows.
struct LinearWeight {
  const void* data = nullptr;
  const float* scale = nullptr;
  const float* block_scale = nullptr;

  LinearWeight() = default;
  LinearWeight(const bf16* weight) : data(weight) {}  // NOLINT: a bf16 weight is a LinearWeight
  LinearWeight(const void* fp8_weight, const float* scale, const float* block_scale = nullptr)
      : data(fp8_weight), scale(scale), block_scale(block_scale) {}
  bool fp8() const { return scale != nullptr; }
  const bf16* bf16_data() const { return static_cast<const bf16*>(data); }
};

// out[N, K] (bf16) = the dequantised weight, each element rounded once: the operand of the
// cuBLASLt path for FP8 weights at M > kGemvFp8MaxM. K a positive multiple of 16; weight and out
// 16-byte aligned. Asynchronous on stream; graph-capturable.
void dequantize_fp8(const void* weight, const float* scale, bf16* out, int N, int K,
                    cudaStream_t stream);

// Activations for the block-scaled FP8 GEMM (quantize_fp8.cu): x [M, K] bf16 (row stride K) ->
// q [M, K] e4m3 and one float32 scale per row per 128 columns, scale[kb * M + m] for row m and
// columns [128 kb, 128 kb + 128): [ceil(K / 128), M] row-major, the layout of cuBLASLt's
// CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F for the GEMM's B operand (the activations), which is
// "N-major" (the token index contiguous). A block's scale is its largest magnitude / 448 (1 for
// an all-zero block); q = e4m3(x / scale), rounded to nearest even, saturating (e4m3.cuh).
// K a positive multiple of 16; x, q and scale 16-byte aligned. Graph-capturable.
void quantize_fp8_activations(const bf16* x, void* q, float* scale, int M, int K,
                              cudaStream_t stream);

}  // namespace nanograph
