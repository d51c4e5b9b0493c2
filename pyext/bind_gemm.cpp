// Binding for Gemm: a cuBLASLt linear layer object that caches one plan per shape.
#include "../csrc/gemm.h"
#include "linear_args.h"

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
            LinearArgs a = linear_args(x, weight, bias, out, "linear");
            self.linear(a.x.data<bf16>(), a.weight.data<bf16>(), a.bias.data<bf16>(),
                        a.out.data<bf16>(), a.M, a.N, a.K, torch_current_stream());
          },
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"),
          "out[M, N] = x[M, K] @ weight[N, K].T (+ bias[N]); bias may be None. Runs on torch's "
          "current stream.")
      .def(
          "linear_fp8",
          [](Gemm& self, py::object x, py::object weight, py::object scale, py::object bias,
             py::object out) {
            Tensor ts;
            LinearArgs a = fp8_linear_args(x, weight, scale, bias, out, "linear_fp8", &ts);
            self.reserve_dequantized(static_cast<size_t>(a.N) * a.K);
            self.linear(a.x.data<bf16>(), LinearWeight(a.weight.ptr, ts.data<float>()),
                        a.bias.data<bf16>(), a.out.data<bf16>(), a.M, a.N, a.K,
                        torch_current_stream());
          },
          py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("bias"), py::arg("out"),
          "linear with an FP8 weight (float8_e4m3fn [N, K]) and its block scales (float32 "
          "[ceil(N / 8), ceil(K / 128)]): the FP8 GEMV at M <= GEMV_MAX_M, else the weight "
          "dequantised to bf16 and cuBLASLt. Reserves the dequantised buffer on first use.");
}

}  // namespace nanograph::py_ext
