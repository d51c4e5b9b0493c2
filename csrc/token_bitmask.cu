// apply_token_bitmask: the grammar mask of structured outputs, in place on the logits. For each
// constrained row i, logits[rows[i], t] = -inf wherever bit t % 32 of word t / 32 of bitmask[i] is
// 0 (t < vocab).
//   logits:  [*, vocab] bf16 or float32, row stride `stride` elements
//   bitmask: [n, words] int32, words >= ceil(vocab / 32), filled on the host by the matchers
//   rows:    [n] int32, the logits row of each bitmask row
// Launch: grid (ceil(vocab / 256), n), 256 threads, one token per thread: a warp reads one word
// (one broadcast load) and writes its 32 consecutive logits, coalesced, only where a bit is 0.
#include "sampling.h"

namespace nanograph {

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T negative_infinity();
template <>
__device__ __forceinline__ float negative_infinity<float>() { return -INFINITY; }
template <>
__device__ __forceinline__ bf16 negative_infinity<bf16>() { return __float2bfloat16(-INFINITY); }

template <typename T>
__global__ void __launch_bounds__(kThreads) apply_token_bitmask_kernel(
    T* logits, int64_t stride, int vocab, const int32_t* bitmask, int words, const int32_t* rows) {
  const int i = blockIdx.y;
  const int token = blockIdx.x * kThreads + threadIdx.x;
  if (token >= vocab) return;
  const uint32_t word = static_cast<uint32_t>(bitmask[static_cast<int64_t>(i) * words + token / 32]);
  if (!((word >> (token % 32)) & 1u)) logits[rows[i] * stride + token] = negative_infinity<T>();
}

}  // namespace

void apply_token_bitmask(void* logits, bool logits_bf16, int64_t stride, int vocab,
                         const int32_t* bitmask, int words, const int32_t* rows, int n,
                         cudaStream_t stream) {
  require(vocab > 0 && stride >= vocab,
          "apply_token_bitmask: the logits' row stride must be at least vocab");
  require(words * 32 >= vocab, "apply_token_bitmask: a bitmask row of " + std::to_string(words) +
                                   " words is too short for vocab " + std::to_string(vocab));
  if (n == 0) return;
  const dim3 grid((vocab + kThreads - 1) / kThreads, n);
  if (logits_bf16) {
    apply_token_bitmask_kernel<bf16><<<grid, kThreads, 0, stream>>>(
        static_cast<bf16*>(logits), stride, vocab, bitmask, words, rows);
  } else {
    apply_token_bitmask_kernel<float><<<grid, kThreads, 0, stream>>>(
        static_cast<float*>(logits), stride, vocab, bitmask, words, rows);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace nanograph
