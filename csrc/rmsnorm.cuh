// Device pieces shared by the norm kernels (norm.cu) and the GEMV's fused input norm
// (gemv_common.cuh), which must add a row's squares in the same order (rmsnorm_cut, norm.h).
#pragma once
#include "common.h"

namespace nanograph {

// The sum of v over a warp's 32 lanes by an xor-shuffle tree (offsets 16, 8, 4, 2, 1); every lane
// gets the same bits.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace nanograph
