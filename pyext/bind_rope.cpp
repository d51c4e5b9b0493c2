// Binding for the fused QK-norm + RoPE + K/V cache store (csrc/rope.h).
#include <string>

#include "rope_args.h"

namespace nanograph::py_ext {

NANOGRAPH_BINDINGS(bind_rope) {
  m.def(
      "qk_norm_rope_kv_store",
      [](py::object qkv, py::object q_norm_weight, py::object k_norm_weight, py::object cos_sin,
         py::object positions, py::object slot_mapping, py::object k_cache, py::object v_cache,
         int num_q_heads, int num_kv_heads, float eps, float k_scale, float v_scale) {
        Tensor t_qkv = cuda_tensor(qkv, "qkv", "bfloat16");
        const PagedCaches caches = paged_caches(k_cache, v_cache, k_scale, v_scale);
        if (num_q_heads <= 0 || num_kv_heads <= 0) {
          throw_invalid_argument("num_q_heads and num_kv_heads must be positive, got " +
                                std::to_string(num_q_heads) + " and " +
                                std::to_string(num_kv_heads));
        }
        const int64_t head_dim = paged_cache_head_dim(caches.k, caches.v);
        expect_shape(caches.k, {-1, -1, num_kv_heads, head_dim});
        qk_norm_rope_kv_store(rope_kv_args(t_qkv, caches, q_norm_weight, k_norm_weight,
                                           cos_sin, positions, slot_mapping, num_q_heads, eps),
                              torch_current_stream());
      },
      py::arg("qkv"), py::arg("q_norm_weight"), py::arg("k_norm_weight"), py::arg("cos_sin"),
      py::arg("positions"), py::arg("slot_mapping"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("eps"), py::arg("k_scale") = 1.f,
      py::arg("v_scale") = 1.f,
      "In place on qkv [T, (nq + 2 nkv) * hd] bf16: optional per-head RMSNorm of q and k (both "
      "weights [hd] or both None), then NeoX RoPE from cos_sin [max_pos, hd] fp32 at positions "
      "[T] int32; stores k and v to k_cache/v_cache [num_blocks, block_size, nkv, hd] at "
      "slot_mapping [T] int32 (-1 skips). The caches are both bfloat16, or both float8_e4m3fn: "
      "an FP8 cache stores e4m3(clamp(k / k_scale, -448, 448)) of the rotated bf16 k, and the "
      "same of v with v_scale. positions must be < max_pos and slots < "
      "num_blocks * block_size (not checked: the values live on the GPU).");
}

}  // namespace nanograph::py_ext
