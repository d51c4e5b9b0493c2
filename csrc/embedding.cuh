// Which table row each token of a step embeds: the device code shared by the embedding kernel
// (embedding.cu) and embedding_rmsnorm (norm.cu), so that both resolve ids alike.
#pragma once
#include "common.h"

namespace nanograph {

// Token t takes row sampled[id_src[t]] when id_src is given and id_src[t] >= 0 (a decode step's
// token sampled on the device by the step before, StepLayout), else row ids[t].
struct EmbeddingIds {
  const int32_t* ids = nullptr;
  const int32_t* id_src = nullptr;
  const int32_t* sampled = nullptr;
  int vocab = 0;
};

// Token t's row, or -1 for an id outside [0, vocab) (a zero row).
__device__ __forceinline__ int embedding_row(const EmbeddingIds& e, int t) {
  const int from = e.id_src != nullptr ? e.id_src[t] : -1;
  const int id = from >= 0 ? e.sampled[from] : e.ids[t];
  return id >= 0 && id < e.vocab ? id : -1;
}

}  // namespace nanograph
