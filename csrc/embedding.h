// Token embedding lookup.
#pragma once
#include "common.h"

namespace nanograph {

// ids: [num_tokens] int32; table: [vocab, hidden]; out: [num_tokens, hidden].
// An id outside [0, vocab) yields a zero row (the Python side rejects such ids first).
// id_src and sampled (both or neither): where id_src[t] >= 0, token t's id is sampled[id_src[t]]
// instead of ids[t] (a decode step's tokens sampled on the device by the step before, StepLayout).
void embedding(const int32_t* ids, const bf16* table, bf16* out, int num_tokens, int hidden,
               int vocab, cudaStream_t stream, const int32_t* id_src = nullptr,
               const int32_t* sampled = nullptr);

}  // namespace nanograph
