"""Benchmark cases for the memory-bound layer kernels: embedding, RMSNorm, SiLU-and-mul, argmax.

Shapes are a 256-token decode/prefill batch of a Qwen3-8B-sized model (hidden 4096, MLP 12288,
vocabulary 151936). All kernels are memory-bound, so flops = 0 and bytes_moved counts each
tensor read or written once.
"""
import torch

from nanograph import ops

BF16 = torch.bfloat16
ROWS = 256
HIDDEN = 4096
INTER = 12288
VOCAB = 151936
EPS = 1e-6


def _randn(*shape):
    return torch.randn(*shape, device="cuda").to(BF16)


def cases():
    x, residual, weight, out = _randn(ROWS, HIDDEN), _randn(ROWS, HIDDEN), _randn(HIDDEN), _randn(ROWS, HIDDEN)
    row_bytes = ROWS * HIDDEN * 2
    yield (f"rmsnorm {ROWS}x{HIDDEN}", lambda: ops.rmsnorm(x, weight, out, EPS),
           2 * row_bytes + HIDDEN * 2, 0)
    # In place: reads x and residual, writes both.
    yield (f"add_rmsnorm {ROWS}x{HIDDEN}", lambda: ops.add_rmsnorm(x, residual, weight, EPS),
           4 * row_bytes + HIDDEN * 2, 0)

    gate_up, act = _randn(ROWS, 2 * INTER), _randn(ROWS, INTER)
    yield (f"silu_mul {ROWS}x{INTER}", lambda: ops.silu_mul(gate_up, act), 3 * ROWS * INTER * 2, 0)

    table = _randn(VOCAB, HIDDEN)
    ids = torch.randint(0, VOCAB, (ROWS,), dtype=torch.int32, device="cuda")
    yield (f"embedding {ROWS} tokens x {HIDDEN}", lambda: ops.embedding(ids, table, out),
           2 * row_bytes + ROWS * 4, 0)

    logits = _randn(ROWS, VOCAB)
    tokens = torch.empty(ROWS, dtype=torch.int32, device="cuda")
    yield (f"argmax {ROWS}x{VOCAB}", lambda: ops.argmax(logits, tokens), ROWS * VOCAB * 2 + ROWS * 4, 0)
