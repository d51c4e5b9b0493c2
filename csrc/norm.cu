// RMSNorm and fused residual-add + RMSNorm, rounded like HF transformers' LlamaRMSNorm:
//   h   = x                          (rmsnorm)      or  residual = bf16(x + residual); h = residual
//   out = bf16(bf16(h * rsqrt(mean(h^2) + eps)) * weight)
// Statistics are accumulated in fp32; the two bf16 roundings reproduce the reference's
// "normalise in fp32, cast to the input dtype, then multiply by the bf16 weight".
//
// Layouts: x, residual, out [rows, dim] bf16, row-major; weight [dim] bf16; dim a multiple of 8.
// Launch: each row is held in registers as VPT 16-byte vectors per thread, so it is read from
// global memory once. Rows of up to 512 elements get one warp each (four rows per CTA, shuffle
// reduction only); wider rows get one CTA of at most 256 threads (shuffle + shared-memory
// reduction). VPT = ceil(vectors / threads) is a template parameter so the row stays in registers.
// embedding_rmsnorm, the first layer's input, takes each row from the embedding table (the id
// resolved as embedding() resolves it), stores it as the residual and normalises it: the
// embedding kernel and rmsnorm's bits in one launch.
#include "norm.h"

#include "bf16x8.cuh"
#include "embedding.cuh"
#include "launch.h"

namespace nanograph {

namespace {

constexpr int kMaxDim = 8192;
constexpr int kMaxWarpRowVecs = 64;  // rows of <= 512 elements: one warp per row
constexpr int kWarpRowsPerCta = 4;
constexpr int kMaxCtaThreads = 256;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// blockDim = (threads per row, rows per CTA); blockDim.y > 1 only when blockDim.x == 32.
// With kAddResidual, `residual` is updated in place and out may alias x. With kEmbed, x is the
// embedding table, row `row` of it is chosen by `embed`, and residual receives it.
template <int VPT, bool kAddResidual, bool kEmbed>
__global__ void __launch_bounds__(kMaxCtaThreads)
    rmsnorm_kernel(const bf16* x, bf16* residual, const bf16* __restrict__ weight, bf16* out,
                   int rows, int dim, float eps, EmbeddingIds embed) {
  // The weight is no kernel's output: it is in flight before the PDL wait (launch.h).
  const int vecs = dim / 8;
  uint4 w_raw[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < vecs) w_raw[i] = *reinterpret_cast<const uint4*>(weight + v * 8);
  }
  if constexpr (kEmbed) {
    // The ids come from the step's metadata staging, which the kernels after this one read
    // before their own waits: they may launch only once it has completed (launch.h).
    wait_for_producers_after_loads();
    allow_dependents();
  } else {
    allow_dependents();  // before the wait: the next kernel is a GEMV (launch.h)
    wait_for_producers_after_loads();
  }
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int64_t row_offset = static_cast<int64_t>(row) * dim;
  const bf16* src = x + row_offset;
  bool zero_row = false;
  if constexpr (kEmbed) {
    const int id = embedding_row(embed, row);
    zero_row = id < 0;
    src = x + static_cast<int64_t>(zero_row ? 0 : id) * dim;
  }

  Float8 h[VPT];
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= vecs) break;
    const int64_t offset = row_offset + v * 8;
    if constexpr (kEmbed) {
      // The row's bits as embedding() copies them (a NaN's payload included).
      const uint4 raw = zero_row ? make_uint4(0, 0, 0, 0)
                                 : *reinterpret_cast<const uint4*>(src + v * 8);
      *reinterpret_cast<uint4*>(residual + offset) = raw;
      h[i] = bf16x8_to_float8(raw);
    } else {
      h[i] = load_bf16x8(src + v * 8);
    }
    if constexpr (kAddResidual) {
      Float8 r = load_bf16x8(residual + offset);
#pragma unroll
      for (int k = 0; k < 8; ++k) h[i].v[k] += r.v[k];
      round_to_bf16(h[i]);
      store_bf16x8(residual + offset, h[i]);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) sum_sq += h[i].v[k] * h[i].v[k];
  }

  sum_sq = warp_sum(sum_sq);
  if (blockDim.x > 32) {
    __shared__ float warp_sums[kMaxCtaThreads / 32];
    const int warps = blockDim.x / 32;
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum_sq;
    __syncthreads();
    sum_sq = 0.f;
    for (int w = 0; w < warps; ++w) sum_sq += warp_sums[w];
  }
  const float rstd = rsqrtf(sum_sq / dim + eps);

#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= vecs) break;
    const Float8 w = bf16x8_to_float8(w_raw[i]);
#pragma unroll
    for (int k = 0; k < 8; ++k) h[i].v[k] *= rstd;
    round_to_bf16(h[i]);
#pragma unroll
    for (int k = 0; k < 8; ++k) h[i].v[k] *= w.v[k];
    store_bf16x8(out + row_offset + v * 8, h[i]);
  }
}

template <bool kAddResidual, bool kEmbed = false>
void launch_rmsnorm(const bf16* x, bf16* residual, const bf16* weight, bf16* out, int rows,
                    int dim, float eps, cudaStream_t stream, const char* name,
                    EmbeddingIds embed = {}) {
  require(dim >= 8 && dim <= kMaxDim && dim % 8 == 0,
          std::string(name) + ": hidden size " + std::to_string(dim) +
              " is unsupported; it must be a multiple of 8 between 8 and " +
              std::to_string(kMaxDim) + " (rows are held in registers as 16-byte vectors)");
  for (const void* p : {static_cast<const void*>(x), static_cast<const void*>(residual),
                        static_cast<const void*>(weight), static_cast<const void*>(out)}) {
    require(reinterpret_cast<uintptr_t>(p) % 16 == 0,
            std::string(name) + ": tensors must be 16-byte aligned (pass whole-row slices)");
  }
  if (rows == 0) return;
  const int vecs = dim / 8;
  dim3 block, grid;
  int vpt;
  if (vecs <= kMaxWarpRowVecs) {
    vpt = ceil_div(vecs, 32);
    block = dim3(32, kWarpRowsPerCta);
    grid = dim3(ceil_div(rows, kWarpRowsPerCta));
  } else {
    vpt = ceil_div(vecs, kMaxCtaThreads);
    block = dim3(ceil_div(ceil_div(vecs, vpt), 32) * 32);
    grid = dim3(rows);
  }
  auto launch = [&](auto kernel) {
    launch_pdl(kernel, grid, block, 0, stream, x, residual, weight, out, rows, dim, eps, embed);
  };
  switch (vpt) {
    case 1: return launch(rmsnorm_kernel<1, kAddResidual, kEmbed>);
    case 2: return launch(rmsnorm_kernel<2, kAddResidual, kEmbed>);
    case 3: return launch(rmsnorm_kernel<3, kAddResidual, kEmbed>);
    default: return launch(rmsnorm_kernel<4, kAddResidual, kEmbed>);
  }
}

}  // namespace

void rmsnorm(const bf16* x, const bf16* weight, bf16* out, int rows, int dim, float eps,
             cudaStream_t stream) {
  launch_rmsnorm<false>(x, nullptr, weight, out, rows, dim, eps, stream, "rmsnorm");
}

void add_rmsnorm(bf16* x, bf16* residual, const bf16* weight, int rows, int dim, float eps,
                 cudaStream_t stream) {
  launch_rmsnorm<true>(x, residual, weight, x, rows, dim, eps, stream, "add_rmsnorm");
}

void embedding_rmsnorm(const int32_t* ids, const bf16* table, int vocab, bf16* residual,
                       const bf16* weight, bf16* out, int rows, int dim, float eps,
                       cudaStream_t stream, const int32_t* id_src, const int32_t* sampled) {
  require((id_src == nullptr) == (sampled == nullptr),
          "embedding_rmsnorm: give both id_src and sampled, or neither");
  require(vocab > 0, "embedding_rmsnorm: vocab must be positive, got " + std::to_string(vocab));
  launch_rmsnorm<false, true>(table, residual, weight, out, rows, dim, eps, stream,
                              "embedding_rmsnorm", EmbeddingIds{ids, id_src, sampled, vocab});
}

}  // namespace nanograph
