"""Paged prefill attention (causal, variable length) against a float32 torch reference."""
import itertools
import math
import random

import pytest
import torch

from nanograph import ops

pytestmark = pytest.mark.gpu

LENGTHS = [1, 15, 16, 17, 63, 64, 65, 200, 1000, 2048]


def make_batch(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size,
               q_stride=None, seed=0):
    """Random q and a paged cache whose blocks are handed out in shuffled order.

    Cache slots that hold no key of any sequence are NaN, so reading one spoils the output.
    """
    torch.manual_seed(seed)
    dev = "cuda"
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    width = max(blocks_per_seq + [1]) + 1
    order = torch.randperm(num_blocks).tolist()
    block_tables = torch.full((len(q_lens), width), -1, dtype=torch.int32)
    valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    next_block = 0
    for s, (n_blocks, ctx) in enumerate(zip(blocks_per_seq, context_lens)):
        blocks = order[next_block:next_block + n_blocks]
        next_block += n_blocks
        block_tables[s, :n_blocks] = torch.tensor(blocks, dtype=torch.int32)
        j = torch.arange(ctx)
        valid[block_tables[s, j // block_size].long() * block_size + j % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=dev).to(torch.bfloat16)
    v_cache = torch.randn(shape, device=dev).to(torch.bfloat16)
    k_cache.view(-1, num_kv_heads, head_dim)[~valid.to(dev)] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[~valid.to(dev)] = float("nan")

    total_q = sum(q_lens)
    q_stride = q_stride or num_q_heads * head_dim
    q = torch.randn(total_q, q_stride, device=dev).to(torch.bfloat16)
    cu_seqlens_q = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables.to(dev),
                cu_seqlens_q=cu_seqlens_q.to(dev),
                context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev))


def reference(b, q_lens, context_lens, num_q_heads, scale):
    _, block_size, num_kv_heads, head_dim = b["k_cache"].shape
    k_slots = b["k_cache"].float().view(-1, num_kv_heads, head_dim)
    v_slots = b["v_cache"].float().view(-1, num_kv_heads, head_dim)
    group = num_q_heads // num_kv_heads
    outs = []
    start = 0
    for s, (q_len, ctx) in enumerate(zip(q_lens, context_lens)):
        q = b["q"][start:start + q_len, :num_q_heads * head_dim].float()
        q = q.view(q_len, num_q_heads, head_dim)
        start += q_len
        j = torch.arange(ctx, device="cuda")
        slots = b["block_tables"][s, j // block_size].long() * block_size + j % block_size
        k = k_slots[slots].repeat_interleave(group, dim=1)
        v = v_slots[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pos = ctx - q_len + torch.arange(q_len, device="cuda")
        scores.masked_fill_(j[None, :] > pos[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key give zeros
        outs.append(torch.einsum("hqk,khd->qhd", p, v).reshape(q_len, -1))
    return torch.cat(outs)


def run_and_check(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                  scale=None, max_q_len=None, q_stride=None, seed=0):
    b = make_batch(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                   q_stride, seed)
    scale = scale if scale is not None else head_dim ** -0.5
    out = torch.full((sum(q_lens), num_q_heads * head_dim), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    ops.paged_prefill_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                b["cu_seqlens_q"], b["context_lens"], out, num_q_heads, scale,
                                max_q_len if max_q_len is not None else max(q_lens))
    torch.cuda.synchronize()
    ref = reference(b, q_lens, context_lens, num_q_heads, scale)
    assert not out.isnan().any(), "unwritten or NaN outputs"
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    rel = (out.float() - ref).norm() / ref.norm().clamp_min(1e-6)
    assert rel < 1e-2, f"relative error {rel:.3e}"


@pytest.mark.parametrize("q_len", LENGTHS)
def test_single_sequence(q_len):
    run_and_check([q_len], [q_len], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [16, 256])
def test_batch_with_cached_prefixes(head_dim, group, block_size):
    rng = random.Random(head_dim * 1000 + group * 10 + block_size)
    q_lens = [rng.choice(LENGTHS) for _ in range(6)]
    # Half the sequences continue a cached prefix (or earlier chunks): context_len > q_len.
    context_lens = [q + (rng.choice([1, 17, 300, 1500]) if s % 2 else 0)
                    for s, q in enumerate(q_lens)]
    run_and_check(q_lens, context_lens, num_q_heads=2 * group, num_kv_heads=2,
                  head_dim=head_dim, block_size=block_size, seed=group)


def test_decode_rows_and_padding():
    # One-token rows over long contexts (decode through the prefill path), a padding row with
    # context 0 (must write zeros), and a chunk ending mid-block.
    run_and_check([1, 1, 70, 1], [1500, 33, 600, 0], num_q_heads=8, num_kv_heads=8,
                  head_dim=128, block_size=16)


def test_grid_bound_above_lengths_and_strided_q():
    # max_q_len is only an upper bound; q is the leading part of a fused qkv row.
    num_q_heads, num_kv_heads, head_dim = 8, 2, 64
    run_and_check([65, 3, 130], [65, 40, 200], num_q_heads, num_kv_heads, head_dim,
                  block_size=32, max_q_len=1000,
                  q_stride=(num_q_heads + 2 * num_kv_heads) * head_dim)


def test_peaked_softmax():
    # A large scale makes each row's maximum move between key tiles: exercises the rescaling.
    run_and_check([300, 129], [300, 700], num_q_heads=4, num_kv_heads=1, head_dim=128,
                  block_size=64, scale=1.0)


def test_large_batch():
    run_and_check([2048] * 8, [2048] * 8, num_q_heads=32, num_kv_heads=8, head_dim=128,
                  block_size=256)


def test_rejects_bad_arguments():
    b = make_batch([4], [4], 4, 2, 128, 16)
    out = torch.empty(4, 4 * 128, device="cuda", dtype=torch.bfloat16)
    args = [b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["cu_seqlens_q"],
            b["context_lens"]]
    with pytest.raises(TypeError, match="out must have dtype"):
        ops.paged_prefill_attention(*args, out.float(), 4, 0.1, 4)
    with pytest.raises(ValueError, match="multiple of k_cache's num_kv_heads"):
        ops.paged_prefill_attention(*args, out, 3, 0.1, 4)
    with pytest.raises(ValueError, match="out must have shape"):
        ops.paged_prefill_attention(*args, out[:3], 4, 0.1, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q must have shape"):
        ops.paged_prefill_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                    b["cu_seqlens_q"][:1], b["context_lens"], out, 4, 0.1, 4)
