// SiLU-and-multiply for the gated MLP: out[r, j] = silu(gate[r, j]) * up[r, j], in fp32, stored
// as bf16 (one rounding, at the end).
//
// Layouts: gate_up [rows, 2 * inter] bf16 (gate in columns [0, inter), up in [inter, 2 * inter),
// the fused gate/up projection's output); out [rows, inter] bf16; inter a multiple of 8.
// Launch: one thread per 16-byte output vector over a flat grid of rows * inter / 8 vectors:
// the kernel is memory-bound, so each thread does one wide load of gate, one of up, one store.
#include "activation.h"

#include "bf16x8.cuh"
#include "launch.h"
#include "silu_mul.cuh"

namespace nanograph {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    silu_mul_kernel(const bf16* __restrict__ gate_up, bf16* __restrict__ out, int64_t total_vecs,
                    int vecs_per_row) {
  wait_for_producers();  // PDL: see launch.h
  allow_dependents();
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= total_vecs) return;
  const int64_t row = idx / vecs_per_row;
  const int col = static_cast<int>(idx - row * vecs_per_row) * 8;
  const int inter = vecs_per_row * 8;
  const bf16* gate_row = gate_up + row * 2 * inter;
  const Float8 gate = load_bf16x8(gate_row + col);
  const Float8 up = load_bf16x8(gate_row + inter + col);
  Float8 result;
#pragma unroll
  for (int k = 0; k < 8; ++k) result.v[k] = silu_mul_value(gate.v[k], up.v[k]);
  store_bf16x8(out + row * inter + col, result);
}

}  // namespace

void silu_mul(const bf16* gate_up, bf16* out, int rows, int inter, cudaStream_t stream) {
  require(inter > 0 && inter % 8 == 0,
          "silu_mul: intermediate size " + std::to_string(inter) +
              " must be a positive multiple of 8 (rows are processed as 16-byte vectors)");
  require(reinterpret_cast<uintptr_t>(gate_up) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
          "silu_mul: gate_up and out must be 16-byte aligned (pass whole-row slices)");
  const int64_t total_vecs = static_cast<int64_t>(rows) * (inter / 8);
  if (total_vecs == 0) return;
  const int64_t blocks = (total_vecs + kThreads - 1) / kThreads;
  launch_pdl(silu_mul_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
             gate_up, out, total_vecs, inter / 8);
}

}  // namespace nanograph
