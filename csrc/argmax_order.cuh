// The order in which every greedy choice picks its token (argmax in sampling.cu, gemv_argmax's
// epilogue in gemv.cu, the greedy rows of sample_rows in sample_rows.cu): torch.argmax's. A NaN
// comes before every number and NaNs are equal to each other; then the larger number (-0 and +0
// are equal, -inf comes last); among equal values, the lower index. A row of -inf answers index 0.
// Two forms of one rule: a comparison of (value, index) pairs, for scans and their reductions, and
// a 64-bit key whose unsigned order is the same, for reductions by atomicMax.
#pragma once
#include <cstdint>

namespace nanograph {

// Whether `value` comes strictly before `best` by value alone: a NaN before any number, else the
// larger number. A scan that visits indices in increasing order replaces its best only when
// argmax_ahead(value, best): a tie keeps the lower index.
__device__ __forceinline__ bool argmax_ahead(float value, float best) {
  return !(value <= best) && best == best;
}

// Whether the candidate (value, index) comes before (best_value, best_index): ahead by value, or
// equal by value (two NaNs or two equal numbers) at a lower index.
__device__ __forceinline__ bool argmax_precedes(float value, int index, float best_value,
                                                int best_index) {
  return argmax_ahead(value, best_value) ||
         (!argmax_ahead(best_value, value) && index < best_index);
}

// The candidate as one key: the value's bits made order-preserving as unsigned (every NaN as the
// highest, -0 as +0) above the complemented index, so that the unsigned maximum of the keys is
// the candidate argmax_precedes puts first. 0 is below every key: no candidate yet.
__device__ __forceinline__ unsigned long long argmax_key(float value, int index) {
  uint32_t bits = __float_as_uint(value);
  if (value != value) {
    bits = 0xffffffffu;
  } else if ((bits << 1) == 0) {
    bits = 0x80000000u;
  } else {
    bits = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  }
  return (static_cast<unsigned long long>(bits) << 32) | ~static_cast<uint32_t>(index);
}

// The index of the key's candidate; 0 (the answer for a row of -inf) for no candidate.
__device__ __forceinline__ int32_t argmax_key_index(unsigned long long key) {
  return key == 0 ? 0 : static_cast<int32_t>(~static_cast<uint32_t>(key));
}

}  // namespace nanograph
