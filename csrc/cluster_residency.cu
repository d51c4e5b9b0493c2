// resident_clusters_at_two_per_sm (launch.h): how many thread block clusters the current device
// keeps resident at once, asked of cudaOccupancyMaxActiveClusters for a kernel that fits two CTAs
// per SM, as decode attention's small grids do.
#include "launch.h"

namespace nanograph {

namespace {

// Never launched: only its occupancy is asked for, with the shared memory that leaves room for two
// CTAs per SM.
__global__ void __launch_bounds__(128, 2) two_per_sm_kernel() {}

}  // namespace

int resident_clusters_at_two_per_sm(int cluster, size_t smem_per_sm) {
  const int smem = static_cast<int>(smem_per_sm / 2 - 2 * 1024);  // below half, with the CTA reserve
  CUDA_CHECK(cudaFuncSetAttribute(two_per_sm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CUDA_CHECK(cudaFuncSetAttribute(two_per_sm_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
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
  CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, two_per_sm_kernel, &config));
  return clusters;
}

}  // namespace nanograph
