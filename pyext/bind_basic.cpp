// Bindings for the memory-bound layer kernels: embedding, RMSNorm, SiLU-and-mul and argmax.
#include <vector>

#include "../csrc/activation.h"
#include "../csrc/embedding.h"
#include "../csrc/norm.h"
#include "../csrc/sampling.h"  // argmax
#include "tensor.h"

namespace nanograph::py_ext {

namespace {

// Rows of a tensor viewed as [rows, size(-1)].
int leading_rows(const Tensor& t) {
  if (t.dim() == 0) throw_invalid_argument(t.name + " must have at least one dimension");
  return checked_int(t.size(-1) == 0 ? 0 : t.numel() / t.size(-1), t.name + "'s row count");
}

std::vector<int64_t> with_last(std::vector<int64_t> shape, int64_t last) {
  shape.back() = last;
  return shape;
}

// The token ids and table of an embedding lookup, checked: ids [n] int32, table [vocab, hidden]
// bf16, and id_src [n] int32 with sampled [m] int32, both or neither.
struct EmbeddingLookup {
  Tensor ids, table, id_src, sampled;
};

EmbeddingLookup embedding_lookup(py::object ids, py::object table, py::object id_src,
                                 py::object sampled, const std::string& op) {
  EmbeddingLookup e{cuda_tensor(ids, "ids", "int32"), cuda_tensor(table, "table", "bfloat16"),
                    optional_cuda_tensor(id_src, "id_src", "int32"),
                    optional_cuda_tensor(sampled, "sampled", "int32")};
  if (id_src.is_none() != sampled.is_none()) {
    throw_invalid_argument(op + ": give both id_src and sampled, or neither");
  }
  expect_shape(e.ids, {-1});
  expect_shape(e.table, {-1, -1});
  if (!id_src.is_none()) {
    expect_shape(e.id_src, {e.ids.size(0)});
    expect_shape(e.sampled, {-1});
  }
  return e;
}

}  // namespace

NANOGRAPH_BINDINGS(bind_basic) {
  m.def(
      "embedding",
      [](py::object ids, py::object table, py::object out, py::object id_src, py::object sampled) {
        EmbeddingLookup e = embedding_lookup(ids, table, id_src, sampled, "embedding");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        expect_shape(to, {e.ids.size(0), e.table.size(1)});
        same_device({&e.ids, &e.table, &e.id_src, &e.sampled, &to});
        embedding(e.ids.data<int32_t>(), e.table.data<bf16>(), to.data<bf16>(),
                  checked_int(e.ids.size(0), "number of tokens"),
                  checked_int(e.table.size(1), "hidden"), checked_int(e.table.size(0), "vocab"),
                  torch_current_stream(), e.id_src.data<int32_t>(), e.sampled.data<int32_t>());
      },
      py::arg("ids"), py::arg("table"), py::arg("out"), py::arg("id_src") = py::none(),
      py::arg("sampled") = py::none(),
      "out[t] = table[id]; ids [n] int32, table [vocab, hidden] bf16, out [n, hidden] bf16, where id "
      "is ids[t], or sampled[id_src[t]] where id_src ([n] int32, with sampled [m] int32) is >= 0. "
      "Ids outside [0, vocab) give zero rows; id_src[t] must be < m.");

  m.def(
      "rmsnorm",
      [](py::object x, py::object weight, py::object out, float eps) {
        Tensor tx = cuda_tensor(x, "x", "bfloat16");
        Tensor tw = cuda_tensor(weight, "weight", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        const int rows = leading_rows(tx);
        expect_shape(tw, {tx.size(-1)});
        expect_shape(to, tx.shape);
        same_device({&tx, &tw, &to});
        rmsnorm(tx.data<bf16>(), tw.data<bf16>(), to.data<bf16>(), rows,
                checked_int(tx.size(-1), "hidden"), eps, torch_current_stream());
      },
      py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("eps"),
      "out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight) over the last dimension; "
      "x, out [..., hidden] bf16, weight [hidden] bf16.");

  m.def(
      "embedding_rmsnorm",
      [](py::object ids, py::object table, py::object weight, py::object residual, py::object out,
         float eps, py::object id_src, py::object sampled) {
        EmbeddingLookup e = embedding_lookup(ids, table, id_src, sampled, "embedding_rmsnorm");
        Tensor tw = cuda_tensor(weight, "weight", "bfloat16");
        Tensor tr = cuda_tensor(residual, "residual", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        expect_shape(tw, {e.table.size(1)});
        expect_shape(tr, {e.ids.size(0), e.table.size(1)});
        expect_shape(to, tr.shape);
        if (tr.ptr == to.ptr) {
          throw_invalid_argument("embedding_rmsnorm: residual and out must be different tensors "
                                 "(both are written)");
        }
        same_device({&e.ids, &e.table, &e.id_src, &e.sampled, &tw, &tr, &to});
        embedding_rmsnorm(e.ids.data<int32_t>(), e.table.data<bf16>(),
                          checked_int(e.table.size(0), "vocab"), tr.data<bf16>(), tw.data<bf16>(),
                          to.data<bf16>(), checked_int(e.ids.size(0), "number of tokens"),
                          checked_int(e.table.size(1), "hidden"), eps, torch_current_stream(),
                          e.id_src.data<int32_t>(), e.sampled.data<int32_t>());
      },
      py::arg("ids"), py::arg("table"), py::arg("weight"), py::arg("residual"), py::arg("out"),
      py::arg("eps"), py::arg("id_src") = py::none(), py::arg("sampled") = py::none(),
      "embedding then rmsnorm in one kernel: residual = embedding(ids, table, id_src, sampled) and "
      "out = rmsnorm(residual, weight, eps), bit-equal to the two ops; residual, out [n, hidden].");

  m.def(
      "add_rmsnorm",
      [](py::object x, py::object residual, py::object weight, float eps) {
        Tensor tx = cuda_tensor(x, "x", "bfloat16");
        Tensor tr = cuda_tensor(residual, "residual", "bfloat16");
        Tensor tw = cuda_tensor(weight, "weight", "bfloat16");
        const int rows = leading_rows(tx);
        expect_shape(tr, tx.shape);
        expect_shape(tw, {tx.size(-1)});
        same_device({&tx, &tr, &tw});
        add_rmsnorm(tx.data<bf16>(), tr.data<bf16>(), tw.data<bf16>(), rows,
                    checked_int(tx.size(-1), "hidden"), eps, torch_current_stream());
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
      "In place: residual = bf16(x + residual); x = rmsnorm(residual) * weight. "
      "x, residual [..., hidden] bf16, weight [hidden] bf16.");

  m.def(
      "silu_mul",
      [](py::object gate_up, py::object out) {
        Tensor tg = cuda_tensor(gate_up, "gate_up", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        const int rows = leading_rows(tg);
        if (tg.size(-1) % 2 != 0) {
          throw_invalid_argument("gate_up's last dimension must be 2 * inter (gate then up), got " +
                                std::to_string(tg.size(-1)));
        }
        expect_shape(to, with_last(tg.shape, tg.size(-1) / 2));
        same_device({&tg, &to});
        silu_mul(tg.data<bf16>(), to.data<bf16>(), rows, checked_int(tg.size(-1) / 2, "inter"),
                 torch_current_stream());
      },
      py::arg("gate_up"), py::arg("out"),
      "out = silu(gate) * up, gate_up [..., 2 * inter] bf16 (gate first), out [..., inter] bf16.");

  m.def(
      "argmax",
      [](py::object logits, py::object out, py::object host_out) {
        auto [tl, row_stride] = row_strided_logits(logits);
        Tensor to = cuda_tensor(out, "out", "int32");
        expect_shape(to, {tl.size(0)});
        same_device({&tl, &to});
        int32_t* host = mapped_host_ids(host_out, tl.size(0), "argmax");
        argmax(tl.data<bf16>(), checked_int(tl.size(0), "rows"), checked_int(tl.size(1), "vocab"),
               checked_int(row_stride, "logits' row stride"), to.data<int32_t>(),
               torch_current_stream(), host);
      },
      py::arg("logits"), py::arg("out"), py::arg("host_out") = py::none(),
      "out[r] = argmax(logits[r]) in torch.argmax's order (NaN first, ties to the lowest index); logits "
      "[rows, vocab] bf16 (rows may be strided, vocab must be contiguous), out [rows] int32. "
      "host_out: optional pinned CPU int32 [rows] that the kernel writes the same ids into (read "
      "it once the stream has passed the kernel).");
}

}  // namespace nanograph::py_ext
