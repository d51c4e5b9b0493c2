// resident_clusters_at_two_per_sm and loaded_code_arch (launch.h): asked of the CUDA runtime for
// a kernel of this library that is never launched.
#include "launch.h"

namespace nanograph {

namespace {

// Never launched: only its occupancy and attributes are asked for. Its code is built for the same
// architectures as every other kernel here, so the device loads it from the same target.
__global__ void __launch_bounds__(128, 2) two_per_sm_kernel() {}

}  // namespace

int resident_clusters_at_two_per_sm(int cluster, size_t smem_per_sm) {
  const int smem = static_cast<int>(smem_per_sm / 2 - 2 * 1024);  // below half, with the CTA reserve
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(cluster);
  config.blockDim = dim3(128);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaFuncSetAttribute(two_per_sm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveClusters(&clusters, two_per_sm_kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // the plans then launch no clusters
    return 0;
  }
  return clusters;
}

int loaded_code_arch() {
  cudaFuncAttributes attributes{};
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, two_per_sm_kernel));
  return attributes.ptxVersion;
}

}  // namespace nanograph
