// Greedy sampling: out[r] = argmax_j logits[r, j], ties to the lowest index and NaN counted as
// the largest value, exactly like torch.argmax (the order of argmax_order.cuh).
//
// Layouts: logits [rows, vocab] bf16 with a row stride of `stride` elements (>= vocab; any value,
// so a row may start at any 2-byte boundary); out [rows] int32.
// Launch: one CTA of 1024 threads per row (a 152k vocabulary is ~300 KB per row; one CTA keeps
// enough loads in flight to stream it). Each row is split into an unaligned head (< 8 elements,
// read one by one), a body of 16-byte vectors (read four per thread at a time), and a tail
// (< 8 elements), so every row is vectorised whatever its alignment. Each thread keeps its best
// (value, index), then a warp-shuffle and a shared-memory pass reduce them. The per-element
// work is one packed max per pair, which keeps the scan at memory speed.
// Few rows (decode at small batch) leave most SMs idle, and one SM alone streams a 300 KB row far
// below the GPU's bandwidth: on sm_90 such rows take a cluster of kClusterCtas CTAs each, which
// scan one slice of the row's body and merge their results through distributed shared memory.
#include "sampling.h"

#include "argmax_order.cuh"
#include "launch.h"

#include <cooperative_groups.h>

#include <climits>

namespace nanograph {

namespace {

constexpr int kThreads = 1024;
constexpr int kLoadsInFlight = 4;

struct Best {
  float value;
  int index;  // kNone until the thread sees a value above -inf
};

constexpr int kNone = INT_MAX;

// Merges the threads' results in torch.argmax's order (argmax_order.cuh).
__device__ __forceinline__ void merge(Best& best, const Best& other) {
  if (argmax_precedes(other.value, other.index, best.value, best.index)) best = other;
}

// A thread visits its indices in increasing order, so a later value replaces the best only if
// it comes strictly before it (argmax_ahead): ties keep the lower index.
__device__ __forceinline__ void scan_one(Best& best, bf16 x, int index) {
  const float value = __bfloat162float(x);
  if (argmax_ahead(value, best.value)) best = {value, index};
}

// Eight consecutive values: the NaN-propagating packed max decides whether the vector can
// improve the best at all, and only then is the position of its first maximum searched.
__device__ __forceinline__ void scan_vec(Best& best, const uint4& raw, int first_index) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const __nv_bfloat162 m = __hmax2_nan(__hmax2_nan(pairs[0], pairs[1]), __hmax2_nan(pairs[2], pairs[3]));
  const float vec_max = __bfloat162float(__hmax_nan(m.x, m.y));
  if (!argmax_ahead(vec_max, best.value)) return;
  const bool nan = vec_max != vec_max;
  const bf16* x = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float value = __bfloat162float(x[k]);
    if (nan ? value != value : value == vec_max) {
      best = {vec_max, first_index + k};
      return;
    }
  }
}

// Leaves every lane of the warp with the warp's best.
__device__ __forceinline__ void warp_merge(Best& best) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    merge(best, {__shfl_xor_sync(0xffffffffu, best.value, offset),
                 __shfl_xor_sync(0xffffffffu, best.index, offset)});
  }
}

// This CTA's best over the vectors [v_begin, v_end) of the row's body (and the head and tail
// when it scans them), reduced over its threads; every thread of warp 0 holds the result.
__device__ __forceinline__ Best scan_row(const bf16* row, int vocab, int v_begin, int v_end,
                                         bool with_head_and_tail) {
  const int misalignment = static_cast<int>((reinterpret_cast<uintptr_t>(row) % 16) / sizeof(bf16));
  const int head = min(vocab, (8 - misalignment) % 8);
  const int body_vecs = (vocab - head) / 8;
  const int tail_start = head + body_vecs * 8;
  const uint4* body = reinterpret_cast<const uint4*>(row + head);
  v_end = min(v_end, body_vecs);

  Best best = {-INFINITY, kNone};
  if (with_head_and_tail && threadIdx.x < head) scan_one(best, row[threadIdx.x], threadIdx.x);
  int v = v_begin + threadIdx.x;
  for (; v + (kLoadsInFlight - 1) * kThreads < v_end; v += kLoadsInFlight * kThreads) {
    uint4 raw[kLoadsInFlight];
#pragma unroll
    for (int i = 0; i < kLoadsInFlight; ++i) raw[i] = __ldg(body + v + i * kThreads);
#pragma unroll
    for (int i = 0; i < kLoadsInFlight; ++i) scan_vec(best, raw[i], head + (v + i * kThreads) * 8);
  }
  for (; v < v_end; v += kThreads) scan_vec(best, __ldg(body + v), head + v * 8);
  const int tail_index = tail_start + threadIdx.x;
  if (with_head_and_tail && tail_index < vocab) scan_one(best, row[tail_index], tail_index);

  warp_merge(best);
  __shared__ Best warp_best[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp == 0) {
    best = warp_best[lane];
    warp_merge(best);
  }
  return best;
}

// No thread saw a value above -inf only when the whole row is -inf: torch answers 0.
__device__ __forceinline__ int32_t answer(const Best& best) {
  return best.index == kNone ? 0 : best.index;
}

__global__ void __launch_bounds__(kThreads)
    argmax_kernel(const bf16* __restrict__ logits, int vocab, int64_t stride,
                  int32_t* __restrict__ out, int32_t* __restrict__ host_out) {
  const Best best = scan_row(logits + blockIdx.x * stride, vocab, 0, INT_MAX, true);
  if (threadIdx.x == 0) {
    out[blockIdx.x] = answer(best);
    if (host_out != nullptr) host_out[blockIdx.x] = answer(best);
  }
}

// Row blockIdx.y, slice blockIdx.x (the CTA's rank in its cluster of kClusterCtas): the body's
// vectors are cut into kClusterCtas contiguous slices; rank 0 also scans the head and the tail,
// then merges the ranks' results.
constexpr int kClusterCtas = 8;
constexpr int kClusterMaxRows = 16;

__global__ void __launch_bounds__(kThreads)
    argmax_cluster_kernel(const bf16* __restrict__ logits, int vocab, int64_t stride,
                          int32_t* __restrict__ out, int32_t* __restrict__ host_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int body_vecs = vocab / 8;  // an upper bound: scan_row clips to the row's own body
  const int per_cta = (body_vecs + kClusterCtas - 1) / kClusterCtas;
  __shared__ Best cta_best;
  const Best best = scan_row(logits + blockIdx.y * stride, vocab, rank * per_cta,
                             rank * per_cta + per_cta, rank == 0);
  if (threadIdx.x == 0) cta_best = best;
  cluster.sync();  // every rank's cta_best is written
  if (rank == 0 && threadIdx.x < 32) {
    Best merged = threadIdx.x < kClusterCtas ? *cluster.map_shared_rank(&cta_best, threadIdx.x)
                                             : Best{-INFINITY, kNone};
    warp_merge(merged);
    if (threadIdx.x == 0) {
      out[blockIdx.y] = answer(merged);
      if (host_out != nullptr) host_out[blockIdx.y] = answer(merged);
    }
  }
  cluster.sync();  // no rank exits while rank 0 reads its shared memory
#endif
}

}  // namespace

void argmax(const bf16* logits, int rows, int vocab, int stride, int32_t* out, cudaStream_t stream,
            int32_t* host_out) {
  require(vocab > 0, "argmax: vocab must be positive, got " + std::to_string(vocab));
  require(stride >= vocab, "argmax: row stride " + std::to_string(stride) +
                               " is smaller than vocab " + std::to_string(vocab) +
                               "; pass the logits' stride(0)");
  require(reinterpret_cast<uintptr_t>(logits) % sizeof(bf16) == 0,
          "argmax: logits must be 2-byte aligned");
  if (rows == 0) return;
  if (rows <= kClusterMaxRows && vocab >= 8 * kThreads && clusters_supported()) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = kClusterCtas;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(kClusterCtas, rows);
    config.blockDim = dim3(kThreads);
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&config, argmax_cluster_kernel, logits, vocab,
                                  static_cast<int64_t>(stride), out, host_out));
    return;
  }
  argmax_kernel<<<rows, kThreads, 0, stream>>>(logits, vocab, stride, out, host_out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace nanograph
