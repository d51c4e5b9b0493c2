// How fast could one persistent kernel per decode step run a small model's layers at batch 1?
// Qwen3-0.6B's 28 layers of projections (bf16 weights, 31.5 MB a layer):
//   qkv      y[4,096]  = W_qkv (4,096 x 1,024) . rmsnorm(x)
//   o        x[1,024] += W_o (1,024 x 2,048) . y[0:2,048]      (attention left out: o reads q)
//   gate_up  h[3,072]  = silu(W_g . rmsnorm(x)) * (W_u . rmsnorm(x))   (gate and up rows paired)
//   down     x[1,024] += W_down (1,024 x 3,072) . h
// x, y and h are float32; each op reads its input once from L2 (every CTA normalising x itself)
// and rounds it to bf16 in shared memory. Each CTA owns a fixed share of every matrix's rows. One
// producer thread streams the CTA's rows, in the order it will use them, into a ring of
// shared-memory slots with bulk copies (cp.async.bulk, a row per copy, an mbarrier per slot); the
// weights depend on nothing, so the stream runs ahead of the math by as many slots as the ring
// holds. Sixteen consumer warps take each slot's rows on tensor cores (chunk_math). What orders
// the ops differs:
//   mode 0 "persistent": one launch for the whole step, a CTA per SM; after each op every CTA
//          counts itself in a global counter, and before the next op reads its input it waits
//          until all have (release/acquire);
//   mode 1 "pdl": one launch per op (112), captured in a CUDA graph, with programmatic dependent
//          launch: a launch's producer streams from the moment its CTA is resident (with one CTA
//          per SM, as the registers allow, once the launch before has left that SM), its
//          consumers wait in griddepcontrol.wait (the engine's way between kernels);
//   mode 2 "stream": mode 0 without the waits (results wrong): no CTA waits for another;
//   mode 3 "copies alone": the ring's copies, the consumers only releasing each slot;
//   mode 4 "math alone": the consumers' work on whatever the slots hold, with no copies or waits.
// Modes 0 and 1 are checked against a float64 host reference of the same math, after one layer and
// after 28 (before and after the timed runs). Prints the median time of the 28 layers (a graph
// launch that also resets x), per layer, and the weight bytes over that time.
// Build and run on the GPU machine (an argument runs only the variants whose name holds it):
//   nvcc -std=c++17 -O3 -arch=sm_90a benchmarks/megakernel_probe.cu -o /tmp/megakernel_probe &&
//   /tmp/megakernel_probe
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define CK(x)                                                          \
  do {                                                                 \
    cudaError_t e = (x);                                               \
    if (e != cudaSuccess) {                                            \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                         \
    }                                                                  \
  } while (0)

namespace {

constexpr int kHidden = 1024, kQkv = 4096, kQ = 2048, kInter = 3072, kLayers = 28, kOps = 4;
#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 16
#endif
constexpr int kConsumerWarps = CONSUMER_WARPS;  // -DCONSUMER_WARPS=8 for 8
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 32;
constexpr float kEps = 1e-6f;
// Each op rounds its input to bf16, and a rounding that flips carries through the layers: after 28, sums
// taken in another order than the host's land about 1e-2 of the RMS of x away (a broken kernel at its
// order); after one, much nearer. Both are checked.
constexpr double kToleranceOneLayer = 1e-3, kToleranceAllLayers = 5e-2;

// One op's matrix: `rows` rows of `row_elems` bf16, each row dotted with an input of k values (a
// gate_up row holds its gate row and then its up row).
struct Op {
  int rows, k, row_elems;
  size_t offset;  // elements from the start of its layer
};
__host__ __device__ constexpr Op op_shape(int op) {
  return op == 0   ? Op{kQkv, kHidden, kHidden, 0}
         : op == 1 ? Op{kHidden, kQ, kQ, size_t(kQkv) * kHidden}
         : op == 2 ? Op{kInter, kHidden, 2 * kHidden, size_t(kQkv) * kHidden + size_t(kHidden) * kQ}
                   : Op{kHidden, kInter, kInter,
                        size_t(kQkv) * kHidden + size_t(kHidden) * kQ + size_t(kInter) * 2 * kHidden};
}
constexpr size_t kLayerElems = size_t(kQkv) * kHidden + size_t(kHidden) * kQ +
                               size_t(kInter) * 2 * kHidden + size_t(kHidden) * kInter;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}

// This CTA's rows of an op: [begin, end).
__device__ __forceinline__ int2 my_rows(int rows) {
  return make_int2(int(int64_t(rows) * blockIdx.x / gridDim.x),
                   int(int64_t(rows) * (blockIdx.x + 1) / gridDim.x));
}
// A slot holds 16 rows of qkv or 8 of the others (8 rows: the N of an m16n8k16 MMA), each row padded by
// 64 bytes so that the 8 rows one warp reads side by side fall in different shared-memory banks.
constexpr int kRowPad = 64;
__host__ __device__ constexpr int rows_per_slot(const Op& op) { return op.row_elems == kHidden ? 16 : 8; }
__host__ __device__ constexpr int row_stride(const Op& op) { return op.row_elems * 2 + kRowPad; }
constexpr int kSlotBytes = 8 * (kInter * 2 + kRowPad);  // the largest: 8 rows of down
static_assert(16 * row_stride(op_shape(0)) <= kSlotBytes, "16 rows of qkv fit a slot");
constexpr int kPartFloats = 2 * 2 * kConsumerWarps * 8;  // two buffers of (gate, up) x warps x 8 rows

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// One slot of an op's rows (n rows from row0) against xs, on tensor cores: the rows are the MMA's N
// (8 a group), x is row 0 of its A (rows 1-15 zero), and the warps split K. A lane (g, t) loads 16
// bytes of row g at column 8t of each 32-column step, and lanes 0-3 the same columns of x, so that
// both operands meet each column at the same MMA position (the order of a sum's terms is all that
// changes). Lanes 0-3 then hold the step's 8 row sums; the warps' sums meet in `part`.
template <int KIND, int MODE>
__device__ __forceinline__ void chunk_math(const unsigned char* slot, int n, int row0, const __nv_bfloat16* xs,
                                           const float* xraw, float* part, uint64_t* empty, float* x, float* y,
                                           float* h) {
  constexpr Op op = op_shape(KIND);
  constexpr int kGroups = rows_per_slot(op) / 8;
  constexpr int kWarpsPerGroup = kConsumerWarps / kGroups;
  constexpr int kCols = op.k / kWarpsPerGroup;
  constexpr int kSteps = kCols / 32;
  constexpr int kHalves = op.row_elems / op.k;  // gate_up: the gate row, then the up row
  static_assert(kCols % 32 == 0 && kSteps > 0, "each warp takes whole 32-column steps");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int group = warp / kWarpsPerGroup, k0 = (warp % kWarpsPerGroup) * kCols;
  const unsigned char* row = slot + (group * 8 + g) * row_stride(op);
  uint4 wv[kHalves][kSteps];
#pragma unroll
  for (int q = 0; q < kHalves; ++q)
#pragma unroll
    for (int i = 0; i < kSteps; ++i)
      wv[q][i] = *reinterpret_cast<const uint4*>(row + (q * op.k + k0 + i * 32 + 8 * t) * 2);
  __syncwarp();
  if (lane == 0 && MODE != 4) mbar_arrive(empty);  // this warp's bytes are in registers
  float c[kHalves][4] = {};
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const uint4 xv = g == 0 ? *reinterpret_cast<const uint4*>(xs + k0 + i * 32 + 8 * t) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int q = 0; q < kHalves; ++q) {
      mma_bf16(c[q], xv.x, xv.y, wv[q][i].x, wv[q][i].y);
      mma_bf16(c[q], xv.z, xv.w, wv[q][i].z, wv[q][i].w);
    }
  }
  if (g == 0)
#pragma unroll
    for (int q = 0; q < kHalves; ++q) {
      part[(q * kConsumerWarps + warp) * 8 + 2 * t] = c[q][0];
      part[(q * kConsumerWarps + warp) * 8 + 2 * t + 1] = c[q][1];
    }
  consumer_sync();
  if (threadIdx.x < n) {
    const int j = threadIdx.x, first = (j / 8) * kWarpsPerGroup;
    float sum[kHalves];
#pragma unroll
    for (int q = 0; q < kHalves; ++q) {
      sum[q] = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsPerGroup; ++w) sum[q] += part[(q * kConsumerWarps + first + w) * 8 + j % 8];
    }
    if (KIND == 0) y[row0 + j] = sum[0];
    if (KIND == 1 || KIND == 3) x[row0 + j] = (MODE == 1 ? __ldcg(x + row0 + j) : xraw[row0 + j]) + sum[0];
    if (KIND == 2) h[row0 + j] = sum[0] / (1.f + __expf(-sum[0])) * sum[kHalves - 1];
  }
}

// Ops [g_begin, g_end) of the step, op g being op g % 4 of layer g / 4.
template <int MODE>
__global__ void __launch_bounds__(kThreads, 1)
    layers_kernel(const __nv_bfloat16* __restrict__ w, float* x, float* y, float* h,
                  unsigned* counter, int g_begin, int g_end, int slots) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + size_t(slots) * kSlotBytes);  // kInter
  float* xraw = reinterpret_cast<float*>(xs + kInter);         // kHidden: x as the last norm read it
  float* red = xraw + kHidden;                                 // 32 floats
  float* parts = red + 32;                                     // kPartFloats
  uint64_t* full = reinterpret_cast<uint64_t*>(parts + kPartFloats);  // slots
  uint64_t* empty = full + slots;                          // slots
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (MODE == 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // the producer
    if (lane != 0 || MODE == 4) return;
    int it = 0;
    for (int g = g_begin; g < g_end; ++g) {
      const Op op = op_shape(g % kOps);
      const __nv_bfloat16* base = w + size_t(g / kOps) * kLayerElems + op.offset;
      const int2 r = my_rows(op.rows);
      const int per = rows_per_slot(op);
      for (int row = r.x; row < r.y; row += per, ++it) {
        const int s = it % slots;
        if (it >= slots) mbar_wait(&empty[s], (it / slots - 1) & 1);
        const int n = min(per, r.y - row);
        mbar_expect_tx(&full[s], unsigned(n * op.row_elems * 2));
        for (int j = 0; j < n; ++j)
          bulk_copy(ring + size_t(s) * kSlotBytes + j * row_stride(op), base + size_t(row + j) * op.row_elems,
                    unsigned(op.row_elems * 2), &full[s]);
      }
    }
    return;
  }

  // The consumers.
  int it = 0;
  for (int g = g_begin; g < g_end; ++g) {
    const int kind = g % kOps;
    const Op op = op_shape(kind);
    if (MODE == 3) {  // the copies alone
      const int2 r = my_rows(op.rows);
      for (int row0 = r.x; row0 < r.y; row0 += rows_per_slot(op), ++it) {
        const int s = it % slots;
        mbar_wait(&full[s], (it / slots) & 1);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
      }
      continue;
    }
    if (MODE == 0 && g > 0) {
      if (threadIdx.x == 0)
        while (ld_acquire(counter) < unsigned(g) * gridDim.x) {
        }
      consumer_sync();
    }
    if (MODE == 1 && g == g_begin) asm volatile("griddepcontrol.wait;" ::: "memory");
    // The op's input, in float, normalised where it is x.
    const float* in = kind == 1 ? y : kind == 3 ? h : x;
    // All of a thread's loads in flight at once (8 values a group): one round trip to L2 per op.
    constexpr int kGroups = (kInter / 8 + kConsumers - 1) / kConsumers;
    float4 v[kGroups][2];
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int i = (threadIdx.x + u * kConsumers) * 8;
      const bool in_range = i < op.k;
      v[u][0] = in_range ? __ldcg(reinterpret_cast<const float4*>(in + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
      v[u][1] = in_range ? __ldcg(reinterpret_cast<const float4*>(in + i + 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float scale = 1.f;
    if (kind == 0 || kind == 2) {
#pragma unroll
      for (int u = 0; u < kGroups; ++u)
        for (const float4& q : v[u]) ss += q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(~0u, ss, o);
      if (lane == 0) red[warp] = ss;
      consumer_sync();
      float total = 0.f;
#pragma unroll
      for (int i = 0; i < kConsumerWarps; ++i) total += red[i];
      scale = rsqrtf(total / kHidden + kEps);
    }
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      const int i = (threadIdx.x + u * kConsumers) * 8;
      if (i < op.k) {
        uint4 packed;
        __nv_bfloat162* p2 = reinterpret_cast<__nv_bfloat162*>(&packed);
        p2[0] = __floats2bfloat162_rn(v[u][0].x * scale, v[u][0].y * scale);
        p2[1] = __floats2bfloat162_rn(v[u][0].z * scale, v[u][0].w * scale);
        p2[2] = __floats2bfloat162_rn(v[u][1].x * scale, v[u][1].y * scale);
        p2[3] = __floats2bfloat162_rn(v[u][1].z * scale, v[u][1].w * scale);
        *reinterpret_cast<uint4*>(xs + i) = packed;
        if (kind == 0 || kind == 2) {
          *reinterpret_cast<float4*>(xraw + i) = v[u][0];
          *reinterpret_cast<float4*>(xraw + i + 4) = v[u][1];
        }
      }
    }
    consumer_sync();
    const int2 r = my_rows(op.rows);
    const int per = rows_per_slot(op);
    for (int row0 = r.x; row0 < r.y; row0 += per, ++it) {
      const int s = it % slots;
      if (MODE != 4) mbar_wait(&full[s], (it / slots) & 1);
      const int n = min(per, r.y - row0);
      const unsigned char* rows = ring + size_t(s) * kSlotBytes;
      float* part = parts + (it & 1) * (kPartFloats / 2);
      switch (kind) {
        case 0: chunk_math<0, MODE>(rows, n, row0, xs, xraw, part, empty + s, x, y, h); break;
        case 1: chunk_math<1, MODE>(rows, n, row0, xs, xraw, part, empty + s, x, y, h); break;
        case 2: chunk_math<2, MODE>(rows, n, row0, xs, xraw, part, empty + s, x, y, h); break;
        default: chunk_math<3, MODE>(rows, n, row0, xs, xraw, part, empty + s, x, y, h); break;
      }
    }
    consumer_sync();
    if (MODE != 1 && threadIdx.x == 0)  // after the barrier: releases every consumer's writes
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
  }
}

__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t v = uint32_t(i) * 2654435761u ^ uint32_t(i >> 32) * 40503u ^ seed;
    v ^= v >> 15;
    v *= 2246822519u;
    v ^= v >> 13;
    v *= 3266489917u;
    v ^= v >> 16;
    // uniform in [-1, 1); each op's rows are scaled by 1/sqrt(k) below
    p[i] = __float2bfloat16((v >> 8) * (2.f / 16777216.f) - 1.f);
  }
}
__global__ void scale_bf16(__nv_bfloat16* p, size_t n, float s) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(__bfloat162float(p[i]) * s);
}

float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

float to_bf16(float f) {  // round to nearest even, as __float2bfloat16_rn (finite values)
  uint32_t u;
  memcpy(&u, &f, 4);
  u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
}

// The same math in float64 on the host, each op's input rounded to bf16 as the kernel's.
std::vector<double> reference(const std::vector<uint16_t>& w, const std::vector<float>& x0, int layers) {
  std::vector<double> x(x0.begin(), x0.end()), y(kQkv), h(kInter), in;
  auto norm = [&](const std::vector<double>& v) {
    double ss = 0;
    for (double e : v) ss += e * e;
    const double s = 1.0 / std::sqrt(ss / kHidden + kEps);
    std::vector<double> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = to_bf16(float(float(v[i]) * float(s)));
    return o;
  };
  auto dot = [&](size_t at, const std::vector<double>& v, int k) {
    double a = 0;
    for (int i = 0; i < k; ++i) a += bf16_to_float(w[at + i]) * v[i];
    return a;
  };
  for (int l = 0; l < layers; ++l) {
    const size_t L = size_t(l) * kLayerElems;
    in = norm(x);
    for (int r = 0; r < kQkv; ++r) y[r] = dot(L + op_shape(0).offset + size_t(r) * kHidden, in, kHidden);
    in.assign(y.begin(), y.begin() + kQ);
    for (double& e : in) e = to_bf16(float(e));
    for (int r = 0; r < kHidden; ++r) x[r] += dot(L + op_shape(1).offset + size_t(r) * kQ, in, kQ);
    in = norm(x);
    for (int r = 0; r < kInter; ++r) {
      const size_t at = L + op_shape(2).offset + size_t(r) * 2 * kHidden;
      const double g = dot(at, in, kHidden), u = dot(at + kHidden, in, kHidden);
      h[r] = g / (1 + std::exp(-g)) * u;
    }
    for (double& e : h) e = to_bf16(float(e));
    for (int r = 0; r < kHidden; ++r) x[r] += dot(L + op_shape(3).offset + size_t(r) * kInter, h, kInter);
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {  // argv[1]: run only the variants whose name holds it
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, sms);
  const size_t n = kLayerElems * kLayers;
  const double weight_bytes = double(n) * 2;
  __nv_bfloat16* w;
  float *x, *y, *h, *x0;
  unsigned* counter;
  CK(cudaMalloc(&w, n * 2));
  CK(cudaMalloc(&x, kHidden * 4));
  CK(cudaMalloc(&x0, kHidden * 4));
  CK(cudaMalloc(&y, kQkv * 4));
  CK(cudaMalloc(&h, kInter * 4));
  CK(cudaMalloc(&counter, 4));
  fill_bf16<<<1024, 256>>>(w, n, 12345u);
  for (int l = 0; l < kLayers; ++l)
    for (int o = 0; o < kOps; ++o) {
      const Op op = op_shape(o);
      scale_bf16<<<256, 256>>>(w + size_t(l) * kLayerElems + op.offset, size_t(op.rows) * op.row_elems,
                               1.f / std::sqrt(float(op.k)));
    }
  std::vector<float> hx0(kHidden);
  for (int i = 0; i < kHidden; ++i) hx0[i] = std::sin(0.37f * i + 1.f) + 0.25f * std::cos(1.3f * i);
  CK(cudaMemcpy(x0, hx0.data(), kHidden * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> hw(n);
  CK(cudaMemcpy(hw.data(), w, n * 2, cudaMemcpyDeviceToHost));
  const std::vector<double> ref_one = reference(hw, hx0, 1), ref_all = reference(hw, hx0, kLayers);

  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto smem_bytes = [](int slots) {
    return size_t(slots) * kSlotBytes + kInter * 2 + kHidden * 4 + 32 * 4 + kPartFloats * 4 + 2 * slots * 8;
  };
  auto kernel = [](int mode) {
    return mode == 0 ? layers_kernel<0> : mode == 1 ? layers_kernel<1> : mode == 2 ? layers_kernel<2>
         : mode == 3 ? layers_kernel<3> : layers_kernel<4>;
  };
  for (auto k : {layers_kernel<0>, layers_kernel<1>, layers_kernel<2>, layers_kernel<3>, layers_kernel<4>})
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes(4))));

  // One step of `mode` over the first `layers` layers on the stream (x reset from x0 first).
  auto launch = [&](int mode, int slots, int grid, int layers) {
    CK(cudaMemcpyAsync(x, x0, kHidden * 4, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemsetAsync(counter, 0, 4, st));
    const int total = layers * kOps;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem_bytes(slots);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    if (mode == 1) {
      cfg.numAttrs = 1;
      for (int g = 0; g < total; ++g)
        CK(cudaLaunchKernelEx(&cfg, layers_kernel<1>, (const __nv_bfloat16*)w, x, y, h, counter, g, g + 1, slots));
    } else {
      cfg.numAttrs = 0;
      CK(cudaLaunchKernelEx(&cfg, kernel(mode), (const __nv_bfloat16*)w, x,
                            y, h, counter, 0, total, slots));
    }
  };
  struct Variant {
    const char* name;
    int mode, slots, grid;
  };
  const Variant variants[] = {
      {"persistent, 4 slots", 0, 4, sms}, {"persistent, 2 slots", 0, 2, sms},
      {"pdl, 2 slots, grid 1 x SMs", 1, 2, sms}, {"pdl, 2 slots, grid 2 x SMs", 1, 2, 2 * sms},
      {"stream, 4 slots", 2, 4, sms}, {"copies alone, 4 slots", 3, 4, sms}, {"math alone", 4, 4, sms},
  };
  // max |x - ref| / rms(ref) after a graph of `layers` layers; infinite if x holds a NaN or an infinity.
  auto check = [&](cudaGraphExec_t exec, const std::vector<double>& ref) {
    if (exec != nullptr) CK(cudaGraphLaunch(exec, st));
    CK(cudaStreamSynchronize(st));
    std::vector<float> got(kHidden);
    CK(cudaMemcpy(got.data(), x, kHidden * 4, cudaMemcpyDeviceToHost));
    double err = 0, rms = 0;
    for (int i = 0; i < kHidden; ++i) {
      const double d = std::fabs(got[i] - ref[i]);
      err = std::isfinite(d) ? std::max(err, d) : INFINITY;
      rms += ref[i] * ref[i];
    }
    return err / std::sqrt(rms / kHidden);
  };
  auto graph_of = [&](const Variant& v, int layers) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    launch(v.mode, v.slots, v.grid, layers);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphDestroy(graph));
    return exec;
  };
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  printf("variant | check: max |err| / rms of x after 1 layer; after 28, before and after the timed runs | "
         "median us for 28 layers | us per layer | weight TB/s\n");
  for (int round = 0; round < 2; ++round)
    for (const Variant& v : variants) {
      if (argc > 1 && !strstr(v.name, argv[1])) continue;
      int per_sm = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, kernel(v.mode), kThreads,
          smem_bytes(v.slots)));
      if (v.mode != 1 && per_sm * sms < v.grid) {
        printf("%s: only %d CTAs per SM fit, skipped\n", v.name, per_sm);
        continue;
      }
      cudaGraphExec_t one = graph_of(v, 1), exec = graph_of(v, kLayers);
      const double err_one = check(one, ref_one), err_first = check(exec, ref_all);
      CK(cudaGraphExecDestroy(one));
      std::vector<float> ms;
      for (int r = 0; r < 60; ++r) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(exec, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float t;
        CK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
      }
      const double err_last = check(nullptr, ref_all);  // x of the last timed run
      std::sort(ms.begin(), ms.end());
      // Each timed interval holds one whole graph: the reset (two small nodes) and the step.
      const double us = ms[ms.size() / 2] * 1e3;
      const bool ok = err_one < kToleranceOneLayer && std::max(err_first, err_last) < kToleranceAllLayers;
      printf("%s (%d CTAs/SM fit) | %.1e; %.1e, %.1e%s | %.1f | %.2f | %.2f\n", v.name, per_sm, err_one, err_first,
             err_last, v.mode >= 2 ? " (results wrong by design)" : ok ? " ok" : " WRONG", us, us / kLayers,
             weight_bytes / us / 1e6);
      CK(cudaGraphExecDestroy(exec));
    }
  return 0;
}
