// Per-head QK-RMSNorm (optional) + rotary embedding + store of K and V into the paged cache.
#pragma once
#include "common.h"

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
  // k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  bf16* k_cache;
  bf16* v_cache;
  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  float eps;
};

// One kernel: QK-norm (when both norm weights are set), RoPE, K/V store.
void qk_norm_rope_kv_store(const RopeKvArgs& args, cudaStream_t stream);

}  // namespace nanograph
