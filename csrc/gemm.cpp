// Linear layers through cuBLASLt: out[M, N] = x[M, K] . weight[N, K]^T (+ bias[N]).
//
// Layouts: every tensor is row-major as torch holds it. cuBLASLt is column-major, so we compute
// the transpose, which has the same bytes as the row-major result:
//   D = out^T [N, M] (col-major, ld N) = A^T . B, with
//   A = weight seen col-major as [K, N] (ld K), transa = T  -> W [N, K]
//   B = x      seen col-major as [K, M] (ld K), transb = N
// The bias epilogue adds bias[n] to row n of D, i.e. to column n of out.
// bf16 in and out, fp32 accumulation and fp32 alpha/beta (beta = 0, C = D).
//
// Graph capture: a Plan (descriptors + the heuristic's algo) is built once per
// (M, N, K, has_bias) and cached; the workspace is allocated once in the constructor. A call
// therefore only sets the bias pointer on the cached descriptor (host-side) and enqueues
// cublasLtMatmul, which is safe to capture. Plan creation is host-side too (descriptors and the
// heuristic; tests/kernels/test_gemm.py builds one inside a capture), but callers should still
// run every shape once before capturing it, so that capture does no first-time work at all.
// A Gemm is not thread-safe (the plan cache and the per-call bias pointer are shared).
//
// Alignment: plans are chosen for 16-byte aligned buffers (the TMA minimum), not cuBLASLt's
// default 256, so that offset views (e.g. slices of a fused projection) are accepted; linear()
// checks the pointers against that.
#include "gemm.h"

#include <cublasLt.h>

#include <cstdint>
#include <string>

#include "gemv.h"

namespace nanograph {

namespace {

void cublas_check(cublasStatus_t status, const char* expr, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + expr + " failed: " +
                    cublasLtGetStatusString(status) + " (status " +
                    std::to_string(static_cast<int>(status)) + ")");
  }
}

#define CUBLAS_CHECK(expr) cublas_check((expr), #expr, __FILE__, __LINE__)

constexpr uint32_t kMinAlignmentBytes = 16;

std::string shape_str(int M, int N, int K) {
  return "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K);
}

void require_aligned(const void* ptr, const char* name) {
  require(reinterpret_cast<uintptr_t>(ptr) % kMinAlignmentBytes == 0,
          std::string("gemm: ") + name + " must be " + std::to_string(kMinAlignmentBytes) +
              "-byte aligned; pass a contiguous copy instead of an offset view");
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t a = nullptr;  // weight
  cublasLtMatrixLayout_t b = nullptr;  // x
  cublasLtMatrixLayout_t d = nullptr;  // out (also C)
  cublasLtMatmulAlgo_t algo{};

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (matmul) cublasLtMatmulDescDestroy(matmul);
  }
};

Gemm::Gemm(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  cublasLtHandle_t handle = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  handle_ = handle;
  if (workspace_bytes_ > 0) {
    cudaError_t err = cudaMalloc(&workspace_, workspace_bytes_);
    if (err != cudaSuccess) {
      cublasLtDestroy(handle);
      cuda_check(err, "cudaMalloc(gemm workspace)", __FILE__, __LINE__);
    }
  }
}

Gemm::~Gemm() {
  plans_.clear();
  if (dequantized_) cudaFree(dequantized_);
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

Gemm::Plan& Gemm::plan_for(int M, int N, int K, bool has_bias) {
  auto key = std::make_tuple(M, N, K, has_bias);
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;

  auto plan = std::make_unique<Plan>();
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->matmul, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                              sizeof(transa)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                              sizeof(transb)));
  if (has_bias) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                &epilogue, sizeof(epilogue)));
    int32_t bias_type = CUDA_R_16BF;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan->matmul, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, K, N, K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, K, M, K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_16BF, N, M, N));

  cublasLtMatmulPreference_t raw_pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)>
      pref(raw_pref, cublasLtMatmulPreferenceDestroy);
  uint64_t max_workspace = workspace_bytes_;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace)));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.get(), attr, &kMinAlignmentBytes,
                                                      sizeof(kMinAlignmentBytes)));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      static_cast<cublasLtHandle_t>(handle_), plan->matmul, plan->a, plan->b, plan->d, plan->d,
      pref.get(), 1, &result, &found);
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(status);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || found == 0) {
    throw CudaError("gemm: cuBLASLt has no algorithm for " + shape_str(M, N, K) +
                    (has_bias ? " with bias" : "") + " within a " +
                    std::to_string(workspace_bytes_) +
                    "-byte workspace; construct Gemm with a larger workspace_bytes");
  }
  plan->algo = result.algo;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

void Gemm::reserve_dequantized(size_t elements) {
  if (elements <= dequantized_elements_) return;
  if (dequantized_) CUDA_CHECK(cudaFree(dequantized_));
  dequantized_ = nullptr;
  dequantized_elements_ = 0;
  CUDA_CHECK(cudaMalloc(&dequantized_, elements * sizeof(bf16)));
  dequantized_elements_ = elements;
}

bool Gemm::takes_gemv(const LinearWeight& w, int M, int N, int K) {
  return w.fp8() ? gemv_fp8_supported(M, N, K) : gemv_supported(M, N, K);
}

void Gemm::linear(const bf16* x, const LinearWeight& w, const bf16* bias, bf16* out, int M, int N,
                  int K, cudaStream_t stream, const GemvInputNorm* norm) {
  // Decode-sized M: cuBLASLt's tiles leave most SMs idle there; the GEMV streams W at bandwidth.
  if (takes_gemv(w, M, N, K)) {
    if (w.fp8()) {
      gemv_fp8(x, w.data, w.scale, bias, out, M, N, K, stream, norm);
    } else {
      gemv(x, w.bf16_data(), bias, out, M, N, K, stream, norm);
    }
    return;
  }
  require(norm == nullptr, "gemm: a fused input norm needs a shape the GEMV takes, got " +
                               shape_str(M, N, K) + "; run add_rmsnorm first");
  require(M >= 0 && N > 0 && K > 0, "gemm: need M >= 0 and N, K > 0, got " + shape_str(M, N, K));
  if (M == 0) return;
  const bf16* weight = w.bf16_data();
  if (w.fp8()) {
    require(static_cast<size_t>(N) * K <= dequantized_elements_,
            "gemm: an FP8 weight of " + shape_str(M, N, K) + " needs reserve_dequantized(" +
                std::to_string(static_cast<size_t>(N) * K) + ") first, have " +
                std::to_string(dequantized_elements_));
    dequantize_fp8(w.data, w.scale, dequantized_, N, K, stream);
    weight = dequantized_;
  }
  require_aligned(x, "x");
  require_aligned(weight, "weight");
  require_aligned(out, "out");
  if (bias) require_aligned(bias, "bias");

  Plan& plan = plan_for(M, N, K, bias != nullptr);
  if (bias) {
    // The descriptor is cached, so the pointer is set per call; cublasLtMatmul reads it on the
    // host when it enqueues (and bakes it into a captured graph).
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                &bias, sizeof(bias)));
  }
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan.matmul, &alpha, weight,
                              plan.a, x, plan.b, &beta, out, plan.d, out, plan.d, &plan.algo,
                              workspace_, workspace_bytes_, stream));
}

}  // namespace nanograph
