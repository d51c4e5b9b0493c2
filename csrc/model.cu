// The decoder forward for one step. Per layer, for T new tokens:
//   hidden = add_rmsnorm(hidden, residual)            (first layer: the embedding and its rmsnorm,
//                                                     one kernel)
//   qkv    = hidden . Wqkv^T (+ bias)                 cuBLASLt
//   qkv    = qk_norm + rope, K/V stored by slot       one kernel; large decode grids do it inside
//                                                     attention (q rotated there, qkv left as is)
//   attn   = paged decode attention (a decode step; a mixed step's leading one-token rows) and
//            prefill attention (the rest of a mixed or prefill step)
//   hidden = attn . Wo^T;  hidden = add_rmsnorm(hidden, residual)
//   act    = silu(gate) * up of hidden . Wgate_up^T   (where gemv_preferred: one kernel)
//   hidden = act . Wdown^T
// then the final norm and lm_head on each sequence's last token only (a greedy step at small
// batch takes the argmax in lm_head's GEMV).
// All per-step values are read from device buffers at fixed addresses, so a captured decode graph
// replays for any batch contents.
#include "model.h"

#include "activation.h"
#include "gemv.h"
#include "launch.h"
#include "norm.h"
#include "rope.h"
#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <thread>

namespace nanograph {

namespace {

// Copies the rows of each sequence's last new token: out[s] = in[cu_seqlens_q[s + 1] - 1].
// a_out/b_out: [num_seqs, dim]; one CTA per sequence, 16-byte copies (dim % 8 == 0).
__global__ void gather_last_tokens_kernel(const bf16* a, const bf16* b, const int32_t* cu_seqlens_q,
                                          bf16* a_out, bf16* b_out, int dim) {
  const int s = blockIdx.x;
  const int row = cu_seqlens_q[s + 1] - 1;
  const int4* a_src = reinterpret_cast<const int4*>(a + static_cast<size_t>(row) * dim);
  const int4* b_src = reinterpret_cast<const int4*>(b + static_cast<size_t>(row) * dim);
  int4* a_dst = reinterpret_cast<int4*>(a_out + static_cast<size_t>(s) * dim);
  int4* b_dst = reinterpret_cast<int4*>(b_out + static_cast<size_t>(s) * dim);
  for (int i = threadIdx.x; i < dim / 8; i += blockDim.x) {
    a_dst[i] = a_src[i];
    b_dst[i] = b_src[i];
  }
}

// A decode graph's first kernel: the step's metadata from the pinned host buffer (mapped; read
// over PCIe) into the device buffer, `vecs` 16-byte vectors, so that no host-to-device copy on
// the copy engine sits between one graph and the next. Once every CTA has its part, the last
// one writes the step's ticket (ticket[0], set by the host before the launch) to ticket[1]: the
// host may then refill the buffer for the next step.
__global__ void stage_metadata_kernel(const int4* __restrict__ host, int4* __restrict__ device,
                                      int vecs, volatile uint32_t* ticket, unsigned* ctas_done) {
  allow_dependents();  // the next kernel (embedding_rmsnorm) gets resident; it waits for this one
  const uint32_t number = threadIdx.x == 0 ? ticket[0] : 0u;  // in flight with the copy's loads
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vecs; i += gridDim.x * blockDim.x) {
    device[i] = host[i];
  }
  __syncthreads();  // every load of this CTA has returned (its value is stored)
  if (threadIdx.x != 0) return;
  if (gridDim.x > 1) {
    __threadfence();
    if (atomicAdd(ctas_done, 1u) != gridDim.x - 1) return;
    *ctas_done = 0;
  }
  __threadfence_system();
  ticket[1] = number;
}

constexpr int kStageThreads = 256;
constexpr int kStageMaxCtas = 64;

// Graph variants of a bucket: without the argmax, and with it into host token slot 0 or 1.
constexpr int kPlainGraph = 0;
int greedy_graph(int slot) { return 1 + slot; }

// StepLayout's total rounded up to whole 16-byte vectors (the buffers are allocated so).
int meta_vecs(const StepLayout& layout) { return ceil_div(layout.total, 4); }

}  // namespace

StepLayout::StepLayout(int num_tokens, int num_seqs, int block_table_width) {
  input_ids = 0;
  input_src = input_ids + num_tokens;
  positions = input_src + num_tokens;
  slot_mapping = positions + num_tokens;
  cu_seqlens_q = slot_mapping + num_tokens;
  context_lens = cu_seqlens_q + num_seqs + 1;
  block_tables = context_lens + num_seqs;
  total = block_tables + num_seqs * block_table_width;
}

void write_inert_rows(int32_t* meta, const StepLayout& layout, int first_token, int first_seq,
                      int num_tokens, int num_seqs) {
  std::fill(meta + layout.input_ids + first_token, meta + layout.input_ids + num_tokens, 0);
  std::fill(meta + layout.input_src + first_token, meta + layout.input_src + num_tokens, -1);
  std::fill(meta + layout.positions + first_token, meta + layout.positions + num_tokens, 0);
  std::fill(meta + layout.slot_mapping + first_token, meta + layout.slot_mapping + num_tokens, -1);
  for (int s = first_seq; s < num_seqs; ++s) {
    meta[layout.cu_seqlens_q + s + 1] = first_token + (s + 1 - first_seq);
  }
  std::fill(meta + layout.context_lens + first_seq, meta + layout.context_lens + num_seqs, 0);
}

template <class T>
T* Model::alloc(size_t count) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  allocations_.push_back(p);
  return static_cast<T*>(p);
}

Model::Model(const ModelConfig& config, ModelWeights weights, const EngineLimits& limits)
    : config_(config), weights_(std::move(weights)), limits_(limits) {
  const ModelConfig& c = config_;
  require(static_cast<int>(weights_.layers.size()) == c.num_layers,
          "weights have " + std::to_string(weights_.layers.size()) + " layers; config says " +
              std::to_string(c.num_layers));
  require(c.num_q_heads % c.num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads");
  require(c.hidden_size % 8 == 0 && c.intermediate_size % 8 == 0,
          "hidden_size and intermediate_size must be multiples of 8");
  require(limits.max_num_tokens >= limits.max_num_seqs,
          "max_num_batched_tokens (" + std::to_string(limits.max_num_tokens) +
              ") must be at least max_num_seqs (" + std::to_string(limits.max_num_seqs) + ")");
  require(limits.max_model_len <= c.max_position,
          "max_model_len " + std::to_string(limits.max_model_len) + " exceeds the RoPE table (" +
              std::to_string(c.max_position) + " positions)");
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    require_kv_scales("layer " + std::to_string(l) + " (the checkpoint's self_attn.k_scale and v_scale)",
                      c.kv_dtype, w.k_scale, w.v_scale);
  }
  // One extra block: the first decode step after a prefill of exactly max_model_len tokens.
  block_table_width_ = ceil_div(limits.max_model_len, limits.block_size) + 1;
  qkv_width_ = (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim;
  // FP8 projections above the GEMV's rows: those with 128 x 128 block scales quantize the
  // activations for the block-scaled FP8 GEMM (room for a whole step at the widest K); every one
  // may take the dequantised copy through cuBLASLt (no block scales, or a shape cuBLASLt's FP8
  // GEMM refuses, which is known only once the shape is planned).
  size_t dequantized = 0, fp8_activation_cols = 0;
  for (const LayerWeights& w : weights_.layers) {
    const int64_t H = c.hidden_size, I = c.intermediate_size, q = c.num_q_heads * c.head_dim;
    for (auto [weight, elements, K] :
         {std::tuple{w.qkv, qkv_width_ * H, H}, std::tuple{w.o_proj, H * q, q},
          std::tuple{w.gate_up, 2 * I * H, H}, std::tuple{w.down, H * I, I}}) {
      if (weight.fp8()) dequantized = std::max(dequantized, static_cast<size_t>(elements));
      if (weight.block_scale) {
        fp8_activation_cols = std::max(fp8_activation_cols, static_cast<size_t>(K));
      }
    }
  }
  if (dequantized > 0) gemm_.reserve_dequantized(dequantized);
  if (fp8_activation_cols > 0) {
    gemm_.reserve_fp8_activations(limits.max_num_tokens, fp8_activation_cols);
  }

  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (cudaEvent_t* event : {&meta_copied_, &tokens_ready_[0], &tokens_ready_[1]}) {
    CUDA_CHECK(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
  }
  const int T = limits.max_num_tokens;
  const int S = limits.max_num_seqs;
  const size_t meta = 4 * static_cast<size_t>(meta_vecs(StepLayout(T, S, block_table_width_)));
  CUDA_CHECK(cudaHostAlloc(&host_meta_, meta * sizeof(int32_t), cudaHostAllocMapped));
  std::fill(host_meta_, host_meta_ + meta, 0);
  CUDA_CHECK(cudaHostGetDevicePointer(&host_meta_mapped_, host_meta_, 0));
  CUDA_CHECK(cudaHostAlloc(&host_tokens_, 2 * S * sizeof(int32_t), cudaHostAllocMapped));
  std::fill(host_tokens_, host_tokens_ + 2 * S, 0);
  CUDA_CHECK(cudaHostGetDevicePointer(&host_tokens_mapped_, host_tokens_, 0));
  CUDA_CHECK(cudaHostAlloc(&stage_ticket_, 2 * sizeof(uint32_t), cudaHostAllocMapped));
  stage_ticket_[0] = stage_ticket_[1] = 0;
  CUDA_CHECK(cudaHostGetDevicePointer(&stage_ticket_mapped_, stage_ticket_, 0));
  stage_ctas_done_ = alloc<unsigned>(1);
  CUDA_CHECK(cudaMemset(stage_ctas_done_, 0, sizeof(unsigned)));
  device_meta_ = alloc<int32_t>(meta);
  residual_ = alloc<bf16>(static_cast<size_t>(T) * c.hidden_size);
  hidden_ = alloc<bf16>(static_cast<size_t>(T) * c.hidden_size);
  qkv_ = alloc<bf16>(static_cast<size_t>(T) * qkv_width_);
  attn_ = alloc<bf16>(static_cast<size_t>(T) * c.num_q_heads * c.head_dim);
  gate_up_ = alloc<bf16>(static_cast<size_t>(T) * 2 * c.intermediate_size);
  act_ = alloc<bf16>(static_cast<size_t>(T) * c.intermediate_size);
  last_hidden_ = alloc<bf16>(static_cast<size_t>(2) * S * c.hidden_size);
  logits_ = alloc<bf16>(static_cast<size_t>(S) * c.vocab_size);
  sampled_tokens_ = alloc<int32_t>(S);
  CUDA_CHECK(cudaMemset(sampled_tokens_, 0, S * sizeof(int32_t)));
  argmax_keys_ = alloc<uint64_t>(kGemvMaxM);
  CUDA_CHECK(cudaMemset(argmax_keys_, 0, kGemvMaxM * sizeof(uint64_t)));
  // A decode step of n sequences runs under the plan of its graph bucket (decode_plan_seqs), up
  // to max_num_seqs: a plan for every batch size, all sharing one workspace.
  decode_plans_.resize(S + 1);
  size_t workspace = 0;
  for (int b = 1; b <= S; ++b) {
    decode_plans_[b] = plan_decode_attention(b, c.num_q_heads, c.num_kv_heads, c.head_dim,
                                             limits.max_model_len, device_props(), c.kv_dtype);
    workspace = std::max(workspace, decode_plans_[b].workspace_bytes);
  }
  attn_workspace_ = reinterpret_cast<float*>(alloc<char>(workspace));
  attn_arrivals_ = alloc<unsigned>(static_cast<size_t>(S) * c.num_kv_heads);
  CUDA_CHECK(cudaMemset(attn_arrivals_, 0, static_cast<size_t>(S) * c.num_kv_heads * sizeof(unsigned)));
  CUDA_CHECK(cudaDeviceSynchronize());
  seq_order_ = alloc<int32_t>(S);
}

Model::~Model() {
  if (stream_) cudaStreamSynchronize(stream_);
  graphs_.reset();
  if (kv_cache_) cudaFree(kv_cache_);
  for (void* p : allocations_) cudaFree(p);
  if (host_meta_) cudaFreeHost(host_meta_);
  if (host_tokens_) cudaFreeHost(host_tokens_);
  if (stage_ticket_) cudaFreeHost(stage_ticket_);
  for (cudaEvent_t event : {meta_copied_, tokens_ready_[0], tokens_ready_[1]}) {
    if (event) cudaEventDestroy(event);
  }
  if (stream_) cudaStreamDestroy(stream_);
}

size_t Model::kv_bytes_per_block() const {
  return static_cast<size_t>(config_.num_layers) * 2 * limits_.block_size * config_.num_kv_heads *
         config_.head_dim * kv_dtype_bytes(config_.kv_dtype);
}

void Model::allocate_kv_cache(int num_blocks) {
  require(num_blocks >= 1, "the KV cache needs at least one block");
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  graphs_.reset();  // captured graphs point into the old cache
  if (kv_cache_) CUDA_CHECK(cudaFree(kv_cache_));
  kv_cache_ = nullptr;
  num_kv_blocks_ = 0;
  CUDA_CHECK(cudaMalloc(&kv_cache_, kv_bytes_per_block() * num_blocks));
  num_kv_blocks_ = num_blocks;
}

int32_t* Model::host_metadata() {
  CUDA_CHECK(cudaEventSynchronize(meta_copied_));  // an eager step's copy
  wait_staged();
  return host_meta_;
}

void Model::wait_staged() {
  // The last graph step's staging kernel runs as soon as the graph before it ends: a short wait.
  const volatile uint32_t* staged = stage_ticket_ + 1;
  for (int64_t spins = 1; *staged != stage_issued_; ++spins) {
    if (spins % 4096 == 0) {  // the stream may have failed
      const cudaError_t state = cudaStreamQuery(stream_);
      if (state == cudaSuccess && *staged != stage_issued_) {
        throw std::runtime_error("decode graph " + std::to_string(stage_issued_) +
                                 " ended without staging its metadata");
      }
      if (state != cudaErrorNotReady) CUDA_CHECK(state);
    }
    std::this_thread::yield();
  }
}

int Model::step_rows(int num_tokens, int num_seqs, bool use_graph) const {
  if (!use_graph || num_tokens != num_seqs || !graphs_) return num_seqs;
  const int bucket = graphs_->bucket_for(num_seqs);
  return bucket > 0 && graphs_->captured(bucket) ? bucket : num_seqs;
}

int Model::step(int num_tokens, int num_seqs, int max_q_len, bool use_graph, bool greedy) {
  require(kv_cache_ != nullptr, "allocate the KV cache before running the model");
  require(num_tokens >= 1 && num_tokens <= limits_.max_num_tokens,
          "a step has " + std::to_string(num_tokens) + " tokens; max_num_batched_tokens is " +
              std::to_string(limits_.max_num_tokens));
  require(num_seqs >= 1 && num_seqs <= limits_.max_num_seqs,
          "a step has " + std::to_string(num_seqs) + " sequences; max_num_seqs is " +
              std::to_string(limits_.max_num_seqs));
  const int slot = greedy ? next_token_slot_ : -1;
  const bool is_decode = num_tokens == num_seqs;
  const int bucket = step_rows(num_tokens, num_seqs, use_graph);
  if (use_graph && is_decode && graphs_ && graphs_->captured(bucket)) {
    // The graph stages the metadata itself and reports the ticket once it has (the ticket may be
    // renumbered only once the previous graph has read it).
    // Committed once the launch is queued: a launch that throws leaves nothing to wait for.
    wait_staged();
    write_inert_rows(host_meta_, StepLayout(bucket, bucket, block_table_width_), num_tokens,
                     num_seqs, bucket, bucket);
    stage_ticket_[0] = stage_issued_ + 1;
    graphs_->replay(bucket, stream_, greedy ? greedy_graph(slot) : kPlainGraph);
    ++stage_issued_;
  } else {
    const StepLayout layout(num_tokens, num_seqs, block_table_width_);
    // A mixed step's leading rows of one new token (decodes, which the scheduler puts first): count
    // them, before the host metadata is handed to the copy.
    const int32_t* cu_seqlens_q = host_meta_ + layout.cu_seqlens_q;
    int decode_rows = 0;
    while (!is_decode && decode_rows < num_seqs &&
           cu_seqlens_q[decode_rows + 1] - cu_seqlens_q[decode_rows] == 1) {
      ++decode_rows;
    }
    CUDA_CHECK(cudaMemcpyAsync(device_meta_, host_meta_, layout.total * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaEventRecord(meta_copied_, stream_));
    forward(num_tokens, num_seqs, max_q_len, is_decode,
            greedy ? host_tokens_mapped_ + slot * limits_.max_num_seqs : nullptr, decode_rows);
  }
  if (greedy) {
    CUDA_CHECK(cudaEventRecord(tokens_ready_[slot], stream_));
    next_token_slot_ ^= 1;
  }
  return slot;
}

const int32_t* Model::greedy_tokens(int slot) {
  require(slot == 0 || slot == 1, "greedy token slot must be 0 or 1, got " + std::to_string(slot));
  CUDA_CHECK(cudaEventSynchronize(tokens_ready_[slot]));
  return host_tokens_ + slot * limits_.max_num_seqs;
}

void Model::decode_graph_body(int bucket, int32_t* argmax_host_out) {
  const StepLayout layout(bucket, bucket, block_table_width_);
  const int vecs = meta_vecs(layout);
  const int ctas = std::min(ceil_div(vecs, kStageThreads), kStageMaxCtas);
  stage_metadata_kernel<<<ctas, kStageThreads, 0, stream_>>>(
      reinterpret_cast<const int4*>(host_meta_mapped_), reinterpret_cast<int4*>(device_meta_), vecs,
      stage_ticket_mapped_, stage_ctas_done_);
  CUDA_CHECK_LAUNCH();
  forward(bucket, bucket, 1, true, argmax_host_out);
}

void Model::write_inert_decode_metadata(int num_seqs) {
  const StepLayout layout(num_seqs, num_seqs, block_table_width_);
  int32_t* meta = host_metadata();
  std::fill(meta, meta + layout.total, 0);
  write_inert_rows(meta, layout, 0, 0, num_seqs, num_seqs);
  CUDA_CHECK(cudaMemcpyAsync(device_meta_, meta, layout.total * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

size_t Model::capture_decode_graphs(const std::vector<int>& buckets) {
  require(kv_cache_ != nullptr, "allocate the KV cache before capturing graphs");
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  size_t free_before = 0, free_after = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  graphs_ = std::make_unique<GraphManager>(buckets);
  std::vector<int> order = graphs_->buckets();
  std::sort(order.rbegin(), order.rend());  // largest first: later graphs reuse its memory
  for (int bucket : order) {
    require(bucket <= limits_.max_num_seqs, "graph bucket " + std::to_string(bucket) +
                                                " exceeds max_num_seqs " +
                                                std::to_string(limits_.max_num_seqs));
    // Warm the GEMM plans outside the capture (heuristics must not run while capturing), on
    // inert metadata: no cache writes, no context.
    write_inert_decode_metadata(bucket);
    forward(bucket, bucket, 1, true);
    graphs_->capture(bucket, stream_, [&] { decode_graph_body(bucket, nullptr); }, kPlainGraph);
    for (int slot = 0; slot < 2; ++slot) {
      int32_t* host_out = host_tokens_mapped_ + slot * limits_.max_num_seqs;
      graphs_->capture(bucket, stream_, [&] { decode_graph_body(bucket, host_out); },
                       greedy_graph(slot));
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  return free_before > free_after ? free_before - free_after : 0;
}

int Model::decode_plan_seqs(int num_seqs) const {
  const int bucket = decode_bucket(num_seqs);
  if (bucket > 0) return bucket;
  for (int b : default_decode_buckets(limits_.max_num_seqs)) {
    if (b >= num_seqs) return b;
  }
  return num_seqs;
}

void Model::forward(int T, int S, int max_q_len, bool is_decode, int32_t* argmax_host_out,
                    int decode_rows) {
  const ModelConfig& c = config_;
  const StepLayout layout(T, S, block_table_width_);
  const int32_t* input_ids = device_meta_ + layout.input_ids;
  const int32_t* positions = device_meta_ + layout.positions;
  const int32_t* slot_mapping = device_meta_ + layout.slot_mapping;
  const int32_t* cu_seqlens_q = device_meta_ + layout.cu_seqlens_q;
  const int32_t* context_lens = device_meta_ + layout.context_lens;
  const int32_t* block_tables = device_meta_ + layout.block_tables;
  const int H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int q_width = c.num_q_heads * hd;
  const size_t kv_layer_bytes = static_cast<size_t>(num_kv_blocks_) * limits_.block_size *
                                c.num_kv_heads * hd * kv_dtype_bytes(c.kv_dtype);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  cudaStream_t st = stream_;

  // Decode attention runs under its bucket's plan, over every row of a decode step and over the
  // leading one-token rows of a mixed step (the prefill kernel would give each of them a CTA of 64
  // query rows, and a grid row per query tile of the step's longest chunk). Grids that take several
  // sequences longest first get the order once per step (the lengths are the same in every layer).
  const int D = is_decode ? S : decode_rows;
  const DecodeAttentionPlan* plan = D > 0 ? &decode_plans_[decode_plan_seqs(D)] : nullptr;
  const bool ordered = plan && plan->reads_order && D > 1 && D <= kOrderMaxSeqs;
  const bool rope_in_attention = is_decode && plan->fuse_rope;  // a mixed step's is stored first
  if (ordered) order_by_length(context_lens, D, seq_order_, st);
  // Tokens the previous step sampled on the device are read from sampled_tokens_ (input_src).
  embedding_rmsnorm(input_ids, weights_.embed, c.vocab_size, residual_,
                    weights_.layers[0].input_norm, hidden_, T, H, c.rms_norm_eps, st,
                    device_meta_ + layout.input_src, sampled_tokens_);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    if (l > 0) add_rmsnorm(hidden_, residual_, w.input_norm, T, H, c.rms_norm_eps, st);
    gemm_.linear(hidden_, w.qkv, w.qkv_bias, qkv_, T, qkv_width_, H, st);

    char* k_cache = static_cast<char*>(kv_cache_) + 2 * l * kv_layer_bytes;
    char* v_cache = k_cache + kv_layer_bytes;
    RopeKvArgs rope{qkv_,      w.q_norm,      w.k_norm,    weights_.cos_sin,
                    positions, slot_mapping,  k_cache,     v_cache,
                    T,         c.num_q_heads, c.num_kv_heads, hd,
                    c.rms_norm_eps, c.kv_dtype, w.k_scale, w.v_scale};
    PagedKv kv{k_cache,           v_cache,        block_tables, block_table_width_,
               context_lens,      limits_.block_size, c.num_kv_heads, hd,
               c.kv_dtype,        w.k_scale,      w.v_scale};
    if (!rope_in_attention) qk_norm_rope_kv_store(rope, st);
    if (D > 0) {
      DecodeAttentionArgs args{qkv_, qkv_width_, kv, attn_, D, c.num_q_heads,
                               limits_.max_model_len, scale, attn_workspace_, attn_arrivals_,
                               ordered ? seq_order_ : nullptr,
                               rope_in_attention ? rope : RopeKvArgs{}};
      paged_decode_attention(args, *plan, st);
    }
    if (D < S) {  // sequences D .. S - 1 (their offsets in cu_seqlens_q count from token 0)
      PagedKv rest = kv;
      rest.block_tables += static_cast<size_t>(D) * block_table_width_;
      rest.context_lens += D;
      PrefillAttentionArgs args{qkv_, qkv_width_, rest,          cu_seqlens_q + D, attn_,
                                S - D, T,         max_q_len, c.num_q_heads,    scale};
      paged_prefill_attention(args, st);
    }
    gemm_.linear(attn_, w.o_proj, nullptr, hidden_, T, H, q_width, st);
    add_rmsnorm(hidden_, residual_, w.post_norm, T, H, c.rms_norm_eps, st);
    if (w.gate_up.fp8() && gemv_fp8_supported(T, 2 * I, H)) {
      gemv_silu_mul_fp8(hidden_, w.gate_up.data, w.gate_up.scale, act_, T, I, H, st);
    } else if (!w.gate_up.fp8() && gemv_preferred(T, 2 * I, H)) {
      gemv_silu_mul(hidden_, w.gate_up.bf16_data(), act_, T, I, H, st);  // one kernel
    } else {
      gemm_.linear(hidden_, w.gate_up, nullptr, gate_up_, T, 2 * I, H, st);
      silu_mul(gate_up_, act_, T, I, st);
    }
    gemm_.linear(act_, w.down, nullptr, hidden_, T, H, I, st);
  }

  bf16* last_hidden = hidden_;
  bf16* last_residual = residual_;
  if (!is_decode) {
    last_hidden = last_hidden_;
    last_residual = last_hidden_ + static_cast<size_t>(limits_.max_num_seqs) * H;
    gather_last_tokens_kernel<<<S, 128, 0, st>>>(hidden_, residual_, cu_seqlens_q, last_hidden,
                                                 last_residual, H);
    CUDA_CHECK_LAUNCH();
  }
  add_rmsnorm(last_hidden, last_residual, weights_.final_norm, S, H, c.rms_norm_eps, st);
  if (argmax_host_out != nullptr && gemv_preferred(S, c.vocab_size, H)) {
    gemv_argmax(last_hidden, weights_.lm_head, nullptr, logits_, S, c.vocab_size, H, argmax_keys_,
                sampled_tokens_, argmax_host_out, st);
    return;
  }
  gemm_.linear(last_hidden, weights_.lm_head, nullptr, logits_, S, c.vocab_size, H, st);
  if (argmax_host_out != nullptr) {
    argmax(logits_, S, c.vocab_size, c.vocab_size, sampled_tokens_, st, argmax_host_out);
  }
}

}  // namespace nanograph
