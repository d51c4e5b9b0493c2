// Per-head QK-RMSNorm (optional, Qwen3) + NeoX rotary embedding + K/V store into the paged cache.
//
// For each token t and head:
//   q head:  q = rope(norm_q(q))             written back in place into qkv
//   kv head: k = rope(norm_k(k))             written back into qkv and to k_cache[slot]
//            v unchanged                     copied to v_cache[slot]      (slot = slot_mapping[t])
// norm(x) = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight), fp32 statistics: HF Qwen3RMSNorm's
// rounding. rope is computed in fp32 from the fp32 cos/sin row positions[t] and rounded once:
//   x1' = x1 * cos - x2 * sin,  x2' = x2 * cos + x1 * sin,  x1 = x[:hd/2], x2 = x[hd/2:].
// Slot -1 skips the cache store (the token's q and k are still rotated).
//
// Layouts: qkv [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] bf16, q | k | v per token;
//          cos_sin [max_position, head_dim] fp32 (cos | sin); positions, slot_mapping [num_tokens];
//          k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] bf16 or e4m3
//          (KvDtype: an FP8 cache stores bf16(k) / k_scale and v / v_scale, e4m3.cuh), so
//          element (slot, h, d) sits at (slot * num_kv_heads + h) * head_dim + d.
//
// Launch: a group of head_dim / 8 lanes per (token, head item); each lane owns 8 consecutive
// elements (one 16-byte load), so a warp covers 2 heads at head_dim 128 and 4 at 64. Items run
// token-major over num_q_heads + num_kv_heads heads (a kv item also carries its v head), so
// neighbouring groups read neighbouring memory. A lane in the first half of the head pairs with
// the lane head_dim / 16 above it (x[i] with x[i + hd/2]); one shuffle swaps the partner's
// values and a group-wide shuffle reduction gives the RMS statistics. Every byte of q/k/v is
// touched once, with no shared memory and no block-wide barriers: the kernel is bandwidth-bound.
#include "rope.h"

#include <climits>

#include "bf16x8.cuh"
#include "launch.h"
#include "rope.cuh"

namespace nanograph {

namespace {

constexpr int kThreads = 256;

// Before its PDL wait (launch.h) a thread reads what no kernel it can overlap writes: its token's
// position and slot (step metadata, staged before the kernels after the embedding launch), that
// position's cos/sin and the norm weight. The head itself (the previous kernel's output) is read
// after the wait.
template <int HEAD_DIM, bool QK_NORM>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kv_store_kernel(RopeKvArgs args) {
  constexpr int kLanes = HEAD_DIM / kRopeVec;
  const int heads_per_token = args.num_q_heads + args.num_kv_heads;
  const int item = (blockIdx.x * kThreads + threadIdx.x) / kLanes;  // fits int: see the launcher
  const bool in_range = item < args.num_tokens * heads_per_token;
  const int token = item / heads_per_token;
  const int head = item % heads_per_token;
  const int lane_in_head = threadIdx.x % kLanes;
  const bool is_q = head < args.num_q_heads;
  NormRopeOperands op;
  int slot = -1;
  if (in_range) {
    const int position = args.positions[token];
    if (!is_q) slot = args.slot_mapping[token];
    op = load_norm_rope_operands<HEAD_DIM, QK_NORM>(
        is_q ? args.q_norm_weight : args.k_norm_weight,
        args.cos_sin + static_cast<int64_t>(position) * HEAD_DIM, lane_in_head);
  }
  allow_dependents();  // before the wait (launch.h)
  wait_for_producers_after_loads();
  if (!in_range) return;
  // Groups never straddle a warp, and a group is wholly in or out of range.
  const unsigned group_mask = ((1u << kLanes) - 1u) << (threadIdx.x % 32 / kLanes * kLanes);

  const int64_t row = static_cast<int64_t>(token) *
                      (args.num_q_heads + 2 * args.num_kv_heads) * HEAD_DIM;
  const int lane_offset = lane_in_head * kRopeVec;

  bf16* x_ptr = args.qkv + row + head * HEAD_DIM + lane_offset;
  Float8 x = load_bf16x8(x_ptr);
  apply_norm_rope<HEAD_DIM, QK_NORM>(x, op, lane_in_head, group_mask, args.eps);
  store_bf16x8(x_ptr, x);
  if (is_q || slot < 0) return;

  const int kv_head = head - args.num_q_heads;
  const int64_t cache_offset =
      (static_cast<int64_t>(slot) * args.num_kv_heads + kv_head) * HEAD_DIM + lane_offset;
  const bf16* v_ptr = args.qkv + row + (heads_per_token + kv_head) * HEAD_DIM + lane_offset;
  store_kv_slice(args, cache_offset, x, *reinterpret_cast<const uint4*>(v_ptr));
}

}  // namespace

void qk_norm_rope_kv_store(const RopeKvArgs& args, cudaStream_t stream) {
  require((args.q_norm_weight == nullptr) == (args.k_norm_weight == nullptr),
          "qk_norm_rope_kv_store: give both q_norm_weight and k_norm_weight, or neither");
  require(args.num_q_heads > 0 && args.num_kv_heads > 0,
          "qk_norm_rope_kv_store: num_q_heads and num_kv_heads must be positive, got " +
              std::to_string(args.num_q_heads) + " and " + std::to_string(args.num_kv_heads));
  require(args.num_tokens >= 0, "qk_norm_rope_kv_store: num_tokens must be >= 0");
  require_kv_scales("qk_norm_rope_kv_store", args.kv_dtype, args.k_scale, args.v_scale);
  if (args.num_tokens == 0) return;
  const bool qk_norm = args.q_norm_weight != nullptr;
  DISPATCH_HEAD_DIM(args.head_dim, HEAD_DIM, [&] {
    const int64_t threads = static_cast<int64_t>(args.num_tokens) *
                            (args.num_q_heads + args.num_kv_heads) * (HEAD_DIM / kRopeVec);
    require(threads + kThreads <= INT_MAX,
            "qk_norm_rope_kv_store: " + std::to_string(args.num_tokens) + " tokens x " +
                std::to_string(args.num_q_heads + args.num_kv_heads) +
                " heads is too many for one launch; split the batch");
    const int blocks = static_cast<int>(ceil_div(static_cast<int>(threads), kThreads));
    auto kernel = qk_norm ? qk_norm_rope_kv_store_kernel<HEAD_DIM, true>
                          : qk_norm_rope_kv_store_kernel<HEAD_DIM, false>;
    launch_pdl(kernel, dim3(blocks), dim3(kThreads), 0, stream, args);
  });
}

}  // namespace nanograph
