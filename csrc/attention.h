// Paged attention over the KV cache: decode (one query token per sequence, split-KV)
// and prefill (causal, variable length, tensor cores).
#pragma once
#include "common.h"
#include "rope.h"

namespace nanograph {

struct PagedKv {
  // k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  const bf16* k_cache;
  const bf16* v_cache;
  const int32_t* block_tables;  // [num_seqs, block_table_stride]
  int block_table_stride;
  const int32_t* context_lens;  // [num_seqs]: tokens in the cache for each sequence, new ones included
  int block_size;
  int num_kv_heads;
  int head_dim;
};

struct DecodeAttentionArgs {
  const bf16* q;  // [num_seqs, q_stride]; head h at q + s * q_stride + h * head_dim
  int q_stride;
  PagedKv kv;
  bf16* out;  // [num_seqs, num_q_heads * head_dim]
  int num_seqs;
  int num_q_heads;
  // Upper bound on context_lens: sizes the grid. A graph captured with a bound replays for any
  // lengths up to it, because the kernels read the actual lengths from device memory.
  int max_context_len;
  float scale;
  float* workspace;  // decode_attention_workspace_bytes(...) bytes
  // Optional [num_seqs]: a permutation of the sequences, longest first (order_by_length), in which
  // large grids take them up, so that the last CTAs to start are short ones rather than a long
  // sequence that leaves the GPU part-idle while it finishes. Written by a kernel of the chain
  // before this one; small grids (batch 1 to 4 of Qwen3) do not read it.
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
  // The batch size the splits are planned for (0: num_seqs; otherwise at least num_seqs): a decode
  // graph's bucket, so that a step run eagerly with fewer sequences divides every sequence's keys
  // as the graph would, and gives the same bits.
  int plan_num_seqs = 0;
  // Small grids (batch 1 to 4 of Qwen3 at a max_context_len of up to 8192) of 2 to 8 splits
  // per sequence merge them inside a thread block cluster on sm_90 (no combine kernel); false
  // keeps the combine kernel. Both give the same bits.
  bool cluster_merge = true;
};

size_t decode_attention_workspace_bytes(int num_seqs, int num_q_heads, int head_dim,
                                        int max_context_len);

// A row with context length 0 writes zeros.
// Ordering (PDL, launch.h): on small grids the kernel reads the lengths, the block tables and
// each sequence's cached keys and values before it waits for the previous kernel on the stream,
// all but the newest key and value (position len - 1). So a kernel that runs right before it in
// the same chain may write that newest position and nothing else of the cache, as the
// RoPE/KV-store kernel does; lengths and block tables must be in place before this kernel can
// launch (see DecodeAttentionArgs::rope). With args.rope the kernel stores the newest position
// itself.
void paged_decode_attention(const DecodeAttentionArgs& args, cudaStream_t stream);

// Whether paged_decode_attention reads DecodeAttentionArgs::seq_order for these sizes (its large
// grids); where it does not, the order need not be made.
bool decode_attention_reads_order(int num_seqs, int num_kv_heads, int max_context_len);

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
