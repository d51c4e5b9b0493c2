// QK-RMSNorm + NeoX RoPE of one head's slice held by a group of head_dim / 8 lanes: the device
// code shared by the RoPE/KV-store kernel (rope.cu) and decode attention, which applies it to the
// step's own token (decode_attention.cu), so that both give the same bits.
#pragma once
#include "bf16x8.cuh"
#include "e4m3.cuh"
#include "rope.h"

namespace nanograph {

constexpr int kRopeVec = 8;  // bf16 elements per lane: one 16-byte access (bf16x8.cuh)

// What norm_rope reads besides the head itself: this lane's slice of the norm weight (QK_NORM) and
// of the position's cos/sin row. Loaded apart from the head so that a kernel can fetch it before
// its PDL wait (none of it is written by the chain).
struct NormRopeOperands {
  Float8 weight;
  float cos_v[kRopeVec];
  float sin_v[kRopeVec];
};

template <int HEAD_DIM, bool QK_NORM>
__device__ __forceinline__ NormRopeOperands load_norm_rope_operands(const bf16* norm_weight,
                                                                    const float* cos_sin_row,
                                                                    int lane_in_head) {
  constexpr int kHalfLanes = HEAD_DIM / kRopeVec / 2;
  NormRopeOperands op;
  if constexpr (QK_NORM) op.weight = load_bf16x8(norm_weight + lane_in_head * kRopeVec);
  const int freq = (lane_in_head % kHalfLanes) * kRopeVec;
#pragma unroll
  for (int i = 0; i < kRopeVec; i += 4) {
    *reinterpret_cast<float4*>(&op.cos_v[i]) =
        *reinterpret_cast<const float4*>(cos_sin_row + freq + i);
    *reinterpret_cast<float4*>(&op.sin_v[i]) =
        *reinterpret_cast<const float4*>(cos_sin_row + HEAD_DIM / 2 + freq + i);
  }
  return op;
}

// In-place QK-norm + RoPE of one head's 8-element slice held by this lane, with the operands
// load_norm_rope_operands gave for that lane.
template <int HEAD_DIM, bool QK_NORM>
__device__ __forceinline__ void apply_norm_rope(Float8& x, const NormRopeOperands& op,
                                                int lane_in_head, unsigned group_mask, float eps) {
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
#pragma unroll
    for (int i = 0; i < kRopeVec; ++i) x.v[i] = __fmul_rn(x.v[i], rstd);
    round_to_bf16(x);
#pragma unroll
    for (int i = 0; i < kRopeVec; ++i) x.v[i] = __fmul_rn(x.v[i], op.weight.v[i]);
    round_to_bf16(x);
  }
  // First half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin. The roundings are spelled
  // out, so that every kernel inlining this gives the same bits.
  const float sign = lane_in_head < kHalfLanes ? -1.f : 1.f;
#pragma unroll
  for (int i = 0; i < kRopeVec; ++i) {
    const float partner = __shfl_xor_sync(group_mask, x.v[i], kHalfLanes, kLanes);
    x.v[i] = __fmaf_rn(x.v[i], op.cos_v[i], __fmul_rn(sign * partner, op.sin_v[i]));
  }
}

// In-place QK-norm + RoPE of one head's 8-element slice held by this lane.
template <int HEAD_DIM, bool QK_NORM>
__device__ __forceinline__ void norm_rope(Float8& x, const bf16* norm_weight,
                                          const float* cos_sin_row, int lane_in_head,
                                          unsigned group_mask, float eps) {
  apply_norm_rope<HEAD_DIM, QK_NORM>(
      x, load_norm_rope_operands<HEAD_DIM, QK_NORM>(norm_weight, cos_sin_row, lane_in_head),
      lane_in_head, group_mask, eps);
}

// Stores one lane's 8-element slice of a token's key (k, as rotated, not yet rounded) and value (v,
// the raw bf16 slice) into the caches at element `offset`: bf16(k) and v, or for an FP8 cache
// each divided by its scale and rounded to e4m3 (e4m3.cuh).
__device__ __forceinline__ void store_kv_slice(const RopeKvArgs& args, int64_t offset, Float8 k,
                                               const uint4& v) {
  if (args.kv_dtype == KvDtype::kBf16) {
    store_bf16x8(static_cast<bf16*>(args.k_cache) + offset, k);
    *reinterpret_cast<uint4*>(static_cast<bf16*>(args.v_cache) + offset) = v;
    return;
  }
  round_to_bf16(k);
  *reinterpret_cast<uint2*>(static_cast<uint8_t*>(args.k_cache) + offset) =
      quantize_e4m3x8(k, args.k_scale);
  *reinterpret_cast<uint2*>(static_cast<uint8_t*>(args.v_cache) + offset) =
      quantize_e4m3x8(bf16x8_to_float8(v), args.v_scale);
}

}  // namespace nanograph
