// Binding for the small-M GEMV (decode-sized linear layers), and its row limit GEMV_MAX_M.
#include "../csrc/gemv.h"
#include "linear_args.h"

namespace nanograph::py_ext {

NANOGRAPH_BINDINGS(bind_gemv) {
  m.attr("GEMV_MAX_M") = kGemvMaxM;
  m.def(
      "gemv",
      [](py::object x, py::object weight, py::object bias, py::object out) {
        LinearArgs a = linear_args(x, weight, bias, out, "gemv");
        // gemv() rejects unsupported sizes and misaligned pointers with the limit it needs.
        gemv(a.x.data<bf16>(), a.weight.data<bf16>(), a.bias.data<bf16>(), a.out.data<bf16>(),
             a.M, a.N, a.K, torch_current_stream());
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"),
      "out[M, N] = x[M, K] @ weight[N, K].T (+ bias[N]) for 1 <= M <= GEMV_MAX_M and K a multiple "
      "of 8; bias may be None. bf16, fp32 accumulation, deterministic. Runs on torch's current "
      "stream.");
  m.def(
      "gemv_silu_mul",
      [](py::object x, py::object gate_up_weight, py::object out) {
        Tensor tx = cuda_tensor(x, "x", "bfloat16");
        Tensor tw = cuda_tensor(gate_up_weight, "gate_up_weight", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        expect_shape(tx, {-1, -1});
        expect_shape(tw, {-1, tx.size(1)});
        if (tw.size(0) % 2 != 0) {
          throw_invalid_argument("gemv_silu_mul: gate_up_weight must have 2 * inter rows (gate "
                                 "rows, then up rows), got " + std::to_string(tw.size(0)));
        }
        expect_shape(to, {tx.size(0), tw.size(0) / 2});
        same_device({&tx, &tw, &to});
        // gemv_silu_mul() rejects unsupported sizes and misaligned pointers with the limit.
        gemv_silu_mul(tx.data<bf16>(), tw.data<bf16>(), to.data<bf16>(),
                      checked_int(tx.size(0), "M"), checked_int(to.size(1), "inter"),
                      checked_int(tx.size(1), "K"), torch_current_stream());
      },
      py::arg("x"), py::arg("gate_up_weight"), py::arg("out"),
      "out[M, inter] = silu(gate) * up with gate, up = x[M, K] @ gate_up_weight[2 * inter, K].T "
      "(gate rows first), each rounded to bf16: equal to gemv then silu_mul, in one kernel.");
  m.def(
      "gemv_argmax",
      [](py::object x, py::object weight, py::object bias, py::object out, py::object tokens,
         py::object keys, py::object host_out) {
        LinearArgs a = linear_args(x, weight, bias, out, "gemv_argmax");
        Tensor tt = cuda_tensor(tokens, "tokens", "int32");
        Tensor tk = cuda_tensor(keys, "keys", "int64");
        expect_shape(tt, {a.M});
        expect_shape(tk, {kGemvMaxM});
        same_device({&a.x, &a.weight, &a.bias, &a.out, &tt, &tk});
        int32_t* host = mapped_host_ids(host_out, a.M, "gemv_argmax");
        // gemv_argmax() rejects unsupported sizes and misaligned pointers with the limit it needs.
        gemv_argmax(a.x.data<bf16>(), a.weight.data<bf16>(), a.bias.data<bf16>(), a.out.data<bf16>(),
                    a.M, a.N, a.K, tk.data<uint64_t>(), tt.data<int32_t>(), host,
                    torch_current_stream());
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("tokens"),
      py::arg("keys"), py::arg("host_out") = py::none(),
      "gemv into out [M, N], and tokens[m] = argmax(out[m]) as torch.argmax gives it (int32 [M]), "
      "also into host_out (pinned CPU int32 [M]) when given. keys: int64 [GEMV_MAX_M] of zeros on "
      "the device, left zeroed (workspace; one call at a time).");
}

}  // namespace nanograph::py_ext
