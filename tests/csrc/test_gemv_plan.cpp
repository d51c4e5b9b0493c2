// The small-M GEMVs' grids (gemv_plan.h) on described devices (host only): a matrix that fits one
// wave of the device launches at most one wave, a streamed one splits while each split keeps two
// load batches (up to 8), and the SM count is what tells the two apart.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "gemv_plan.h"

namespace nanograph::gemv_detail {
namespace {

struct Shape {
  int N, K;
};

// Projections and lm_heads of SmolLM2-135M, Qwen3-0.6B, Qwen3-8B and a Llama-3-8B shape, and a
// few tails.
const std::vector<Shape> kShapes = {{960, 576},    {576, 576},     {3072, 576},    {576, 1536},
                                    {49152, 576},  {4096, 1024},   {1024, 2048},   {6144, 1024},
                                    {1024, 3072},  {151936, 1024}, {6144, 4096},   {4096, 4096},
                                    {24576, 4096}, {4096, 12288},  {151936, 4096}, {28672, 4096},
                                    {4096, 14336}, {128256, 4096}, {3, 16},        {9001, 2064}};

// The two kernels' layouts: bf16 (gemv.cu: 8 rows and 32 columns a step, 8 steps in flight) and
// FP8 (gemv_fp8.cu: 16 rows and 64 columns, 4 steps).
struct Kernel {
  int rows, step_k, unroll;
};
const Kernel kKernels[] = {{8, 32, 8}, {16, 64, 4}};

const int kSmCounts[] = {8, 16, 66, 108, 114, 132, 144};

TEST(GemvPlan, AMatrixThatFitsOneWaveLaunchesAtMostOne) {
  for (int sms : kSmCounts) {
    const int64_t wave = static_cast<int64_t>(sms) * kWarpsPerSm;
    for (const Kernel& kernel : kKernels) {
      for (const Shape& shape : kShapes) {
        const int row_groups = ceil_div(shape.N, kernel.rows);
        const int steps = ceil_div(shape.K, kernel.step_k);
        SCOPED_TRACE(testing::Message() << sms << " SMs, N=" << shape.N << " K=" << shape.K
                                        << " rows " << kernel.rows);
        const GemvGrid g = gemv_grid(row_groups, steps, kernel.unroll, sms);
        ASSERT_GE(g.splits, 1);
        ASSERT_LE(g.splits, kMaxSplits);
        // Every row group and every step is covered.
        EXPECT_GE(static_cast<int64_t>(g.ctas) * (g.warps / g.splits), row_groups);
        EXPECT_GE(static_cast<int64_t>(g.steps_per_split) * g.splits, steps);
        const bool streaming =
            static_cast<int64_t>(row_groups) * steps > 2LL * kernel.unroll * wave;
        if (!streaming && g.splits > 1) {
          EXPECT_LE(static_cast<int64_t>(row_groups) * g.splits, wave);
        }
        if (streaming) {
          // As many splits as keep two load batches each, up to a CTA's 8 warps.
          EXPECT_LE(g.splits, kWarpsPerCta);
          EXPECT_LE(g.splits * 2 * kernel.unroll, std::max(steps, 2 * kernel.unroll));
          if (g.splits < kWarpsPerCta) {
            EXPECT_GT(g.splits * 4 * kernel.unroll, steps);
          }
        }
      }
    }
  }
}

TEST(GemvPlan, TheSmCountSetsTheSplits) {
  // Qwen3-0.6B's qkv in the bf16 kernel: 512 row groups of 32 steps. It fits one wave of 132 SMs
  // (2,112 warps) in 4 splits (2,048 warps), and one of 66 SMs (1,056) in 2; on 16 SMs it streams,
  // 2 splits keeping two load batches each.
  EXPECT_EQ(choose_splits(512, 32, 8, 132), 4);
  EXPECT_EQ(choose_splits(512, 32, 8, 66), 2);
  EXPECT_EQ(choose_splits(512, 32, 8, 16), 2);
  // A wave of 132 SMs is 2,112 warps, not 2,048: 264 row groups of 64 steps split 8 ways.
  EXPECT_EQ(choose_splits(264, 64, 8, 132), 8);
  // Qwen3-8B's o in the FP8 kernel (256 row groups of 64 steps): one wave of 132 SMs in 8 splits;
  // on 16 SMs it streams, 8 splits keeping two load batches each.
  EXPECT_EQ(choose_splits(256, 64, 4, 132), 8);
  EXPECT_EQ(choose_splits(256, 64, 4, 16), 8);
  // Qwen3-8B's down in the FP8 kernel (256 row groups of 192 steps) streams: 8 splits on 132 SMs,
  // and on 8 SMs, however many waves the grid then has (16 there).
  EXPECT_EQ(choose_splits(256, 192, 4, 132), 8);
  EXPECT_EQ(choose_splits(256, 192, 4, 8), 8);
  // The lm_heads in the bf16 kernel stream on every device: Qwen3-0.6B's (18,992 row groups of 32
  // steps) in 2 splits of two load batches, Qwen3-8B's (128 steps) in 8.
  for (int sms : kSmCounts) {
    EXPECT_EQ(choose_splits(18992, 32, 8, sms), 2) << sms << " SMs";
    EXPECT_EQ(choose_splits(18992, 128, 8, sms), 8) << sms << " SMs";
  }
}

TEST(GemvPlan, BatchesAreRequestedByHalvesInOneWave) {
  // The bf16 kernel on 132 SMs (a wave of 2,112 warps): (N, K) -> by halves.
  auto halves = [](int N, int K) {
    const GemvGrid g = gemv_grid(ceil_div(N, 8), ceil_div(K, 32), 8, 132);
    return gemv_reloads_by_halves(g, 132);
  };
  // Qwen3-0.6B's projections fit one wave (gate_up in 2 batches per split, the others in 1).
  for (Shape s : std::vector<Shape>{{4096, 1024}, {1024, 2048}, {6144, 1024}, {1024, 3072}}) {
    EXPECT_TRUE(halves(s.N, s.K)) << s.N << " x " << s.K;
  }
  // The lm_heads and Qwen3-8B's projections stream through several waves.
  for (Shape s : std::vector<Shape>{{151936, 1024}, {151936, 4096}, {6144, 4096}, {4096, 4096},
                                    {24576, 4096}, {4096, 12288}}) {
    EXPECT_FALSE(halves(s.N, s.K)) << s.N << " x " << s.K;
  }
  // One wave is counted in warps: 16-warp CTAs hold one per SM.
  EXPECT_TRUE(gemv_reloads_by_halves(GemvGrid{16, 16, 132, 6}, 132));
  EXPECT_FALSE(gemv_reloads_by_halves(GemvGrid{16, 16, 133, 6}, 132));
  EXPECT_TRUE(gemv_reloads_by_halves(GemvGrid{4, 8, 264, 8}, 132));
  EXPECT_FALSE(gemv_reloads_by_halves(GemvGrid{4, 8, 265, 8}, 132));
}

TEST(GemvPlan, Fp8OneWaveGridsSplitDownToHalfABatch) {
  // The FP8 kernel's layout (16 rows, 64 columns, 4 steps in flight) on 132 SMs at M <= 8:
  // Qwen3-0.6B's qkv (256 row groups of 16 steps) in 8 splits of 2 steps, 2,048 warps; o (64 of 32)
  // in 16 of 2, one 16-warp CTA per row group; down (64 of 48) keeps gemv_grid's 16 splits;
  // gate_up (384 gated groups of 16) keeps 4 (8 would be 3,072 warps).
  auto fp8 = [](int row_groups, int steps, int M) {
    return gemv_fp8_grid(row_groups, steps, 4, M, 132);
  };
  GemvGrid g = fp8(256, 16, 1);
  EXPECT_EQ(g.splits, 8);
  EXPECT_EQ(g.steps_per_split, 2);
  EXPECT_EQ(g.ctas, 256);
  g = fp8(64, 32, 8);
  EXPECT_EQ(g.splits, 16);
  EXPECT_EQ(g.warps, 16);
  EXPECT_EQ(g.ctas, 64);
  EXPECT_EQ(fp8(64, 48, 1).splits, 16);
  EXPECT_EQ(fp8(384, 16, 1).splits, 4);
  // Above 8 rows of x the kernel keeps gemv_grid's plan.
  EXPECT_EQ(fp8(256, 16, 9).splits, gemv_grid(256, 16, 4, 132).splits);
  // Qwen3-8B's o (256 of 64) is one wave at 8 splits already; its qkv (384 of 64) streams in 8
  // splits of 384 CTAs, one wave at 3 CTAs per SM; its gate_up (1,536 gated groups of 64) takes 2
  // splits in 384 CTAs at 3 per SM instead of 8 in 1,536.
  EXPECT_EQ(fp8(256, 64, 1).splits, 8);
  g = fp8(384, 64, 1);
  EXPECT_EQ(g.splits, 8);
  EXPECT_EQ(g.resident_warps, kThreeCtaWarpsPerSm);
  g = fp8(1536, 64, 1);
  EXPECT_EQ(g.splits, 2);
  EXPECT_EQ(g.ctas, 384);
  EXPECT_EQ(g.resident_warps, kThreeCtaWarpsPerSm);
  EXPECT_EQ(fp8(1536, 64, 9).resident_warps, kWarpsPerSm);
  // Qwen3-0.6B's grids stay at 2 CTAs per SM.
  EXPECT_EQ(fp8(256, 16, 1).resident_warps, kWarpsPerSm);
}

TEST(GemvPlan, Fp8WidensEarlyWhereEverySplitIsOneLoadBatch) {
  // Qwen3-0.6B's four projections (qkv, o, down; gate_up gated) at M <= 8: every split at most 4
  // steps, 16 resident warps. Not above 8 rows of x, nor Qwen3-8B's (several batches per split, or
  // 3 CTAs per SM).
  auto early = [](int row_groups, int steps, int M) {
    return gemv_fp8_widens_early(gemv_fp8_grid(row_groups, steps, 4, M, 132), 4, M);
  };
  for (int M : {1, 2, 8}) {
    EXPECT_TRUE(early(256, 16, M));
    EXPECT_TRUE(early(64, 32, M));
    EXPECT_TRUE(early(384, 16, M));
    EXPECT_TRUE(early(64, 48, M));
    EXPECT_FALSE(early(384, 64, M));
    EXPECT_FALSE(early(256, 64, M));
    EXPECT_FALSE(early(1536, 64, M));
    EXPECT_FALSE(early(256, 192, M));
  }
  EXPECT_FALSE(early(256, 16, 9));
  EXPECT_FALSE(gemv_fp8_widens_early(GemvGrid{4, 8, 264, 4, kThreeCtaWarpsPerSm}, 4, 1));
  EXPECT_TRUE(gemv_fp8_widens_early(GemvGrid{4, 8, 264, 4}, 4, 1));
  EXPECT_FALSE(gemv_fp8_widens_early(GemvGrid{4, 8, 264, 5}, 4, 1));
}

TEST(GemvPlan, Fp8GridsCoverTheMatrixAndKeepOneWaveGridsInOne) {
  for (int sms : kSmCounts) {
    const int64_t wave = static_cast<int64_t>(sms) * kWarpsPerSm;
    for (const Shape& shape : kShapes) {
      for (int M : {1, 8, 9, 16}) {
        const int row_groups = ceil_div(shape.N, 16);
        const int steps = ceil_div(shape.K, 64);
        SCOPED_TRACE(testing::Message() << sms << " SMs, N=" << shape.N << " K=" << shape.K
                                        << " M=" << M);
        const GemvGrid base = gemv_grid(row_groups, steps, 4, sms);
        const GemvGrid g = gemv_fp8_grid(row_groups, steps, 4, M, sms);
        ASSERT_GE(g.splits, 1);
        ASSERT_LE(g.splits, kMaxSplits);
        EXPECT_EQ(g.warps, std::max(g.splits, kWarpsPerCta));
        EXPECT_GE(static_cast<int64_t>(g.ctas) * (g.warps / g.splits), row_groups);
        EXPECT_GE(static_cast<int64_t>(g.steps_per_split) * g.splits, steps);
        if (gemv_reloads_by_halves(base, sms)) {
          EXPECT_LE(static_cast<int64_t>(g.ctas) * g.warps, wave);
          EXPECT_GE(g.splits, base.splits);
        }
        if (M > 8) EXPECT_EQ(g.splits, base.splits);
        if (g.resident_warps == kThreeCtaWarpsPerSm) {
          EXPECT_LE(M, 8);
          EXPECT_EQ(g.warps, kWarpsPerCta);
          EXPECT_GT(g.total_warps(), wave);
        }
      }
    }
  }
}

}  // namespace
}  // namespace nanograph::gemv_detail
