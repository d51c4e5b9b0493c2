// Validated arguments of the fused QK-norm + RoPE + K/V cache store (csrc/rope.h), for its own
// binding and for decode attention's, which can do the same work before it attends.
#pragma once

#include <cstdint>
#include <string>

#include "../csrc/rope.h"
#include "tensor.h"

namespace nanograph::py_ext {

// head_dim of the paged caches k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
// checked to be one the kernels take.
inline int64_t paged_cache_head_dim(const Tensor& k_cache, const Tensor& v_cache) {
  if (k_cache.dim() != 4) {
    throw_invalid_argument(
        "k_cache must have shape [num_blocks, block_size, num_kv_heads, head_dim], got " +
        std::to_string(k_cache.dim()) + " dims");
  }
  const int64_t head_dim = k_cache.size(3);
  if (head_dim != 64 && head_dim != 128) {
    throw_invalid_argument("unsupported head_dim " + std::to_string(head_dim) +
                           " (k_cache.size(-1)); supported: 64, 128");
  }
  expect_shape(v_cache, k_cache.shape);
  return head_dim;
}

// The arguments of qk_norm_rope_kv_store for qkv [num_tokens, (num_q_heads + 2 * num_kv_heads) *
// head_dim] (named as its binding names it) and caches checked by paged_cache_head_dim, which
// give num_kv_heads and head_dim. The norm weights are both given or both None (no QK-norm).
inline RopeKvArgs rope_kv_args(const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                               py::handle q_norm_weight, py::handle k_norm_weight,
                               py::handle cos_sin, py::handle positions, py::handle slot_mapping,
                               int num_q_heads, float eps) {
  const Tensor t_qw = optional_cuda_tensor(q_norm_weight, "q_norm_weight", "bfloat16");
  const Tensor t_kw = optional_cuda_tensor(k_norm_weight, "k_norm_weight", "bfloat16");
  const Tensor t_cs = cuda_tensor(cos_sin, "cos_sin", "float32");
  const Tensor t_pos = cuda_tensor(positions, "positions", "int32");
  const Tensor t_slot = cuda_tensor(slot_mapping, "slot_mapping", "int32");
  // Given or not by None, not by the data pointer (an empty tensor has none).
  const bool qk_norm = !q_norm_weight.is_none();
  if (qk_norm != !k_norm_weight.is_none()) {
    throw_invalid_argument(
        "q_norm_weight and k_norm_weight must both be given (Qwen3 QK-norm) or both be None");
  }
  const int64_t num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  expect_shape(qkv, {-1, (num_q_heads + 2 * num_kv_heads) * head_dim});
  const int64_t num_tokens = qkv.size(0);
  expect_shape(t_pos, {num_tokens});
  expect_shape(t_slot, {num_tokens});
  expect_shape(t_cs, {-1, head_dim});
  if (qk_norm) {
    expect_shape(t_qw, {head_dim});
    expect_shape(t_kw, {head_dim});
  }
  // The kernel moves 16 bytes per access.
  for (const Tensor* t : {&qkv, &t_qw, &t_kw, &t_cs, &k_cache, &v_cache}) {
    if (reinterpret_cast<uintptr_t>(t->ptr) % 16 != 0) {
      throw_invalid_argument(t->name + " must start on a 16-byte boundary (pass a fresh tensor, "
                             "or .clone() the view)");
    }
  }
  same_device({&qkv, &t_qw, &t_kw, &t_cs, &t_pos, &t_slot, &k_cache, &v_cache});

  RopeKvArgs args;
  args.qkv = qkv.data<bf16>();
  args.q_norm_weight = t_qw.data<bf16>();
  args.k_norm_weight = t_kw.data<bf16>();
  args.cos_sin = t_cs.data<float>();
  args.positions = t_pos.data<int32_t>();
  args.slot_mapping = t_slot.data<int32_t>();
  args.k_cache = k_cache.data<bf16>();
  args.v_cache = v_cache.data<bf16>();
  args.num_tokens = static_cast<int>(num_tokens);
  args.num_q_heads = num_q_heads;
  args.num_kv_heads = static_cast<int>(num_kv_heads);
  args.head_dim = static_cast<int>(head_dim);
  args.eps = eps;
  return args;
}

}  // namespace nanograph::py_ext
