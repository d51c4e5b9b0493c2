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
// Launch: one CTA row per activation row, 16 threads per 128-column block, 8 columns (one 16-byte
// load) each; the block's amax is a 16-lane shuffle reduction, so every lane reaches it (no early
// return). Memory-bound: 3 bytes moved per element.
#include <algorithm>
#include <string>

#include "e4m3.cuh"
#include "fp8.h"

namespace nanograph {

namespace {

constexpr int kLanesPerBlock = kFp8ScaleCols / 8;  // 16
constexpr float kE4m3Max = 448.f;

// Grid: x = the row, y = the row's chunks of blockDim.x * 8 columns (no index division).
__global__ void quantize_fp8_activations_kernel(const bf16* __restrict__ x, uint8_t* __restrict__ q,
                                                float* __restrict__ scale, int M, int K) {
  const int m = blockIdx.x;
  const int k = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
  const int lane = threadIdx.x % kLanesPerBlock;
  const bool active = k < K;
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
  if (lane == 0) scale[static_cast<int64_t>(k / kFp8ScaleCols) * M + m] = s;
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
  // A multiple of 32 (whole 16-lane groups in each warp), up to 256: narrow rows launch no idle
  // warps.
  const int threads = std::min(256, ceil_div(K / 8, 32) * 32);
  const dim3 grid(static_cast<unsigned>(M), static_cast<unsigned>(ceil_div(K / 8, threads)));
  quantize_fp8_activations_kernel<<<grid, threads, 0, stream>>>(x, static_cast<uint8_t*>(q), scale,
                                                               M, K);
  CUDA_CHECK_LAUNCH();
}

}  // namespace nanograph
