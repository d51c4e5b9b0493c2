"""The step's metadata, from tensor-parallel rank 0 to every other rank, as collectives of one int32 tensor.

A ForwardBatch (input ids already resolved: the workers never see the sampled tokens) flattens into a header
[num_tokens, num_seqs, max_blocks, is_decode] and its arrays, in a fixed order. The first broadcast carries a buffer
of FIRST_INTS, enough for the header and all of a decode step of up to a few hundred sequences; a larger step sends
the rest in a second broadcast. One collective reaches every rank at once, so a step costs no Python round trip per
rank (a pipe or queue per worker would). num_tokens -1 tells the workers to stop."""
from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch

from ..engine.batch import ForwardBatch

FIRST_INTS = 4096
_STOP = -1


def send_step(group, batch: ForwardBatch | None, timeout: timedelta):
    """Broadcast batch from rank 0 (None: the stop message)."""
    if batch is None:
        flat = np.array([_STOP, 0, 0, 0], np.int32)
    else:
        header = np.array([batch.num_tokens, batch.num_seqs, batch.block_tables.shape[1], batch.is_decode], np.int32)
        flat = np.concatenate([header, batch.input_ids, batch.positions, batch.slot_mapping, batch.cu_seqlens_q,
                               batch.context_lens, batch.block_tables.ravel()]).astype(np.int32, copy=False)
    first = torch.zeros(FIRST_INTS, dtype=torch.int32)
    first[:min(len(flat), FIRST_INTS)] = torch.from_numpy(flat[:FIRST_INTS])
    group.broadcast(first, 0, timeout).wait()
    if len(flat) > FIRST_INTS:
        group.broadcast(torch.from_numpy(flat[FIRST_INTS:].copy()), 0, timeout).wait()


def receive_step(group, idle_timeout: timedelta, timeout: timedelta) -> ForwardBatch | None:
    """On a rank other than 0: wait up to idle_timeout for the next step's metadata (None: stop)."""
    first = torch.empty(FIRST_INTS, dtype=torch.int32)
    group.broadcast(first, 0, idle_timeout).wait()
    num_tokens, num_seqs, max_blocks, is_decode = first[:4].tolist()
    if num_tokens == _STOP:
        return None
    size = 4 + 3 * num_tokens + 2 * num_seqs + 1 + num_seqs * max_blocks
    flat = first.numpy()
    if size > FIRST_INTS:
        rest = torch.empty(size - FIRST_INTS, dtype=torch.int32)
        group.broadcast(rest, 0, timeout).wait()
        flat = np.concatenate([flat, rest.numpy()])
    fields = np.split(flat[4:size], np.cumsum([num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs]))
    input_ids, positions, slot_mapping, cu_seqlens_q, context_lens, block_tables = fields
    return ForwardBatch(input_ids=input_ids, input_src=np.full(num_tokens, -1, np.int32), positions=positions,
                        slot_mapping=slot_mapping, cu_seqlens_q=cu_seqlens_q, context_lens=context_lens,
                        block_tables=block_tables.reshape(num_seqs, max_blocks), is_decode=bool(is_decode))
