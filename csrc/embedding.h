// Token embedding lookup.
#pragma once
#include "common.h"

namespace nanograph {

// ids: [num_tokens] int32; table: [vocab, hidden]; out: [num_tokens, hidden].
// An id outside [0, vocab) yields a zero row (the Python side rejects such ids first).
void embedding(const int32_t* ids, const bf16* table, bf16* out, int num_tokens, int hidden,
               int vocab, cudaStream_t stream);

}  // namespace nanograph
