// Paged attention over the KV cache: decode (one query token per sequence, split-KV)
// and prefill (causal, variable length, tensor cores).
#pragma once
#include "common.h"
#include "launch.h"
#include "rope.h"

namespace nanograph {

struct PagedKv {
  // k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] of dtype
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;  // [num_seqs, block_table_stride]
  int block_table_stride;
  const int32_t* context_lens;  // [num_seqs]: tokens in the cache for each sequence, new ones included
  int block_size;
  int num_kv_heads;
  int head_dim;
  KvDtype dtype = KvDtype::kBf16;
  float k_scale = 1.f;  // kFp8E4m3: a stored key reads as float(e4m3) * k_scale
  float v_scale = 1.f;
};

struct DecodeAttentionArgs {
  const bf16* q;  // [num_seqs, q_stride]; head h at q + s * q_stride + h * head_dim
  int q_stride;
  PagedKv kv;
  bf16* out;  // [num_seqs, num_q_heads * head_dim]
  int num_seqs;
  int num_q_heads;
  // Upper bound on context_lens, the plan's. A graph captured with a bound replays for any
  // lengths up to it, because the kernel reads the actual lengths from device memory.
  int max_context_len;
  float scale;
  float* workspace;  // the plan's workspace_bytes
  // The plan's arrival_counters, zero-filled before their first use; every launch leaves them at
  // zero. Plans of any batch size may share them (and the workspace), one launch at a time.
  unsigned* arrivals;
  // Optional [num_seqs]: a permutation of the sequences, longest first (order_by_length), in which
  // large grids (DecodeAttentionPlan::reads_order) take them up, so that the last CTAs to start
  // are short ones rather than a long sequence that leaves the GPU part-idle while it finishes.
  // Written by a kernel of the chain before this one; small grids do not read it.
  const int32_t* seq_order = nullptr;
  // Optional, for a decode step (rope.qkv set): q is the step's raw qkv rows (rope.qkv == q,
  // one token per sequence), and the kernel does what qk_norm_rope_kv_store(rope) would do before
  // it, so the step needs no separate RoPE/KV-store kernel: it normalises and rotates the q heads
  // (in shared memory; qkv is left unrotated) and stores each sequence's newest key and value
  // into the cache at slot_mapping[s] (-1: no store; sequences of length 0 store nothing).
  // rope's caches must be kv's; positions and slot_mapping, like the lengths, must be in place
  // before this kernel can launch (small grids read them before the PDL wait): written before
  // the chain, or by a kernel that completes before any later one launches (launch.h).
  RopeKvArgs rope{};
};

// How paged_decode_attention divides each (sequence, kv head)'s keys over CTAs, made once per
// decode graph bucket by plan_decode_attention. It depends on the batch size it is planned for,
// the heads, head_dim, the bound on the lengths and the device, never on the lengths themselves:
// those are read on the device, and a sequence uses as many of the plan's CTAs as its length
// fills. A launch with fewer sequences than planned divides every sequence's keys as the planned
// batch would, and gives the same bits.
struct DecodeAttentionPlan {
  int num_seqs = 0;  // the batch size planned for; launches take up to this many sequences
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_context_len = 0;
  KvDtype kv_dtype = KvDtype::kBf16;  // on small grids an e4m3 cache's warps take two tiles a step
  // A sequence's keys fall into up to `chunks` contiguous ranges of whole CTA steps (one chunk
  // per chunk_min_keys keys of its length), and each chunk's steps go round its `cluster` CTAs in
  // turn. The grid is chunks * cluster CTAs per (sequence, kv head).
  int chunks = 1;
  int cluster = 1;
  int chunk_min_keys = 0;
  // Small grids (every CTA resident at once, 2 per SM): each warp's first keys are loaded before
  // the PDL wait, and a sequence whose keys fill one chunk merges its CTAs' rows inside a thread
  // block cluster (sm_90, cluster_merge), with no round trip through the workspace, where the
  // device keeps all of the grid's clusters resident at once (DeviceProps::resident_clusters;
  // the plan drops chunks for that if it keeps kClusterGridShare of them, or else launches
  // without clusters).
  bool early_kv = false;
  bool cluster_merge = false;
  // Large grids: the sequences are taken longest first (seq_order), and the step's RoPE/KV store
  // is done inside attention (DecodeAttentionArgs::rope), one kernel fewer per layer; small grids
  // measured faster with the separate RoPE/KV-store kernel.
  bool reads_order = false;
  bool fuse_rope = false;
  // Large grids of an e4m3 cache: each warp requests its next step's K and V into L2 while it
  // computes this one (a large grid's e4m3 step is half the bytes in flight of a bf16 one, and a
  // wider step would spill), in launches with the fused RoPE (DecodeAttentionArgs::rope), as the
  // engine's; without it the flag is ignored. Small grids always do.
  bool prefetch_next_step = false;
  size_t workspace_bytes = 0;
  size_t arrival_counters = 0;

  int splits() const { return chunks * cluster; }
};

DecodeAttentionPlan plan_decode_attention(int num_seqs, int num_q_heads, int num_kv_heads,
                                          int head_dim, int max_context_len,
                                          const DeviceProps& device,
                                          KvDtype kv_dtype = KvDtype::kBf16);

// The plan's arrival counters in bytes, rounded up to 16.
size_t arrival_bytes(const DecodeAttentionPlan& plan);

// The most bytes any plan for these sizes takes for its arrival counters (first, 16-byte aligned)
// and workspace together, over every number of kv heads that divides num_q_heads, on the current
// device: one buffer for both, as the Python binding takes them. Such a buffer serves launches
// of one plan (its counters' size depends on the plan).
size_t decode_attention_workspace_bytes(int num_seqs, int num_q_heads, int head_dim,
                                        int max_context_len);

// A row with context length 0 writes zeros.
// Ordering (PDL, launch.h): on small grids the kernel reads the lengths, the block tables and
// each sequence's cached keys and values before it waits for the previous kernel on the stream,
// all but the newest key and value (position len - 1). So a kernel that runs right before it in
// the same chain may write that newest position and nothing else of these sequences' cache, as
// the RoPE/KV-store kernel does. (In a mixed step that kernel also stores the other rows' keys and
// values, in slots no decode row reads: a block shared through the prefix cache is full, and a
// step's blocks are offered to it only once the step is queued.) Lengths and block tables must be
// in place before this kernel can launch (see DecodeAttentionArgs::rope). With args.rope the
// kernel stores the newest position itself.
void paged_decode_attention(const DecodeAttentionArgs& args, const DecodeAttentionPlan& plan,
                            cudaStream_t stream);

// seq_order[r] = the sequence of rank r when sorted by context_lens, longest first, ties in index
// order (a stable sort); [num_seqs] each, num_seqs <= kOrderMaxSeqs. Launched with PDL; for
// DecodeAttentionArgs::seq_order, once per step (the lengths are the same in every layer).
constexpr int kOrderMaxSeqs = 8192;
void order_by_length(const int32_t* context_lens, int num_seqs, int32_t* seq_order,
                     cudaStream_t stream);

struct PrefillAttentionArgs {
  const bf16* q;  // [total_q, q_stride]; head h of token t at q + t * q_stride + h * head_dim
  int q_stride;
  PagedKv kv;
  // cu_seqlens_q: [num_seqs + 1] prefix sums of query tokens per sequence. Query token i of
  // sequence s sits at position context_lens[s] - q_len(s) + i: tokens before it (a cached
  // prefix or earlier chunks) are read from the cache, never recomputed.
  const int32_t* cu_seqlens_q;
  bf16* out;  // [total_q, num_q_heads * head_dim]
  int num_seqs;
  int total_q;
  int max_q_len;  // upper bound on q_len(s); sizes the grid
  int num_q_heads;
  float scale;
};

void paged_prefill_attention(const PrefillAttentionArgs& args, cudaStream_t stream);

}  // namespace nanograph
