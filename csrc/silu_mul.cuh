// The gated MLP's activation on one element: silu(gate) * up in fp32, from bf16 gate and up.
// Shared by silu_mul (activation.cu) and the GEMV's fused epilogue (gemv.cu), which must agree
// bit for bit.
#pragma once
#include "common.h"

namespace nanograph {

__device__ __forceinline__ float silu_mul_value(float gate, float up) {
  return gate / (1.f + __expf(-gate)) * up;
}

}  // namespace nanograph
