"""Benchmark cases for the small-M GEMV at decode batch 1, 8, 16 and 32, on Qwen3-0.6B and
Qwen3-8B projections, each beside torch.matmul (cuBLAS) on the same inputs.

The driver replays one CUDA graph of 20 launches, and matrices under ~50 MB would otherwise stay
in the H200's L2 between launches. So each case cycles through distinct weight copies (a counter
advanced per call; each captured launch bakes in its own pointer): at least 200 MB of them where
20 copies reach that, else 20 copies. Below 10 MB a matrix therefore rotates through less than
200 MB (o_proj: 20 x 4 MB = 80 MB, still above L2's 50 MB).
"""
import itertools

import torch

from nanograph import ops

# (name, N, K): out[M, N] = x[M, K] @ W[N, K].T
SHAPES = [
    ("0.6B qkv", 4096, 1024),
    ("0.6B o", 1024, 2048),
    ("0.6B gate_up", 6144, 1024),
    ("0.6B down", 1024, 3072),
    ("0.6B lm_head", 151936, 1024),
    ("8B qkv", 6144, 4096),
    ("8B o", 4096, 4096),
    ("8B gate_up", 24576, 4096),
    ("8B down", 4096, 12288),
    ("8B lm_head", 151936, 4096),
]
TOKEN_COUNTS = (1, 8, 16, 32)
GRAPH_LAUNCHES = 20  # launches per graph in benchmarks/bench_kernels.py
ROTATION_BYTES = 200 << 20


def weight_copies(N, K):
    bytes_each = 2 * N * K
    count = min(GRAPH_LAUNCHES, max(2, -(-ROTATION_BYTES // bytes_each)))
    return [(torch.randn(N, K, device="cuda") * K**-0.5).to(torch.bfloat16) for _ in range(count)]


def rotating(launch, weights):
    """A zero-argument callable that runs launch(w) on the next weight copy each call."""
    cycle = itertools.cycle(weights)
    return lambda: launch(next(cycle))


def _cases_for(name, M, weights):
    N, K = weights[0].shape
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    bytes_moved = 2 * (N * K + M * K + M * N)
    shape = f"M={M} N={N} K={K}"
    yield (f"gemv {name} {shape}", rotating(lambda w: ops.gemv(x, w, None, out), weights),
           bytes_moved, 0)
    yield (f"torch.matmul {name} {shape}",
           rotating(lambda w: torch.matmul(x, w.T, out=out), weights), bytes_moved, 0)


def cases():
    for name, N, K in SHAPES:
        weights = weight_copies(N, K)
        for M in TOKEN_COUNTS:
            yield from _cases_for(name, M, weights)
