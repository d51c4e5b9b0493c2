// Bindings for the decoder Model: construction from packed torch weights, KV cache sizing, the
// per-step metadata views (numpy over pinned memory), step(), decode graphs, the logits buffer and
// the last step's hidden states.
#include <pybind11/numpy.h>

#include <tuple>

#include "../csrc/model.h"
#include "tensor.h"

namespace nanograph::py_ext {

namespace {

const bf16* weight(const py::dict& weights, const std::string& name,
                   const std::vector<int64_t>& shape, bool optional = false) {
  if (!weights.contains(name)) {
    if (optional) return nullptr;
    throw_invalid_argument("weights have no tensor named '" + name + "'");
  }
  Tensor t = cuda_tensor(weights[name.c_str()], name.c_str(), "bfloat16");
  expect_shape(t, shape);
  return t.data<bf16>();
}

// A projection: bf16, or float8_e4m3fn with its block scales in `<name>_scale` and, optionally,
// the same scales once per 128 x 128 block in `<name>_block_scale` (fp8.h; the block-scaled FP8
// GEMM at prefill sizes).
LinearWeight linear_weight(const py::dict& weights, const std::string& name, int64_t N, int64_t K) {
  if (!weights.contains(name)) {
    throw_invalid_argument("weights have no tensor named '" + name + "'");
  }
  const std::string dtype = py::str(weights[name.c_str()].attr("dtype")).cast<std::string>();
  if (dtype != "torch.float8_e4m3fn") return weight(weights, name, {N, K});
  Tensor t = cuda_tensor(weights[name.c_str()], name.c_str(), "float8_e4m3fn");
  expect_shape(t, {N, K});
  const std::string scale_name = name + "_scale";
  if (!weights.contains(scale_name)) {
    throw_invalid_argument("FP8 weight '" + name + "' has no block scales '" + scale_name + "'");
  }
  Tensor scale = cuda_tensor(weights[scale_name.c_str()], scale_name.c_str(), "float32");
  expect_shape(scale, {fp8_scale_rows(N), fp8_scale_cols(K)});
  const std::string block_name = name + "_block_scale";
  if (!weights.contains(block_name)) return LinearWeight(t.ptr, scale.data<float>());
  Tensor block = cuda_tensor(weights[block_name.c_str()], block_name.c_str(), "float32");
  expect_shape(block, {fp8_block_scale_rows(N), fp8_block_scale_cols(K)});
  same_device({&t, &scale, &block});
  return LinearWeight(t.ptr, scale.data<float>(), block.data<float>());
}

std::unique_ptr<Model> make_model(const py::dict& cfg, const py::dict& weights,
                                  const py::dict& lim, py::object cos_sin) {
  ModelConfig c{};
  c.vocab_size = cfg["vocab_size"].cast<int>();
  c.hidden_size = cfg["hidden_size"].cast<int>();
  c.num_layers = cfg["num_layers"].cast<int>();
  c.num_q_heads = cfg["num_heads"].cast<int>();
  c.num_kv_heads = cfg["num_kv_heads"].cast<int>();
  c.head_dim = cfg["head_dim"].cast<int>();
  c.intermediate_size = cfg["intermediate_size"].cast<int>();
  c.rms_norm_eps = cfg["rms_norm_eps"].cast<float>();
  Tensor table = cuda_tensor(cos_sin, "cos_sin", "float32");
  expect_shape(table, {-1, c.head_dim});
  c.max_position = static_cast<int>(table.size(0));
  // The KV cache: "auto" (bf16) or "fp8" (e4m3, with each layer's [k_scale, v_scale] in
  // "kv_scales").
  const std::string kv_cache_dtype =
      cfg.contains("kv_cache_dtype") ? cfg["kv_cache_dtype"].cast<std::string>() : "auto";
  if (kv_cache_dtype != "auto" && kv_cache_dtype != "fp8") {
    throw_invalid_argument("config kv_cache_dtype '" + kv_cache_dtype +
                           "' is not one the core runs; use 'auto' (bf16) or 'fp8' (e4m3)");
  }
  c.kv_dtype = kv_cache_dtype == "fp8" ? KvDtype::kFp8E4m3 : KvDtype::kBf16;
  std::vector<std::pair<float, float>> kv_scales(c.num_layers, {1.f, 1.f});
  if (c.kv_dtype == KvDtype::kBf16 && cfg.contains("kv_scales")) {
    throw_invalid_argument("config kv_scales apply to kv_cache_dtype 'fp8' only; drop them, or "
                           "set kv_cache_dtype 'fp8'");
  }
  if (c.kv_dtype == KvDtype::kFp8E4m3) {
    if (!cfg.contains("kv_scales")) {
      throw_invalid_argument("config kv_cache_dtype 'fp8' needs kv_scales: each layer's "
                             "[k_scale, v_scale]");
    }
    try {
      kv_scales = cfg["kv_scales"].cast<std::vector<std::pair<float, float>>>();
    } catch (const py::cast_error&) {
      throw_type_error("config kv_scales must be a list of [k_scale, v_scale] float pairs, one "
                       "per layer");
    }
    if (static_cast<int>(kv_scales.size()) != c.num_layers) {
      throw_invalid_argument("config kv_scales has " + std::to_string(kv_scales.size()) +
                             " [k_scale, v_scale] pairs; the model has " +
                             std::to_string(c.num_layers) + " layers");
    }
  }

  EngineLimits limits{lim["max_num_tokens"].cast<int>(), lim["max_num_seqs"].cast<int>(),
                      lim["max_model_len"].cast<int>(), lim["block_size"].cast<int>()};

  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t qkv = (c.num_q_heads + 2 * c.num_kv_heads) * hd;
  ModelWeights w;
  w.embed = weight(weights, "embed_tokens", {c.vocab_size, H});
  w.final_norm = weight(weights, "norm", {H});
  w.lm_head = weight(weights, "lm_head", {c.vocab_size, H});
  w.cos_sin = table.data<float>();
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LayerWeights lw{};
    lw.input_norm = weight(weights, p + "input_layernorm", {H});
    lw.qkv = linear_weight(weights, p + "qkv_proj", qkv, H);
    lw.qkv_bias = weight(weights, p + "qkv_bias", {qkv}, true);
    lw.q_norm = weight(weights, p + "q_norm", {hd}, true);
    lw.k_norm = weight(weights, p + "k_norm", {hd}, true);
    if ((lw.q_norm == nullptr) != (lw.k_norm == nullptr)) {
      throw_invalid_argument(p + "q_norm and " + p + "k_norm must be given together");
    }
    lw.o_proj = linear_weight(weights, p + "o_proj", H, c.num_q_heads * hd);
    lw.post_norm = weight(weights, p + "post_attention_layernorm", {H});
    lw.gate_up = linear_weight(weights, p + "gate_up_proj", 2 * I, H);
    lw.down = linear_weight(weights, p + "down_proj", H, I);
    std::tie(lw.k_scale, lw.v_scale) = kv_scales[l];
    w.layers.push_back(lw);
  }
  cudaSetDevice(table.device);
  return std::make_unique<Model>(c, std::move(w), limits);
}

// numpy int32 views over the pinned metadata of a step's num_tokens and num_seqs, laid out for
// the rows the step will run (Model::step_rows: a decode graph's bucket).
py::dict step_views(Model& m, int num_tokens, int num_seqs, bool use_graph, py::handle owner) {
  require(num_tokens >= 1 && num_tokens <= m.limits().max_num_tokens,
          "num_tokens must be in [1, " + std::to_string(m.limits().max_num_tokens) + "]");
  require(num_seqs >= 1 && num_seqs <= m.limits().max_num_seqs,
          "num_seqs must be in [1, " + std::to_string(m.limits().max_num_seqs) + "]");
  const int rows = m.step_rows(num_tokens, num_seqs, use_graph);
  const StepLayout layout(rows == num_seqs ? num_tokens : rows, rows, m.block_table_width());
  int32_t* base = m.host_metadata();
  auto view = [&](int offset, std::vector<py::ssize_t> shape) {
    return py::array_t<int32_t>(shape, base + offset, owner);
  };
  py::dict d;
  d["input_ids"] = view(layout.input_ids, {num_tokens});
  d["input_src"] = view(layout.input_src, {num_tokens});
  d["positions"] = view(layout.positions, {num_tokens});
  d["slot_mapping"] = view(layout.slot_mapping, {num_tokens});
  d["cu_seqlens_q"] = view(layout.cu_seqlens_q, {num_seqs + 1});
  d["context_lens"] = view(layout.context_lens, {num_seqs});
  d["block_tables"] = view(layout.block_tables, {num_seqs, m.block_table_width()});
  return d;
}

}  // namespace

NANOGRAPH_BINDINGS(bind_model) {
  m.def("default_decode_buckets", &default_decode_buckets, py::arg("max_num_seqs"),
        "Decode graph buckets [1, 2, 4, 8, 16, 24, ...] up to and including max_num_seqs.");

  py::class_<Model>(m, "Model")
      .def(py::init(&make_model), py::arg("config"), py::arg("weights"), py::arg("limits"),
           py::arg("cos_sin"))
      .def_property_readonly("kv_bytes_per_block", &Model::kv_bytes_per_block)
      .def_property_readonly("num_kv_blocks", &Model::num_kv_blocks)
      .def_property_readonly("block_table_width", &Model::block_table_width)
      .def_property_readonly("stream", [](const Model& self) {
        return reinterpret_cast<uintptr_t>(self.stream());
      })
      .def_property_readonly("logits_ptr", [](const Model& self) {
        return reinterpret_cast<uintptr_t>(self.logits());
      })
      .def_property_readonly("hidden_ptr", [](const Model& self) {
        return reinterpret_cast<uintptr_t>(self.hidden());
      })
      .def_property_readonly("residual_ptr", [](const Model& self) {
        return reinterpret_cast<uintptr_t>(self.residual());
      })
      .def_property_readonly("sampled_tokens_ptr", [](const Model& self) {
        return reinterpret_cast<uintptr_t>(self.sampled_tokens());
      })
      .def_property_readonly("graph_buckets", [](const Model& self) {
        return self.graphs() ? self.graphs()->buckets() : std::vector<int>{};
      })
      .def("allocate_kv_cache", &Model::allocate_kv_cache, py::arg("num_blocks"))
      .def("step_views", [](py::object self, int num_tokens, int num_seqs, bool use_graph) {
        return step_views(self.cast<Model&>(), num_tokens, num_seqs, use_graph, self);
      }, py::arg("num_tokens"), py::arg("num_seqs"), py::arg("use_graph") = false,
      "numpy views of the pinned step metadata of num_tokens and num_seqs, laid out for the "
      "graph bucket a decode step replays when use_graph (the core makes its other rows inert).")
      .def("step", &Model::step, py::arg("num_tokens"), py::arg("num_seqs"), py::arg("max_q_len"),
           py::arg("use_graph"), py::arg("greedy") = false, py::call_guard<py::gil_scoped_release>(),
           "Queues one step; with greedy, also each sequence's argmax (into sampled_tokens and a "
           "host slot, returned; else -1).")
      .def("greedy_tokens", [](Model& self, int slot, int rows) {
        require(rows >= 0 && rows <= self.limits().max_num_seqs,
                "rows must be in [0, max_num_seqs=" + std::to_string(self.limits().max_num_seqs) + "]");
        const int32_t* ids = nullptr;
        {
          py::gil_scoped_release release;
          ids = self.greedy_tokens(slot);
        }
        return std::vector<int>(ids, ids + rows);
      }, py::arg("slot"), py::arg("rows"),
      "The first `rows` token ids a greedy step wrote into `slot`, once it has run (waits for it).")
      .def("capture_decode_graphs", &Model::capture_decode_graphs, py::arg("buckets"))
      .def("decode_bucket", &Model::decode_bucket, py::arg("num_seqs"))
      .def("synchronize", [](const Model& self) { CUDA_CHECK(cudaStreamSynchronize(self.stream())); },
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace nanograph::py_ext
