// Greedy argmax over rows of logits.
#pragma once
#include "common.h"

namespace nanograph {

// logits: [rows, vocab] with row stride `stride` elements; out: [rows] int32.
// Ties resolve to the lowest index, like torch.argmax.
void argmax(const bf16* logits, int rows, int vocab, int stride, int32_t* out, cudaStream_t stream);

}  // namespace nanograph
