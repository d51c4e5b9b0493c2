// Shared by the C++ tests: GPU tests skip, with the reason, when no CUDA device is visible.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

inline bool has_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!has_gpu()) GTEST_SKIP() << "no CUDA GPU is visible; this test needs one"
