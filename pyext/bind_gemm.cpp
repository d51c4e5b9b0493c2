// Binding for Gemm: a cuBLASLt linear layer object that caches one plan per shape.
#include <climits>

#include "../csrc/gemm.h"
#include "tensor.h"

namespace nanograph::py_ext {

NANOGRAPH_BINDINGS(bind_gemm) {
  py::class_<Gemm>(m, "Gemm",
                   "cuBLASLt linear layers, out = x @ weight.T (+ bias), bf16 in and out, fp32 "
                   "accumulation. Serves the CUDA device current at construction. The workspace "
                   "is allocated once; run every shape once before capturing it in a CUDA graph.")
      .def(py::init<size_t>(), py::arg("workspace_bytes") = size_t{32} << 20)
      .def(
          "linear",
          [](Gemm& self, py::object x, py::object weight, py::object bias, py::object out) {
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
              throw_invalid_argument("linear: sizes must fit in int32, got M=" + std::to_string(M) +
                                    " N=" + std::to_string(N) + " K=" + std::to_string(K));
            }
            same_device({&tx, &tw, &tb, &to});
            self.linear(tx.data<bf16>(), tw.data<bf16>(), tb.data<bf16>(), to.data<bf16>(),
                        static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                        torch_current_stream());
          },
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"),
          "out[M, N] = x[M, K] @ weight[N, K].T (+ bias[N]); bias may be None. Runs on torch's "
          "current stream.");
}

}  // namespace nanograph::py_ext
