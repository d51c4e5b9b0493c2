// Paged decode attention: one query token per sequence against its paged KV cache, split-KV.
//
// Computes out[s, h] = softmax(scale * q[s, h] . K_s^T) V_s over the context_lens[s] cached keys
// of sequence s, for every q head h; q head h reads kv head h / (num_q_heads / num_kv_heads).
//   q:        [num_seqs, q_stride] bf16; head h at q + s * q_stride + h * head_dim
//   k_cache,
//   v_cache:  [num_blocks, block_size, num_kv_heads, head_dim] bf16, or e4m3 read as
//             float(e4m3) * k_scale (v_scale) (KvDtype); key j of sequence s lives in
//             slot block_tables[s][j / block_size] * block_size + j % block_size
//   out:      [num_seqs, num_q_heads * head_dim] bf16; a row with context length 0 is zeros
//   workspace (plans of more than one split): parts [num_seqs, num_q_heads, splits, head_dim]
//             fp32, each normalised, then their lse [num_seqs, num_q_heads, splits] fp32 (log2
//             domain); arrivals: [num_seqs, num_kv_heads] uint32 counters, zero at rest.
//
// Launch: split_kernel, one CTA of 4 warps per (split, kv head, sequence). The grid comes from the
// plan (DecodeAttentionPlan), so a captured graph replays for any lengths up to its bound. The
// CTA serves every q head of its kv head (up to 16, the rows of an m16n8k16 tile), so K and V are
// read once. Warps take 16-key tiles in turn; per tile each lane issues its 16-byte K and V loads
// straight from global memory into mma fragments (no shared memory): the head_dim order inside a
// fragment is permuted to match what one lane loads, which a dot product over head_dim does not
// notice. S = Q K^T and O += P V run on mma.sync with fp32 accumulation and an exp2 online
// softmax; decode is bandwidth-bound, so the tile rows left empty by a group under 16 cost
// nothing. The 4 warps merge through shared memory. An FP8 cache (KvDtype::kFp8E4m3) is loaded
// 8 bytes (8 values) per fragment and widened to fp16 at use, exactly; q (saturating at fp16's
// +-65504) and P then meet it as fp16; k_scale folds into the softmax scale and v_scale into each
// CTA's normalised rows.
// Keys (KeySpan): a sequence's keys are cut into CTA steps (cta_step_keys: one 16-key tile per
// warp at head_dim 128, two for an e4m3 cache on a small grid), the steps into as many contiguous
// chunks as its length fills (one per chunk_min_keys keys, up to the plan's chunks; the steps
// shared out evenly), and a chunk's steps go round its cluster of CTAs in turn. The work follows
// the lengths in device memory: a short
// sequence under a large bound takes a few CTAs of the grid, and the rest return at once.
// Merge (merge_column, one definition): a CTA that holds all of its row's keys writes bf16 out
// directly. Otherwise every CTA with keys writes its normalised rows and their lse, and one CTA
// merges them with log-sum-exp weights, in split order: on small grids whose clusters are all
// resident at once (DeviceProps::resident_clusters), for a sequence that fills one chunk, rank 0
// of the thread block cluster, from its shared memory, where the other ranks wrote
// (no kernel boundary and no global round trip); elsewhere the last CTA of the row to finish, from
// the workspace, found by an arrival counter that it then resets.
// With DecodeAttentionArgs::rope (the decode step's own token, split_kernel<..., true>), each CTA
// normalises and rotates its q heads itself (into shared memory), and the CTA whose steps hold
// the newest position stores that key and value into the cache before its warps load them; the
// step then needs no RoPE/KV-store kernel. rope.cuh's norm_rope gives both paths the same bits.
// Order: CTAs start in blockIdx order, sequences slowest. With a seq_order (order_by_length,
// once per step), large grids take the sequences longest first, so the last CTAs to start are
// short ones and the GPU is not left part-idle behind one long sequence at the end.
// The kernels are launched with PDL (launch.h). split_kernel on large grids waits for its
// producers before any read. On small grids (where the wait is on the critical path)
// split_kernel<HD, true, ...> loads each warp's first step of keys and values before the wait, but
// for the newest key of the sequence (position len - 1), which the step's RoPE/KV-store kernel
// (or, with rope, the CTA itself) writes; see paged_decode_attention in attention.h. Its L2
// prefetch of the next step may touch the newest key's line before that write, which is harmless:
// L2 is where the device's writes meet, and the prefetch brings nothing nearer the SM. (Large
// grids of an e4m3 cache prefetch too, in launches with the fused RoPE, and after the wait.)
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attention.h"
#include "bf16x8.cuh"
#include "e4m3.cuh"
#include "launch.h"
#include "mma.cuh"
#include "rope.cuh"

namespace nanograph {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = 16;
constexpr int kMaxGroup = 16;  // q heads per kv head: the M rows of one mma tile
constexpr int kMaxSplits = 128;
// Large grids aim at this many CTAs per SM (3 resident at 168 registers, so the launch runs in
// waves that end on short work).
constexpr int kTargetCtasPerSm = 8;
// Small grids: at most 2 CTAs per SM, all resident at once. The early-KV variant holds the
// first step's fragments across the wait (over 168 registers at head_dim 128); larger grids,
// which need 3 CTAs per SM to keep the bandwidth, take the other (168 registers).
constexpr int kEarlyKvCtasPerSm = 2;
constexpr int kLargeGridCtasPerSm = 3;
constexpr int kMaxClusterSplits = 8;  // the portable cluster size
static_assert(kMaxClusterSplits < static_cast<int>(std::tuple_size<decltype(DeviceProps::resident_clusters)>::value),
              "DeviceProps::resident_clusters covers every cluster size");
constexpr int kMaxChunks = kMaxSplits / kMaxClusterSplits;
// On small grids a sequence takes one chunk (`cluster` CTAs) per this many keys, so that up to
// that length it merges inside its thread block cluster where the plan launches clusters (no
// round trip through the workspace), and longer ones spread over more of the GPU.
constexpr int kSmallGridChunkKeys = 2048;
// A small grid launches in thread block clusters (merging a one-chunk sequence inside its cluster)
// if that costs at most a quarter of its chunks.
constexpr struct {
  int num, den;
} kClusterGridShare{3, 4};
constexpr size_t kDefaultSmemBytes = 48 * 1024;  // more needs cudaFuncSetAttribute
constexpr float kLog2e = 1.4426950408889634f;

// The 16-key tiles a warp loads per step: 8 KB of bf16 K and V (one tile at head_dim 128). With
// an e4m3 cache on a small grid (`wide`) twice the tiles, so that each of its few warps keeps as
// many bytes in flight as a bf16 one. A large grid's warps take the bf16 count (a wider step would
// need more than its 168 registers): 3 CTAs per SM keep a bf16 cache's bytes in flight, and an
// e4m3 cache's warps ask L2 for their next step (DecodeAttentionPlan::prefetch_next_step).
constexpr int warp_step_tiles(int head_dim, bool wide) { return (wide ? 256 : 128) / head_dim; }

// The keys that one step of a CTA's warps covers.
constexpr int cta_step_keys(int head_dim, bool wide) {
  return kWarps * warp_step_tiles(head_dim, wide) * kTileKeys;
}

// What split_kernel needs of the plan.
struct KeyLayout {
  int chunks;
  int cluster;
  int chunk_min_keys;  // a multiple of cta_step_keys
  int prefetch;  // large grids: DecodeAttentionPlan::prefetch_next_step
};

// The keys of one split (CTA) of a sequence of `len` keys: steps of kStep keys starting at
// begin, begin + stride, ... below end (none when begin >= end).
struct KeySpan {
  int begin;
  int end;
  int stride;
};

// How a sequence of len keys is cut: its steps of kStep keys are shared out in order over the
// `active` chunks it fills (one per chunk_min_keys keys, up to the layout's chunks), the first
// `longer` chunks taking one step more than the others' `base`.
template <int kStep>
struct Chunking {
  int active;
  int base;
  int longer;

  __device__ __forceinline__ Chunking(int len, const KeyLayout& layout) {
    const int steps = (len + kStep - 1) / kStep;
    active = len <= 0 ? 0 : min(layout.chunks, (len + layout.chunk_min_keys - 1) / layout.chunk_min_keys);
    base = active > 0 ? steps / active : 0;
    longer = steps - base * active;
  }
  __device__ __forceinline__ int first_step(int chunk) const { return chunk * base + min(chunk, longer); }
  __device__ __forceinline__ int steps_of(int chunk) const { return base + (chunk < longer ? 1 : 0); }
  // The splits that hold keys: the first min(cluster, steps) ranks of each chunk.
  __device__ __forceinline__ int splits_with_keys(int cluster) const {
    return (active - longer) * min(cluster, base) + longer * min(cluster, base + 1);
  }
};

template <int kStep>
__device__ __forceinline__ KeySpan key_span(int len, int split, const KeyLayout& layout,
                                            const Chunking<kStep>& cut) {
  const int chunk = split / layout.cluster, rank = split % layout.cluster;
  if (chunk >= cut.active) return {0, 0, 0};
  const int first = cut.first_step(chunk);
  return {(first + rank) * kStep, min((first + cut.steps_of(chunk)) * kStep, len),
          layout.cluster * kStep};
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// What one lane loads of a key or value: 8 elements, bf16 (16 bytes) or e4m3 (8 bytes).
template <bool kFp8>
using KvFragment = std::conditional_t<kFp8, uint2, uint4>;

template <bool kFp8>
__device__ __forceinline__ KvFragment<kFp8> load_streaming(const void* p) {
  return __ldcs(reinterpret_cast<const KvFragment<kFp8>*>(p));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// A fragment as the 8 mma operands it holds: bf16 as loaded, or e4m3 widened to fp16 (exact).
__device__ __forceinline__ uint4 mma_operands(const uint4& bf16x8) { return bf16x8; }
__device__ __forceinline__ uint4 mma_operands(const uint2& e4m3x8) {
  return e4m3x8_to_f16x8(e4m3x8);
}

// Element j of two keys' fragments as one mma operand {a[j], b[j]}, key a in the low half (a
// fragment holds one key's dims; the B operand of O = P V pairs two keys per dim). Bf16 pairs
// the halves of loaded words; e4m3 pairs the bytes, then widens them (exact).
__device__ __forceinline__ uint32_t key_pair_operand(const uint4& a, const uint4& b, int j) {
  return __byte_perm(word(a, j / 2), word(b, j / 2), j % 2 ? 0x7632 : 0x5410);
}
__device__ __forceinline__ uint32_t key_pair_operand(const uint2& a, const uint2& b, int j) {
  return zip_e4m3x8_to_f16x2(a, b, j);
}

// The cluster barrier (sm_90), executed by every thread of the CTA at the same point (.aligned).
// An arrive with release makes this CTA's earlier writes to any rank's shared memory visible to a
// thread that then waits (acquire) on the same phase; each thread waits once per phase before it
// arrives again.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The address of `local` (this CTA's shared memory) in the shared memory of cluster rank 0.
__device__ __forceinline__ float* in_rank0(float* local) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(local, 0);
#else
  __trap();  // the cluster variant is launched only where clusters_supported()
  return local;
#endif
}

// One float4 column of a merged output row, from n parts: a CTA's normalised rows [part][HD] and
// their lse[part] (log2 domain), part = parts[i] (i where parts is null). The parts are weighted
// by exp2(lse - max) and summed one after another in list order, so that every path that merges
// the same parts gives the same bits. kGlobal: other SMs wrote the parts during this launch, so
// they are read from L2, past this SM's L1.
template <int HD, bool kGlobal>
__device__ __forceinline__ uint2 merge_column(const float* lse, const float* rows, const int* parts,
                                              int n, int column) {
  auto part = [&](int i) { return parts != nullptr ? parts[i] : i; };
  auto load = [](const float* p) {
    if constexpr (kGlobal) {
      return __ldcg(p);
    } else {
      return *p;
    }
  };
  auto load4 = [](const float* p) {
    if constexpr (kGlobal) {
      return __ldcg(reinterpret_cast<const float4*>(p));
    } else {
      return *reinterpret_cast<const float4*>(p);
    }
  };
  // Unrolled so that many parts' loads are in flight at once: from the workspace each is a round
  // trip to L2, and the merge is the last thing the step waits for.
  float max = -INFINITY;
#pragma unroll 16
  for (int i = 0; i < n; ++i) max = fmaxf(max, load(lse + part(i)));
  float sum = 0.f;
  float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int i = 0; i < n; ++i) {
    const int p = part(i);
    const float w = exp2f(load(lse + p) - max);
    const float4 v = load4(rows + p * HD + column * 4);
    sum += w;
    total.x += w * v.x, total.y += w * v.y, total.z += w * v.z, total.w += w * v.w;
  }
  const float inv = n > 0 ? 1.f / sum : 0.f;
  __nv_bfloat162 pairs[2] = {__floats2bfloat162_rn(total.x * inv, total.y * inv),
                             __floats2bfloat162_rn(total.z * inv, total.w * inv)};
  return *reinterpret_cast<uint2*>(pairs);
}

// The decode step's own token for one CTA (DecodeAttentionArgs::rope): the group's q heads of
// sequence seq at `position`, normalised and rotated, into s_q [group][HD]; with store_kv, also
// its key (normalised, rotated) and value into the cache at `slot` (-1: none). Lanes work in
// groups of HD / 8, one head each, as in the RoPE/KV-store kernel.
template <int HD>
__device__ __forceinline__ void rotate_own_token(const DecodeAttentionArgs& args, int seq,
                                                 int position, int slot, int kv_head, int group,
                                                 bool store_kv, bf16* s_q) {
  constexpr int kLanes = HD / kRopeVec;
  constexpr int kHeadsPerPass = kThreads / kLanes;
  const RopeKvArgs& r = args.rope;
  const int lane_in_head = threadIdx.x % kLanes;
  const unsigned group_mask = ((1u << kLanes) - 1u) << (threadIdx.x % 32 / kLanes * kLanes);
  const float* cos_sin_row = r.cos_sin + static_cast<int64_t>(position) * HD;
  const bf16* row = args.q + static_cast<int64_t>(seq) * args.q_stride + lane_in_head * kRopeVec;
  const int items = group + (store_kv ? 1 : 0);  // the q heads, then the k head
  for (int item = threadIdx.x / kLanes; item < items; item += kHeadsPerPass) {
    const bool is_q = item < group;
    const int head = is_q ? kv_head * group + item : args.num_q_heads + kv_head;
    Float8 x = load_bf16x8(row + head * HD);
    const bf16* weight = is_q ? r.q_norm_weight : r.k_norm_weight;
    if (weight != nullptr) {
      norm_rope<HD, true>(x, weight, cos_sin_row, lane_in_head, group_mask, r.eps);
    } else {
      norm_rope<HD, false>(x, nullptr, cos_sin_row, lane_in_head, group_mask, r.eps);
    }
    if (is_q) {
      store_bf16x8(s_q + item * HD + lane_in_head * kRopeVec, x);
      continue;
    }
    if (slot < 0) continue;
    const int64_t offset =
        (static_cast<int64_t>(slot) * r.num_kv_heads + kv_head) * HD + lane_in_head * kRopeVec;
    store_kv_slice(r, offset, x,
                   *reinterpret_cast<const uint4*>(row + (args.num_q_heads + r.num_kv_heads + kv_head) * HD));
  }
}

// Lane (g = lane / 4, t = lane % 4) of a warp, in mma fragment terms:
//   Q (A operand, rows = q heads g and g + 8 of the group): for head_dim chunk c it holds
//     q[head][c*32 + t*8 .. +8]; k-step 2c+s uses words 2s (cols 2t, 2t+1) and 2s+1
//     (cols 2t+8, 2t+9).
//   K (B operand of S = Q K^T, n = key): the same 8 dims of keys g and g + 8 of the tile.
//   S, P (C of Q K^T, then A of P V): keys 2t, 2t+1 (n-tile 0) and 8+2t, 9+2t (n-tile 1).
//   V (B operand of O = P V, k = key, n = dim): n-tile i = 8*hc + j has dim hc*64 + g*8 + j, so
//     the lane loads dims hc*64 + g*8 .. +8 of keys 2t, 2t+1, 2t+8, 2t+9 and pairs them by key.
//   O (C of P V): n-tile i, cols 2t and 2t+1 are dims hc*64 + t*16 + j and hc*64 + t*16 + 8 + j.
// kCluster (small grids): each chunk's CTAs are one thread block cluster. When a sequence fills
// one chunk, its splits with keys write their normalised rows and lse into the shared memory of
// rank 0 (split 0), which merges them once every rank has arrived. Dynamic shared memory (every
// CTA has it; rank 0's is used): rows [group][cluster][HD] then lse [group][cluster], fp32.
// kFp8: the caches hold e4m3 (KvDtype::kFp8E4m3); each lane loads 8-byte fragments, widens them
// to fp16 at use, and q and P go to the mma as fp16. k_scale folds into the softmax scale and
// v_scale into each CTA's normalised rows.
template <int HD, bool kEarlyKv, bool kRope, bool kCluster, bool kFp8>
__global__ void __launch_bounds__(kThreads, kEarlyKv ? kEarlyKvCtasPerSm : kLargeGridCtasPerSm)
    split_kernel(DecodeAttentionArgs args, KeyLayout layout) {
  static_assert(!kCluster || kEarlyKv, "clusters are for small grids");
  constexpr int kChunks = HD / 32;      // K fragments (8 values: 16 or 8 bytes) per key per lane
  constexpr int kHalves = HD / 64;      // V fragments per key per lane
  constexpr int kNTiles = HD / 8;       // n-tiles of O
  constexpr bool kWideStep = kFp8 && kEarlyKv;
  constexpr int kTilesPerStep = warp_step_tiles(HD, kWideStep);  // tiles loaded together
  constexpr int kStepKeys = kTilesPerStep * kTileKeys;
  constexpr int kRowPad = HD + 4;      // spreads the lanes' shared-memory stores over the banks

  __shared__ float s_out[kWarps][kMaxGroup][kRowPad];
  __shared__ float s_max[kWarps][kMaxGroup];
  __shared__ float s_sum[kWarps][kMaxGroup];

  // kEarlyKv: before the wait (PDL, launch.h), this CTA reads only what no kernel of the step
  // writes: the lengths and block tables (step metadata, in place before the kernels after the
  // embedding launch: launch.h) and the keys and
  // values cached by earlier steps. The newest key of a sequence (position len - 1) is the one
  // this step writes (the RoPE/KV-store kernel, or with kRope this CTA after the wait): it is
  // loaded after the wait. (The L2 prefetch reads nothing into the SM: see the file comment.)
  extern __shared__ __align__(16) float s_inbox[];
  // Phase 0 of the cluster barrier: no rank writes into rank 0's shared memory before rank 0 has
  // started.
  if constexpr (kCluster) cluster_arrive_relaxed();
  if constexpr (!kEarlyKv) {
    wait_for_producers();
    allow_dependents();
  }
  const PagedKv& kv = args.kv;
  // Large grids take the sequences longest first (after the wait: a kernel of the chain wrote the
  // order); CTA order is blockIdx order, so z is the slowest.
  constexpr int kStep = cta_step_keys(HD, kWideStep);
  constexpr int kColumns = HD / 4;
  const int split = blockIdx.x, kv_head = blockIdx.y;
  const int seq = !kEarlyKv && args.seq_order ? args.seq_order[blockIdx.z] : blockIdx.z;
  const int group = args.num_q_heads / kv.num_kv_heads;
  // (A length above max_context_len breaks the contract; the bound keeps its reads in the tables.)
  const int len = min(kv.context_lens[seq], args.max_context_len);
  const Chunking<kStep> cut(len, layout);
  const KeySpan span = key_span<kStep>(len, split, layout, cut);
  const int start = span.begin, end = span.end;
  // The splits of the row that hold keys, and (the same for every rank of a cluster) whether they
  // merge in rank 0's inbox.
  auto parts = [&] { return cut.splits_with_keys(layout.cluster); };
  auto in_cluster = [&] { return kCluster && cut.active == 1 && parts() > 1; };
  const size_t out_row = static_cast<size_t>(seq) * args.num_q_heads + kv_head * group;
  float* inbox_lse = s_inbox + group * layout.cluster * HD;
  // in_cluster: after this CTA's rows are in rank 0's inbox (or it has none), rank 0 merges.
  auto merge_in_rank0 = [&](int row_parts) {
    cluster_arrive_release();
    if (split != 0) return;
    cluster_wait();
    for (int item = threadIdx.x; item < group * kColumns; item += kThreads) {
      const int head = item / kColumns, column = item % kColumns;
      reinterpret_cast<uint2*>(args.out + (out_row + head) * HD)[column] =
          merge_column<HD, false>(inbox_lse + head * layout.cluster,
                                  s_inbox + head * layout.cluster * HD, nullptr, row_parts, column);
    }
  };

  if (start >= end) {
    if constexpr (kEarlyKv) {
      wait_for_producers();
      allow_dependents();
    }
    if (in_cluster()) {  // a rank without keys
      cluster_wait();
      merge_in_rank0(parts());
    } else if (len == 0 && split == 0) {  // the row is defined as zeros
      for (int i = threadIdx.x; i < group * HD / 8; i += kThreads) {
        reinterpret_cast<uint4*>(args.out + out_row * HD)[i] = make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t key_stride = static_cast<int64_t>(kv.num_kv_heads) * HD;
  const int32_t* block_table = kv.block_tables + static_cast<int64_t>(seq) * kv.block_table_stride;
  const int block_shift = __ffs(kv.block_size) - 1;
  const float scale_log2 = args.scale * (kFp8 ? kv.k_scale : 1.f) * kLog2e;
  const int newest = len - 1;

  // A tile never crosses a block: tiles start at multiples of 16 and block_size >= 16. The
  // block ids of the next step are fetched one step ahead, off the K/V loads' critical path.
  auto block_of = [&](int tile_start) {
    return tile_start < end ? block_table[tile_start >> block_shift] : 0;
  };
  const int warp_stride = span.stride;
  const int first_step = start + warp * kStepKeys;
  int32_t next_block[kTilesPerStep];
#pragma unroll
  for (int tile = 0; tile < kTilesPerStep; ++tile) {
    next_block[tile] = block_of(first_step + tile * kTileKeys);
  }

  using Fragment = KvFragment<kFp8>;
  Fragment k_frag[kTilesPerStep][2][kChunks];  // keys g, g + 8
  Fragment v_frag[kTilesPerStep][kHalves][4];  // keys 2t, 2t + 1, 2t + 8, 2t + 9
  using Element = std::conditional_t<kFp8, uint8_t, bf16>;
  auto tile_rows = [&](int tile_start, int64_t block, const Element*& k, const Element*& v) {
    const int64_t slot = block * kv.block_size + (tile_start & (kv.block_size - 1));
    k = static_cast<const Element*>(kv.k_cache) + slot * key_stride + kv_head * HD;
    v = static_cast<const Element*>(kv.v_cache) + slot * key_stride + kv_head * HD;
  };
  // The fragments of one step's keys (those below `below`; zeros for the rest, and for keys past
  // end: 0 * NaN is NaN), from the step's block ids in `blocks`, which then become the block ids
  // of the warp's next step. Small grids (kEarlyKv: 8 warps per SM) then request the next step's
  // K and V rows into L2, one 128-byte line (or a row shorter than one) per prefetch, so that
  // while this step is computed the warp has twice its fragments' bytes in flight without more
  // registers; so do large grids of an e4m3 cache with the fused RoPE (layout.prefetch; the
  // engine's large grids all fuse it), whose tile is half a bf16 tile's bytes. Large grids of a
  // bf16 cache, 12 warps per SM loading 8 KB each, go without it, and so does the e4m3 variant
  // without the RoPE, whose registers the prefetch's addresses would spill.
  auto load_step = [&](int step, int below, int32_t (&blocks)[kTilesPerStep]) {
#pragma unroll
    for (int tile = 0; tile < kTilesPerStep; ++tile) {
      const int tile_start = step + tile * kTileKeys;
      const int64_t block = blocks[tile];
      blocks[tile] = block_of(tile_start + warp_stride);
      const Element *k, *v;
      tile_rows(tile_start, block, k, v);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool valid = tile_start + g + 8 * h < below;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          k_frag[tile][h][c] =
              valid ? load_streaming<kFp8>(k + (g + 8 * h) * key_stride + c * 32 + t * 8) : Fragment{};
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = 2 * t + (j & 1) + 8 * (j >> 1);
        const bool valid = tile_start + key < below;
#pragma unroll
        for (int hc = 0; hc < kHalves; ++hc) {
          v_frag[tile][hc][j] =
              valid ? load_streaming<kFp8>(v + key * key_stride + hc * 64 + g * 8) : Fragment{};
        }
      }
    }
    if constexpr (!kEarlyKv) {
      if (!kFp8 || !kRope || !layout.prefetch) return;
    }
    constexpr int kLinesPerRow = HD * int(sizeof(Element)) > 128 ? HD * int(sizeof(Element)) / 128 : 1;
    constexpr int kLinesPerLane = 2 * kTileKeys * kLinesPerRow / 32;
#pragma unroll
    for (int tile = 0; tile < kTilesPerStep; ++tile) {
      const int tile_start = step + warp_stride + tile * kTileKeys;
      if (tile_start >= end) break;
      const Element *k, *v;
      tile_rows(tile_start, blocks[tile], k, v);
#pragma unroll
      for (int i = 0; i < kLinesPerLane; ++i) {
        const int line = lane + 32 * i;  // key, then K or V, then the line of the row
        const int key = line % kTileKeys, part = line / kTileKeys;
        prefetch_l2((part % 2 ? v : k) + key * key_stride + part / 2 * (128 / int(sizeof(Element))));
      }
    }
  };
  int32_t first_blocks[kTilesPerStep];  // the first step's block ids, kept for a reload
  // kRope: the token's position and cache slot are step metadata, in place before the chain, so
  // small grids read them before the wait.
  int position = 0, slot = -1;
  auto read_token_metadata = [&] {
    position = args.rope.positions[seq];
    slot = args.rope.slot_mapping[seq];
  };
  if constexpr (kRope && kEarlyKv) read_token_metadata();
  if constexpr (kEarlyKv) {
#pragma unroll
    for (int tile = 0; tile < kTilesPerStep; ++tile) first_blocks[tile] = next_block[tile];
    // The warp's first step, but for the newest key, is in flight during the wait.
    if (first_step < end) load_step(first_step, min(end, newest), next_block);
    wait_for_producers();
    allow_dependents();
  }

  // kRope: the step's own token is this CTA's to rotate (and, in the split that holds the
  // newest position, to store); the barrier orders the store before the warps' loads of it.
  __shared__ __align__(16) bf16 s_q[kRope ? kMaxGroup : 1][HD];
  if constexpr (kRope) {
    if constexpr (!kEarlyKv) read_token_metadata();
    const bool holds_newest = start <= newest && newest < end && (newest - start) % span.stride < kStep;
    rotate_own_token<HD>(args, seq, position, slot, kv_head, group, holds_newest, &s_q[0][0]);
    __syncthreads();
  }
  // If the newest key falls in the warp's first step, the step is loaded again, now whole, with
  // the same loader as every other step. It is requested before q, so that the two round trips
  // overlap (q's loads feed selects, which wait for them).
  if constexpr (kEarlyKv) {
    if (first_step <= newest && newest < min(end, first_step + kStepKeys)) {
      load_step(first_step, end, first_blocks);
    }
  }
  uint4 q_lo[kChunks], q_hi[kChunks];  // q heads g and g + 8
  const bf16* q = kRope ? &s_q[0][0]
                        : args.q + static_cast<size_t>(seq) * args.q_stride + kv_head * group * HD;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    q_lo[c] = g < group ? *reinterpret_cast<const uint4*>(q + g * HD + c * 32 + t * 8) : zero;
    q_hi[c] = g + 8 < group ? *reinterpret_cast<const uint4*>(q + (g + 8) * HD + c * 32 + t * 8)
                            : zero;
    if constexpr (kFp8) {
      q_lo[c] = bf16x8_to_f16x8(q_lo[c]);
      q_hi[c] = bf16x8_to_f16x8(q_hi[c]);
    }
  }

  float row_max[2] = {-INFINITY, -INFINITY};  // heads g and g + 8, log2 domain
  float row_sum[2] = {0.f, 0.f};              // this lane's share of the softmax denominator
  float acc[kNTiles][4];
#pragma unroll
  for (int i = 0; i < kNTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (int step = first_step; step < end; step += warp_stride) {
    if (!kEarlyKv || step != first_step) load_step(step, end, next_block);

#pragma unroll
    for (int tile = 0; tile < kTilesPerStep; ++tile) {
      const int tile_start = step + tile * kTileKeys;
      if (tile_start >= end) break;

      float s[2][4] = {};  // [key n-tile][head g: keys 2t, 2t+1; head g+8: keys 2t, 2t+1]
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const uint4 k_ops = mma_operands(k_frag[tile][n][c]);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t a[4] = {word(q_lo[c], 2 * half), word(q_hi[c], 2 * half),
                                   word(q_lo[c], 2 * half + 1), word(q_hi[c], 2 * half + 1)};
            mma_16816<kFp8>(s[n], a, word(k_ops, 2 * half), word(k_ops, 2 * half + 1));
          }
        }
      }

      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool valid = tile_start + 8 * n + 2 * t + (e & 1) < end;
          s[n][e] = valid ? s[n][e] * scale_log2 : -INFINITY;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
        }
      }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        // Finite: the first tile a warp sees holds at least one valid key.
        const float new_max = fmaxf(row_max[r], tile_max[r]);
        alpha[r] = exp2f(row_max[r] - new_max);
        row_max[r] = new_max;
        row_sum[r] *= alpha[r];
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = exp2f(s[n][e] - row_max[e >> 1]);
          row_sum[e >> 1] += s[n][e];
        }
      }
#pragma unroll
      for (int i = 0; i < kNTiles; ++i) {
        acc[i][0] *= alpha[0];
        acc[i][1] *= alpha[0];
        acc[i][2] *= alpha[1];
        acc[i][3] *= alpha[1];
      }

      const uint32_t p[4] = {pack_x2<kFp8>(s[0][0], s[0][1]), pack_x2<kFp8>(s[0][2], s[0][3]),
                             pack_x2<kFp8>(s[1][0], s[1][1]), pack_x2<kFp8>(s[1][2], s[1][3])};
#pragma unroll
      for (int hc = 0; hc < kHalves; ++hc) {
        Fragment v[4];  // keys 2t, 2t + 1, 2t + 8, 2t + 9
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = v_frag[tile][hc][j];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t b0 = key_pair_operand(v[0], v[1], j);
          const uint32_t b1 = key_pair_operand(v[2], v[3], j);
          mma_16816<kFp8>(acc[hc * 8 + j], p, b0, b1);
        }
      }
    }
  }

  // Merge the warps: each publishes its running max, sum and unnormalised output rows.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
  if (t == 0) {
    s_max[warp][g] = row_max[0];
    s_max[warp][g + 8] = row_max[1];
    s_sum[warp][g] = row_sum[0];
    s_sum[warp][g + 8] = row_sum[1];
  }
#pragma unroll
  for (int i = 0; i < kNTiles; ++i) {
    const int dim = (i / 8) * 64 + t * 16 + i % 8;
    s_out[warp][g][dim] = acc[i][0];
    s_out[warp][g][dim + 8] = acc[i][1];
    s_out[warp][g + 8][dim] = acc[i][2];
    s_out[warp][g + 8][dim + 8] = acc[i][3];
  }
  __syncthreads();

  const int splits = gridDim.x;
  const int row_parts = parts();
  const bool merge_in_cluster = in_cluster();
  const size_t rows = static_cast<size_t>(args.num_seqs) * args.num_q_heads;
  float* partial_out = args.workspace;
  float* partial_lse = args.workspace + rows * splits * HD;
  unsigned* arrivals = args.arrivals + static_cast<size_t>(seq) * kv.num_kv_heads + kv_head;
  float *rank0_rows = nullptr, *rank0_lse = nullptr;
  if (merge_in_cluster) {
    cluster_wait();  // phase 0: every rank has started
    rank0_rows = in_rank0(s_inbox);
    rank0_lse = in_rank0(inbox_lse);
  }
  // Two dims per thread, spread over the CTA's warps: the step waits for this merge, so each thread's
  // chain is kept short.
  for (int item = threadIdx.x; item < group * HD / 2; item += kThreads) {
    const int head = item / (HD / 2), dim = item % (HD / 2) * 2;
    float max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) max = fmaxf(max, s_max[w][head]);  // warp 0 saw a valid key
    float weight[kWarps], sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      weight[w] = exp2f(s_max[w][head] - max);  // 0 for a warp that saw no keys
      sum += weight[w] * s_sum[w][head];
    }
    float o[2];
#pragma unroll
    for (int d = 0; d < 2; ++d) {
      float x = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) x += weight[w] * s_out[w][head][dim + d];
      o[d] = x / sum;
      if constexpr (kFp8) o[d] *= kv.v_scale;
    }
    const size_t row = out_row + head;
    if (row_parts == 1) {
      *reinterpret_cast<__nv_bfloat162*>(args.out + row * HD + dim) =
          __floats2bfloat162_rn(o[0], o[1]);
    } else if (merge_in_cluster) {
      *reinterpret_cast<float2*>(rank0_rows + (head * layout.cluster + split) * HD + dim) =
          make_float2(o[0], o[1]);
      if (dim == 0) rank0_lse[head * layout.cluster + split] = max + log2f(sum);
    } else {
      *reinterpret_cast<float2*>(partial_out + (row * splits + split) * HD + dim) =
          make_float2(o[0], o[1]);
      if (dim == 0) partial_lse[row * splits + split] = max + log2f(sum);
    }
  }
  if (row_parts == 1) return;
  if (merge_in_cluster) {
    merge_in_rank0(row_parts);
    return;
  }

  // Through the workspace: the last of the row's parts to arrive merges them.
  __shared__ int s_parts[kMaxSplits];
  __shared__ bool s_last;
  __syncthreads();  // every thread's rows are stored
  if (threadIdx.x == 0) {
    // Release: the count follows the stores of the whole CTA (ordered before it by the barrier);
    // acquire: the CTA that counts last then reads every part counted before it.
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(before) : "l"(arrivals) : "memory");
    s_last = before + 1 == static_cast<unsigned>(row_parts);
    if (s_last) {
      *arrivals = 0;  // no other CTA of this launch counts here again
      int n = 0;
      for (int c = 0; c < cut.active; ++c) {
        for (int r = 0; r < min(layout.cluster, cut.steps_of(c)); ++r) s_parts[n++] = c * layout.cluster + r;
      }
    }
  }
  __syncthreads();
  if (!s_last) return;
  for (int item = threadIdx.x; item < group * kColumns; item += kThreads) {
    const int head = item / kColumns, column = item % kColumns;
    const size_t row = out_row + head;
    reinterpret_cast<uint2*>(args.out + row * HD)[column] = merge_column<HD, true>(
        partial_lse + row * splits, partial_out + row * splits * HD, s_parts, row_parts, column);
  }
}

constexpr int kOrderThreads = 256;

// Rank of each sequence by length, longest first, ties in index order: every thread counts the
// sequences ahead of its own in shared memory (num_seqs <= a few thousand: one pass per CTA).
__global__ void __launch_bounds__(kOrderThreads) order_by_length_kernel(
    const int32_t* __restrict__ context_lens, int num_seqs, int32_t* __restrict__ seq_order) {
  extern __shared__ int32_t lens[];
  wait_for_producers();
  allow_dependents();
  for (int i = threadIdx.x; i < num_seqs; i += kOrderThreads) lens[i] = context_lens[i];
  __syncthreads();
  const int i = blockIdx.x * kOrderThreads + threadIdx.x;
  if (i >= num_seqs) return;
  const int len = lens[i];
  int rank = 0;
  for (int j = 0; j < num_seqs; ++j) {
    rank += lens[j] > len || (lens[j] == len && j < i);
  }
  seq_order[rank] = i;
}

}  // namespace

void order_by_length(const int32_t* context_lens, int num_seqs, int32_t* seq_order,
                     cudaStream_t stream) {
  require(num_seqs >= 0 && num_seqs <= kOrderMaxSeqs,
          "order_by_length takes up to " + std::to_string(kOrderMaxSeqs) + " sequences, got " +
              std::to_string(num_seqs));
  if (num_seqs == 0) return;
  launch_pdl(order_by_length_kernel, dim3(ceil_div(num_seqs, kOrderThreads)),
             dim3(kOrderThreads), num_seqs * sizeof(int32_t), stream, context_lens, num_seqs,
             seq_order);
}

DecodeAttentionPlan plan_decode_attention(int num_seqs, int num_q_heads, int num_kv_heads,
                                          int head_dim, int max_context_len,
                                          const DeviceProps& device, KvDtype kv_dtype) {
  require(num_seqs >= 0 && num_kv_heads > 0 && num_q_heads > 0 && max_context_len >= 0,
          "plan_decode_attention: sizes must be positive (num_seqs and max_context_len at least 0)");
  DecodeAttentionPlan plan;
  plan.num_seqs = num_seqs;
  plan.num_q_heads = num_q_heads;
  plan.num_kv_heads = num_kv_heads;
  plan.head_dim = head_dim;
  plan.max_context_len = max_context_len;
  plan.kv_dtype = kv_dtype;
  require(head_dim == 64 || head_dim == 128,
          "unsupported head_dim " + std::to_string(head_dim) + "; supported: 64, 128");
  const int keys = std::max(max_context_len, 1);
  const bool fp8 = kv_dtype == KvDtype::kFp8E4m3;
  const int small_grid_steps = ceil_div(keys, cta_step_keys(head_dim, fp8));
  const int64_t rows = std::max<int64_t>(static_cast<int64_t>(num_seqs) * num_kv_heads, 1);
  const int64_t resident = static_cast<int64_t>(kEarlyKvCtasPerSm) * device.sm_count;
  const int cluster = std::min(kMaxClusterSplits, small_grid_steps);
  if (rows * cluster <= resident) {
    // Small grid: clusters of CTAs interleaving a chunk's steps, as many chunks as fit in one
    // resident wave (a long sequence then spreads over every SM).
    plan.cluster = cluster;
    plan.chunks = static_cast<int>(std::clamp<int64_t>(
        resident / (rows * cluster), 1,
        std::min(kMaxChunks, ceil_div(keys, kSmallGridChunkKeys))));
    plan.chunk_min_keys = kSmallGridChunkKeys;
    plan.early_kv = true;
    // Thread block clusters only if every cluster of the grid is resident at once: a cluster's
    // CTAs share a GPC, and a cluster left for a second wave would double the kernel's time. A grid
    // with more clusters than the device holds drops chunks to fit if it keeps kClusterGridShare of
    // its CTAs; otherwise it launches without clusters and its rows merge through the workspace
    // (the same bits).
    if (cluster > 1 && device.clusters) {
      const int64_t fit = std::min<int64_t>(plan.chunks, device.resident_clusters[cluster] / rows);
      if (fit * kClusterGridShare.den >= plan.chunks * kClusterGridShare.num) {
        plan.chunks = static_cast<int>(fit);
        plan.cluster_merge = true;
      }
    }
  } else {
    // Large grid: one CTA per chunk, chunks as long as the bound's share of the wanted CTAs.
    const int step = cta_step_keys(head_dim, false);
    const int steps = ceil_div(keys, step);
    const int64_t wanted = std::max<int64_t>(kTargetCtasPerSm * device.sm_count / rows, 1);
    plan.chunks = static_cast<int>(std::min<int64_t>({wanted, steps, kMaxSplits}));
    plan.cluster = 1;
    plan.chunk_min_keys = ceil_div(steps, plan.chunks) * step;
    plan.reads_order = true;
    plan.fuse_rope = true;
    plan.prefetch_next_step = fp8;
  }
  if (plan.splits() > 1) {
    const size_t parts = static_cast<size_t>(num_seqs) * num_q_heads * plan.splits();
    plan.workspace_bytes = parts * (head_dim + 1) * sizeof(float);
    plan.arrival_counters = static_cast<size_t>(num_seqs) * num_kv_heads;
  }
  return plan;
}

size_t arrival_bytes(const DecodeAttentionPlan& plan) {
  return (plan.arrival_counters * sizeof(unsigned) + 15) / 16 * 16;
}

size_t decode_attention_workspace_bytes(int num_seqs, int num_q_heads, int head_dim,
                                        int max_context_len) {
  size_t bytes = 0;
  for (int kv_heads = 1; kv_heads <= num_q_heads; ++kv_heads) {
    if (num_q_heads % kv_heads != 0) continue;
    for (KvDtype kv_dtype : {KvDtype::kBf16, KvDtype::kFp8E4m3}) {
      const DecodeAttentionPlan plan = plan_decode_attention(
          num_seqs, num_q_heads, kv_heads, head_dim, max_context_len, device_props(), kv_dtype);
      bytes = std::max(bytes, arrival_bytes(plan) + plan.workspace_bytes);
    }
  }
  return bytes;
}

void paged_decode_attention(const DecodeAttentionArgs& args, const DecodeAttentionPlan& plan,
                            cudaStream_t stream) {
  const PagedKv& kv = args.kv;
  require(kv.num_kv_heads > 0 && args.num_q_heads % kv.num_kv_heads == 0,
          "num_q_heads (" + std::to_string(args.num_q_heads) +
              ") must be a multiple of num_kv_heads (" + std::to_string(kv.num_kv_heads) + ")");
  const int group = args.num_q_heads / kv.num_kv_heads;
  require(group <= kMaxGroup, "decode attention supports up to " + std::to_string(kMaxGroup) +
                                  " q heads per kv head, got " + std::to_string(group));
  require(kv.block_size >= kTileKeys && (kv.block_size & (kv.block_size - 1)) == 0,
          "decode attention needs a power-of-two block_size >= 16, got " +
              std::to_string(kv.block_size));
  require(args.q_stride % 8 == 0 && args.q_stride >= args.num_q_heads * kv.head_dim,
          "q_stride must be a multiple of 8 and at least num_q_heads * head_dim (16-byte rows), "
          "got " + std::to_string(args.q_stride));
  require(args.max_context_len >= 0 &&
              static_cast<int64_t>(kv.block_table_stride) * kv.block_size >= args.max_context_len,
          "block tables of width " + std::to_string(kv.block_table_stride) +
              " cannot hold max_context_len " + std::to_string(args.max_context_len) +
              "; widen them to ceil(max_context_len / block_size)");
  for (const void* p : {static_cast<const void*>(args.q), static_cast<const void*>(kv.k_cache),
                        static_cast<const void*>(kv.v_cache), static_cast<const void*>(args.out),
                        static_cast<const void*>(args.workspace)}) {
    require(reinterpret_cast<uintptr_t>(p) % 16 == 0,
            "decode attention needs 16-byte aligned q, k_cache, v_cache, out and workspace");
  }
  const RopeKvArgs& r = args.rope;
  if (r.qkv != nullptr) {
    require(r.qkv == args.q && r.num_tokens == args.num_seqs &&
                r.num_q_heads == args.num_q_heads && r.num_kv_heads == kv.num_kv_heads &&
                r.head_dim == kv.head_dim &&
                args.q_stride == (args.num_q_heads + 2 * kv.num_kv_heads) * kv.head_dim,
            "decode attention's rope must describe its q: rope.qkv == q, one token per sequence, "
            "the same heads and head_dim, rows of (num_q_heads + 2 * num_kv_heads) * head_dim");
    require(r.k_cache == kv.k_cache && r.v_cache == kv.v_cache && r.kv_dtype == kv.dtype &&
                r.k_scale == kv.k_scale && r.v_scale == kv.v_scale,
            "decode attention's rope must store into the caches it reads (k_cache, v_cache, their "
            "dtype and scales)");
    require(r.cos_sin != nullptr && r.positions != nullptr && r.slot_mapping != nullptr,
            "decode attention's rope needs cos_sin, positions and slot_mapping");
    require((r.q_norm_weight == nullptr) == (r.k_norm_weight == nullptr),
            "decode attention's rope: give both q_norm_weight and k_norm_weight, or neither");
    for (const void* p : {static_cast<const void*>(r.cos_sin),
                          static_cast<const void*>(r.q_norm_weight),
                          static_cast<const void*>(r.k_norm_weight)}) {
      require(reinterpret_cast<uintptr_t>(p) % 16 == 0,
              "decode attention's rope reads cos_sin and the norm weights 16 bytes at a time: "
              "they must start on a 16-byte boundary (pass fresh tensors, or .clone() the views)");
    }
  }
  require(plan.num_q_heads == args.num_q_heads && plan.num_kv_heads == kv.num_kv_heads &&
              plan.head_dim == kv.head_dim && plan.max_context_len == args.max_context_len &&
              args.num_seqs <= plan.num_seqs && plan.kv_dtype == kv.dtype,
          "decode attention: the plan was made for other sizes (" + std::to_string(plan.num_seqs) +
              " sequences, " + std::to_string(plan.num_q_heads) + "/" +
              std::to_string(plan.num_kv_heads) + " heads, head_dim " +
              std::to_string(plan.head_dim) + ", max_context_len " +
              std::to_string(plan.max_context_len) + ") than the launch (" +
              std::to_string(args.num_seqs) + " sequences, " + std::to_string(args.num_q_heads) +
              "/" + std::to_string(kv.num_kv_heads) + ", head_dim " + std::to_string(kv.head_dim) +
              ", max_context_len " + std::to_string(args.max_context_len) +
              "), or for the other KV cache dtype");
  require_kv_scales("decode attention", kv.dtype, kv.k_scale, kv.v_scale);
  require(plan.workspace_bytes == 0 || (args.workspace != nullptr && args.arrivals != nullptr),
          "decode attention needs the plan's workspace and zero-filled arrival counters");
  if (args.num_seqs == 0) return;
  require(args.num_seqs <= 65535 && kv.num_kv_heads <= 65535,
          "decode attention supports up to 65535 sequences and kv heads per launch");
  require(!plan.cluster_merge || clusters_supported(),
          "decode attention: the plan merges in thread block clusters, which this GPU lacks");

  const KeyLayout layout{plan.chunks, plan.cluster, plan.chunk_min_keys,
                         plan.prefetch_next_step ? 1 : 0};
  DISPATCH_HEAD_DIM(kv.head_dim, HD, [&] {
    const dim3 grid(plan.splits(), kv.num_kv_heads, args.num_seqs);
    const bool rope = args.rope.qkv != nullptr;
    const bool cluster = plan.cluster_merge;
    auto pick = [&](auto fp8) {
      constexpr bool kFp8 = decltype(fp8)::value;
      return cluster ? (rope ? split_kernel<HD, true, true, true, kFp8>
                             : split_kernel<HD, true, false, true, kFp8>)
             : plan.early_kv ? (rope ? split_kernel<HD, true, true, false, kFp8>
                                     : split_kernel<HD, true, false, false, kFp8>)
                             : (rope ? split_kernel<HD, false, true, false, kFp8>
                                     : split_kernel<HD, false, false, false, kFp8>);
    };
    auto kernel = kv.dtype == KvDtype::kFp8E4m3 ? pick(std::true_type{}) : pick(std::false_type{});
    size_t inbox_bytes = 0;
    if (cluster) {
      inbox_bytes = static_cast<size_t>(group) * plan.cluster * (HD + 1) * sizeof(float);
      cudaFuncAttributes attributes{};
      CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
      if (attributes.sharedSizeBytes + inbox_bytes > kDefaultSmemBytes) {
        // The largest inbox any launch of the kernel takes, so that the limit never drops below
        // what an earlier launch (or a captured graph) needs.
        constexpr size_t kMaxInboxBytes =
            static_cast<size_t>(kMaxGroup) * kMaxClusterSplits * (HD + 1) * sizeof(float);
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kMaxInboxBytes)));
      }
    }
    launch_pdl_cluster(kernel, grid, dim3(kThreads), inbox_bytes, stream,
                       cluster ? plan.cluster : 1, args, layout);
  });
}

}  // namespace nanograph
