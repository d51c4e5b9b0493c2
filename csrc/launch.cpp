// pdl_enabled() and clusters_supported() (see launch.h): compute capability 9.0 or newer (PDL
// unless NANOGRAPH_PDL=0).
#include "launch.h"

#include <cstdlib>
#include <cstring>

namespace nanograph {

namespace {

// Whether the current device has compute capability 9.0 or newer (Hopper: PDL and clusters).
// Asked each call, since the current device can change between calls.
bool current_device_is_sm90_or_newer() {
  int device = 0, major = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9;
}

}  // namespace

bool pdl_enabled() {
  static const bool allowed = [] {
    const char* value = std::getenv("NANOGRAPH_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return allowed && current_device_is_sm90_or_newer();
}

bool clusters_supported() { return current_device_is_sm90_or_newer(); }

}  // namespace nanograph
