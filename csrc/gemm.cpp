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
// The block-scaled FP8 GEMM keeps that "TN" layout, which FP8 needs (both operands K-contiguous),
// with A and B in e4m3 (CUDA_R_8F_E4M3), D in bf16, CUBLAS_COMPUTE_32F, scale type fp32 and no
// fast accumulation. Its scales follow the cuBLAS documentation, section "128-element 1D and
// 128x128 2D Block Scaling For FP8 Data Types" and its "Scaling factors layouts" (cuBLAS 12.9+,
// compute capability 9.0): A (the weight) takes CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
// "K-major", shape ceil(K / 128) rounded up to 4 by ceil(N / 128), the stride between 128-row
// blocks a multiple of 4; B (the activations) takes CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
// "N-major" (cuBLAS's N is our M: the token index contiguous), shape M x ceil(K / 128); every
// scale tensor starts 16-byte aligned, and cuBLAS's M and N (our N and M) must be multiples of 4.
// (BLK128x128 on both operands is the one combination the documentation rules out.)
// Whether the device and library have these scale modes is decided once, at construction, from
// cublasLtGetVersion() and the compute capability (and a workspace, whose address stands in for
// the scale pointers at plan time): elsewhere an FP8 plan is never built (an older library rejects
// the scale-mode attributes themselves), and linear() dequantises. Where they do, only the
// heuristic's NOT_SUPPORTED (or no algorithm) means that a shape is refused.
//
// Graph capture: a Plan (descriptors + the heuristic's algo) is built once per
// (M, N, K, has_bias, fp8) and cached; the workspace is allocated once in the constructor. A call
// therefore only sets the bias and scale pointers on the cached descriptor (host-side) and enqueues
// cublasLtMatmul, which is safe to capture. Plan creation is host-side too (descriptors and the
// heuristic; tests/kernels/test_gemm.py builds one inside a capture), but callers should still
// run every shape once before capturing it, so that capture does no first-time work at all.
// A Gemm is not thread-safe (the plan cache and the per-call pointers are shared).
//
// Alignment: plans are chosen for 16-byte aligned buffers (the TMA minimum), not cuBLASLt's
// default 256, so that offset views (e.g. slices of a fused projection) are accepted; linear()
// checks the pointers against that.
#include "gemm.h"

#include <cublasLt.h>

#include <cstdint>
#include <string>
#include <utility>

#include "gemv.h"
#include "launch.h"

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

constexpr uint32_t kMinAlignmentBytes = kAlignmentBytes;
constexpr size_t kBlockScaledFp8Version = 120900;  // cuBLAS 12.9.0, as cublasLtGetVersion() counts

std::string shape_str(int M, int N, int K) {
  return "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K);
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t a = nullptr;  // weight
  cublasLtMatrixLayout_t b = nullptr;  // x
  cublasLtMatrixLayout_t d = nullptr;  // out (also C)
  cublasLtMatmulAlgo_t algo{};
  bool found = false;  // the heuristic gave an algorithm

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
  const DeviceProps& device = device_props();
  block_scaled_fp8_ = cublasLtGetVersion() >= kBlockScaledFp8Version && device.compute_major == 9 &&
                      device.compute_minor == 0 && workspace_bytes_ > 0;
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
  if (fp8_activations_) cudaFree(fp8_activations_);
  if (fp8_activation_scales_) cudaFree(fp8_activation_scales_);
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

Gemm::Plan& Gemm::plan_for(int M, int N, int K, bool has_bias, bool fp8) {
  auto key = std::make_tuple(M, N, K, has_bias, fp8);
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
  if (fp8) {
    int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                &a_mode, sizeof(a_mode)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                &b_mode, sizeof(b_mode)));
    // The heuristic refuses a block scale mode whose scale pointer is unset; the real pointers are
    // set per call (linear_fp8_quantized), so the plan carries the workspace's address until then.
    for (auto attr : {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER}) {
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->matmul, attr, &workspace_, sizeof(workspace_)));
    }
  }
  const cudaDataType_t in_type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, in_type, K, N, K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, in_type, K, M, K));
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
  // NOT_SUPPORTED (or no algorithm) is cuBLASLt refusing the shape: the plan is recorded as such.
  // Any other failure is a mistake in the descriptors above.
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(status);
  plan->found = status == CUBLAS_STATUS_SUCCESS && found > 0;
  if (plan->found) plan->algo = result.algo;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

namespace {

// Makes buffer, which holds `capacity` elements, hold at least `elements`: a smaller one is freed
// (its contents dropped) and allocated anew. Grows only.
template <class T>
void grow(T*& buffer, size_t& capacity, size_t elements) {
  if (elements <= capacity) return;
  if (buffer) CUDA_CHECK(cudaFree(buffer));
  buffer = nullptr;
  capacity = 0;
  CUDA_CHECK(cudaMalloc(&buffer, elements * sizeof(T)));
  capacity = elements;
}

// Rows of quantized activations (and of their scales) that linear_fp8_dynamic writes for M rows:
// M rounded down to 4 for the first GEMM, then the last 4 rows again, in a region of their own, for
// the second.
size_t fp8_activation_rows(size_t M) { return M / 4 * 4 + 4; }

size_t fp8_activation_scale_count(size_t rows, size_t K) {
  return fp8_activation_rows(rows) * static_cast<size_t>(fp8_scale_cols(static_cast<int64_t>(K)));
}

}  // namespace

void Gemm::reserve_dequantized(size_t elements) {
  grow(dequantized_, dequantized_elements_, elements);
}

void Gemm::reserve_fp8_activations(size_t rows, size_t K) {
  grow(fp8_activations_, fp8_activation_bytes_, fp8_activation_rows(rows) * K);
  grow(fp8_activation_scales_, fp8_activation_scale_count_, fp8_activation_scale_count(rows, K));
}

bool Gemm::fp8_gemm_supported(int M, int N, int K, bool has_bias) {
  if (!block_scaled_fp8_ || M <= kGemvFp8MaxM || K % 16 != 0 || N % 8 != 0) return false;
  const int rows = M / 4 * 4;
  return plan_for(rows, N, K, has_bias, true).found &&
         (rows == M || plan_for(4, N, K, has_bias, true).found);
}

void Gemm::linear_fp8_quantized(const void* x_q, const float* x_scale, const void* weight,
                                const float* block_scale, const bf16* bias, bf16* out, int M,
                                int N, int K, cudaStream_t stream) {
  require(M > 0 && N > 0 && K > 0,
          "gemm: the block-scaled FP8 GEMM needs M, N and K positive, got " + shape_str(M, N, K));
  require(M % 4 == 0, "gemm: the block-scaled FP8 GEMM needs M (x_q's rows) a multiple of 4, got M=" +
                          std::to_string(M) + "; use Gemm.linear_fp8 (Gemm::linear), which "
                          "quantizes x itself and takes the rows past a multiple of 4 through a "
                          "second GEMM");
  require(K % 16 == 0, "gemm: the block-scaled FP8 GEMM needs K (the columns of x_q and weight) a "
                       "multiple of 16, got K=" + std::to_string(K) + "; pad x and the weight "
                       "with zero columns to a multiple of 16");
  require(N % 8 == 0, "gemm: the block-scaled FP8 GEMM needs N (the weight's rows) a multiple of "
                      "8, got N=" + std::to_string(N) + "; pad the weight with zero rows to a "
                      "multiple of 8 and drop out's extra columns");
  require(x_scale != nullptr && block_scale != nullptr,
          "gemm: the block-scaled FP8 GEMM needs x_scale and block_scale");
  for (auto [ptr, name] : {std::pair<const void*, const char*>{x_q, "x_q"}, {x_scale, "x_scale"},
                           {weight, "weight"}, {block_scale, "block_scale"}, {out, "out"}}) {
    require_aligned("gemm", name, ptr);
  }
  if (bias) require_aligned("gemm", "bias", bias);
  if (!block_scaled_fp8_) {
    const DeviceProps& device = device_props();
    throw CudaError("gemm: the block-scaled FP8 GEMM needs compute capability 9.0 and cuBLAS 12.9+ "
                    "(and a workspace), have compute capability " +
                    std::to_string(device.compute_major) + "." +
                    std::to_string(device.compute_minor) + " and cuBLASLt version " +
                    std::to_string(cublasLtGetVersion()) + "; use Gemm::linear, which dequantises "
                    "instead");
  }
  Plan& plan = plan_for(M, N, K, bias != nullptr, true);
  if (!plan.found) {
    throw CudaError("gemm: cuBLASLt has no block-scaled FP8 algorithm for " + shape_str(M, N, K) +
                    (bias ? " with bias" : "") + " within a " + std::to_string(workspace_bytes_) +
                    "-byte workspace; use Gemm::linear, which dequantises instead");
  }
  // The scale pointers are set per call, as enqueue sets the bias pointer.
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.matmul, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                              &block_scale, sizeof(block_scale)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.matmul, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                              &x_scale, sizeof(x_scale)));
  enqueue(plan, weight, x_q, bias, out, stream);
}

// cuBLASLt's rule that M be a multiple of 4 for these scale modes: the first M rounded down to 4
// rows take one GEMM; when rows are left, a second GEMM takes the last 4 rows, so that every row
// is computed from quantized activations. The last 4 rows are quantized into their own region of
// the buffers, after the first GEMM's operands (fp8_activation_rows), so that nothing the first
// GEMM reads is rewritten. The output rows both GEMMs cover are quantized identically (the
// quantization is per row) and written twice, the second time last; the two quantizations and
// GEMMs run in order on the stream.
void Gemm::linear_fp8_dynamic(const bf16* x, const LinearWeight& w, const bf16* bias, bf16* out,
                              int M, int N, int K, cudaStream_t stream) {
  require(fp8_activation_rows(M) * K <= fp8_activation_bytes_ &&
              fp8_activation_scale_count(M, K) <= fp8_activation_scale_count_,
          "gemm: an FP8 weight with block scales at " + shape_str(M, N, K) +
              " needs reserve_fp8_activations(" + std::to_string(M) + ", " + std::to_string(K) +
              ") first");
  const int rows = M / 4 * 4;
  const size_t head_scales = static_cast<size_t>(rows) * fp8_scale_cols(K);  // a multiple of 4
  quantize_fp8_activations(x, fp8_activations_, fp8_activation_scales_, rows, K, stream);
  linear_fp8_quantized(fp8_activations_, fp8_activation_scales_, w.data, w.block_scale, bias, out,
                       rows, N, K, stream);
  if (rows == M) return;
  const size_t first = static_cast<size_t>(M) - 4;
  uint8_t* tail_q = fp8_activations_ + static_cast<size_t>(rows) * K;  // 16-byte aligned: K % 16 == 0
  float* tail_scale = fp8_activation_scales_ + head_scales;
  quantize_fp8_activations(x + first * K, tail_q, tail_scale, 4, K, stream);
  linear_fp8_quantized(tail_q, tail_scale, w.data, w.block_scale, bias, out + first * N, 4, N, K,
                       stream);
}

void Gemm::linear(const bf16* x, const LinearWeight& w, const bf16* bias, bf16* out, int M, int N,
                  int K, cudaStream_t stream) {
  // Decode-sized M: cuBLASLt's tiles leave most SMs idle there; the GEMV streams W at bandwidth
  // (bf16: where gemv_preferred says it beats cuBLASLt's floor).
  if (w.fp8() ? gemv_fp8_supported(M, N, K) : gemv_preferred(M, N, K)) {
    if (w.fp8()) {
      gemv_fp8(x, w.data, w.scale, bias, out, M, N, K, stream);
    } else {
      gemv(x, w.bf16_data(), bias, out, M, N, K, stream);
    }
    return;
  }
  require(M >= 0 && N > 0 && K > 0, "gemm: need M >= 0 and N, K > 0, got " + shape_str(M, N, K));
  if (M == 0) return;
  if (w.fp8() && w.block_scale && fp8_gemm_supported(M, N, K, bias != nullptr)) {
    linear_fp8_dynamic(x, w, bias, out, M, N, K, stream);
    return;
  }
  const bf16* weight = w.bf16_data();
  if (w.fp8()) {
    require(static_cast<size_t>(N) * K <= dequantized_elements_,
            "gemm: an FP8 weight of " + shape_str(M, N, K) + " needs reserve_dequantized(" +
                std::to_string(static_cast<size_t>(N) * K) + ") first, have " +
                std::to_string(dequantized_elements_));
    dequantize_fp8(w.data, w.scale, dequantized_, N, K, stream);
    weight = dequantized_;
  }
  require_aligned("gemm", "x", x);
  require_aligned("gemm", "weight", weight);
  require_aligned("gemm", "out", out);
  if (bias) require_aligned("gemm", "bias", bias);

  Plan& plan = plan_for(M, N, K, bias != nullptr, false);
  if (!plan.found) {
    throw CudaError("gemm: cuBLASLt has no algorithm for " + shape_str(M, N, K) +
                    (bias ? " with bias" : "") + " within a " + std::to_string(workspace_bytes_) +
                    "-byte workspace; construct Gemm with a larger workspace_bytes");
  }
  enqueue(plan, weight, x, bias, out, stream);
}

void Gemm::enqueue(Plan& plan, const void* a, const void* b, const bf16* bias, bf16* out,
                   cudaStream_t stream) {
  if (bias) {
    // The descriptor is cached, so the pointer is set per call; cublasLtMatmul reads it on the
    // host when it enqueues (and bakes it into a captured graph).
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                &bias, sizeof(bias)));
  }
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan.matmul, &alpha, a,
                              plan.a, b, plan.b, &beta, out, plan.d, out, plan.d, &plan.algo,
                              workspace_, workspace_bytes_, stream));
}

}  // namespace nanograph
