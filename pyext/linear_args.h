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

}  // namespace nanograph::py_ext
