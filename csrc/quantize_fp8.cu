// Activation quantization for the block-scaled FP8 GEMM (Gemm::linear, gemm.h): x [M, K] bf16 ->
// q [M, K] e4m3 plus one float32 scale per row per 128 columns, so that x[m, k] ~= q[m, k] *
// scale[k / 128][m]. This is the math the checkpoint format intends: Hugging Face's
// FineGrainedFP8 layers (activation_scheme "dynamic") and vLLM quantize each token's activations
// per group of 128 columns to e4m3 in the same way before their FP8 GEMM.
//
// Layouts: x and q row-major with row stride K; scale [ceil(K / 128), M] row-major, i.e. the M
// scales of one 128-column block contiguous (cuBLASLt's VEC128_32F layout for its B operand,
// fp8.h). Rounding: scale = amax / 448 in fp32 (rounded once; 1 for an all-zero block, which
// keeps its zeros exact), q = e4m3(x / scale) with the division rounded once and the conversion
// to nearest even, saturating at +-448 (quantize_e4m3x8, e4m3.cuh) -- as torch computes
// (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).
//
// Launch: 16 threads per (row, 128-column block), 8 columns (one 16-byte load) each; the block's
// amax is a 16-lane shuffle reduction, so every lane reaches it (no early return). Memory-bound:
// 3 bytes moved per element.
#include <string>

#include "e4m3.cuh"
#include "fp8.h"

namespace nanograph {

namespace {

constexpr int kLanesPerBlock = kFp8ScaleCols / 8;  // 16
constexpr float kE4m3Max = 448.f;

__global__ void quantize_fp8_activations_kernel(const bf16* __restrict__ x, uint8_t* __restrict__ q,
                                                float* __restrict__ scale, int M, int K,
                                                int blocks_per_row) {
  const int64_t thread = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t block = thread / kLanesPerBlock;
  const int lane = static_cast<int>(thread % kLanesPerBlock);
  const int m = static_cast<int>(block / blocks_per_row);
  const int kb = static_cast<int>(block % blocks_per_row);
  const int k = kb * kFp8ScaleCols + 8 * lane;
  const bool active = m < M && k < K;
  const int64_t offset = static_cast<int64_t>(m) * K + k;

  Float8 v{};
  if (active) v = load_bf16x8(x + offset);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v.v[i]));
#pragma unroll
  for (int mask = kLanesPerBlock / 2; mask > 0; mask /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, mask));
  }
  const float s = amax > 0.f ? __fdiv_rn(amax, kE4m3Max) : 1.f;
  if (!active) return;
  *reinterpret_cast<uint2*>(q + offset) = quantize_e4m3x8(v, s);
  if (lane == 0) scale[static_cast<int64_t>(kb) * M + m] = s;
}

}  // namespace

void quantize_fp8_activations(const bf16* x, void* q, float* scale, int M, int K,
                              cudaStream_t stream) {
  require(M >= 0 && K >= 16 && K % 16 == 0,
          "quantize_fp8_activations: needs M >= 0 and K a positive multiple of 16, got M=" +
              std::to_string(M) + " K=" + std::to_string(K));
  require_aligned("quantize_fp8_activations", "x", x);
  require_aligned("quantize_fp8_activations", "q", q);
  require_aligned("quantize_fp8_activations", "scale", scale);
  if (M == 0) return;
  const int blocks_per_row = static_cast<int>(fp8_scale_cols(K));
  const int64_t threads_needed = static_cast<int64_t>(M) * blocks_per_row * kLanesPerBlock;
  const int threads = 256;
  const int64_t grid = (threads_needed + threads - 1) / threads;
  quantize_fp8_activations_kernel<<<static_cast<unsigned>(grid), threads, 0, stream>>>(
      x, static_cast<uint8_t*>(q), scale, M, K, blocks_per_row);
  CUDA_CHECK_LAUNCH();
}

}  // namespace nanograph
