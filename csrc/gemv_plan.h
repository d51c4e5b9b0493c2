// How the small-M GEMVs (gemv.cu, gemv_fp8.cu) divide a weight over warps and CTAs: host code,
// planned from the device's SM count (DeviceProps::sm_count, launch.h), never from a constant.
#pragma once
#include "common.h"

namespace nanograph::gemv_detail {

constexpr int kWarpsPerCta = 8;  // the usual CTA; 16 when a row group takes 16 splits
constexpr int kMaxSplits = 16;
// Resident warps per SM the launch bounds allow: 2 CTAs of 8 or 1 of 16. This caps registers at
// 128, which is what holds a whole batch of loads in flight: without a minimum, ptxas trades
// them for occupancy and issues each load just before its MMA.
constexpr int kWarpsPerSm = 16;

// K splits per row group on a device of sm_count SMs, for a kernel whose warps keep `unroll` steps
// of loads in flight: a warp owns one row group and one of `splits` contiguous ranges of its
// `steps` warp steps. A full wave is sm_count * kWarpsPerSm warps. Matrices of at most two load
// batches per warp of a full wave fit one wave: splits double while the launch stays within it (so
// that no matrix ends in a partial second wave) and while a split holds more than one load batch
// (below that, more splits add warps but no bytes in flight). Larger ones (Qwen3-8B's bf16
// projections, the lm_heads) stream through several waves of 8-warp CTAs: splits double up to 8
// while each split keeps two load batches, however many waves the grid then has (a warp that
// streams a whole long row alone holds its slot of the SM for all of it).
inline int choose_splits(int row_groups, int steps, int unroll, int sm_count) {
  const int64_t wave = static_cast<int64_t>(sm_count) * kWarpsPerSm;
  int splits = 1;
  const bool streaming = static_cast<int64_t>(row_groups) * steps > 2LL * unroll * wave;
  if (!streaming) {
    while (splits < kMaxSplits && 2LL * row_groups * splits <= wave && 2 * splits <= steps &&
           ceil_div(steps, splits) > unroll) {
      splits *= 2;
    }
    return splits;
  }
  while (2 * splits <= kWarpsPerCta && 2 * splits * 2 * unroll <= steps) {
    splits *= 2;
  }
  return splits;
}

// Warps per SM of the launch bounds that grids of more than one 16-warp wave may take instead:
// 3 CTAs of 8 at 80 registers (gemv_fp8_grid says which).
constexpr int kThreeCtaWarpsPerSm = 24;

// A GEMV launch: `splits` warps per row group, CTAs of `warps` warps (kWarpsPerCta, or one row
// group's 16 splits), `ctas` of them, the warp steps of each split, and the resident warps per
// SM of the kernel's launch bounds.
struct GemvGrid {
  int splits;
  int warps;
  int ctas;
  int steps_per_split;
  int resident_warps = kWarpsPerSm;

  int64_t total_warps() const { return static_cast<int64_t>(ctas) * warps; }
};

// The launch of `splits` splits per row group.
inline GemvGrid gemv_grid_of(int row_groups, int steps, int splits) {
  const int warps = splits > kWarpsPerCta ? splits : kWarpsPerCta;
  return {splits, warps, ceil_div(row_groups, warps / splits), ceil_div(steps, splits)};
}

inline GemvGrid gemv_grid(int row_groups, int steps, int unroll, int sm_count) {
  return gemv_grid_of(row_groups, steps, choose_splits(row_groups, steps, unroll, sm_count));
}

// Whether all of the grid's warps are resident at once (one wave at its resident warps per SM).
inline bool gemv_is_one_wave(const GemvGrid& g, int sm_count) {
  return g.total_warps() <= static_cast<int64_t>(sm_count) * g.resident_warps;
}

// Whether the bf16 GEMV's warps of up to 8 x rows request each half of their next load batch as
// soon as the steps holding its registers are summed, or the whole batch at once before its first
// step (one burst of `unroll` x 64 contiguous bytes of each of the warp's rows). Halves where the
// grid is one wave at its resident warps (Qwen3-0.6B's projections): a warp's gap between batches
// is then nobody's work, and a split of one batch runs the halves loop, whose code has no reload
// ahead of its MMAs. Whole bursts where other waves' warps fill the gap (Qwen3-8B's projections,
// the lm_heads).
inline bool gemv_reloads_by_halves(const GemvGrid& g, int sm_count) {
  return gemv_is_one_wave(g, sm_count);
}

// The FP8 GEMV (gemv_fp8.cu: 16 rows and 64 columns a warp step, `unroll` steps in flight) on M
// rows of x: gemv_grid, then at M <= 8:
// - A grid of one wave whose splits hold one load batch has its whole weight in flight before the
//   PDL wait, and widened there (gemv_fp8_widens_early), so what the wait leaves is each warp's x
//   loads and its chain of MMAs over its steps: the splits go on doubling down to half a batch per
//   warp while the grid stays one wave (Qwen3-0.6B's qkv and o).
// - A grid of more than one wave runs at 3 CTAs per SM: the longer wait between a warp's
//   instructions is hidden by more warps, and Qwen3-8B's qkv (384 CTAs) then fits one wave. A
//   grid of several waves even so (Qwen3-8B's gate_up: 1,536 CTAs of 8 splits) takes the fewest
//   splits that fill one such wave, if any do: longer splits and no partial last wave.
// (Above 8 rows of x, two sets of MMAs would spill at 80 registers.)
inline GemvGrid gemv_fp8_grid(int row_groups, int steps, int unroll, int M, int sm_count) {
  GemvGrid g = gemv_grid(row_groups, steps, unroll, sm_count);
  if (M > 8) return g;
  if (gemv_is_one_wave(g, sm_count)) {
    if (g.steps_per_split > unroll) return g;
    const int64_t wave = static_cast<int64_t>(sm_count) * kWarpsPerSm;
    while (g.splits < kMaxSplits && 2LL * row_groups * g.splits <= wave &&
           g.steps_per_split > unroll / 2) {
      g = gemv_grid_of(row_groups, steps, 2 * g.splits);
    }
    return g;
  }
  if (g.warps != kWarpsPerCta) return g;
  const int one_wave = kThreeCtaWarpsPerSm / kWarpsPerCta * sm_count;  // CTAs at 3 per SM
  if (g.ctas > one_wave) {
    for (int splits = 1; splits < g.splits; splits *= 2) {
      const GemvGrid fewer = gemv_grid_of(row_groups, steps, splits);
      if (fewer.ctas > 2 * sm_count && fewer.ctas <= one_wave) {
        g = fewer;
        break;
      }
    }
  }
  g.resident_warps = kThreeCtaWarpsPerSm;
  return g;
}

// Whether the FP8 GEMV widens its weight to bf16 before the PDL wait (gemv_fp8.cu, kWidenEarly):
// where each split is at most one load batch, at 16 resident warps and up to 8 rows of x, the whole
// split is in registers before the wait, and widening it there leaves the wait only x's loads and
// the MMAs (Qwen3-0.6B's projections).
inline bool gemv_fp8_widens_early(const GemvGrid& g, int unroll, int M) {
  return M <= 8 && g.resident_warps == kWarpsPerSm && g.steps_per_split <= unroll;
}

}  // namespace nanograph::gemv_detail
