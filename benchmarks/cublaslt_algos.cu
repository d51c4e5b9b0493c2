// How far cuBLASLt's first heuristic answer is from the best of its first 16, for the bf16 GEMMs that
// Gemm::linear builds (csrc/gemm.cpp: the "TN" layout, fp32 compute and scale, 16-byte alignment, a
// 32 MiB workspace) at decode batch sizes from 17 rows, on Qwen3-0.6B and Qwen3-8B projections.
// Each algorithm is timed in a CUDA graph of 40 back-to-back calls that cycle through copies of the
// weight (up to 40 in a 983 MB pool, so that no matrix that fits in L2 stays there), the best of 5
// replays. Per shape it prints heuristic #0, the fastest, their split-K counts and
// workspace sizes, the roofline of the bytes moved at 4.1 TB/s, then every algorithm as time/split-K.
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O2 -arch=sm_90a benchmarks/cublaslt_algos.cu -lcublasLt -o /tmp/cublaslt_algos &&
//   /tmp/cublaslt_algos
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                           \
  do {                                                                  \
    const auto status = (x);                                            \
    if (status != 0) {                                                  \
      printf("%s:%d %s failed: %d\n", __FILE__, __LINE__, #x, (int)status); \
      exit(1);                                                          \
    }                                                                   \
  } while (0)

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // Gemm's default
constexpr size_t kPoolBytes = 160000ull * 12288 * 2 / 4;  // the weight copies
constexpr int kMaxAlgos = 16;
constexpr int kCallsPerGraph = 40;
constexpr int kReplays = 5;

struct Shape {
  const char* name;
  int N, K;  // out[M, N] = x[M, K] . W[N, K]^T
};

int algo_attribute(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  int value = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written);
  return value;
}

}  // namespace

int main() {
  cublasLtHandle_t handle;
  CK(cublasLtCreate(&handle));
  void *workspace, *pool, *x, *out;
  CK(cudaMalloc(&workspace, kWorkspaceBytes));
  CK(cudaMalloc(&pool, kPoolBytes));
  CK(cudaMalloc(&x, 256ull * 12288 * 2));
  CK(cudaMalloc(&out, 256ull * 160000 * 2));
  CK(cudaMemset(pool, 0x3c, kPoolBytes));  // bf16 0x3c3c, about 0.0115
  CK(cudaMemset(x, 0x3c, 256ull * 12288 * 2));
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));

  const Shape shapes[] = {{"0.6B qkv", 4096, 1024},     {"0.6B o", 1024, 2048},
                          {"0.6B gate_up", 6144, 1024}, {"0.6B down", 1024, 3072},
                          {"0.6B lm_head", 151936, 1024}, {"8B qkv", 6144, 4096},
                          {"8B o", 4096, 4096},         {"8B gate_up", 24576, 4096},
                          {"8B down", 4096, 12288}};
  for (const Shape& s : shapes) {
    for (int M : {17, 32, 64, 128, 256}) {
      if (s.N > 100000 && M > 64) continue;
      cublasLtMatmulDesc_t op;
      CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
      cublasLtMatrixLayout_t a, b, d;
      CK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, s.K, s.N, s.K));
      CK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, s.K, M, s.K));
      CK(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, s.N, M, s.N));
      cublasLtMatmulPreference_t pref;
      CK(cublasLtMatmulPreferenceCreate(&pref));
      const uint64_t max_workspace = kWorkspaceBytes;
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &max_workspace, sizeof(max_workspace)));
      const uint32_t alignment = 16;
      for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
        CK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &alignment, sizeof(alignment)));
      }
      cublasLtMatmulHeuristicResult_t results[kMaxAlgos];
      int found = 0;
      CK(cublasLtMatmulAlgoGetHeuristic(handle, op, a, b, d, d, pref, kMaxAlgos, results, &found));
      if (found == 0) continue;

      const float alpha = 1.f, beta = 0.f;
      const size_t weight_bytes = (static_cast<size_t>(s.N) * s.K * 2 + 255) / 256 * 256;
      const size_t copies = std::max<size_t>(1, std::min<size_t>(kCallsPerGraph, kPoolBytes / weight_bytes));
      std::vector<float> us(found, 1e9f);
      for (int i = 0; i < found; ++i) {
        size_t call_index = 0;
        auto call = [&] {
          const char* weight = static_cast<const char*>(pool) + (call_index++ % copies) * weight_bytes;
          return cublasLtMatmul(handle, op, &alpha, weight, a, x, b, &beta, out, d, out, d,
                                &results[i].algo, workspace, kWorkspaceBytes, stream);
        };
        if (call() != CUBLAS_STATUS_SUCCESS) continue;
        CK(cudaStreamSynchronize(stream));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        for (int r = 0; r < kCallsPerGraph; ++r) call();
        CK(cudaStreamEndCapture(stream, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        CK(cudaGraphLaunch(exec, stream));  // warm-up
        for (int r = 0; r < kReplays; ++r) {
          CK(cudaEventRecord(start, stream));
          CK(cudaGraphLaunch(exec, stream));
          CK(cudaEventRecord(stop, stream));
          CK(cudaEventSynchronize(stop));
          float ms = 0.f;
          CK(cudaEventElapsedTime(&ms, start, stop));
          us[i] = std::min(us[i], ms * 1000.f / kCallsPerGraph);
        }
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
      }
      const int best = static_cast<int>(std::min_element(us.begin(), us.end()) - us.begin());
      const double bytes = 2.0 * (static_cast<double>(s.N) * s.K + static_cast<double>(M) * s.K +
                                  static_cast<double>(M) * s.N);
      printf("%-13s M=%3d  heuristic #0 %7.2f us (split-K %d, workspace %zu)  best #%d %7.2f us "
             "(split-K %d, workspace %zu)  %.2fx  roofline %.2f us  [",
             s.name, M, us[0], algo_attribute(results[0].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
             results[0].workspaceSize, best, us[best],
             algo_attribute(results[best].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
             results[best].workspaceSize, us[0] / us[best], bytes / 4.1e6);
      for (int i = 0; i < found; ++i) {
        printf("%.1f/%d ", us[i], algo_attribute(results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM));
      }
      printf("]\n");
      fflush(stdout);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(a);
      cublasLtMatrixLayoutDestroy(b);
      cublasLtMatrixLayoutDestroy(d);
      cublasLtMatmulDescDestroy(op);
    }
  }
  return 0;
}
