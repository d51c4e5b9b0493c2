// plan_decode_attention on a described device (host only): the grid follows the batch, the heads
// and the bound, stays one resident wave on small grids at any bound, and the workspace holds
// every part the grid can write.
#include <gtest/gtest.h>

#include "attention.h"

namespace nanograph {
namespace {

DeviceProps h200() {
  DeviceProps props;
  props.sm_count = 132;
  props.compute_major = 9;
  props.smem_per_block_optin = 227 * 1024;
  props.smem_per_sm = 228 * 1024;
  props.clusters = true;
  // Clusters of 1 to 8 CTAs at 2 CTAs per SM as an H200 reports them (GPCs of unequal size hold fewer
  // clusters of 3 and more than 264 CTAs would).
  props.resident_clusters = {0, 264, 132, 79, 62, 47, 39, 32, 30};
  props.pdl = true;
  return props;
}

// The parts and their lse, fp32; and one arrival counter per (sequence, kv head).
size_t expected_workspace(const DecodeAttentionPlan& p) {
  if (p.splits() == 1) return 0;
  return static_cast<size_t>(p.num_seqs) * p.num_q_heads * p.splits() * (p.head_dim + 1) * 4;
}

size_t expected_counters(const DecodeAttentionPlan& p) {
  return p.splits() == 1 ? 0 : static_cast<size_t>(p.num_seqs) * p.num_kv_heads;
}

TEST(DecodePlan, BatchOneIsOneResidentWaveAtEveryBound) {
  // Qwen3-0.6B's heads, from a latency benchmark's bound to the model's whole context.
  for (int bound : {384, 1024, 4096, 8192, 16384, 32768, 40960}) {
    const DecodeAttentionPlan p = plan_decode_attention(1, 16, 8, 128, bound, h200());
    SCOPED_TRACE(bound);
    EXPECT_TRUE(p.early_kv);
    // Clusters at every bound: 8 rows of up to 3 chunks of 8 CTAs (30 fit), a fourth chunk given up.
    EXPECT_TRUE(p.cluster_merge);
    EXPECT_FALSE(p.reads_order);
    EXPECT_FALSE(p.fuse_rope);
    EXPECT_EQ(p.cluster, std::min(8, (bound + 63) / 64));
    EXPECT_LE(static_cast<int64_t>(p.splits()) * 8, 2 * 132);  // every CTA resident at once
    EXPECT_EQ(p.chunk_min_keys, 2048);
    EXPECT_EQ(p.chunks, std::min(3, (bound + 2047) / 2048));
    EXPECT_EQ(p.workspace_bytes, expected_workspace(p));
    EXPECT_EQ(p.arrival_counters, expected_counters(p));
  }
}

TEST(DecodePlan, LargeGridsSplitByTheBoundAndTakeTheOrder) {
  const DecodeAttentionPlan big = plan_decode_attention(256, 16, 8, 128, 2048, h200());
  EXPECT_FALSE(big.early_kv);
  EXPECT_TRUE(big.reads_order);
  EXPECT_TRUE(big.fuse_rope);
  EXPECT_EQ(big.splits(), 1);  // 2,048 rows fill the GPU
  EXPECT_EQ(big.workspace_bytes, 0u);
  const DecodeAttentionPlan mid = plan_decode_attention(64, 32, 8, 128, 4096, h200());
  EXPECT_EQ(mid.cluster, 1);
  EXPECT_EQ(mid.chunks, 2);  // 8 CTAs per SM over 512 rows
  EXPECT_EQ(mid.chunk_min_keys, 2048);
  EXPECT_EQ(mid.workspace_bytes, expected_workspace(mid));
  const DecodeAttentionPlan eight = plan_decode_attention(8, 16, 8, 128, 40960, h200());
  EXPECT_FALSE(eight.early_kv);
  EXPECT_EQ(eight.chunks, 16);
  EXPECT_EQ(eight.chunk_min_keys % 64, 0);
  EXPECT_GE(static_cast<int64_t>(eight.chunks) * eight.chunk_min_keys, 40960);
}

TEST(DecodePlan, SplitsStayWithinBoundsForAnyHeadsDeviceAndCache) {
  DeviceProps small = h200();
  small.sm_count = 16;
  small.clusters = false;
  DeviceProps no_clusters = h200();
  no_clusters.clusters = false;
  for (const DeviceProps& device : {h200(), small}) {
    for (int seqs : {1, 2, 3, 4, 7, 8, 64, 512}) {
      for (int kv : {1, 2, 8}) {
        for (int hd : {64, 128}) {
          for (int bound : {0, 1, 64, 65, 400, 2048, 40960}) {
            for (KvDtype dtype : {KvDtype::kBf16, KvDtype::kFp8E4m3}) {
              const DecodeAttentionPlan p =
                  plan_decode_attention(seqs, 16, kv, hd, bound, device, dtype);
              SCOPED_TRACE(std::to_string(seqs) + " " + std::to_string(kv) + " " +
                           std::to_string(hd) + " " + std::to_string(bound) + " " +
                           (dtype == KvDtype::kBf16 ? "bf16" : "fp8"));
              // A CTA step: 4 warps of 8 KB of bf16 K and V each; twice the keys for an e4m3
              // cache on a small grid.
              const bool wide = dtype == KvDtype::kFp8E4m3 && p.early_kv;
              const int step = (hd == 128 ? 64 : 128) * (wide ? 2 : 1);
              EXPECT_EQ(p.kv_dtype, dtype);
              EXPECT_GE(p.chunks, 1);
              EXPECT_GE(p.cluster, 1);
              EXPECT_LE(p.cluster, 8);
              EXPECT_LE(p.cluster, std::max(1, (bound + step - 1) / step));
              EXPECT_LE(p.splits(), 128);
              EXPECT_EQ(p.chunk_min_keys % step, 0);
              EXPECT_GT(p.chunk_min_keys, 0);
              // Clusters only if all are resident at once, giving up at most a quarter of the
              // chunks the grid takes without them.
              const DecodeAttentionPlan plain = plan_decode_attention(
                  seqs, 16, kv, hd, bound, device.clusters ? no_clusters : device, dtype);
              EXPECT_FALSE(plain.cluster_merge);
              EXPECT_EQ(p.cluster, plain.cluster);
              EXPECT_EQ(p.chunk_min_keys, plain.chunk_min_keys);
              if (p.cluster_merge) {
                EXPECT_TRUE(p.early_kv && p.cluster > 1 && device.clusters);
                EXPECT_LE(static_cast<int64_t>(seqs) * kv * p.chunks, device.resident_clusters[p.cluster]);
                EXPECT_LE(p.chunks, plain.chunks);
                EXPECT_GE(p.chunks * 4, plain.chunks * 3);
              } else {
                EXPECT_EQ(p.chunks, plain.chunks);
                if (p.early_kv && p.cluster > 1 && device.clusters) {
                  EXPECT_LT(device.resident_clusters[p.cluster] / (seqs * kv) * 4, p.chunks * 3);
                }
              }
              EXPECT_EQ(p.reads_order, !p.early_kv);
              if (p.early_kv) {
                EXPECT_LE(static_cast<int64_t>(seqs) * kv * p.splits(), 2 * device.sm_count);
              }
              EXPECT_EQ(p.workspace_bytes, expected_workspace(p));
              EXPECT_EQ(p.arrival_counters, expected_counters(p));
            }
          }
        }
      }
    }
  }
  EXPECT_THROW(plan_decode_attention(1, 16, 8, 96, 1024, h200()), std::invalid_argument);
}

TEST(DecodePlan, SmallGridsLaunchClustersOnlyIfAllAreResidentAtOnce) {
  // 4 sequences x 8 kv heads in one chunk each: 32 clusters of 8, where 30 fit; 3 sequences: 24.
  EXPECT_FALSE(plan_decode_attention(4, 32, 8, 128, 16384, h200()).cluster_merge);
  EXPECT_TRUE(plan_decode_attention(3, 32, 8, 128, 16384, h200()).cluster_merge);
  DeviceProps even = h200();
  even.resident_clusters[8] = 33;  // 264 CTAs in clusters of 8
  const DecodeAttentionPlan p = plan_decode_attention(4, 32, 8, 128, 16384, even);
  EXPECT_TRUE(p.cluster_merge);
  EXPECT_EQ(p.splits(), 8);  // the division of the keys does not depend on it
  EXPECT_EQ(plan_decode_attention(4, 32, 8, 128, 16384, h200()).splits(), 8);
  // One sequence over 32,768 keys: 3 chunks of 8 in clusters, not 4 without.
  const DecodeAttentionPlan one = plan_decode_attention(1, 16, 8, 128, 32768, h200());
  EXPECT_TRUE(one.cluster_merge);
  EXPECT_EQ(one.splits(), 24);
  // Two over 40,960: 2 chunks each, where clusters would keep only 1.
  const DecodeAttentionPlan two = plan_decode_attention(2, 16, 8, 128, 40960, h200());
  EXPECT_FALSE(two.cluster_merge);
  EXPECT_EQ(two.splits(), 16);
}

TEST(DecodePlan, NoClustersWhereTheResidencyQueryFailed) {
  // A device whose residency query failed reports no resident clusters (cluster_residency.cu):
  // every small grid then launches without clusters and keeps the chunks of a plain plan.
  DeviceProps unknown = h200();
  unknown.resident_clusters.fill(0);
  DeviceProps plain = h200();
  plain.clusters = false;
  for (int seqs : {1, 2, 3, 4}) {
    for (int bound : {384, 6144, 32768, 40960}) {
      SCOPED_TRACE(testing::Message() << seqs << " sequences, bound " << bound);
      const DecodeAttentionPlan p = plan_decode_attention(seqs, 16, 8, 128, bound, unknown);
      const DecodeAttentionPlan q = plan_decode_attention(seqs, 16, 8, 128, bound, plain);
      EXPECT_FALSE(p.cluster_merge);
      EXPECT_EQ(p.chunks, q.chunks);
      EXPECT_EQ(p.cluster, q.cluster);
      EXPECT_EQ(p.workspace_bytes, q.workspace_bytes);
    }
  }
}

}  // namespace
}  // namespace nanograph
