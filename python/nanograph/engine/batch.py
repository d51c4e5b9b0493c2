"""ForwardBatch: one step's metadata as every runner consumes it, built from the scheduled sequences with numpy."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from .sequence import Sequence


@dataclass
class ForwardBatch:
    input_ids: np.ndarray     # int32 [num_tokens]: the new tokens of every scheduled sequence, concatenated
    positions: np.ndarray     # int32 [num_tokens]
    slot_mapping: np.ndarray  # int32 [num_tokens]: block_table[pos // block_size] * block_size + pos % block_size
    cu_seqlens_q: np.ndarray  # int32 [num_seqs + 1]: prefix sums of new tokens per sequence
    context_lens: np.ndarray  # int32 [num_seqs]: tokens in the KV cache after this step (cached + new)
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks_in_batch], padded with 0 (never read)
    is_decode: bool           # every sequence has exactly one new token

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def build_forward_batch(seqs: list[Sequence], num_new_tokens: list[int], block_size: int) -> ForwardBatch:
    """The new tokens of each sequence start at its num_computed_tokens (a cached or already prefilled prefix)."""
    num_seqs = len(seqs)
    num_new = np.asarray(num_new_tokens, dtype=np.int32)
    starts = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int32, num_seqs)
    cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(num_new, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])

    seq_of_token = np.repeat(np.arange(num_seqs), num_new)
    positions = (np.arange(num_tokens, dtype=np.int32) + (starts - cu_seqlens_q[:-1])[seq_of_token]).astype(np.int32)
    input_ids = np.fromiter(
        chain.from_iterable(seq.token_ids[start:start + n] for seq, start, n in zip(seqs, starts, num_new)),
        np.int32, num_tokens)

    block_tables = np.zeros((num_seqs, max(len(seq.block_table) for seq in seqs)), dtype=np.int32)
    for row, seq in zip(block_tables, seqs):
        row[:len(seq.block_table)] = seq.block_table
    slot_mapping = (block_tables[seq_of_token, positions // block_size] * block_size
                    + positions % block_size).astype(np.int32)
    return ForwardBatch(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                        cu_seqlens_q=cu_seqlens_q, context_lens=starts + num_new, block_tables=block_tables,
                        is_decode=bool((num_new == 1).all()))
