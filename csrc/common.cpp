// The core's error throwers (see common.h).
#include "common.h"

namespace nanograph {

void throw_invalid_argument(const std::string& message) { throw std::invalid_argument(message); }

void throw_type_error(const std::string& message) { throw ArgumentTypeError(message); }

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + expr + " failed: " +
                  cudaGetErrorString(err));
}

}  // namespace nanograph
