// SiLU(gate) * up for the MLP.
#pragma once
#include "common.h"

namespace nanograph {

// gate_up: [rows, 2 * inter], gate in columns [0, inter), up in [inter, 2 * inter).
// out: [rows, inter] = silu(gate) * up, computed in fp32.
void silu_mul(const bf16* gate_up, bf16* out, int rows, int inter, cudaStream_t stream);

}  // namespace nanograph
