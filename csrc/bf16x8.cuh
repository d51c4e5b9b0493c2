// Eight bf16 values moved as one 16-byte vector and widened to fp32: the unit of work of the
// memory-bound elementwise and row kernels (norm, activation).
#pragma once
#include "common.h"

namespace nanograph {

struct Float8 {
  float v[8];
};

__device__ __forceinline__ Float8 bf16x8_to_float8(const uint4& raw) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  Float8 out;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(pairs[i]);
    out.v[2 * i] = f.x;
    out.v[2 * i + 1] = f.y;
  }
  return out;
}

// src must be 16-byte aligned.
__device__ __forceinline__ Float8 load_bf16x8(const bf16* src) {
  return bf16x8_to_float8(*reinterpret_cast<const uint4*>(src));
}

// Rounds to nearest-even, like torch's cast to bfloat16. dst must be 16-byte aligned.
__device__ __forceinline__ void store_bf16x8(bf16* dst, const Float8& x) {
  uint4 raw;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(x.v[2 * i], x.v[2 * i + 1]);
  *reinterpret_cast<uint4*>(dst) = raw;
}

// Rounds every element to bf16 and back, to reproduce an intermediate bf16 tensor.
__device__ __forceinline__ void round_to_bf16(Float8& x) {
#pragma unroll
  for (int i = 0; i < 8; ++i) x.v[i] = __bfloat162float(__float2bfloat16_rn(x.v[i]));
}

}  // namespace nanograph
