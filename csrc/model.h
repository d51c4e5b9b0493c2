// The decoder forward (Qwen3, Llama family, Qwen2) over the paged KV cache, for one step's batch
// described by device buffers. The model owns the KV cache, the activations, the step metadata
// (pinned host copy + device copy) and the decode graphs.
#pragma once
#include "attention.h"
#include "common.h"
#include "gemm.h"
#include "graph.h"

#include <memory>
#include <vector>

namespace nanograph {

struct ModelConfig {
  int vocab_size;
  int hidden_size;
  int num_layers;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int intermediate_size;
  float rms_norm_eps;
  int max_position;  // rows of the cos/sin table
  KvDtype kv_dtype = KvDtype::kBf16;  // the KV cache's element type
};

// Device pointers; the caller keeps the memory alive. Optional ones may be nullptr. The four
// projections are bf16 or FP8 (fp8.h), each on its own.
struct LayerWeights {
  const bf16* input_norm;  // [H]
  LinearWeight qkv;        // [(nq + 2 nkv) hd, H]
  const bf16* qkv_bias;    // [(nq + 2 nkv) hd] or nullptr (Qwen2 has one)
  const bf16* q_norm;      // [hd] or nullptr (Qwen3 has QK-norm)
  const bf16* k_norm;      // [hd] or nullptr
  LinearWeight o_proj;     // [H, nq hd]
  const bf16* post_norm;   // [H]
  LinearWeight gate_up;    // [2 I, H], gate rows first
  LinearWeight down;       // [H, I]
  // An FP8 KV cache's scales for this layer (KvDtype); 1.0 where the checkpoint gives none.
  float k_scale = 1.f;
  float v_scale = 1.f;
};

struct ModelWeights {
  const bf16* embed;       // [V, H]
  const bf16* final_norm;  // [H]
  const bf16* lm_head;     // [V, H]; equal to embed when tied
  const float* cos_sin;    // [max_position, hd]
  std::vector<LayerWeights> layers;
};

struct EngineLimits {
  int max_num_tokens;  // new tokens in one step (max_num_batched_tokens)
  int max_num_seqs;
  int max_model_len;
  int block_size;
};

// Where each field of the step metadata sits in the int32 metadata buffer for a step of
// `num_tokens` new tokens over `num_seqs` sequences; the fields are packed back to back so one
// copy (an eager step) or one staging kernel (a decode graph's first) moves exactly the bytes the
// step uses.
// input_src[t] >= 0 says that token t is not in input_ids yet: it is sampled_tokens()[input_src[t]],
// which the previous step wrote on the device (the sampler, or the step's own greedy argmax), so
// the host can queue a step before it has read the tokens of the one before. -1: input_ids[t]
// holds the token.
struct StepLayout {
  int input_ids, input_src, positions, slot_mapping, cu_seqlens_q, context_lens, block_tables,
      total;
  StepLayout(int num_tokens, int num_seqs, int block_table_width);
};

// The one writer of inert rows: tokens [first_token, num_tokens) and sequences
// [first_seq, num_seqs) of `meta` (laid out by `layout`, made for num_tokens and num_seqs) store
// nothing (slot -1), read no pending token (input_src -1), feed token 0 at position 0, and have one
// query token and no context each. Their block-table rows are left as they are (never read).
void write_inert_rows(int32_t* meta, const StepLayout& layout, int first_token, int first_seq,
                      int num_tokens, int num_seqs);

class Model {
 public:
  Model(const ModelConfig& config, ModelWeights weights, const EngineLimits& limits);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const EngineLimits& limits() const { return limits_; }
  int block_table_width() const { return block_table_width_; }
  cudaStream_t stream() const { return stream_; }
  size_t kv_bytes_per_block() const;
  int num_kv_blocks() const { return num_kv_blocks_; }
  // Frees any previous cache; the cache is [layers][k|v][blocks][block_size][nkv][hd] of
  // config().kv_dtype.
  void allocate_kv_cache(int num_blocks);

  // Pinned; StepLayout gives the fields. Waits until the previous step has read it.
  int32_t* host_metadata();
  // The rows the metadata of a step of (num_tokens, num_seqs) is laid out for: its graph bucket
  // when the step will replay a decode graph, else num_seqs (and num_tokens tokens).
  int step_rows(int num_tokens, int num_seqs, bool use_graph) const;
  // One step: moves the step's metadata to the device, then runs the forward (the decode graph
  // when captured and all sequences have one new token). Logits of each sequence's last new
  // token land in logits()[0 : num_seqs]. Asynchronous on stream().
  // A decode graph's first kernel reads the metadata from the pinned buffer itself (no copy on
  // the copy engine between graphs); eager steps copy it.
  // The caller writes the metadata of its num_tokens and num_seqs, laid out for step_rows(); a
  // graph step makes the bucket's other rows inert itself (write_inert_rows).
  // greedy: the step also takes each sequence's argmax (inside the graph, for a graph step) into
  // sampled_tokens() and into a pinned host slot; returns that slot (read it with
  // greedy_tokens), else -1.
  int step(int num_tokens, int num_seqs, int max_q_len, bool use_graph, bool greedy = false);
  // The ids a greedy step wrote into `slot` ([num_seqs] int32, the step's sequences first),
  // once the step has run (waits for it). Valid until the second greedy step after it is queued:
  // the slots alternate.
  const int32_t* greedy_tokens(int slot);
  const bf16* logits() const { return logits_; }  // [max_num_seqs, vocab]
  // The last step's tokens, until the next step: the last layer's output (hidden) and the residual
  // stream, [max_num_tokens, hidden_size] each, rows [0, num_tokens). A prefill step's final norm
  // runs on gathered copies of each sequence's last token, leaving both as they were: the final
  // norm's input is bf16(hidden + residual). A decode step's runs in place, leaving that sum in
  // residual (and the normalised rows in hidden).
  const bf16* hidden() const { return hidden_; }
  const bf16* residual() const { return residual_; }
  int32_t* sampled_tokens() const { return sampled_tokens_; }  // [max_num_seqs], see StepLayout

  // Decode graphs: capture every bucket (largest first), each without and with the greedy
  // argmax (one per host slot); returns the device bytes they took.
  size_t capture_decode_graphs(const std::vector<int>& buckets);
  int decode_bucket(int num_seqs) const { return graphs_ ? graphs_->bucket_for(num_seqs) : -1; }
  const GraphManager* graphs() const { return graphs_.get(); }

 private:
  // argmax_host_out: also take each sequence's argmax into sampled_tokens_ and this pinned
  // host buffer (a greedy decode graph).
  // decode_rows: a mixed step's leading sequences of one new token each, which decode attention
  // takes (the rest go through prefill attention); 0 for a decode step.
  void forward(int num_tokens, int num_seqs, int max_q_len, bool is_decode,
               int32_t* argmax_host_out = nullptr, int decode_rows = 0);
  // A decode graph's body: the metadata staged from the pinned buffer, then the forward.
  void decode_graph_body(int bucket, int32_t* argmax_host_out);
  // The batch size decode attention plans its splits for: the graph bucket of num_seqs (the
  // default buckets when no graph is captured), so that eager and graph steps give the same bits.
  int decode_plan_seqs(int num_seqs) const;
  // Padding-like metadata for a decode step of num_seqs rows (slot -1, context 0), on the device.
  void write_inert_decode_metadata(int num_seqs);
  // Waits until the last graph step's first kernel has read host_meta_ (stage_ticket_).
  void wait_staged();
  template <class T>
  T* alloc(size_t count);

  ModelConfig config_;
  ModelWeights weights_;
  EngineLimits limits_;
  int block_table_width_;
  int qkv_width_;
  cudaStream_t stream_ = nullptr;
  Gemm gemm_;
  std::vector<void*> allocations_;

  int32_t* host_meta_ = nullptr;     // pinned and mapped: decode graphs read it directly
  int32_t* host_meta_mapped_ = nullptr;  // its device address
  cudaEvent_t meta_copied_ = nullptr;  // the last eager step's copy has read host_meta_
  int32_t* host_tokens_ = nullptr;   // pinned and mapped: [2][max_num_seqs], a greedy step's ids
  int32_t* host_tokens_mapped_ = nullptr;
  cudaEvent_t tokens_ready_[2] = {nullptr, nullptr};
  int next_token_slot_ = 0;
  // Decode graphs read host_meta_ in their first kernel, which then reports that it has: the
  // host numbers each graph step (stage_ticket_[0], mapped) and the kernel copies the number
  // into stage_ticket_[1] once the metadata is read; host_metadata() waits for the last one.
  // Unsigned: they wrap around (a long-running server), and only equality is compared.
  uint32_t* stage_ticket_ = nullptr;  // pinned and mapped: [issued, staged]
  uint32_t* stage_ticket_mapped_ = nullptr;
  uint32_t stage_issued_ = 0;
  unsigned* stage_ctas_done_ = nullptr;  // device: the staging CTAs that have finished their part
  int32_t* device_meta_ = nullptr;
  bf16* residual_ = nullptr;
  bf16* hidden_ = nullptr;
  bf16* qkv_ = nullptr;
  bf16* attn_ = nullptr;
  bf16* gate_up_ = nullptr;
  bf16* act_ = nullptr;
  bf16* last_hidden_ = nullptr;
  bf16* logits_ = nullptr;
  int32_t* sampled_tokens_ = nullptr;
  uint64_t* argmax_keys_ = nullptr;  // [kGemvMaxM], zero between steps: gemv_argmax's workspace
  std::vector<DecodeAttentionPlan> decode_plans_;  // [max_num_seqs + 1]: by planned batch size
  float* attn_workspace_ = nullptr;
  unsigned* attn_arrivals_ = nullptr;  // [max_num_seqs, num_kv_heads], zero at rest
  int32_t* seq_order_ = nullptr;  // [max_num_seqs]: decode attention's sequences, longest first
  void* kv_cache_ = nullptr;
  int num_kv_blocks_ = 0;
  std::unique_ptr<GraphManager> graphs_;
};

}  // namespace nanograph
