// e4m3 conversions on the device, for FP8 weights (gemv_fp8.cu) and the FP8 KV cache
// (KvDtype::kFp8E4m3, kv_cache.h): a cached value x is stored as e4m3(clamp(x / scale, -448, 448)),
// the division in fp32 and rounded once to nearest even, and read back as float(e4m3) * scale.
// Every e4m3 value is exact in fp16 and in bf16; the hardware widens e4m3 to fp16 directly.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "bf16x8.cuh"

namespace nanograph {

// Eight values as the cache stores them, in order, one byte each. Saturating: finite values past
// 448 * scale and infinities store +-448; NaN stays NaN.
__device__ __forceinline__ uint2 quantize_e4m3x8(const Float8& x, float scale) {
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int i = 4 * w + 2 * p;
      const float2 pair = make_float2(__fdiv_rn(x.v[i], scale), __fdiv_rn(x.v[i + 1], scale));
      const uint32_t bytes = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
      word |= bytes << (16 * p);
    }
    words[w] = word;
  }
  return make_uint2(words[0], words[1]);
}

// Two e4m3 values (the low and high byte of `bytes`) as an fp16x2 word, low value in the low half.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(bytes & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// The same for bytes 2 and 3 of `bytes`; sm_89+ converts the high half in place, with no shift.
__device__ __forceinline__ uint32_t e4m3x2_high_to_f16x2(uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}"
      : "=r"(h)
      : "r"(bytes));
  return h;
#else
  return e4m3x2_to_f16x2(bytes >> 16);
#endif
}

// Eight e4m3 values as eight fp16 (the layout of a 16-byte bf16/fp16 load), in order.
__device__ __forceinline__ uint4 e4m3x8_to_f16x8(const uint2& v) {
  return make_uint4(e4m3x2_to_f16x2(v.x), e4m3x2_high_to_f16x2(v.x), e4m3x2_to_f16x2(v.y),
                    e4m3x2_high_to_f16x2(v.y));
}

// Value j of two runs of eight e4m3 values, zipped: {a[j], b[j]} as an fp16x2 word, a[j] in the
// low half. The bytes are zipped first ({a[j], b[j], a[j + 1], b[j + 1]} for even j), so that one
// conversion of either 16-bit half gives a word: 4 byte permutes and 8 conversions for all 8.
__device__ __forceinline__ uint32_t zip_e4m3x8_to_f16x2(const uint2& a, const uint2& b, int j) {
  const uint32_t a4 = j < 4 ? a.x : a.y, b4 = j < 4 ? b.x : b.y;
  const uint32_t zipped = __byte_perm(a4, b4, j % 4 < 2 ? 0x5140 : 0x7362);
  return j % 2 ? e4m3x2_high_to_f16x2(zipped) : e4m3x2_to_f16x2(zipped);
}

// An fp16x2 word of e4m3 values as a bf16x2, exactly (every e4m3 value is a bf16 value).
__device__ __forceinline__ uint32_t e4m3_f16x2_to_bf16x2(uint32_t h) {
  const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(*reinterpret_cast<const __half2*>(&h)));
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Two e4m3 values (the low byte of `bytes` first) as a bf16x2, exactly, low value in the low half.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t bytes) {
  return e4m3_f16x2_to_bf16x2(e4m3x2_to_f16x2(bytes));
}

// Eight e4m3 values as eight bf16, exactly, in order.
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(const uint2& v) {
  const uint4 h = e4m3x8_to_f16x8(v);
  return make_uint4(e4m3_f16x2_to_bf16x2(h.x), e4m3_f16x2_to_bf16x2(h.y), e4m3_f16x2_to_bf16x2(h.z),
                    e4m3_f16x2_to_bf16x2(h.w));
}

// Eight bf16 values (a 16-byte load) as eight fp16, rounded to nearest even; values beyond fp16's
// range saturate at +-65504 (NaN stays NaN).
__device__ __forceinline__ uint4 bf16x8_to_f16x8(const uint4& v) {
  const uint32_t* in = &v.x;
  uint4 out;
  uint32_t* o = &out.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // A bf16 is the high half of the float it equals.
    const float lo = __uint_as_float(in[i] << 16), hi = __uint_as_float(in[i] & 0xffff0000u);
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(o[i]) : "f"(hi), "f"(lo));
  }
  return out;
}

}  // namespace nanograph
