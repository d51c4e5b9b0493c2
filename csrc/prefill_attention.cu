// Paged prefill attention: causal, variable-length batches, FlashAttention-2 on tensor cores.
//
// Computes out[t, h] = softmax(scale * q[t, h] . K^T) V over keys 0..p of t's sequence, where
// query i of sequence s sits at position p = context_lens[s] - q_len(s) + i. Keys come from the
// paged cache, so a cached prefix (or earlier chunks) is attended without being recomputed.
//   q:        [total_q, q_stride] bf16; head h of token t at q + t * q_stride + h * head_dim
//   k_cache,
//   v_cache:  [num_blocks, block_size, num_kv_heads, head_dim] bf16, or e4m3 read as
//             float(e4m3) * k_scale (v_scale) (KvDtype); key j of sequence s lives in
//             slot block_tables[s][j / block_size] * block_size + j % block_size
//   out:      [total_q, num_q_heads * head_dim] bf16
// GQA: q head h reads kv head h / (num_q_heads / num_kv_heads).
//
// Launch: one CTA of 4 warps per (sequence, q head, 64-query tile); each warp owns 16 query rows.
// Small CTAs keep head_dim 128 under 255 registers and 80 KB of shared memory, so two CTAs share
// an SM and one's softmax overlaps the other's MMAs.
// grid.x = num_seqs * num_q_heads (heads of one sequence adjacent, so heads sharing a kv head hit
// L2 together), grid.y = query tiles of max_q_len, issued last tile first: the last tiles attend
// the most keys and should not be left for the tail of the grid.
// Per 64-key tile: K and V rows are gathered from their own cache slots with 16-byte cp.async
// into XOR-swizzled shared memory (double buffered; the next tile streams in while this one is
// computed); S = Q K^T and O += P V run on mma.sync m16n8k16 bf16 with fp32 accumulation; the
// online softmax stays in registers (exp2 with the log2(e)-prescaled scale). Only tiles that
// cross the diagonal are masked; tiles wholly above it are never visited.
// An FP8 cache (kFp8) streams its e4m3 tiles into their own double buffer; once a tile has landed
// the CTA widens it (exactly) into the bf16 tile that the MMAs read, which one buffer then holds.
// k_scale folds into the softmax scale, v_scale into the final normalisation.
// A row whose sequence has no key to attend (context_len < q_len, e.g. padding) writes zeros.
#include <cmath>
#include <type_traits>

#include "attention.h"
#include "cp_async.cuh"
#include "e4m3.cuh"
#include "mma.cuh"

namespace nanograph {
namespace {

constexpr int kBlockM = 64;  // query rows per CTA, 16 per warp
constexpr int kBlockN = 64;  // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory tiles are [rows][head_dim] bf16, with the 16-byte chunk c of row r stored at
// chunk c ^ (r % 8): the 8 rows an ldmatrix phase reads then fall in 8 distinct bank groups.
template <int HEAD_DIM>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}

// Dynamic shared memory: the Q tile, then the K and V tiles (two buffers each of bf16, or one
// each and two e4m3 staging buffers each for an FP8 cache).
template <int HEAD_DIM, bool kFp8>
constexpr size_t prefill_smem_bytes() {
  constexpr size_t tile = size_t(kBlockN) * HEAD_DIM;
  return size_t(kBlockM) * HEAD_DIM * sizeof(bf16) +
         (kFp8 ? 2 * tile * sizeof(bf16) + 4 * tile : 4 * tile * sizeof(bf16));
}

template <int HEAD_DIM, bool kFp8>
__global__ void __launch_bounds__(kThreads, 2)
    prefill_attention_kernel(const PrefillAttentionArgs args, const float scale_log2) {
  constexpr int kChunks = HEAD_DIM / 8;            // 16-byte chunks per bf16 row
  constexpr int kRowStep = kThreads / kChunks;     // rows the CTA copies per pass
  constexpr int kRowsPerThread = kBlockN / kRowStep;
  constexpr int kTileElems = kBlockN * HEAD_DIM;
  static_assert(kBlockM == kBlockN, "Q and K/V tiles share one copy pattern");
  static_assert(kRowStep % 8 == 0, "a thread's rows must share one swizzle phase");
  // The cache's rows: 16-byte chunks of CacheElem elements, copied by the same rule.
  using CacheElem = std::conditional_t<kFp8, uint8_t, bf16>;
  constexpr int kKvChunks = HEAD_DIM * int(sizeof(CacheElem)) / 16;
  constexpr int kKvRowStep = kThreads / kKvChunks;
  constexpr int kKvRowsPerThread = kBlockN / kKvRowStep;
  constexpr int kBuffers = kFp8 ? 1 : 2;  // bf16 K (and V) tiles the MMAs read

  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);
  const uint32_t s_q_addr = smem_address(s_q);
  const uint32_t s_k_addr = s_q_addr + kBlockM * HEAD_DIM * sizeof(bf16);
  const uint32_t s_v_addr = s_k_addr + kBuffers * kTileElems * sizeof(bf16);
  // Where the cache's tiles land: the bf16 tiles themselves, or e4m3 staging (two K buffers,
  // then two V buffers).
  const uint32_t stage_k_addr = kFp8 ? s_v_addr + kTileElems * sizeof(bf16) : s_k_addr;
  const uint32_t stage_v_addr = kFp8 ? stage_k_addr + 2 * kTileElems : s_v_addr;

  const int seq = blockIdx.x / args.num_q_heads;
  const int head = blockIdx.x % args.num_q_heads;
  const int m0 = (gridDim.y - 1 - blockIdx.y) * kBlockM;
  const int q_start = args.cu_seqlens_q[seq];
  const int q_len = args.cu_seqlens_q[seq + 1] - q_start;
  if (m0 >= q_len) return;
  const int context_len = args.kv.context_lens[seq];
  const int first_pos = context_len - q_len;  // position of query 0 of the sequence
  // Keys this tile attends: up to its last valid query's position.
  const int kv_end = min(context_len, first_pos + min(q_len, m0 + kBlockM));
  const int num_kv_tiles = kv_end > 0 ? (kv_end + kBlockN - 1) / kBlockN : 0;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  // Copy pattern (Q): thread owns chunk `copy_chunk` of rows copy_row + i * kRowStep.
  const int copy_chunk = tid % kChunks;
  const int copy_row = tid / kChunks;
  const uint32_t copy_smem = swizzle<HEAD_DIM>(copy_row, copy_chunk) * sizeof(bf16);
  constexpr uint32_t kCopyStepBytes = kRowStep * HEAD_DIM * sizeof(bf16);
  // The same for the cache's tiles: bf16 ones land swizzled, e4m3 staging row-major.
  const int kv_copy_chunk = tid % kKvChunks;
  const int kv_copy_row = tid / kKvChunks;
  const uint32_t kv_copy_smem = kFp8 ? kv_copy_row * HEAD_DIM + kv_copy_chunk * 16 : copy_smem;
  constexpr uint32_t kKvCopyStepBytes = kKvRowStep * HEAD_DIM * sizeof(CacheElem);
  constexpr uint32_t kStageBytes = kTileElems * sizeof(CacheElem);

  const int kv_head = head / (args.num_q_heads / args.kv.num_kv_heads);
  const int64_t slot_stride = int64_t(args.kv.num_kv_heads) * HEAD_DIM;
  const CacheElem* k_cache = static_cast<const CacheElem*>(args.kv.k_cache);
  const CacheElem* v_cache = static_cast<const CacheElem*>(args.kv.v_cache);
  const int head_offset = kv_head * HEAD_DIM + kv_copy_chunk * 16 / int(sizeof(CacheElem));
  const int32_t* block_table = args.kv.block_tables + int64_t(seq) * args.kv.block_table_stride;
  const int block_size = args.kv.block_size;
  const int block_shift = __ffs(block_size) - 1;

  int block_ids[kKvRowsPerThread];
  auto read_block_ids = [&](int tile) {
#pragma unroll
    for (int i = 0; i < kKvRowsPerThread; ++i) {
      const int key = tile * kBlockN + kv_copy_row + i * kKvRowStep;
      block_ids[i] = key < kv_end ? block_table[key >> block_shift] : 0;
    }
  };
  // K tile and V tile go in separate commit groups, so S = Q K^T can start before V lands.
  auto copy_kv_tile = [&](int tile, int buffer) {
    const uint32_t buffer_offset = buffer * kStageBytes + kv_copy_smem;
    int64_t offsets[kKvRowsPerThread];
#pragma unroll
    for (int i = 0; i < kKvRowsPerThread; ++i) {
      const int key = tile * kBlockN + kv_copy_row + i * kKvRowStep;
      offsets[i] = (int64_t(block_ids[i]) * block_size + (key & (block_size - 1))) * slot_stride +
                   head_offset;
      cp_async_16(stage_k_addr + buffer_offset + i * kKvCopyStepBytes,
                  key < kv_end ? k_cache + offsets[i] : k_cache, key < kv_end);
    }
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < kKvRowsPerThread; ++i) {
      const int key = tile * kBlockN + kv_copy_row + i * kKvRowStep;
      cp_async_16(stage_v_addr + buffer_offset + i * kKvCopyStepBytes,
                  key < kv_end ? v_cache + offsets[i] : v_cache, key < kv_end);
    }
    cp_async_commit();
  };
  // kFp8: a landed e4m3 tile widened into the bf16 tile at `tile_addr` (swizzled), 16 values (two
  // bf16 chunks) per thread and pass.
  auto widen_tile = [&](uint32_t stage_addr, uint32_t tile_addr) {
    const unsigned char* stage = smem + (stage_addr - s_q_addr);
#pragma unroll
    for (int i = tid; i < kTileElems / 16; i += kThreads) {
      const int row = i / (HEAD_DIM / 16), pair = i % (HEAD_DIM / 16);
      const uint4 raw = *reinterpret_cast<const uint4*>(stage + i * 16);
      uint4* dst = reinterpret_cast<uint4*>(smem + (tile_addr - s_q_addr));
      dst[swizzle<HEAD_DIM>(row, 2 * pair) / 8] = e4m3x8_to_bf16x8(make_uint2(raw.x, raw.y));
      dst[swizzle<HEAD_DIM>(row, 2 * pair + 1) / 8] = e4m3x8_to_bf16x8(make_uint2(raw.z, raw.w));
    }
  };

  // Accumulator fragments (mma m16n8 C layout): thread holds rows g and g + 8 of the warp's 16,
  // columns 2t and 2t + 1 of each 8-wide n-tile.
  const int g = lane / 4;
  const int t = lane % 4;
  float o[HEAD_DIM / 8][4];
#pragma unroll
  for (int d = 0; d < HEAD_DIM / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  uint32_t q_frag[HEAD_DIM / 16][4];

  if (num_kv_tiles > 0) {
    const bf16* q_rows = args.q + int64_t(q_start + m0) * args.q_stride + head * HEAD_DIM +
                         copy_chunk * 8;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = copy_row + i * kRowStep;
      const bool valid = m0 + row < q_len;
      cp_async_16(s_q_addr + copy_smem + i * kCopyStepBytes,
                  valid ? q_rows + int64_t(row) * args.q_stride : args.q, valid);
    }
    read_block_ids(0);
    copy_kv_tile(0, 0);  // groups: {Q, K0}, {V0}
  }

  // ldmatrix lane addressing: lane supplies row (lane % 8) of matrix lane / 8.
  const int lane_row = lane & 7;
  const int warp_first_pos = first_pos + m0 + warp * 16;

  for (int n = 0; n < num_kv_tiles; ++n) {
    const int buffer = n & 1;
    const bool has_next = n + 1 < num_kv_tiles;
    if (has_next) read_block_ids(n + 1);  // in flight while we wait below
    cp_async_wait<1>();                   // K_n (and Q) landed; V_n may be pending
    __syncthreads();                      // ... for all threads; buffers of n-1 are free
    if constexpr (kFp8) widen_tile(stage_k_addr + buffer * kStageBytes, s_k_addr);

    if (n == 0) {
      // A fragments of Q: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15) of each 16-col slice.
      const int row = warp * 16 + lane_row + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        ldmatrix_x4(q_frag[kk],
                    s_q_addr + swizzle<HEAD_DIM>(row, kk * 2 + (lane >> 4)) * sizeof(bf16));
      }
    }
    if (has_next) {
      copy_kv_tile(n + 1, buffer ^ 1);
    } else {
      cp_async_commit();  // empty groups keep the wait counts uniform
      cp_async_commit();
    }
    if constexpr (kFp8) __syncthreads();  // the widened K tile

    // S = Q K^T for the warp's 16 rows x 64 keys: s[j] is keys j*8 .. j*8+7.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    const uint32_t k_tile = s_k_addr + (kFp8 ? 0 : buffer) * kTileElems * sizeof(bf16);
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
      for (int jp = 0; jp < kBlockN / 16; ++jp) {
        // B fragments of keys jp*16 .. +15: matrices (keys 0-7 | 8-15) x (dims 0-7 | 8-15).
        uint32_t b[4];
        const int key = jp * 16 + lane_row + (lane >> 4) * 8;
        ldmatrix_x4(b, k_tile + swizzle<HEAD_DIM>(key, kk * 2 + ((lane >> 3) & 1)) * sizeof(bf16));
        mma_bf16_16816(s[2 * jp], q_frag[kk], b[0], b[1]);
        mma_bf16_16816(s[2 * jp + 1], q_frag[kk], b[2], b[3]);
      }
    }

    const int key0 = n * kBlockN;
    if (key0 + kBlockN - 1 > warp_first_pos) {  // tile crosses this warp's diagonal
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + j * 8 + 2 * t + (e & 1);
          const int pos = warp_first_pos + g + (e >> 1) * 8;
          if (key > pos) s[j][e] = -INFINITY;
        }
      }
    }

    // Online softmax; each row's 64 scores are spread over the 4 threads of a quad.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        tile_max = fmaxf(tile_max, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[r], tile_max);
      // A row with every key so far masked keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
      const float base = new_max == -INFINITY ? 0.f : new_max * scale_log2;
      const float alpha = fast_exp2(row_max[r] * scale_log2 - base);
      row_max[r] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        s[j][2 * r] = fast_exp2(fmaf(s[j][2 * r], scale_log2, -base));
        s[j][2 * r + 1] = fast_exp2(fmaf(s[j][2 * r + 1], scale_log2, -base));
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * alpha + sum;  // per-thread partial; the quad sums at the end
#pragma unroll
      for (int d = 0; d < HEAD_DIM / 8; ++d) {
        o[d][2 * r] *= alpha;
        o[d][2 * r + 1] *= alpha;
      }
    }

    // P as bf16 A fragments: the C layout of n-tiles 2kk, 2kk+1 is the A layout of k-slice kk.
    uint32_t p_frag[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      p_frag[kk][0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
      p_frag[kk][1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
      p_frag[kk][2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      p_frag[kk][3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }

    cp_async_wait<2>();  // V_n landed (K_{n+1}, V_{n+1} may be pending)
    __syncthreads();
    if constexpr (kFp8) {
      widen_tile(stage_v_addr + buffer * kStageBytes, s_v_addr);
      __syncthreads();
    }

    // O += P V: B fragments via ldmatrix.trans of (keys 0-7 | 8-15) x (dims 0-7 | 8-15).
    const uint32_t v_tile = s_v_addr + (kFp8 ? 0 : buffer) * kTileElems * sizeof(bf16);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const int key = kk * 16 + lane_row + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_tile + swizzle<HEAD_DIM>(key, dp * 2 + (lane >> 4)) * sizeof(bf16));
        mma_bf16_16816(o[2 * dp], p_frag[kk], b[0], b[1]);
        mma_bf16_16816(o[2 * dp + 1], p_frag[kk], b[2], b[3]);
      }
    }
  }

  // Normalise and stage the warp's 16 rows in its own rows of the Q tile (no other warp reads
  // them), then write whole 16-byte chunks.
  float inv_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv_sum[r] = sum > 0.f ? 1.f / sum : 0.f;
    if constexpr (kFp8) inv_sum[r] *= args.kv.v_scale;
  }
#pragma unroll
  for (int d = 0; d < HEAD_DIM / 8; ++d) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + g + r * 8;
      *reinterpret_cast<uint32_t*>(s_q + swizzle<HEAD_DIM>(row, d) + 2 * t) =
          pack_bf16x2(o[d][2 * r] * inv_sum[r], o[d][2 * r + 1] * inv_sum[r]);
    }
  }
  __syncwarp();
  const int out_stride = args.num_q_heads * HEAD_DIM;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int row = warp * 16 + idx / kChunks;
    const int chunk = idx % kChunks;
    if (m0 + row < q_len) {
      *reinterpret_cast<uint4*>(args.out + int64_t(q_start + m0 + row) * out_stride +
                                head * HEAD_DIM + chunk * 8) =
          *reinterpret_cast<const uint4*>(s_q + swizzle<HEAD_DIM>(row, chunk));
    }
  }
}

}  // namespace

void paged_prefill_attention(const PrefillAttentionArgs& args, cudaStream_t stream) {
  const PagedKv& kv = args.kv;
  require(args.num_q_heads > 0 && kv.num_kv_heads > 0 && args.num_q_heads % kv.num_kv_heads == 0,
          "prefill attention: num_q_heads (" + std::to_string(args.num_q_heads) +
              ") must be a positive multiple of num_kv_heads (" + std::to_string(kv.num_kv_heads) +
              ")");
  require(kv.block_size > 0 && (kv.block_size & (kv.block_size - 1)) == 0,
          "prefill attention: block_size " + std::to_string(kv.block_size) +
              " must be a power of two");
  require(args.q_stride % 8 == 0 && args.q_stride >= args.num_q_heads * kv.head_dim,
          "prefill attention: q_stride " + std::to_string(args.q_stride) +
              " must be a multiple of 8 (16-byte rows) and at least num_q_heads * head_dim");
  require(args.max_q_len >= 0 && ceil_div(args.max_q_len, kBlockM) <= 65535,
          "prefill attention: max_q_len " + std::to_string(args.max_q_len) +
              " out of range; split the prefill into chunks of at most " +
              std::to_string(65535 * kBlockM) + " tokens");
  if (args.num_seqs == 0 || args.total_q == 0 || args.max_q_len == 0) return;

  const bool fp8 = kv.dtype == KvDtype::kFp8E4m3;
  require_kv_scales("prefill attention", kv.dtype, kv.k_scale, kv.v_scale);
  DISPATCH_HEAD_DIM(kv.head_dim, HEAD_DIM, [&] {
    const size_t smem_bytes =
        fp8 ? prefill_smem_bytes<HEAD_DIM, true>() : prefill_smem_bytes<HEAD_DIM, false>();
    auto kernel = fp8 ? prefill_attention_kernel<HEAD_DIM, true>
                      : prefill_attention_kernel<HEAD_DIM, false>;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem_bytes)));
    const dim3 grid(args.num_seqs * args.num_q_heads, ceil_div(args.max_q_len, kBlockM));
    kernel<<<grid, kThreads, smem_bytes, stream>>>(args, args.scale * (fp8 ? kv.k_scale : 1.f) * kLog2e);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace nanograph
