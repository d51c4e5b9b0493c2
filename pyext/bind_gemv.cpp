// Binding for the small-M GEMV (decode-sized linear layers), and its row limits GEMV_MAX_M and
// GEMV_FP8_MAX_M (FP8 weights).
#include "../csrc/fp8.h"
#include "../csrc/gemv.h"
#include "linear_args.h"

namespace nanograph::py_ext {

NANOGRAPH_BINDINGS(bind_gemv) {
  m.attr("GEMV_MAX_M") = kGemvMaxM;
  m.attr("GEMV_FP8_MAX_M") = kGemvFp8MaxM;
  m.def("gemv_preferred", &gemv_preferred, py::arg("M"), py::arg("N"), py::arg("K"),
        "Whether Gemm.linear (and the decode step's fused gate_up and lm_head) takes the bf16 GEMV "
        "for M rows over an [N, K] weight rather than cuBLASLt: up to 8 rows wherever gemv takes the "
        "shape, 9 to 16 for weights of at most 8 Mi elements, 17 to GEMV_MAX_M for at most 3.5 Mi.");
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
        SiluMulArgs a = silu_mul_args(x, gate_up_weight, py::none(), out, "gemv_silu_mul");
        // gemv_silu_mul() rejects unsupported sizes and misaligned pointers with the limit.
        gemv_silu_mul(a.x.data<bf16>(), a.weight.data<bf16>(), a.out.data<bf16>(), a.M, a.inter,
                      a.K, torch_current_stream());
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
  m.def(
      "gemv_fp8",
      [](py::object x, py::object weight, py::object scale, py::object bias, py::object out) {
        Tensor ts;
        LinearArgs a = fp8_linear_args(x, weight, scale, bias, out, "gemv_fp8", &ts);
        gemv_fp8(a.x.data<bf16>(), a.weight.ptr, ts.data<float>(), a.bias.data<bf16>(),
                 a.out.data<bf16>(), a.M, a.N, a.K, torch_current_stream());
      },
      py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("bias"), py::arg("out"),
      "gemv with an FP8 weight: out[M, N] = x[M, K] @ (weight * scale).T (+ bias), weight "
      "float8_e4m3fn [N, K], scale float32 [ceil(N / 8), ceil(K / 128)] (one per 8 rows x 128 "
      "columns); 1 <= M <= GEMV_FP8_MAX_M and K a multiple of 16.");
  m.def(
      "gemv_silu_mul_fp8",
      [](py::object x, py::object gate_up_weight, py::object scale, py::object out) {
        if (scale.is_none()) throw_type_error("gemv_silu_mul_fp8: scale must be a torch.Tensor");
        SiluMulArgs a = silu_mul_args(x, gate_up_weight, scale, out, "gemv_silu_mul_fp8");
        gemv_silu_mul_fp8(a.x.data<bf16>(), a.weight.ptr, a.scale.data<float>(), a.out.data<bf16>(),
                          a.M, a.inter, a.K, torch_current_stream());
      },
      py::arg("x"), py::arg("gate_up_weight"), py::arg("scale"), py::arg("out"),
      "gemv_silu_mul with an FP8 gate_up weight and its block scales (as gemv_fp8).");
  m.def(
      "dequantize_fp8",
      [](py::object weight, py::object scale, py::object out) {
        Tensor tw = cuda_tensor(weight, "weight", "float8_e4m3fn");
        Tensor ts = cuda_tensor(scale, "scale", "float32");
        Tensor to = cuda_tensor(out, "out", "bfloat16");
        expect_shape(tw, {-1, -1});
        expect_shape(ts, {fp8_scale_rows(tw.size(0)), fp8_scale_cols(tw.size(1))});
        expect_shape(to, {tw.size(0), tw.size(1)});
        same_device({&tw, &ts, &to});
        dequantize_fp8(tw.ptr, ts.data<float>(), to.data<bf16>(), checked_int(tw.size(0), "N"),
                       checked_int(tw.size(1), "K"), torch_current_stream());
      },
      py::arg("weight"), py::arg("scale"), py::arg("out"),
      "out[N, K] (bfloat16) = weight * scale, each element rounded once (the operand of the "
      "cuBLASLt path for FP8 weights); K a multiple of 16.");
}

}  // namespace nanograph::py_ext
