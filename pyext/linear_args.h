// Validated arguments of a linear layer binding: out[M, N] = x[M, K] . weight[N, K]^T (+ bias[N]).
#pragma once

#include <climits>
#include <string>

#include "../csrc/fp8.h"
#include "tensor.h"

namespace nanograph::py_ext {

struct LinearArgs {
  Tensor x, weight, bias, out;  // bias.ptr == nullptr when absent
  int M, N, K;
};

inline LinearArgs linear_args(py::handle x, py::handle weight, py::handle bias, py::handle out,
                              const char* op) {
  LinearArgs a{cuda_tensor(x, "x", "bfloat16"), cuda_tensor(weight, "weight", "bfloat16"),
               optional_cuda_tensor(bias, "bias", "bfloat16"), cuda_tensor(out, "out", "bfloat16"),
               0, 0, 0};
  expect_shape(a.x, {-1, -1});
  expect_shape(a.weight, {-1, a.x.size(1)});
  const int64_t M = a.x.size(0), N = a.weight.size(0), K = a.x.size(1);
  if (a.bias.ptr) expect_shape(a.bias, {N});
  expect_shape(a.out, {M, N});
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX) {
    throw_invalid_argument(std::string(op) + ": sizes must fit in int32, got M=" +
                           std::to_string(M) + " N=" + std::to_string(N) + " K=" +
                           std::to_string(K));
  }
  same_device({&a.x, &a.weight, &a.bias, &a.out});
  a.M = static_cast<int>(M);
  a.N = static_cast<int>(N);
  a.K = static_cast<int>(K);
  return a;
}

// An FP8 weight's arguments: weight float8_e4m3fn [N, K] and scale float32 [ceil(N / 8),
// ceil(K / 128)] (csrc/fp8.h), the rest as linear_args.
inline LinearArgs fp8_linear_args(py::handle x, py::handle weight, py::handle scale,
                                  py::handle bias, py::handle out, const char* op, Tensor* scale_out) {
  Tensor tw = cuda_tensor(weight, "weight", "float8_e4m3fn");
  Tensor ts = cuda_tensor(scale, "scale", "float32");
  Tensor tx = cuda_tensor(x, "x", "bfloat16");
  expect_shape(tx, {-1, -1});
  expect_shape(tw, {-1, tx.size(1)});
  expect_shape(ts, {fp8_scale_rows(tw.size(0)), fp8_scale_cols(tx.size(1))});
  Tensor tb = optional_cuda_tensor(bias, "bias", "bfloat16");
  Tensor to = cuda_tensor(out, "out", "bfloat16");
  if (tb.ptr) expect_shape(tb, {tw.size(0)});
  expect_shape(to, {tx.size(0), tw.size(0)});
  same_device({&tx, &tw, &ts, &tb, &to});
  *scale_out = ts;
  return LinearArgs{tx, tw, tb, to, checked_int(tx.size(0), std::string(op) + " M"),
                    checked_int(tw.size(0), std::string(op) + " N"),
                    checked_int(tx.size(1), std::string(op) + " K")};
}

// The arguments of the fused gate/up projection + SiLU-and-mul: out[M, inter] from x[M, K] and
// gate_up_weight [2 * inter, K] (gate rows first), bf16, or float8_e4m3fn with its block scales
// (scale given: float32 [ceil(2 * inter / 8), ceil(K / 128)]).
struct SiluMulArgs {
  Tensor x, weight, scale, out;  // scale.ptr == nullptr for a bf16 weight
  int M, inter, K;
};

inline SiluMulArgs silu_mul_args(py::handle x, py::handle gate_up_weight, py::handle scale,
                                 py::handle out, const char* op) {
  const bool fp8 = !scale.is_none();
  SiluMulArgs a{cuda_tensor(x, "x", "bfloat16"),
                cuda_tensor(gate_up_weight, "gate_up_weight", fp8 ? "float8_e4m3fn" : "bfloat16"),
                optional_cuda_tensor(scale, "scale", "float32"), cuda_tensor(out, "out", "bfloat16"),
                0, 0, 0};
  expect_shape(a.x, {-1, -1});
  expect_shape(a.weight, {-1, a.x.size(1)});
  if (a.weight.size(0) % 2 != 0) {
    throw_invalid_argument(std::string(op) + ": gate_up_weight must have 2 * inter rows (gate "
                           "rows, then up rows), got " + std::to_string(a.weight.size(0)));
  }
  if (fp8) expect_shape(a.scale, {fp8_scale_rows(a.weight.size(0)), fp8_scale_cols(a.x.size(1))});
  expect_shape(a.out, {a.x.size(0), a.weight.size(0) / 2});
  same_device({&a.x, &a.weight, &a.scale, &a.out});
  a.M = checked_int(a.x.size(0), std::string(op) + " M");
  a.inter = checked_int(a.out.size(1), std::string(op) + " inter");
  a.K = checked_int(a.x.size(1), std::string(op) + " K");
  return a;
}

}  // namespace nanograph::py_ext
