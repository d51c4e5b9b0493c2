// The KV cache's element type: bf16, or e4m3 with one float32 scale for K and one for V per layer
// (per tensor): a value x is stored as e4m3(clamp(x / scale, -448, 448)) and read as
// float(e4m3) * scale (e4m3.cuh). Both caches of a layer have the same type.
#pragma once
#include <cmath>
#include <cstddef>
#include <string>

#include "common.h"

namespace nanograph {

enum class KvDtype { kBf16, kFp8E4m3 };

inline size_t kv_dtype_bytes(KvDtype dtype) { return dtype == KvDtype::kBf16 ? 2 : 1; }

// An FP8 cache's scales must be positive finite numbers (a bf16 cache ignores them); `what` names
// the caller and the layer for the error.
inline void require_kv_scales(const std::string& what, KvDtype dtype, float k_scale,
                              float v_scale) {
  if (dtype == KvDtype::kBf16) return;
  for (float scale : {k_scale, v_scale}) {
    require(scale > 0.f && std::isfinite(scale),
            what + ": an FP8 KV cache's k_scale and v_scale must be positive finite numbers, got " +
                std::to_string(k_scale) + " and " + std::to_string(v_scale));
  }
}

}  // namespace nanograph
