// Binding for paged prefill attention (csrc/prefill_attention.cu): checks shapes, dtypes and
// devices, then runs the kernel on torch's current stream.
#include "../csrc/attention.h"
#include "rope_args.h"

namespace nanograph::py_ext {

NANOGRAPH_BINDINGS(bind_prefill_attention) {
  m.def(
      "paged_prefill_attention",
      [](py::object q, py::object k_cache, py::object v_cache, py::object block_tables,
         py::object cu_seqlens_q, py::object context_lens, py::object out, int num_q_heads,
         float scale, int max_q_len, float k_scale, float v_scale) {
        Tensor tq = cuda_tensor(q, "q", "bfloat16");
        const PagedCaches caches = paged_caches(k_cache, v_cache, k_scale, v_scale);
        const Tensor& tk = caches.k;
        const Tensor& tv = caches.v;
        Tensor tbt = cuda_tensor(block_tables, "block_tables", "int32");
        Tensor tcu = cuda_tensor(cu_seqlens_q, "cu_seqlens_q", "int32");
        Tensor tctx = cuda_tensor(context_lens, "context_lens", "int32");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        expect_shape(tk, {-1, -1, -1, -1});
        expect_shape(tv, tk.shape);
        const int64_t block_size = tk.size(1), num_kv_heads = tk.size(2), head_dim = tk.size(3);
        if (num_kv_heads <= 0 || num_q_heads <= 0 || num_q_heads % num_kv_heads != 0) {
          throw_invalid_argument("num_q_heads (" + std::to_string(num_q_heads) +
                                ") must be a positive multiple of k_cache's num_kv_heads (" +
                                std::to_string(num_kv_heads) + ")");
        }
        expect_shape(tq, {-1, -1});
        const int64_t total_q = tq.size(0);
        if (tq.size(1) < num_q_heads * head_dim) {
          throw_invalid_argument("q rows hold " + std::to_string(tq.size(1)) +
                                " values, fewer than num_q_heads * head_dim = " +
                                std::to_string(num_q_heads * head_dim));
        }
        expect_shape(tbt, {-1, -1});
        const int64_t num_seqs = tbt.size(0);
        expect_shape(tcu, {num_seqs + 1});
        expect_shape(tctx, {num_seqs});
        expect_shape(to, {total_q, num_q_heads * head_dim});
        if (max_q_len < 0) {
          throw_invalid_argument("max_q_len must be >= 0 (an upper bound on the query lengths)");
        }
        same_device({&tq, &tk, &tv, &tbt, &tcu, &tctx, &to});

        PrefillAttentionArgs args{};
        args.q = tq.data<bf16>();
        args.q_stride = static_cast<int>(tq.size(1));
        args.kv.k_cache = tk.ptr;
        args.kv.v_cache = tv.ptr;
        args.kv.dtype = caches.dtype;
        args.kv.k_scale = caches.k_scale;
        args.kv.v_scale = caches.v_scale;
        args.kv.block_tables = tbt.data<int32_t>();
        args.kv.block_table_stride = static_cast<int>(tbt.size(1));
        args.kv.context_lens = tctx.data<int32_t>();
        args.kv.block_size = static_cast<int>(block_size);
        args.kv.num_kv_heads = static_cast<int>(num_kv_heads);
        args.kv.head_dim = static_cast<int>(head_dim);
        args.cu_seqlens_q = tcu.data<int32_t>();
        args.out = to.data<bf16>();
        args.num_seqs = static_cast<int>(num_seqs);
        args.total_q = static_cast<int>(total_q);
        args.max_q_len = max_q_len;
        args.num_q_heads = num_q_heads;
        args.scale = scale;
        paged_prefill_attention(args, torch_current_stream());
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
      py::arg("cu_seqlens_q"), py::arg("context_lens"), py::arg("out"), py::arg("num_q_heads"),
      py::arg("scale"), py::arg("max_q_len"), py::arg("k_scale") = 1.f, py::arg("v_scale") = 1.f,
      "Causal variable-length attention of q [total_q, q_stride] over the paged KV cache "
      "[num_blocks, block_size, num_kv_heads, head_dim] into out "
      "[total_q, num_q_heads * head_dim]. The caches are both bf16, or both float8_e4m3fn (read "
      "as float(e4m3) * k_scale / v_scale). "
      "Query i of sequence s sits at position context_lens[s] - q_len(s) + i; max_q_len must bound "
      "every q_len(s).");
}

}  // namespace nanograph::py_ext
