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

// A linear layer's weight [N, K], row-major (torch Linear): bf16 when scale is nullptr, else e4m3
// with its block scales.
struct LinearWeight {
  const void* data = nullptr;
  const float* scale = nullptr;

  LinearWeight() = default;
  LinearWeight(const bf16* weight) : data(weight) {}  // NOLINT: a bf16 weight is a LinearWeight
  LinearWeight(const void* fp8_weight, const float* block_scale)
      : data(fp8_weight), scale(block_scale) {}
  bool fp8() const { return scale != nullptr; }
  const bf16* bf16_data() const { return static_cast<const bf16*>(data); }
};

// out[N, K] (bf16) = the dequantised weight, each element rounded once: the operand of the
// cuBLASLt path for FP8 weights at M > kGemvMaxM. K a positive multiple of 16; weight and out
// 16-byte aligned. Asynchronous on stream; graph-capturable.
void dequantize_fp8(const void* weight, const float* scale, bf16* out, int N, int K,
                    cudaStream_t stream);

}  // namespace nanograph
