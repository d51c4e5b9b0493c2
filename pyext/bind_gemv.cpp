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
      [](py::object gate_up, py::object weight, py::object out) {
        Tensor t_gu = cuda_tensor(gate_up, "gate_up", "bfloat16");
        expect_shape(t_gu, {-1, -1});
        if (t_gu.size(1) % 2 != 0) {
          throw_invalid_argument("gate_up must have an even number of columns [gate | up], got " +
                                 std::to_string(t_gu.size(1)));
        }
        Tensor t_w = cuda_tensor(weight, "weight", "bfloat16");
        expect_shape(t_w, {-1, t_gu.size(1) / 2});
        Tensor t_out = cuda_tensor(out, "out", "bfloat16");
        expect_shape(t_out, {t_gu.size(0), t_w.size(0)});
        same_device({&t_gu, &t_w, &t_out});
        gemv_silu_mul(t_gu.data<bf16>(), t_w.data<bf16>(), t_out.data<bf16>(),
                      static_cast<int>(t_gu.size(0)), static_cast<int>(t_w.size(0)),
                      static_cast<int>(t_w.size(1)), torch_current_stream());
      },
      py::arg("gate_up"), py::arg("weight"), py::arg("out"),
      "out[M, N] = (silu(gate) * up) @ weight[N, K].T with gate_up[M, 2K] = [gate | up], the "
      "activation rounded to bf16 as silu_mul rounds it; 1 <= M <= GEMV_MAX_M. Runs on torch's "
      "current stream.");
}

}  // namespace nanograph::py_ext
