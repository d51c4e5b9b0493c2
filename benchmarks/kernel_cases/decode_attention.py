"""Benchmark cases for paged decode attention (memory-bound: every cached K and V byte is read once)."""
import math

import torch


def _case(lens, nq, nkv, hd, block_size, max_context_len, label, ordered=False, fp8=False):
    """fp8: an e4m3 cache (scales 0.5 for K, 2.0 for V), one byte per value."""
    from nanograph import ops

    dev = "cuda"
    width = math.ceil(max_context_len / block_size)
    num_seqs = len(lens)
    num_blocks = num_seqs * width
    k_cache = torch.randn(num_blocks, block_size, nkv, hd, device=dev).bfloat16()
    v_cache = torch.randn_like(k_cache)
    scales = {}
    if fp8:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        scales = dict(k_scale=0.5, v_scale=2.0)
        label += " fp8"
    block_tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(num_seqs, width)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(num_seqs, (nq + 2 * nkv) * hd, device=dev).bfloat16()
    out = torch.empty(num_seqs, nq * hd, device=dev, dtype=torch.bfloat16)
    workspace = torch.zeros(  # zero-filled once: its arrival counters are zero at rest
        max(ops.decode_attention_workspace_bytes(num_seqs, nq, hd, max_context_len) // 4, 1), device=dev)

    seq_order = None
    if ordered:  # longest first, as the engine's decode steps take them
        seq_order = torch.empty_like(context_lens)
        ops.order_by_length(context_lens, seq_order)
        label += " longest-first"

    def fn():
        ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, nq, hd**-0.5,
                                   max_context_len, workspace, seq_order, **scales)

    bytes_moved = sum(lens) * nkv * hd * 2 * k_cache.element_size() + num_seqs * nq * hd * 2 * 2
    return f"decode_attn {label} q{nq}/kv{nkv} hd{hd} bs{block_size}", fn, bytes_moved, 0


def cases():
    yield _case([4096] * 64, 32, 8, 128, 16, 4096, "64x4096")
    yield _case([4096] * 64, 32, 8, 128, 256, 4096, "64x4096")
    yield _case([1024] * 256, 32, 8, 128, 16, 1024, "256x1024")
    g = torch.Generator().manual_seed(0)
    yield _case(torch.randint(1024, 2049, (256,), generator=g).tolist(), 32, 8, 128, 16, 2048,
                "256x(1k-2k)")
    # Qwen3-0.6B's heads at the throughput benchmark's batch (contexts of 100..2,047 tokens).
    mixed = torch.randint(100, 2048, (256,), generator=g).tolist()
    yield _case(mixed, 16, 8, 128, 16, 2048, "256x(100-2k)")
    yield _case(mixed, 16, 8, 128, 16, 2048, "256x(100-2k)", ordered=True)
    # Half the batch (one split: 1,024 CTAs) and a quarter (2 splits of 1,024 keys, so sequences over 1,024 take
    # two CTAs).
    yield _case(mixed[:128], 16, 8, 128, 16, 2048, "128x(100-2k)")
    yield _case(mixed[:128], 16, 8, 128, 16, 2048, "128x(100-2k)", ordered=True)
    yield _case(mixed[:64], 16, 8, 128, 16, 2048, "64x(100-2k)", ordered=True)
    yield _case([1024] * 256, 16, 8, 128, 16, 1024, "256x1024")
    # The decode rows of prefill_attention's mixed case, through this kernel.
    from .prefill_attention import mixed_decode_contexts
    yield _case(mixed_decode_contexts(), 16, 8, 128, 16, 1152, "255x(1024-1152)", ordered=True)
    yield _case([32768], 32, 8, 128, 16, 32768, "1x32768")
    yield _case([16384] * 4, 32, 8, 128, 16, 16384, "4x16384")
    # Batch 1 of Qwen3-0.6B's heads under the model's whole context: the work follows the length.
    for length in (128, 1024, 2048, 4096, 16000, 40960):
        yield _case([length], 16, 8, 128, 16, 40960, f"1x{length} of 40960")
    yield _case([16000] * 2, 16, 8, 128, 16, 40960, "2x16000 of 40960")
    yield _case([4096] * 64, 16, 8, 64, 16, 4096, "64x4096")
    yield _case([4096] * 64, 64, 8, 128, 16, 4096, "64x4096")
    # An FP8 cache: half the bytes of the cases above.
    yield _case([4096] * 64, 32, 8, 128, 16, 4096, "64x4096", fp8=True)
    yield _case([1024] * 256, 32, 8, 128, 16, 1024, "256x1024", fp8=True)
    yield _case(mixed, 16, 8, 128, 16, 2048, "256x(100-2k)", ordered=True, fp8=True)
    yield _case([32768], 32, 8, 128, 16, 32768, "1x32768", fp8=True)
    yield _case([16384] * 4, 32, 8, 128, 16, 16384, "4x16384", fp8=True)
    yield _case([128], 16, 8, 128, 16, 40960, "1x128 of 40960", fp8=True)
