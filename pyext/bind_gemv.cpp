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
}

}  // namespace nanograph::py_ext
