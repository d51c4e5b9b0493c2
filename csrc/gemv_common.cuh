// Building blocks of the bf16 GEMV (gemv.cu) and the FP8 GEMV (gemv_fp8.cu): the 16-byte
// streaming loads, the bf16 MMA and the shape check; the launch constants and how a matrix's K
// range is split over warps are in gemv_plan.h. See gemv.cu's header for why the kernels are
// built this way.
#pragma once
#include "common.h"
#include "gemv.h"
#include "gemv_plan.h"

#include <string>

namespace nanograph::gemv_detail {

// 16 bytes from global memory, or zeros where !pred. The predicate sits inside the asm (no
// branch), so a batch of these is one basic block that the compiler issues back to back.
#define GEMV_LOAD_16B(QUALIFIERS)                                           \
  "{\n"                                                                    \
  "  .reg .pred p;\n"                                                      \
  "  setp.ne.b32 p, %5, 0;\n"                                              \
  "  mov.b32 %0, 0;\n"                                                     \
  "  mov.b32 %1, 0;\n"                                                     \
  "  mov.b32 %2, 0;\n"                                                     \
  "  mov.b32 %3, 0;\n"                                                     \
  "  @p ld.global.nc" QUALIFIERS ".v4.u32 {%0, %1, %2, %3}, [%4];\n"      \
  "}\n"

// The weight is streamed once: kept out of L1 so that x, which every warp reads, stays there.
__device__ __forceinline__ uint4 load_weight(const void* ptr, bool pred) {
  uint4 v;
  asm volatile(GEMV_LOAD_16B(".L1::no_allocate")
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

__device__ __forceinline__ uint4 load_x(const bf16* ptr, bool pred) {
  uint4 v;
  asm volatile(GEMV_LOAD_16B("")
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

#undef GEMV_LOAD_16B

// 16 bytes of x from an address known to be valid.
__device__ __forceinline__ uint4 load_x(const bf16* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// A float from global memory that no kernel writes (the FP8 weights' block scales). asm volatile:
// it stays where it is written relative to the PDL wait (launch.h), which is asm volatile too.
__device__ __forceinline__ float load_scale(const float* ptr) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(ptr));
  return v;
}

// The same, or 0 where !pred.
__device__ __forceinline__ float load_scale(const float* ptr, bool pred) {
  float v;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %2, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  @p ld.global.nc.f32 %0, [%1];\n"
      "}\n"
      : "=f"(v)
      : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

// d += a (16x16, row-major) . b (16x8, column-major); bf16 operands, fp32 accumulator.
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                            uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

inline std::string shape_str(int M, int N, int K) {
  return "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K);
}

// Throws unless `supported`, naming the op, the shape and the limits of a GEMV of at most max_m
// rows whose K must be a positive multiple of k_multiple.
inline void require_gemv_shape(bool supported, const char* op, int M, int N, int K,
                               int k_multiple, int max_m) {
  require(supported, std::string(op) + ": unsupported " + shape_str(M, N, K) +
                         "; it takes 1 <= M <= " + std::to_string(max_m) +
                         ", N >= 1 and K a positive multiple of " + std::to_string(k_multiple) +
                         " (use Gemm::linear for other shapes)");
}

}  // namespace nanograph::gemv_detail
