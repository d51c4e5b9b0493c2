"""Paged prefill attention at a long causal prefill: 8 sequences x 2048 tokens, 32 q heads,
8 kv heads, head_dim 128, with the cache in 256-token blocks and in 16-token blocks; the throughput benchmark's
prefill step: 31 prompts of 100..1,024 tokens (15.7k in all) with Qwen3-0.6B's 16 q heads and 8 kv heads; and a step
that mixes a 2,048-token chunk with 255 decode rows over 1,024..1,152 tokens of context each (a server's step under
load, where every row went through this kernel), its two parts alone, and the step as the engine runs it; and steps
of the same chunk beside 1 or 4 decode rows, both ways."""
import torch

from nanograph import ops


def causal_flops(q_lens, context_lens, num_q_heads, head_dim):
    # Query i of a sequence attends context_len - q_len + i + 1 keys; QK^T and PV are 2 FLOPs
    # per multiply-add each.
    pairs = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(q_lens, context_lens))
    return 4 * head_dim * num_q_heads * pairs


def make_case(num_seqs, seq_len, num_q_heads, num_kv_heads, head_dim, block_size, lens=None, contexts=None):
    """num_seqs prompts of seq_len tokens each, or of the lengths in lens (then seq_len is their maximum), over
    contexts (default: the prompts alone; else each at least its length, at most seq_len)."""
    dev = "cuda"
    lens = lens or [seq_len] * num_seqs
    contexts = contexts or lens
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    block_tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(num_seqs, -1)
    total_q = sum(lens)
    q = torch.randn(total_q, num_q_heads * head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu_seqlens_q = torch.tensor([0] + lens, device=dev, dtype=torch.int32).cumsum(0).to(torch.int32)
    context_lens = torch.tensor(contexts, device=dev, dtype=torch.int32)
    scale = head_dim ** -0.5

    def fn():
        ops.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                    context_lens, out, num_q_heads, scale, max(lens))

    bytes_moved = 2 * q.numel() * 2 + 2 * sum(contexts) * num_kv_heads * head_dim * 2 * 2  # Q + O, K + V (bf16)
    flops = causal_flops(lens, contexts, num_q_heads, head_dim)
    return fn, bytes_moved, flops


def mixed_decode_contexts() -> list[int]:
    """The contexts of the mixed case's 255 decode rows, 1,024..1,152 tokens (drawn after the throughput step's
    prompt lengths, from the same generator)."""
    g = torch.Generator().manual_seed(0)
    torch.randint(100, 1025, (31,), generator=g)
    return torch.randint(1024, 1153, (255,), generator=g).tolist()


def cases():
    for block_size in (256, 16):
        fn, bytes_moved, flops = make_case(8, 2048, 32, 8, 128, block_size)
        label = f"prefill_attention 8x2048 causal q32/kv8 d128 block{block_size}"
        yield label, fn, bytes_moved, flops
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 1025, (31,), generator=g).tolist()
    fn, bytes_moved, flops = make_case(len(lens), max(lens), 16, 8, 128, 16, lens)
    yield f"prefill_attention 31x(100-1024) causal q16/kv8 d128 block16", fn, bytes_moved, flops
    contexts = [2048] + mixed_decode_contexts()
    lens = [2048] + [1] * 255
    fn, bytes_moved, flops = make_case(len(lens), 2048, 16, 8, 128, 16, lens, contexts)
    yield "prefill_attention mixed 2048-token chunk + 255 decode rows (1024-1152) q16/kv8 d128 block16", fn, \
        bytes_moved, flops
    # Its two parts alone: what the decode rows add to the chunk.
    chunk = make_case(1, 2048, 16, 8, 128, 16)
    yield "prefill_attention mixed's 2048-token chunk alone q16/kv8 d128 block16", *chunk
    fn, bytes_moved, flops = make_case(255, 2048, 16, 8, 128, 16, lens[1:], contexts[1:])
    yield "prefill_attention mixed's 255 decode rows alone (1024-1152) q16/kv8 d128 block16", fn, bytes_moved, flops
    # The step as the engine runs it: the leading decode rows through decode attention (longest first, as planned
    # for a 2,048-token bound), then the chunk through this kernel.
    from .decode_attention import _case as decode_case

    def as_the_engine_runs_it(decode_contexts):
        """The decode rows through decode attention, then the chunk: (fn, bytes, flops)."""
        _, decode_fn, decode_bytes, _ = decode_case(decode_contexts, 16, 8, 128, 16, 2048, "", ordered=True)

        def fn():
            decode_fn()
            chunk[0]()

        return fn, decode_bytes + chunk[1], chunk[2]

    yield "prefill_attention mixed, the decode rows through decode attention q16/kv8 d128 block16", \
        *as_the_engine_runs_it(contexts[1:])
    # A step with only a few decode rows beside the chunk (a lightly loaded server): the extra decode-attention
    # launch against the rows' few CTAs in the prefill grid.
    for rows in (1, 4):
        few, what = contexts[1:rows + 1], f"{rows} decode row" + ("s" if rows > 1 else "")
        fn, bytes_moved, flops = make_case(rows + 1, 2048, 16, 8, 128, 16, [2048] + [1] * rows, [2048] + few)
        yield f"prefill_attention mixed {what} + chunk, one prefill launch q16/kv8 d128 block16", fn, \
            bytes_moved, flops
        yield f"prefill_attention mixed {what} + chunk, split as the engine runs it q16/kv8 d128 block16", \
            *as_the_engine_runs_it(few)
