"""Benchmark cases for the memory-bound layer kernels: embedding, RMSNorm, SiLU-and-mul, argmax, sampling.

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

    # The sampler's kernel over a decode step's logits (one read of the rows; the race of a sampled row reads each
    # logit once): greedy, the throughput benchmark's temperature 0.6, top-k 50 with top-p 0.9, Qwen3's generation
    # defaults (temperature 0.6, top-k 20, top-p 0.95) and top-p 0.9 alone (Llama 3's). Logits of scale 4 (peaked)
    # and 1 (flat, where more tokens enter the race).
    keys = torch.arange(ROWS, dtype=torch.int64, device="cuda") * 7919
    ones, zeros = torch.ones(ROWS, device="cuda"), torch.zeros(ROWS, device="cuda")
    no_top_k = torch.zeros(ROWS, dtype=torch.int32, device="cuda")
    drawn = torch.empty(ROWS, dtype=torch.int64, device="cuda")
    for scale in (4.0, 1.0):
        scaled = (torch.randn(ROWS, VOCAB, device="cuda") * scale).to(BF16)
        for name, temperature, top_k, top_p in [("greedy", 0.0, no_top_k, ones),
                                                ("temperature 0.6", 0.6, no_top_k, ones),
                                                ("top_k 50 top_p 0.9", 1.0, no_top_k + 50, ones * 0.9),
                                                ("temperature 0.6 top_k 20 top_p 0.95", 0.6, no_top_k + 20,
                                                 ones * 0.95),
                                                ("temperature 0.6 top_p 0.9", 0.6, no_top_k, ones * 0.9)]:
            temperatures = ones * temperature
            yield (f"sample_rows {ROWS}x{VOCAB} {name}, logits x{scale:g}",
                   lambda s=scaled, t=temperatures, k=top_k, p=top_p: ops.sample_rows(s, t, k, p, zeros, keys, drawn),
                   ROWS * VOCAB * 2 + ROWS * 8, 0)
