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

}  // namespace

NANOGRAPH_BINDINGS(bind_basic) {
  m.def(
      "embedding",
      [](py::object ids, py::object table, py::object out, py::object id_src, py::object sampled) {
        Tensor ti = cuda_tensor(ids, "ids", "int32");
        Tensor tt = cuda_tensor(table, "table", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        Tensor ts = optional_cuda_tensor(id_src, "id_src", "int32");
        Tensor tz = optional_cuda_tensor(sampled, "sampled", "int32");
        if (id_src.is_none() != sampled.is_none()) {
          throw_invalid_argument("embedding: give both id_src and sampled, or neither");
        }
        expect_shape(ti, {-1});
        expect_shape(tt, {-1, -1});
        expect_shape(to, {ti.size(0), tt.size(1)});
        std::vector<const Tensor*> tensors{&ti, &tt, &to};
        if (!id_src.is_none()) {
          expect_shape(ts, {ti.size(0)});
          expect_shape(tz, {-1});
          tensors.insert(tensors.end(), {&ts, &tz});
        }
        same_device(tensors);
        embedding(ti.data<int32_t>(), tt.data<bf16>(), to.data<bf16>(),
                  checked_int(ti.size(0), "number of tokens"), checked_int(tt.size(1), "hidden"),
                  checked_int(tt.size(0), "vocab"), torch_current_stream(), ts.data<int32_t>(),
                  tz.data<int32_t>());
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
        int32_t* host = nullptr;
        if (!host_out.is_none()) {
          const bool usable = py::str(host_out.attr("device").attr("type")).cast<std::string>() == "cpu" &&
                              host_out.attr("is_pinned")().cast<bool>() &&
                              py::str(host_out.attr("dtype")).cast<std::string>() == "torch.int32" &&
                              host_out.attr("is_contiguous")().cast<bool>() &&
                              host_out.attr("numel")().cast<int64_t>() == tl.size(0);
          if (!usable) {
            throw_invalid_argument("argmax: host_out must be a contiguous pinned CPU int32 tensor of " +
                                   std::to_string(tl.size(0)) +
                                   " elements (torch.empty(rows, dtype=torch.int32, pin_memory=True))");
          }
          // The kernel's address of the page-locked memory (the host's own under unified
          // addressing for cudaHostAlloc, not necessarily for registered memory).
          void* mapped = nullptr;
          void* pinned = reinterpret_cast<void*>(host_out.attr("data_ptr")().cast<uintptr_t>());
          if (cudaHostGetDevicePointer(&mapped, pinned, 0) != cudaSuccess) {
            cudaGetLastError();  // not sticky: clear it
            throw_invalid_argument("argmax: host_out's memory is not mapped for the GPU; allocate it "
                                   "with torch.empty(..., pin_memory=True)");
          }
          host = static_cast<int32_t*>(mapped);
        }
        argmax(tl.data<bf16>(), checked_int(tl.size(0), "rows"), checked_int(tl.size(1), "vocab"),
               checked_int(row_stride, "logits' row stride"), to.data<int32_t>(),
               torch_current_stream(), host);
      },
      py::arg("logits"), py::arg("out"), py::arg("host_out") = py::none(),
      "out[r] = argmax(logits[r]) with ties to the lowest index, like torch.argmax; logits "
      "[rows, vocab] bf16 (rows may be strided, vocab must be contiguous), out [rows] int32. "
      "host_out: optional pinned CPU int32 [rows] that the kernel writes the same ids into (read "
      "it once the stream has passed the kernel).");
}

}  // namespace nanograph::py_ext
