// Shared helpers for the CUDA core: error checking, bf16 conversions and the
// compile-time dispatch used to turn runtime sizes into template parameters.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace nanograph {

using bf16 = __nv_bfloat16;

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wrong dtype or kind of argument (TypeError in Python); other bad values are
// std::invalid_argument (ValueError).
class ArgumentTypeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Every error leaves the core through these out-of-line throwers, so exceptions always start in
// the core library's code, whichever module calls it.
[[noreturn]] void throw_invalid_argument(const std::string& message);
[[noreturn]] void throw_type_error(const std::string& message);
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);

inline void cuda_check(cudaError_t err, const char* expr, const char* file, int line) {
  if (err != cudaSuccess) throw_cuda_error(err, expr, file, line);
}

#define CUDA_CHECK(expr) ::nanograph::cuda_check((expr), #expr, __FILE__, __LINE__)
// After every launch: reports bad launch configurations at the call site.
#define CUDA_CHECK_LAUNCH() ::nanograph::cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

inline void require(bool ok, const std::string& message) {
  if (!ok) throw_invalid_argument(message);
}

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The alignment the kernels' 16-byte vector loads, and cuBLASLt's plans (gemm.cpp), need.
constexpr int kAlignmentBytes = 16;

// A ValueError from `op` unless its argument `name` at ptr is kAlignmentBytes-aligned.
inline void require_aligned(const char* op, const char* name, const void* ptr) {
  require(reinterpret_cast<uintptr_t>(ptr) % kAlignmentBytes == 0,
          std::string(op) + ": " + name + " must be " + std::to_string(kAlignmentBytes) +
              "-byte aligned; pass a contiguous copy instead of an offset view");
}

// DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, { body using constexpr HEAD_DIM })
#define DISPATCH_HEAD_DIM(value, NAME, ...)                                               \
  [&] {                                                                                  \
    if ((value) == 64) {                                                                 \
      constexpr int NAME = 64;                                                           \
      return __VA_ARGS__();                                                              \
    } else if ((value) == 128) {                                                         \
      constexpr int NAME = 128;                                                          \
      return __VA_ARGS__();                                                              \
    }                                                                                    \
    ::nanograph::throw_invalid_argument("unsupported head_dim " + std::to_string(value) + \
                                        "; supported: 64, 128");                         \
  }()

}  // namespace nanograph
