// Asynchronous 16-byte global->shared copies (cp.async, sm_80+): the loads of a later tile stay
// in flight while the current one is computed. The "memory" clobbers keep the compiler from
// moving shared-memory loads and stores across the copies and waits.
#pragma once
#include "common.h"

namespace nanograph {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A copy that is not `valid` zero-fills its 16 bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kPending of this thread's most recent groups are still in flight; the
// copies of the older groups are then visible to this thread.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace nanograph
