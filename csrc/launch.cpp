// device_props() (see launch.h): each device's properties, read once and kept for the process.
#include "launch.h"

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace nanograph {

namespace {

constexpr int kMaxDevices = 64;

DeviceProps query(int device) {
  DeviceProps props;
  int smem = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&props.sm_count, cudaDevAttrMultiProcessorCount, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&props.compute_major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&props.compute_minor, cudaDevAttrComputeCapabilityMinor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  props.smem_per_block_optin = static_cast<size_t>(smem);
  // Clusters and PDL need code built for 9.0 or later (a newer GPU may run code JIT-compiled from
  // an older target, where the kernels' cluster and PDL instructions are compiled out).
  const bool sm90_code = props.compute_major >= 9 && loaded_code_arch() >= 90;
  props.clusters = sm90_code;
  CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  props.smem_per_sm = static_cast<size_t>(smem);
  if (props.clusters) {
    for (int n = 1; n < static_cast<int>(props.resident_clusters.size()); ++n) {
      props.resident_clusters[n] = resident_clusters_at_two_per_sm(n, props.smem_per_sm);
    }
  }
  const char* pdl = std::getenv("NANOGRAPH_PDL");
  props.pdl = sm90_code && (pdl == nullptr || std::strcmp(pdl, "0") != 0);
  return props;
}

}  // namespace

const DeviceProps& device_props() {
  static std::array<DeviceProps, kMaxDevices> props;
  static std::array<std::once_flag, kMaxDevices> queried;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  require(device >= 0 && device < kMaxDevices,
          "device " + std::to_string(device) + " is beyond the " + std::to_string(kMaxDevices) +
              " devices nanograph keeps properties for");
  std::call_once(queried[device], [&] { props[device] = query(device); });
  return props[device];
}

}  // namespace nanograph
