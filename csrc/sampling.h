// Token sampling on the device: greedy argmax over rows of logits, and sample_rows, which draws
// one token per row with temperature, top-k, top-p and min_p.
#pragma once
#include "common.h"

namespace nanograph {

// logits: [rows, vocab] with row stride `stride` elements; out: [rows] int32.
// In torch.argmax's order (argmax_order.cuh): NaN first, ties to the lowest index.
// host_out (optional): [rows] int32 in mapped pinned host memory (cudaHostAllocMapped), written
// with the same ids by the kernel itself, so the host reads them once the stream has passed the
// kernel, without a device-to-host copy.
void argmax(const bf16* logits, int rows, int vocab, int stride, int32_t* out, cudaStream_t stream,
            int32_t* host_out = nullptr);

// One token per row, in vLLM's order, on x = logit / temperature:
//   1. floor: the higher of the k-th largest x (top-k) and max x + log(min_p) (min_p);
//   2. top-p over the tokens at or above the floor, counting at most the first k by rank: the
//      nucleus is the fewest most likely tokens whose renormalised probability reaches top_p;
//   3. the row keeps every token whose x reaches the threshold (the nucleus' smallest x, else the
//      floor; ties included) and draws one with probability proportional to exp(x).
// The draw is a function of the row's logits, parameters and key alone (not of the batch). It
// treats NaN logits as absent. A row with nothing to draw (every x -inf, or NaN in a sampled row)
// gives the id `vocab`, past the vocabulary, on which the engine fails that request alone.
struct SampleRowsArgs {
  const void* logits;  // [rows, vocab] bf16 (logits_bf16) or float32, row stride logits_stride
  bool logits_bf16;
  int64_t logits_stride;
  const float* overrides = nullptr;  // [n, vocab] float32, row stride overrides_stride
  int64_t overrides_stride = 0;
  const int32_t* override_rows = nullptr;  // [rows]: row r reads overrides[override_rows[r]] if >= 0
  int rows;
  int vocab;
  const float* temperatures;  // [rows]; 0: greedy (argmax in torch.argmax's order: NaN first,
                              // ties to the lowest index; argmax_order.cuh)
  const int32_t* top_ks;      // [rows]; <= 0 or >= vocab: none
  const float* top_ps;        // [rows] in (0, 1]; 1: none
  const float* min_ps;        // [rows] in [0, 1]; 0: none
  const uint64_t* keys;       // [rows]: the random key of each row's draw
  int64_t* out;               // [rows] token ids
  float* thresholds = nullptr;  // [rows] optional: the smallest x a row may draw (greedy: its
                                // token's logit)
  // Logprobs of the raw logits (logits, not overrides), for the rows where num_logprobs >= 0:
  const int32_t* num_logprobs = nullptr;  // [rows]: -1 none, else n top logprobs (<= logprob_width)
  int logprob_width = 0;                  // <= kMaxTopLogprobs
  float* logprobs = nullptr;        // [rows, 1 + logprob_width]: the sampled token's, then the top n
  int64_t* logprob_ids = nullptr;   // [rows, 1 + logprob_width]: the sampled token's rank (the
                                    // tokens strictly more likely), then the top n's ids
};
constexpr int kMaxTopLogprobs = 32;
void sample_rows(const SampleRowsArgs& args, cudaStream_t stream);

// overrides[p] = logits[source_rows[p]] as float32 (-inf but at its biased tokens where
// mask_others[p]: allowed_token_ids), plus the bias of each of its biased tokens (logit_bias; unique
// per row, -1: padding); then for each of the row's seen tokens (unique per row; -1: padding) the
// penalties of vLLM on that value: repetition divides a positive logit and multiplies a negative
// one; frequency is subtracted per output occurrence, presence once if any; then -inf at its masked
// tokens (-1: padding).
struct OverrideArgs {
  const void* logits;  // [*, vocab] bf16 (logits_bf16) or float32, row stride logits_stride
  bool logits_bf16;
  int64_t logits_stride;
  int vocab;
  int num_rows;
  const int32_t* source_rows;    // [num_rows]
  float* overrides;              // [num_rows, vocab]
  int num_seen;
  const int32_t* seen_tokens;    // [num_rows, num_seen]
  const int32_t* output_counts;  // [num_rows, num_seen]
  const float* presence;         // [num_rows]
  const float* frequency;        // [num_rows]
  const float* repetition;       // [num_rows]
  int num_masked;
  const int32_t* masked_tokens;  // [num_rows, num_masked]
  int num_biased = 0;
  const int32_t* biased_tokens = nullptr;  // [num_rows, num_biased]
  const float* biases = nullptr;           // [num_rows, num_biased]
  const int32_t* mask_others = nullptr;    // [num_rows]: nonzero: -inf but at the biased tokens
};
void prepare_overrides(const OverrideArgs& args, cudaStream_t stream);

// The grammar mask of structured outputs, in place: logits[rows[i], t] = -inf where bit t of
// bitmask[i] is 0 (bit t % 32 of word t / 32). logits: [*, vocab] bf16 (logits_bf16) or float32,
// row stride `stride`; bitmask: [n, words] int32, words * 32 >= vocab; rows: [n] int32.
void apply_token_bitmask(void* logits, bool logits_bf16, int64_t stride, int vocab,
                         const int32_t* bitmask, int words, const int32_t* rows, int n,
                         cudaStream_t stream);

}  // namespace nanograph
