"""Benchmark cases for the FP8-weight GEMV (e4m3, one float32 scale per 8 rows x 128 columns) at
decode batch 1, 8 and 16 (gemv.py's TOKEN_COUNTS up to GEMV_FP8_MAX_M) on the Qwen3-0.6B and
Qwen3-8B projections, each beside the bf16 GEMV on the same shape, and gate_up also as the gated
GEMV a decode step runs; bytes moved count the e4m3 weight, its scales, x and out. Weight copies
rotate as in benchmarks/kernel_cases/gemv.py, so that no matrix stays in L2."""

import torch

from nanograph import ops

from .gemv import GRAPH_LAUNCHES, ROTATION_BYTES, SHAPES, TOKEN_COUNTS, rotating, weight_copies

PROJECTIONS = [(name, N, K) for name, N, K in SHAPES if "lm_head" not in name]  # lm_head stays bf16


def fp8_copies(N, K):
    count = min(GRAPH_LAUNCHES, max(2, -(-ROTATION_BYTES // (N * K))))
    scale_shape = (-(-N // 8), -(-K // 128))
    return [((torch.randn(N, K, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
             torch.rand(scale_shape, device="cuda") * K**-0.5 / 64) for _ in range(count)]


def cases():
    for name, N, K in PROJECTIONS:
        fp8, bf16 = fp8_copies(N, K), weight_copies(N, K)
        for M in (M for M in TOKEN_COUNTS if M <= ops.GEMV_FP8_MAX_M):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            shape = f"M={M} N={N} K={K}"
            act = 2 * (M * K + M * N)
            yield (f"gemv_fp8 {name} {shape}",
                   rotating(lambda w: ops.gemv_fp8(x, w[0], w[1], None, out), fp8),
                   N * K + 4 * fp8[0][1].numel() + act, 0)
            yield (f"gemv bf16 {name} {shape}", rotating(lambda w: ops.gemv(x, w, None, out), bf16),
                   2 * N * K + act, 0)
            if "gate_up" in name:  # what a decode step runs: the gated product in the epilogue
                inter = N // 2
                gated = torch.empty(M, inter, device="cuda", dtype=torch.bfloat16)
                yield (f"gemv_silu_mul_fp8 {name} M={M} inter={inter} K={K}",
                       rotating(lambda w: ops.gemv_silu_mul_fp8(x, w[0], w[1], gated), fp8),
                       N * K + 4 * fp8[0][1].numel() + 2 * (M * K + M * inter), 0)
        del fp8, bf16
