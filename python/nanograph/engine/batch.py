"""ForwardBatch: one step's metadata as every runner consumes it, built from the scheduled batch with numpy."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from .block_manager import BlockManager
from .scheduler import ScheduledBatch
from .sequence import PENDING_TOKEN


@dataclass
class ForwardBatch:
    input_ids: np.ndarray     # int32 [num_tokens]: the new tokens of every scheduled sequence, concatenated
    input_src: np.ndarray     # int32 [num_tokens]: -1, or the row of the previous step's sampled tokens that holds
                              # this token (input_ids has PENDING_TOKEN there; the runner reads it on the device)
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


def build_forward_batch(batch: ScheduledBatch, block_manager: BlockManager) -> ForwardBatch:
    """The new tokens of each sequence start at its num_computed_tokens (a cached or already prefilled prefix).
    A step may mix decodes (one new token) with prompt chunks; no loop here runs per token."""
    seqs, block_size = batch.seqs, block_manager.block_size
    num_seqs = len(seqs)
    num_new = np.asarray(batch.num_new_tokens, dtype=np.int32)
    starts = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int32, num_seqs)
    context_lens = starts + num_new
    cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(num_new, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])

    seq_of_token = np.repeat(np.arange(num_seqs), num_new)
    positions = (np.arange(num_tokens, dtype=np.int32) + (starts - cu_seqlens_q[:-1])[seq_of_token]).astype(np.int32)
    if num_tokens == num_seqs:
        input_ids = np.fromiter((seq.token_ids[start] for seq, start in zip(seqs, starts.tolist())), np.int32, num_seqs)
    else:
        input_ids = np.fromiter(chain.from_iterable(
            seq.token_ids[start:start + n] for seq, start, n in zip(seqs, starts.tolist(), batch.num_new_tokens)),
            np.int32, num_tokens)

    input_src = np.full(num_tokens, -1, dtype=np.int32)
    pending = input_ids == PENDING_TOKEN
    if pending.any():
        sample_rows = np.fromiter((seq.sample_row for seq in seqs), np.int32, num_seqs)
        input_src[pending] = sample_rows[seq_of_token[pending]]

    max_blocks = -(-int(context_lens.max()) // block_size)
    block_tables = block_manager.block_tables[block_manager.rows(seqs), :max_blocks]
    slot_mapping = (block_tables[seq_of_token, positions // block_size] * block_size
                    + positions % block_size).astype(np.int32)
    return ForwardBatch(input_ids=input_ids, input_src=input_src, positions=positions, slot_mapping=slot_mapping,
                        cu_seqlens_q=cu_seqlens_q, context_lens=context_lens, block_tables=block_tables,
                        is_decode=num_tokens == num_seqs)


def storeless_batch(input_ids: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray,
                    block_tables: np.ndarray) -> ForwardBatch:
    """A step that stores nothing in the KV cache (slot -1), for warm-ups and benchmarks: sequence i feeds
    query_lens[i] of input_ids, its last ones, at the end of a context of context_lens[i] tokens whose blocks
    block_tables[i] names."""
    query_lens = np.asarray(query_lens, np.int32)
    context_lens = np.asarray(context_lens, np.int32)
    cu_seqlens_q = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = (np.arange(num_tokens) - cu_seqlens_q[:-1][seq_of_token]
                 + (context_lens - query_lens)[seq_of_token]).astype(np.int32)
    return ForwardBatch(input_ids=np.asarray(input_ids, np.int32), input_src=np.full(num_tokens, -1, np.int32),
                        positions=positions, slot_mapping=np.full(num_tokens, -1, np.int32),
                        cu_seqlens_q=cu_seqlens_q, context_lens=context_lens,
                        block_tables=np.asarray(block_tables, np.int32), is_decode=num_tokens == len(query_lens))
