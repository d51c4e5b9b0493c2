"""Benchmark cases for Gemm (cuBLASLt linear): Qwen3-0.6B projections at decode and small-prefill
token counts, plus one large square GEMM to compare with cuBLAS's peak."""
import torch

from nanograph import ops

from .gemv import SHAPES

# (name, N, K): out[M, N] = x[M, K] @ W[N, K].T
QWEN3_0_6B = [(name.removeprefix("0.6B "), N, K) for name, N, K in SHAPES if name.startswith("0.6B ")]


def _case(gemm, label, M, w):
    N, K = w.shape
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    gemm.linear(x, w, None, out)  # build the plan outside the timed calls
    bytes_moved = 2 * (N * K + M * K + M * N)
    return (f"gemm {label} M={M} N={N} K={K}", lambda: gemm.linear(x, w, None, out), bytes_moved,
            2 * M * N * K)


def cases():
    gemm = ops.Gemm()
    for name, N, K in QWEN3_0_6B:
        w = (torch.randn(N, K, device="cuda") * K**-0.5).to(torch.bfloat16)
        for M in (1, 64):
            yield _case(gemm, name, M, w)
    w = (torch.randn(4096, 4096, device="cuda") * 4096**-0.5).to(torch.bfloat16)
    yield _case(gemm, "square", 8192, w)
