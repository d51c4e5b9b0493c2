// Token embedding lookup: out[t, :] = table[id, :], or a zero row when id is outside [0, vocab),
// where id = ids[t], or sampled[id_src[t]] when id_src is given and id_src[t] >= 0.
//
// Layouts: ids [num_tokens] int32; table [vocab, hidden] bf16; out [num_tokens, hidden] bf16;
// hidden is a multiple of 8 so every row is a whole number of 16-byte vectors.
// Launch: one CTA per token, threads striding over the row's 16-byte vectors. The kernel is a
// pure copy, so the only thing that matters is wide, coalesced loads and stores. Launched with
// PDL (launch.h): it waits for the step's metadata staging before it reads the ids, and only then
// lets the next kernel launch.
#include "embedding.h"

#include "embedding.cuh"
#include "launch.h"

namespace nanograph {

namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads)
    embedding_kernel(EmbeddingIds embed, const uint4* __restrict__ table, uint4* __restrict__ out,
                     int vecs_per_row) {
  wait_for_producers();  // ids and id_src come from the step's metadata staging
  // After the wait: the kernels of the step read the metadata before their own waits, so none may
  // launch before the staging kernel has completed (launch.h).
  allow_dependents();
  const int token = blockIdx.x;
  const int id = embedding_row(embed, token);
  uint4* dst = out + static_cast<int64_t>(token) * vecs_per_row;
  if (id < 0) {
    for (int v = threadIdx.x; v < vecs_per_row; v += kThreads) dst[v] = make_uint4(0, 0, 0, 0);
    return;
  }
  const uint4* src = table + static_cast<int64_t>(id) * vecs_per_row;
  for (int v = threadIdx.x; v < vecs_per_row; v += kThreads) dst[v] = __ldg(src + v);
}

}  // namespace

void embedding(const int32_t* ids, const bf16* table, bf16* out, int num_tokens, int hidden,
               int vocab, cudaStream_t stream, const int32_t* id_src, const int32_t* sampled) {
  require((id_src == nullptr) == (sampled == nullptr),
          "embedding: give both id_src and sampled, or neither");
  require(hidden > 0 && hidden % 8 == 0,
          "embedding: hidden size " + std::to_string(hidden) +
              " must be a positive multiple of 8 (rows are copied as 16-byte vectors)");
  require(reinterpret_cast<uintptr_t>(table) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
          "embedding: table and out must be 16-byte aligned (allocate them with torch/cudaMalloc)");
  if (num_tokens == 0) return;
  launch_pdl(embedding_kernel, dim3(num_tokens), dim3(kThreads), 0, stream,
             EmbeddingIds{ids, id_src, sampled, vocab}, reinterpret_cast<const uint4*>(table),
             reinterpret_cast<uint4*>(out), hidden / 8);
}

}  // namespace nanograph
