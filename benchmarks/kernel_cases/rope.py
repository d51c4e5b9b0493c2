"""Benchmark cases for the fused QK-norm + RoPE + K/V cache store (memory-bound)."""
import torch

EPS = 1e-6
MAX_POSITION = 32768
BLOCK_SIZE = 16


def _case(num_tokens, nq, nkv, hd, qk_norm):
    from nanograph import ops

    dev = "cuda"
    qkv = torch.randn(num_tokens, (nq + 2 * nkv) * hd, device=dev).bfloat16()
    qw = kw = None
    if qk_norm:
        qw, kw = (torch.rand(hd, device=dev) + 0.5).bfloat16(), (torch.rand(hd, device=dev) + 0.5).bfloat16()
    cos_sin = torch.randn(MAX_POSITION, hd, device=dev)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=dev, dtype=torch.int32)
    num_blocks = (2 * num_tokens) // BLOCK_SIZE + 1
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev)[:num_tokens].to(torch.int32)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, nkv, hd, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)

    def fn():
        ops.qk_norm_rope_kv_store(qkv, qw, kw, cos_sin, positions, slots, k_cache, v_cache, nq, nkv, EPS)

    # Read q, k, v and one cos/sin row per token; write q, k back and k, v to the cache.
    qk = num_tokens * (nq + nkv) * hd * 2
    kv = num_tokens * nkv * hd * 2
    bytes_moved = (qk + kv) + qk + 2 * kv + num_tokens * (hd * 4 + 8)
    label = f"rope_kv T={num_tokens} q{nq}/kv{nkv} hd{hd} {'qk_norm' if qk_norm else 'no_norm'}"
    return label, fn, bytes_moved, 0


def cases():
    yield _case(8192, 32, 8, 128, qk_norm=True)   # Qwen3-8B prefill
    yield _case(8192, 32, 8, 128, qk_norm=False)  # Llama-3-8B prefill
    yield _case(16384, 64, 8, 128, qk_norm=True)  # Qwen3-32B long prefill
    yield _case(8192, 16, 8, 64, qk_norm=True)    # head_dim 64
    yield _case(256, 32, 8, 128, qk_norm=True)    # decode batch
