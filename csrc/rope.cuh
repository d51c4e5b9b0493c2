// QK-RMSNorm + NeoX RoPE of one head's slice held by a group of head_dim / 8 lanes: the device
// code shared by the RoPE/KV-store kernel (rope.cu) and decode attention, which applies it to the
// step's own token (decode_attention.cu), so that both give the same bits.
#pragma once
#include "bf16x8.cuh"

namespace nanograph {

constexpr int kRopeVec = 8;  // bf16 elements per lane: one 16-byte access (bf16x8.cuh)

// In-place QK-norm + RoPE of one head's 8-element slice held by this lane.
template <int HEAD_DIM, bool QK_NORM>
__device__ __forceinline__ void norm_rope(Float8& x, const bf16* norm_weight,
                                          const float* cos_sin_row, int lane_in_head,
                                          unsigned group_mask, float eps) {
  constexpr int kLanes = HEAD_DIM / kRopeVec;
  constexpr int kHalfLanes = kLanes / 2;
  if constexpr (QK_NORM) {
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < kRopeVec; ++i) sum_sq = __fmaf_rn(x.v[i], x.v[i], sum_sq);
#pragma unroll
    for (int offset = kHalfLanes; offset > 0; offset /= 2) {
      sum_sq += __shfl_xor_sync(group_mask, sum_sq, offset, kLanes);
    }
    const float rstd = rsqrtf(sum_sq / HEAD_DIM + eps);
    const Float8 w = load_bf16x8(norm_weight + lane_in_head * kRopeVec);
#pragma unroll
    for (int i = 0; i < kRopeVec; ++i) x.v[i] = __fmul_rn(x.v[i], rstd);
    round_to_bf16(x);
#pragma unroll
    for (int i = 0; i < kRopeVec; ++i) x.v[i] = __fmul_rn(x.v[i], w.v[i]);
    round_to_bf16(x);
  }
  const bool first_half = lane_in_head < kHalfLanes;
  const int freq = (lane_in_head % kHalfLanes) * kRopeVec;
  float cos_v[kRopeVec], sin_v[kRopeVec];
#pragma unroll
  for (int i = 0; i < kRopeVec; i += 4) {
    *reinterpret_cast<float4*>(&cos_v[i]) = *reinterpret_cast<const float4*>(cos_sin_row + freq + i);
    *reinterpret_cast<float4*>(&sin_v[i]) =
        *reinterpret_cast<const float4*>(cos_sin_row + HEAD_DIM / 2 + freq + i);
  }
  // First half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin. The roundings are spelled
  // out, so that every kernel inlining this gives the same bits.
  const float sign = first_half ? -1.f : 1.f;
#pragma unroll
  for (int i = 0; i < kRopeVec; ++i) {
    const float partner = __shfl_xor_sync(group_mask, x.v[i], kHalfLanes, kLanes);
    x.v[i] = __fmaf_rn(x.v[i], cos_v[i], __fmul_rn(sign * partner, sin_v[i]));
  }
}

}  // namespace nanograph
