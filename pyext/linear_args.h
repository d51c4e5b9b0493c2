// Validated arguments of a linear layer binding: out[M, N] = x[M, K] . weight[N, K]^T (+ bias[N]).
#pragma once

#include <climits>
#include <string>

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

}  // namespace nanograph::py_ext
