// Validated arguments of the fused QK-norm + RoPE + K/V cache store (csrc/rope.h), for its own
// binding and for decode attention's, which can do the same work before it attends.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "../csrc/rope.h"
#include "tensor.h"

namespace nanograph::py_ext {

// The paged caches of a kernel binding: k_cache and v_cache both bfloat16, or both float8_e4m3fn
// (an FP8 cache, read as float(e4m3) * k_scale / v_scale; csrc/rope.h KvDtype).
struct PagedCaches {
  Tensor k;
  Tensor v;
  KvDtype dtype = KvDtype::kBf16;
  float k_scale = 1.f;
  float v_scale = 1.f;
};

inline PagedCaches paged_caches(py::handle k_cache, py::handle v_cache, float k_scale,
                                float v_scale) {
  auto dtype_of = [](py::handle obj, const char* name) {
    if (obj.is_none() || !py::hasattr(obj, "dtype")) {
      throw_type_error(std::string(name) + " must be a torch.Tensor");
    }
    return py::str(obj.attr("dtype")).cast<std::string>();
  };
  const std::string k_dtype = dtype_of(k_cache, "k_cache"), v_dtype = dtype_of(v_cache, "v_cache");
  if (k_dtype != v_dtype) {
    throw_type_error("k_cache (" + k_dtype + ") and v_cache (" + v_dtype +
                     ") must have the same dtype");
  }
  PagedCaches caches;
  if (k_dtype == "torch.float8_e4m3fn") {
    caches.dtype = KvDtype::kFp8E4m3;
  } else if (k_dtype != "torch.bfloat16") {
    throw_type_error("k_cache and v_cache must have dtype torch.bfloat16 or torch.float8_e4m3fn "
                     "(an FP8 cache), got " + k_dtype);
  }
  const char* dtype = caches.dtype == KvDtype::kBf16 ? "bfloat16" : "float8_e4m3fn";
  caches.k = cuda_tensor(k_cache, "k_cache", dtype);
  caches.v = cuda_tensor(v_cache, "v_cache", dtype);
  for (auto [name, value] : {std::pair{"k_scale", k_scale}, std::pair{"v_scale", v_scale}}) {
    if (caches.dtype == KvDtype::kBf16 && value != 1.f) {
      throw_invalid_argument(std::string(name) + " is " + std::to_string(value) +
                             "; the scales apply to an FP8 cache (float8_e4m3fn) only, and a "
                             "bfloat16 cache takes 1.0");
    }
    if (!(value > 0.f) || !std::isfinite(value)) {
      throw_invalid_argument(std::string(name) + " is " + std::to_string(value) +
                             "; an FP8 cache's scale must be a positive finite number");
    }
  }
  caches.k_scale = k_scale;
  caches.v_scale = v_scale;
  return caches;
}

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
inline RopeKvArgs rope_kv_args(const Tensor& qkv, const PagedCaches& caches,
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
  const Tensor& k_cache = caches.k;
  const Tensor& v_cache = caches.v;
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
  args.k_cache = k_cache.ptr;
  args.v_cache = v_cache.ptr;
  args.num_tokens = static_cast<int>(num_tokens);
  args.num_q_heads = num_q_heads;
  args.num_kv_heads = static_cast<int>(num_kv_heads);
  args.head_dim = static_cast<int>(head_dim);
  args.eps = eps;
  args.kv_dtype = caches.dtype;
  args.k_scale = caches.k_scale;
  args.v_scale = caches.v_scale;
  return args;
}

}  // namespace nanograph::py_ext
