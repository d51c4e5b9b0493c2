// Kernel launches with programmatic dependent launch (PDL, sm_90+).
//
// Normally a kernel starts only after the previous one on its stream has finished and flushed its
// writes, so every step of the decode chain pays a launch ramp and a drain. With PDL the next
// kernel is launched as soon as every CTA of the previous one has called allow_dependents() (or
// exited): its CTAs get resident early, may do work that does not read the previous kernel's
// output (e.g. a GEMV prefetching its weight), and then block in wait_for_producers() until the
// previous grid has completed and its memory is visible.
//
// Rules for a kernel launched with launch_pdl():
//   - every CTA calls wait_for_producers() before it reads anything an earlier kernel wrote and
//     before it exits (so that completion stays transitive down the chain);
//   - before the wait it reads only data no kernel it can overlap writes: weights, tables, and
//     the step's metadata. A decode graph writes the metadata in its first kernel; the embedding
//     after it (embedding_rmsnorm) calls allow_dependents() only after its wait, so every later
//     kernel launches after the metadata is in place. Decode attention on small grids also reads the KV cache before
//     the wait, under the contract stated in attention.h (paged_decode_attention).
// Where a kernel calls allow_dependents() decides how early the next one is launched. The small
// kernels that come right before a GEMV (the norms but the first, RoPE) call
// it before their wait, so the GEMV's CTAs are resident and its first weight batch in flight while
// they wait; the GEMVs and attention's split call it after their wait (earlier, their dependents took
// SM room from their own CTAs: a slower decode step, measured).
// On older GPUs, or with NANOGRAPH_PDL=0 in the environment, launches are ordinary and the
// device functions compile to nothing.
#pragma once
#include "common.h"

#include <array>

#include <utility>

namespace nanograph {

__device__ __forceinline__ void wait_for_producers() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// wait_for_producers() for a kernel that issues loads before it (a GEMV's first weight batch).
// ptxas places griddepcontrol.wait as early as it can within its basic block, so a wait in
// straight-line code after such loads ends up above them (seen with CUDA 13.0 for sm_90a), and
// the loads start only once the previous kernel has completed. It does not move the wait out of
// its own block: the branch keeps it after the loads, and is taken at run time (a grid has at
// least one CTA), so every CTA still waits.
__device__ __forceinline__ void wait_for_producers_after_loads() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (gridDim.x != 0) wait_for_producers();
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// What launch plans need to know of a GPU, queried once per device (device_props()).
struct DeviceProps {
  int sm_count = 0;
  int compute_major = 0;
  int compute_minor = 0;
  size_t smem_per_block_optin = 0;  // the most shared memory a CTA can opt in to
  size_t smem_per_sm = 0;           // all the shared memory of one SM
  bool clusters = false;            // thread block clusters (9.0+ device and code)
  // resident_clusters[n] (n = 1 .. 8; 0 without clusters): the thread block clusters of n CTAs
  // resident at once for a kernel of two CTAs per SM. A cluster's CTAs share a GPC, so where GPCs
  // differ in size this is below 2 * sm_count / n (an H200: 30 clusters of 8, 240 CTAs, not 33).
  std::array<int, 9> resident_clusters{};
  bool pdl = false;                 // programmatic dependent launch (9.0+ device and code,
                                    // unless NANOGRAPH_PDL=0)
};

// The most clusters of `cluster` CTAs the current device keeps resident at once for a kernel of
// two CTAs per SM, given its shared memory per SM (cudaOccupancyMaxActiveClusters; 0 if the
// runtime cannot say).
int resident_clusters_at_two_per_sm(int cluster, size_t smem_per_sm);

// The architecture the current device's copy of this library's kernels was compiled for, as
// 10 * major + minor of its PTX target: 90 for the sm_90a build, 86 where a newer GPU runs code
// JIT-compiled from compute_86.
int loaded_code_arch();

// The current device's properties, read on the first call for that device.
const DeviceProps& device_props();

// True when launches on the current device use PDL.
inline bool pdl_enabled() { return device_props().pdl; }

// True when the current device launches thread block clusters (compute capability 9.0+).
inline bool clusters_supported() { return device_props().clusters; }

// launch_pdl with the grid's CTAs grouped into thread block clusters of cluster_x along x (grid.x
// a multiple of it; 1: no clusters, which any GPU launches; more needs clusters_supported()).
template <class... Params, class... Args>
void launch_pdl_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                        cudaStream_t stream, int cluster_x, Args&&... args) {
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (pdl_enabled()) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster_x > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = cluster_x;
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = count;
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                cudaStream_t stream, Args&&... args) {
  launch_pdl_cluster(kernel, grid, block, smem_bytes, stream, 1, std::forward<Args>(args)...);
}

}  // namespace nanograph
