// Binding for the fused QK-norm + RoPE + K/V cache store (csrc/rope.h).
#include <cstdint>
#include <string>

#include "../csrc/rope.h"
#include "tensor.h"

namespace nanograph::py_ext {

namespace {

// The kernel moves 16 bytes per access.
void expect_aligned(const Tensor& t) {
  if (t.ptr != nullptr && reinterpret_cast<uintptr_t>(t.ptr) % 16 != 0) {
    throw_invalid_argument(t.name + " must start on a 16-byte boundary (pass a fresh tensor, "
                          "or .clone() the view)");
  }
}

}  // namespace

NANOGRAPH_BINDINGS(bind_rope) {
  m.def(
      "qk_norm_rope_kv_store",
      [](py::object qkv, py::object q_norm_weight, py::object k_norm_weight, py::object cos_sin,
         py::object positions, py::object slot_mapping, py::object k_cache, py::object v_cache,
         int num_q_heads, int num_kv_heads, float eps) {
        Tensor t_qkv = cuda_tensor(qkv, "qkv", "bfloat16");
        Tensor t_qw = optional_cuda_tensor(q_norm_weight, "q_norm_weight", "bfloat16");
        Tensor t_kw = optional_cuda_tensor(k_norm_weight, "k_norm_weight", "bfloat16");
        Tensor t_cs = cuda_tensor(cos_sin, "cos_sin", "float32");
        Tensor t_pos = cuda_tensor(positions, "positions", "int32");
        Tensor t_slot = cuda_tensor(slot_mapping, "slot_mapping", "int32");
        Tensor t_kc = cuda_tensor(k_cache, "k_cache", "bfloat16");
        Tensor t_vc = cuda_tensor(v_cache, "v_cache", "bfloat16");

        if ((t_qw.ptr == nullptr) != (t_kw.ptr == nullptr)) {
          throw_invalid_argument(
              "q_norm_weight and k_norm_weight must both be given (Qwen3 QK-norm) or both be None");
        }
        if (num_q_heads <= 0 || num_kv_heads <= 0) {
          throw_invalid_argument("num_q_heads and num_kv_heads must be positive, got " +
                                std::to_string(num_q_heads) + " and " +
                                std::to_string(num_kv_heads));
        }
        if (t_kc.dim() != 4) {
          throw_invalid_argument(
              "k_cache must have shape [num_blocks, block_size, num_kv_heads, head_dim], got " +
              std::to_string(t_kc.dim()) + " dims");
        }
        const int64_t head_dim = t_kc.size(-1);
        if (head_dim != 64 && head_dim != 128) {
          throw_invalid_argument("unsupported head_dim " + std::to_string(head_dim) +
                                " (k_cache.size(-1)); supported: 64, 128");
        }
        expect_shape(t_kc, {-1, -1, num_kv_heads, head_dim});
        expect_shape(t_vc, t_kc.shape);
        expect_shape(t_qkv, {-1, (num_q_heads + 2 * num_kv_heads) * head_dim});
        const int64_t num_tokens = t_qkv.size(0);
        expect_shape(t_pos, {num_tokens});
        expect_shape(t_slot, {num_tokens});
        expect_shape(t_cs, {-1, head_dim});
        if (t_qw.ptr != nullptr) {
          expect_shape(t_qw, {head_dim});
          expect_shape(t_kw, {head_dim});
        }
        for (const Tensor* t : {&t_qkv, &t_qw, &t_kw, &t_cs, &t_kc, &t_vc}) expect_aligned(*t);
        same_device({&t_qkv, &t_qw, &t_kw, &t_cs, &t_pos, &t_slot, &t_kc, &t_vc});

        RopeKvArgs args;
        args.qkv = t_qkv.data<bf16>();
        args.q_norm_weight = t_qw.data<bf16>();
        args.k_norm_weight = t_kw.data<bf16>();
        args.cos_sin = t_cs.data<float>();
        args.positions = t_pos.data<int32_t>();
        args.slot_mapping = t_slot.data<int32_t>();
        args.k_cache = t_kc.data<bf16>();
        args.v_cache = t_vc.data<bf16>();
        args.num_tokens = static_cast<int>(num_tokens);
        args.num_q_heads = num_q_heads;
        args.num_kv_heads = num_kv_heads;
        args.head_dim = static_cast<int>(head_dim);
        args.eps = eps;
        qk_norm_rope_kv_store(args, torch_current_stream());
      },
      py::arg("qkv"), py::arg("q_norm_weight"), py::arg("k_norm_weight"), py::arg("cos_sin"),
      py::arg("positions"), py::arg("slot_mapping"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("eps"),
      "In place on qkv [T, (nq + 2 nkv) * hd] bf16: optional per-head RMSNorm of q and k (both "
      "weights [hd] or both None), then NeoX RoPE from cos_sin [max_pos, hd] fp32 at positions "
      "[T] int32; stores k and v to k_cache/v_cache [num_blocks, block_size, nkv, hd] at "
      "slot_mapping [T] int32 (-1 skips). positions must be < max_pos and slots < "
      "num_blocks * block_size (not checked: the values live on the GPU).");
}

}  // namespace nanograph::py_ext
