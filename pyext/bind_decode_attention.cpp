// Binding for paged decode attention (csrc/attention.h): one query token per sequence, split-KV.
#include <cstdint>
#include <string>

#include "../csrc/attention.h"
#include "rope_args.h"

namespace nanograph::py_ext {

NANOGRAPH_BINDINGS(bind_decode_attention) {
  m.def("decode_attention_workspace_bytes", &decode_attention_workspace_bytes,
        py::arg("num_seqs"), py::arg("num_q_heads"), py::arg("head_dim"),
        py::arg("max_context_len"),
        "Bytes of fp32 workspace paged_decode_attention needs for these sizes (0: none).");

  m.def(
      "paged_decode_attention",
      [](py::object q, py::object k_cache, py::object v_cache, py::object block_tables,
         py::object context_lens, py::object out, int num_q_heads, float scale,
         int max_context_len, py::object workspace, py::object seq_order,
         py::object q_norm_weight, py::object k_norm_weight, py::object cos_sin,
         py::object positions, py::object slot_mapping, float eps, bool cluster_merge,
         py::object plan_num_seqs, float k_scale, float v_scale) {
        Tensor t_q = cuda_tensor(q, "q", "bfloat16");
        const PagedCaches caches = paged_caches(k_cache, v_cache, k_scale, v_scale);
        const Tensor& t_kc = caches.k;
        const Tensor& t_vc = caches.v;
        Tensor t_bt = cuda_tensor(block_tables, "block_tables", "int32");
        Tensor t_len = cuda_tensor(context_lens, "context_lens", "int32");
        Tensor t_out = cuda_tensor(out, "out", "bfloat16");
        Tensor t_ws = optional_cuda_tensor(workspace, "workspace", "float32");
        Tensor t_order = optional_cuda_tensor(seq_order, "seq_order", "int32");

        const int64_t head_dim = paged_cache_head_dim(t_kc, t_vc);
        const int64_t block_size = t_kc.size(1), num_kv_heads = t_kc.size(2);
        if (num_q_heads <= 0 || num_q_heads % num_kv_heads != 0) {
          throw_invalid_argument("num_q_heads (" + std::to_string(num_q_heads) +
                                ") must be a positive multiple of num_kv_heads (" +
                                std::to_string(num_kv_heads) + ", k_cache.size(2))");
        }
        if (t_q.dim() != 2) {
          throw_invalid_argument("q must be 2-D [num_seqs, q_stride] (q heads first in each row)");
        }
        const int64_t num_seqs = t_q.size(0);
        if (t_q.size(1) < num_q_heads * head_dim) {
          throw_invalid_argument("q rows hold " + std::to_string(t_q.size(1)) +
                                " values; num_q_heads * head_dim = " +
                                std::to_string(num_q_heads * head_dim) + " are needed");
        }
        expect_shape(t_bt, {num_seqs, -1});
        expect_shape(t_len, {num_seqs});
        expect_shape(t_out, {num_seqs, num_q_heads * head_dim});
        if (!seq_order.is_none()) expect_shape(t_order, {num_seqs});
        RopeKvArgs rope{};  // rope.qkv == nullptr: no RoPE/KV store
        if (!cos_sin.is_none()) {
          if (positions.is_none() || slot_mapping.is_none()) {
            throw_invalid_argument("with cos_sin, give positions and slot_mapping too");
          }
          rope = rope_kv_args(t_q, caches, q_norm_weight, k_norm_weight, cos_sin, positions,
                              slot_mapping, num_q_heads, eps);
        } else if (!q_norm_weight.is_none() || !k_norm_weight.is_none() || !positions.is_none() ||
                   !slot_mapping.is_none()) {
          throw_invalid_argument("norm weights, positions and slot_mapping go with cos_sin");
        }
        same_device({&t_q, &t_kc, &t_vc, &t_bt, &t_len, &t_out, &t_ws, &t_order});

        const int planned =
            plan_num_seqs.is_none() ? static_cast<int>(num_seqs) : plan_num_seqs.cast<int>();
        if (planned < num_seqs) {
          throw_invalid_argument("plan_num_seqs (" + std::to_string(planned) +
                                 ") must be at least the number of sequences (" +
                                 std::to_string(num_seqs) + ")");
        }
        DecodeAttentionPlan plan = plan_decode_attention(
            planned, num_q_heads, static_cast<int>(num_kv_heads), static_cast<int>(head_dim),
            max_context_len, device_props(), caches.dtype);
        plan.cluster_merge = plan.cluster_merge && cluster_merge;
        // One buffer: the arrival counters, then the workspace.
        const size_t ws_bytes = plan.workspace_bytes > 0 ? arrival_bytes(plan) + plan.workspace_bytes : 0;
        py::object allocated;  // keeps a workspace made here alive until the launch is queued
        if (t_ws.ptr == nullptr && ws_bytes > 0) {
          py::module_ torch = py::module_::import("torch");
          allocated = torch.attr("zeros")(static_cast<int64_t>(ws_bytes / sizeof(float)),
                                          py::arg("dtype") = torch.attr("float32"),
                                          py::arg("device") = q.attr("device"));
          t_ws = cuda_tensor(allocated, "workspace", "float32");
        }
        if (static_cast<size_t>(t_ws.numel()) * sizeof(float) < ws_bytes) {
          throw_invalid_argument("workspace holds " + std::to_string(t_ws.numel() * 4) +
                                " bytes; the plan takes " +
                                std::to_string(ws_bytes) + " are needed");
        }

        DecodeAttentionArgs args;
        args.q = t_q.data<bf16>();
        args.q_stride = static_cast<int>(t_q.size(1));
        args.kv = PagedKv{t_kc.ptr,
                          t_vc.ptr,
                          t_bt.data<int32_t>(),
                          static_cast<int>(t_bt.size(1)),
                          t_len.data<int32_t>(),
                          static_cast<int>(block_size),
                          static_cast<int>(num_kv_heads),
                          static_cast<int>(head_dim),
                          caches.dtype,
                          caches.k_scale,
                          caches.v_scale};
        args.out = t_out.data<bf16>();
        args.num_seqs = static_cast<int>(num_seqs);
        args.num_q_heads = num_q_heads;
        args.max_context_len = max_context_len;
        args.scale = scale;
        if (ws_bytes > 0) {
          args.arrivals = reinterpret_cast<unsigned*>(t_ws.data<float>());
          args.workspace = t_ws.data<float>() + arrival_bytes(plan) / sizeof(float);
        } else {
          args.arrivals = nullptr;
          args.workspace = nullptr;
        }
        args.seq_order = t_order.data<int32_t>();
        args.rope = rope;
        paged_decode_attention(args, plan, torch_current_stream());
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
      py::arg("context_lens"), py::arg("out"), py::arg("num_q_heads"), py::arg("scale"),
      py::arg("max_context_len"), py::arg("workspace") = py::none(),
      py::arg("seq_order") = py::none(), py::arg("q_norm_weight") = py::none(),
      py::arg("k_norm_weight") = py::none(), py::arg("cos_sin") = py::none(),
      py::arg("positions") = py::none(), py::arg("slot_mapping") = py::none(),
      py::arg("eps") = 1e-6f, py::arg("cluster_merge") = true, py::arg("plan_num_seqs") = py::none(),
      py::arg("k_scale") = 1.f, py::arg("v_scale") = 1.f,
      "out [num_seqs, nq * hd] bf16 = softmax(scale * q K^T) V for one query token per sequence. "
      "q: [num_seqs, q_stride] bf16 with q heads first in each row (e.g. the qkv rows); "
      "k_cache, v_cache: [num_blocks, block_size, nkv, hd], both bf16 or both float8_e4m3fn (an "
      "FP8 cache, read as float(e4m3) * k_scale / v_scale; q and the probabilities then meet it "
      "in fp16); block_tables: [num_seqs, W] "
      "int32; context_lens: [num_seqs] int32, each <= max_context_len (a row of length 0 gives "
      "zeros). max_context_len sizes the grid, as in a captured graph. workspace: fp32 tensor of "
      "at least decode_attention_workspace_bytes(plan_num_seqs or num_seqs, ...) bytes (its first "
      "bytes count the splits' arrivals), zero-filled before its first use (every call leaves the "
      "counters at zero) and used by calls of one plan only (the same plan_num_seqs, heads and "
      "max_context_len: the counters' size depends on the plan), or None to allocate one per "
      "call. "
      "seq_order: None, or [num_seqs] int32, a permutation of the sequences (order_by_length) in "
      "which large grids take them up; it changes no result. "
      "With cos_sin (and positions, slot_mapping [num_seqs] int32, optional q_norm_weight and "
      "k_norm_weight [hd], eps), q is the raw qkv rows [num_seqs, (nq + 2 nkv) * hd] of the step's "
      "own token, and the call does what qk_norm_rope_kv_store would before it: q and k are "
      "normalised and rotated (qkv itself is left as it is) and each sequence's key and value are "
      "stored at slot_mapping (-1 skips; length-0 sequences store nothing). positions must be "
      "below cos_sin's rows and slots below num_blocks * block_size (not checked: the values live "
      "on the GPU). "
      "cluster_merge: where the plan launches thread block clusters (sm_90 small grids whose "
      "clusters are all resident at once), a sequence whose keys fill one chunk merges its splits "
      "inside its cluster (False: through the workspace; the same bits either way). "
      "plan_num_seqs: the batch size to plan for (a decode graph's bucket; default num_seqs). "
      "Block ids, lengths and the order live on the GPU and are not checked.");

  m.def(
      "decode_attention_plan",
      [](int num_seqs, int num_q_heads, int num_kv_heads, int head_dim, int max_context_len,
         bool fp8) {
        const DecodeAttentionPlan plan =
            plan_decode_attention(num_seqs, num_q_heads, num_kv_heads, head_dim, max_context_len,
                                  device_props(), fp8 ? KvDtype::kFp8E4m3 : KvDtype::kBf16);
        py::dict d;
        d["chunks"] = plan.chunks;
        d["cluster"] = plan.cluster;
        d["splits"] = plan.splits();
        d["chunk_min_keys"] = plan.chunk_min_keys;
        d["early_kv"] = plan.early_kv;
        d["cluster_merge"] = plan.cluster_merge;
        d["reads_order"] = plan.reads_order;
        d["fuse_rope"] = plan.fuse_rope;
        d["prefetch_next_step"] = plan.prefetch_next_step;
        d["workspace_bytes"] = plan.workspace_bytes;
        return d;
      },
      py::arg("num_seqs"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
      py::arg("max_context_len"), py::arg("fp8") = false,
      "paged_decode_attention's plan for these sizes (fp8: an e4m3 KV cache) on the current GPU, "
      "as a dict: chunks, "
      "cluster (CTAs per chunk), splits (CTAs per sequence and kv head), chunk_min_keys (a "
      "sequence fills one chunk per this many keys), early_kv, cluster_merge, reads_order (takes "
      "seq_order), fuse_rope (the engine passes the RoPE/KV store in), prefetch_next_step (a large "
      "grid's warps request their next keys into L2 in launches with the fused RoPE; small grids always do), workspace_bytes.");

  m.def(
      "order_by_length",
      [](py::object context_lens, py::object seq_order) {
        Tensor t_len = cuda_tensor(context_lens, "context_lens", "int32");
        Tensor t_order = cuda_tensor(seq_order, "seq_order", "int32");
        expect_shape(t_len, {-1});
        expect_shape(t_order, {t_len.size(0)});
        same_device({&t_len, &t_order});
        order_by_length(t_len.data<int32_t>(), checked_int(t_len.size(0), "num_seqs"),
                        t_order.data<int32_t>(), torch_current_stream());
      },
      py::arg("context_lens"), py::arg("seq_order"),
      "seq_order[r] = the sequence of rank r by context length, longest first, ties in index "
      "order (a stable descending sort), for paged_decode_attention's seq_order.");
}

}  // namespace nanograph::py_ext
