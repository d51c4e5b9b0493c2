// Binding for the small-M GEMV (decode-sized linear layers), and its row limit GEMV_MAX_M.
#include <climits>

#include "../csrc/gemv.h"
#include "tensor.h"

namespace nanograph::py_ext {

NANOGRAPH_BINDINGS(bind_gemv) {
  m.attr("GEMV_MAX_M") = kGemvMaxM;
  m.def(
      "gemv",
      [](py::object x, py::object weight, py::object bias, py::object out) {
        Tensor tx = cuda_tensor(x, "x", "bfloat16");
        Tensor tw = cuda_tensor(weight, "weight", "bfloat16");
        Tensor tb = optional_cuda_tensor(bias, "bias", "bfloat16");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        expect_shape(tx, {-1, -1});
        expect_shape(tw, {-1, tx.size(1)});
        const int64_t M = tx.size(0), N = tw.size(0), K = tx.size(1);
        if (tb.ptr) expect_shape(tb, {N});
        expect_shape(to, {M, N});
        if (M > INT_MAX || N > INT_MAX || K > INT_MAX) {
          throw_invalid_argument("gemv: sizes must fit in int32, got M=" + std::to_string(M) +
                                 " N=" + std::to_string(N) + " K=" + std::to_string(K));
        }
        same_device({&tx, &tw, &tb, &to});
        // gemv() rejects unsupported sizes and misaligned pointers with the limit it needs.
        gemv(tx.data<bf16>(), tw.data<bf16>(), tb.data<bf16>(), to.data<bf16>(),
             static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
             torch_current_stream());
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"),
      "out[M, N] = x[M, K] @ weight[N, K].T (+ bias[N]) for 1 <= M <= GEMV_MAX_M and K a multiple "
      "of 8; bias may be None. bf16, fp32 accumulation, deterministic. Runs on torch's current "
      "stream.");
}

}  // namespace nanograph::py_ext
