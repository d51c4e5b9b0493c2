// Per-head QK-RMSNorm (optional) + rotary embedding + store of K and V into the paged cache.
#pragma once
#include "common.h"
#include "kv_cache.h"

namespace nanograph {

struct RopeKvArgs {
  // qkv: [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim], q | k | v packed per token.
  // Q and K are normalised (if weights are given) and rotated in place; V is only copied.
  bf16* qkv;
  const bf16* q_norm_weight;  // [head_dim] or nullptr (no QK-norm)
  const bf16* k_norm_weight;  // [head_dim] or nullptr
  // cos_sin: [max_position, head_dim] fp32; row p holds cos(p * inv_freq[i]) for i < head_dim/2,
  // then sin(p * inv_freq[i]). NeoX half-split rotation: x[i] pairs with x[i + head_dim/2].
  const float* cos_sin;
  const int32_t* positions;     // [num_tokens]
  const int32_t* slot_mapping;  // [num_tokens]; slot = block * block_size + offset; -1 = skip
  // k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] of kv_dtype
  void* k_cache;
  void* v_cache;
  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  float eps;
  KvDtype kv_dtype = KvDtype::kBf16;
  float k_scale = 1.f;  // kFp8E4m3: what a stored key or value is divided by
  float v_scale = 1.f;
};

// One kernel: QK-norm (when both norm weights are set), RoPE, K/V store (an FP8 cache stores the
// rotated bf16 key and the bf16 value, each divided by its scale).
void qk_norm_rope_kv_store(const RopeKvArgs& args, cudaStream_t stream);

}  // namespace nanograph
