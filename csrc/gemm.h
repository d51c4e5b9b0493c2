// Linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]), bf16 in and out, fp32 accumulation.
// Small M (decode batches up to kGemvMaxM rows) goes to the GEMV kernel in gemv.cu, which keeps
// the weights streaming near bandwidth where cuBLAS does not; the rest goes through cuBLASLt,
// whose heuristic is chosen once per shape and cached. The workspace is fixed at construction so
// that calls can be captured into a CUDA graph.
// FP8 weights (fp8.h) take the GEMV's FP8 path at small M; at larger M they are dequantised into a
// bf16 buffer reserved beforehand (reserve_dequantized) and go through cuBLASLt.
#pragma once
#include "common.h"
#include "fp8.h"
#include "gemv.h"

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
  // bias: [N] or nullptr. `norm` fuses the input's add-RMSNorm into the GEMV (GemvInputNorm,
  // gemv.h); only for shapes the GEMV takes, and where gemv_input_norm_supported(M, K).
  void linear(const bf16* x, const LinearWeight& weight, const bf16* bias, bf16* out, int M, int N,
              int K, cudaStream_t stream, const GemvInputNorm* norm = nullptr);

  // Whether linear() runs this shape on the GEMV.
  static bool takes_gemv(const LinearWeight& weight, int M, int N, int K);

  // Room for the largest FP8 weight (elements) that linear() dequantises; allocate it before any
  // capture. Grows only.
  void reserve_dequantized(size_t elements);

 private:
  struct Plan;
  Plan& plan_for(int M, int N, int K, bool has_bias);

  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_;
  bf16* dequantized_ = nullptr;
  size_t dequantized_elements_ = 0;
  std::map<std::tuple<int, int, int, bool>, std::unique_ptr<Plan>> plans_;
};

}  // namespace nanograph
