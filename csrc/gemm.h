// Linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]), bf16 in and out, fp32 accumulation.
// Small M goes to the GEMV kernels in gemv.cu and gemv_fp8.cu, which keep the weights streaming
// near bandwidth where cuBLAS does not (bf16: where gemv_preferred, up to kGemvMaxM rows; FP8 up
// to kGemvFp8MaxM); the rest goes through cuBLASLt, whose heuristic is chosen once per shape and
// cached. The workspace is fixed at construction so that calls can be captured into a CUDA graph.
// FP8 weights (fp8.h) take the GEMV's FP8 path at small M. At larger M, a weight with 128 x 128
// block scales (LinearWeight::block_scale) takes cuBLASLt's block-scaled FP8 GEMM: x is quantized
// per row and 128 columns into a buffer reserved beforehand (reserve_fp8_activations), and the
// tensor cores multiply e4m3 by e4m3 (linear_fp8_quantized). Where cuBLASLt has no algorithm for
// the shape (decided once per shape, at plan time), or the weight has no block scales, the weight
// is dequantised into a bf16 buffer reserved beforehand (reserve_dequantized) for the bf16 GEMM.
#pragma once
#include "common.h"
#include "fp8.h"

#include <map>
#include <memory>
#include <tuple>

namespace nanograph {

class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes = 32u << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // x: [M, K] row-major; weight: [N, K] row-major (torch Linear layout); out: [M, N];
  // bias: [N] or nullptr.
  void linear(const bf16* x, const LinearWeight& weight, const bf16* bias, bf16* out, int M, int N,
              int K, cudaStream_t stream);

  // Room for the largest FP8 weight (elements) that linear() dequantises; allocate it before any
  // capture. Grows only.
  void reserve_dequantized(size_t elements);

  // Room for the quantized activations of up to `rows` rows of `K` columns (the widest K of the
  // FP8 weights with block scales): e4m3 values and scales for `rows` rounded down to 4, then for
  // 4 more rows (linear_fp8_dynamic's second GEMM); allocate it before any capture. Grows only.
  void reserve_fp8_activations(size_t rows, size_t K);

  // Whether linear() takes the block-scaled FP8 GEMM for a weight with block scales at this shape:
  // the device and library have it (block_scaled_fp8_), M > kGemvFp8MaxM, K a multiple of 16,
  // N of 8, and cuBLASLt has an algorithm for it (for M rounded down to a multiple of 4, and for 4
  // rows when M is not one: see linear_fp8_dynamic). The heuristic's answer is cached with the plan.
  bool fp8_gemm_supported(int M, int N, int K, bool has_bias);

  // out[M, N] = dequant(x_q) . dequant(weight)^T (+ bias): the block-scaled FP8 GEMM alone, on
  // activations that quantize_fp8_activations wrote (x_q [M, K] e4m3, x_scale [ceil(K / 128), M])
  // and an e4m3 weight [N, K] with its block_scale (fp8.h). cuBLASLt: A = weight with scale mode
  // CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, B = x_q with
  // CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, D = out^T in bf16, fp32 accumulation. M a multiple of 4
  // (cuBLASLt's rule for these scale modes), K of 16 and N of 8 (16-byte rows of x_q, weight and
  // out); throws where the device or library lacks the GEMM, or cuBLASLt has no algorithm for the
  // shape. Graph-capturable once planned.
  void linear_fp8_quantized(const void* x_q, const float* x_scale, const void* weight,
                            const float* block_scale, const bf16* bias, bf16* out, int M, int N,
                            int K, cudaStream_t stream);

 private:
  struct Plan;
  Plan& plan_for(int M, int N, int K, bool has_bias, bool fp8);
  // cublasLtMatmul under a plan: out = a (the weight) . b (x), with the bias pointer set per call.
  void enqueue(Plan& plan, const void* a, const void* b, const bf16* bias, bf16* out,
               cudaStream_t stream);
  // linear() for an FP8 weight with block scales: quantize x, then linear_fp8_quantized.
  void linear_fp8_dynamic(const bf16* x, const LinearWeight& weight, const bf16* bias, bf16* out,
                          int M, int N, int K, cudaStream_t stream);

  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_;
  // cuBLASLt 12.9+ on compute capability 9.0, with a workspace (gemm.cpp): decided at construction,
  // before any FP8 plan sets the block scale modes that older libraries reject.
  bool block_scaled_fp8_ = false;
  bf16* dequantized_ = nullptr;
  size_t dequantized_elements_ = 0;
  uint8_t* fp8_activations_ = nullptr;  // e4m3 [M rounded down to 4, K], then [4, K]
  size_t fp8_activation_bytes_ = 0;
  float* fp8_activation_scales_ = nullptr;  // [ceil(K / 128), M rounded down to 4], then [.., 4]
  size_t fp8_activation_scale_count_ = 0;
  // (M, N, K, has_bias, fp8 operands)
  std::map<std::tuple<int, int, int, bool, bool>, std::unique_ptr<Plan>> plans_;
};

}  // namespace nanograph
