// pdl_enabled() and clusters_supported() (see launch.h): compute capability 9.0 or newer (PDL
// unless NANOGRAPH_PDL=0).
#include "launch.h"

#include <cstdlib>
#include <cstring>

namespace nanograph {

bool pdl_enabled() {
  static const bool allowed = [] {
    const char* value = std::getenv("NANOGRAPH_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  if (!allowed) return false;
  int device = 0, major = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9;
}

bool clusters_supported() {
  int device = 0, major = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9;
}

}  // namespace nanograph
