// Bindings for Gemm (a cuBLASLt linear layer object that caches one plan per shape) and for the
// activation quantization of its block-scaled FP8 GEMM.
#include "../csrc/gemm.h"
#include "linear_args.h"

namespace nanograph::py_ext {

namespace {

// An FP8 weight's 128 x 128 block scales (fp8.h): float32 [ceil(N / 128), ceil(K / 128) rounded
// up to 4], or None.
Tensor block_scale_arg(py::handle block_scale, int64_t N, int64_t K) {
  Tensor t = optional_cuda_tensor(block_scale, "block_scale", "float32");
  if (t.ptr) expect_shape(t, {fp8_block_scale_rows(N), fp8_block_scale_cols(K)});
  return t;
}

}  // namespace

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
             py::object out, py::object block_scale) {
            Tensor ts;
            LinearArgs a = fp8_linear_args(x, weight, scale, bias, out, "linear_fp8", &ts);
            Tensor tb = block_scale_arg(block_scale, a.N, a.K);
            same_device({&a.x, &tb});
            if (tb.ptr && self.fp8_gemm_supported(a.M, a.N, a.K, a.bias.ptr != nullptr)) {
              self.reserve_fp8_activations(a.M, a.K);
            } else {
              self.reserve_dequantized(static_cast<size_t>(a.N) * a.K);
            }
            self.linear(a.x.data<bf16>(),
                        LinearWeight(a.weight.ptr, ts.data<float>(), tb.data<float>()),
                        a.bias.data<bf16>(), a.out.data<bf16>(), a.M, a.N, a.K,
                        torch_current_stream());
          },
          py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("bias"), py::arg("out"),
          py::arg("block_scale") = py::none(),
          "linear with an FP8 weight (float8_e4m3fn [N, K]) and its block scales (float32 "
          "[ceil(N / 8), ceil(K / 128)]): the FP8 GEMV at M <= GEMV_FP8_MAX_M; above, with "
          "block_scale (float32 [ceil(N / 128), ceil(K / 128) rounded up to 4], the same "
          "scales once per 128 x 128 block) the block-scaled FP8 GEMM where fp8_gemm_supported, "
          "else the weight dequantised to bf16 and cuBLASLt. Reserves its buffers on first use.")
      .def(
          "fp8_gemm_supported",
          [](Gemm& self, int M, int N, int K, bool has_bias) {
            return self.fp8_gemm_supported(M, N, K, has_bias);
          },
          py::arg("M"), py::arg("N"), py::arg("K"), py::arg("has_bias"),
          "Whether linear_fp8 with block_scale takes the block-scaled FP8 GEMM at this shape "
          "(compute capability 9.0 and cuBLAS 12.9+, then cuBLASLt's heuristic, asked once per "
          "shape on the device current at construction).")
      .def(
          "linear_fp8_quantized",
          [](Gemm& self, py::object x_q, py::object x_scale, py::object weight,
             py::object block_scale, py::object bias, py::object out) {
            Tensor tq = cuda_tensor(x_q, "x_q", "float8_e4m3fn");
            Tensor tw = cuda_tensor(weight, "weight", "float8_e4m3fn");
            Tensor to = cuda_tensor(out, "out", "bfloat16");
            expect_shape(tq, {-1, -1});
            const int64_t M = tq.size(0), K = tq.size(1), N = tw.size(0);
            expect_shape(tw, {N, K});
            Tensor ts = cuda_tensor(x_scale, "x_scale", "float32");
            expect_shape(ts, {fp8_scale_cols(K), M});
            Tensor tb = block_scale_arg(block_scale, N, K);
            if (!tb.ptr) throw_invalid_argument("linear_fp8_quantized: block_scale is required");
            Tensor tbias = optional_cuda_tensor(bias, "bias", "bfloat16");
            if (tbias.ptr) expect_shape(tbias, {N});
            expect_shape(to, {M, N});
            same_device({&tq, &ts, &tw, &tb, &tbias, &to});
            self.linear_fp8_quantized(tq.ptr, ts.data<float>(), tw.ptr, tb.data<float>(),
                                      tbias.data<bf16>(), to.data<bf16>(),
                                      checked_int(M, "linear_fp8_quantized M"),
                                      checked_int(N, "linear_fp8_quantized N"),
                                      checked_int(K, "linear_fp8_quantized K"),
                                      torch_current_stream());
          },
          py::arg("x_q"), py::arg("x_scale"), py::arg("weight"), py::arg("block_scale"),
          py::arg("bias"), py::arg("out"),
          "The block-scaled FP8 GEMM alone: out[M, N] = (x_q * x_scale) @ (weight * "
          "block_scale).T (+ bias), x_q float8_e4m3fn [M, K] and x_scale float32 "
          "[ceil(K / 128), M] as quantize_fp8_activations writes them; M a multiple of 4, K of 16 "
          "and N of 8.");

  m.def(
      "quantize_fp8_activations",
      [](py::object x, py::object q, py::object scale) {
        Tensor tx = cuda_tensor(x, "x", "bfloat16");
        Tensor tq = cuda_tensor(q, "q", "float8_e4m3fn");
        Tensor ts = cuda_tensor(scale, "scale", "float32");
        expect_shape(tx, {-1, -1});
        expect_shape(tq, {tx.size(0), tx.size(1)});
        expect_shape(ts, {fp8_scale_cols(tx.size(1)), tx.size(0)});
        same_device({&tx, &tq, &ts});
        quantize_fp8_activations(tx.data<bf16>(), tq.ptr, ts.data<float>(),
                                 checked_int(tx.size(0), "M"), checked_int(tx.size(1), "K"),
                                 torch_current_stream());
      },
      py::arg("x"), py::arg("q"), py::arg("scale"),
      "x [M, K] bfloat16 -> q [M, K] float8_e4m3fn and scale [ceil(K / 128), M] float32, one "
      "per row per 128 columns (amax / 448, 1 for an all-zero block): x ~= q * scale, the "
      "activations of the block-scaled FP8 GEMM. K a multiple of 16.");
}

}  // namespace nanograph::py_ext
