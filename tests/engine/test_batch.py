import numpy as np

from nanograph import SamplingParams
from nanograph.engine.batch import build_forward_batch
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.scheduler import ScheduledBatch
from nanograph.engine.sequence import Sequence


def scheduled(manager, token_ids, num_computed_tokens, num_new_tokens) -> Sequence:
    """A sequence as the scheduler leaves it: num_computed_tokens in the cache, blocks for num_new_tokens more."""
    seq = Sequence("0", None, token_ids, SamplingParams())
    assert manager.append_slots(seq, num_computed_tokens + num_new_tokens)
    seq.num_computed_tokens = num_computed_tokens
    return seq


def forward(manager, seqs, num_new_tokens):
    batch = ScheduledBatch()
    for seq, num_new in zip(seqs, num_new_tokens):
        batch.add(seq, num_new)
    return build_forward_batch(batch, manager)


def test_prefill_with_a_cached_prefix_starts_at_its_computed_tokens():
    manager = BlockManager(16, block_size=4)
    # Blocks 0 and 1, held by a sequence kept alive (the manager keys its rows by id(): a sequence collected while
    # it holds blocks could pass its id, and its row, to the next one).
    first = scheduled(manager, [1, 2, 3, 4, 5, 6, 7, 8], 0, 8)
    fresh = scheduled(manager, [11, 12, 13], 0, 3)
    cached = scheduled(manager, list(range(20, 30)), 8, 2)
    assert fresh.block_table == [2] and cached.block_table == [3, 4, 5]
    batch = forward(manager, [fresh, cached], [3, 2])
    assert batch.input_ids.tolist() == [11, 12, 13, 28, 29]
    assert batch.positions.tolist() == [0, 1, 2, 8, 9]
    assert batch.slot_mapping.tolist() == [8, 9, 10, 20, 21]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 5]
    assert batch.context_lens.tolist() == [3, 10]
    assert batch.block_tables.tolist() == [[2, 0, 0], [3, 4, 5]]
    assert first.block_table == [0, 1]
    assert not batch.is_decode and batch.num_seqs == 2 and batch.num_tokens == 5
    assert all(a.dtype == np.int32 for a in (batch.input_ids, batch.positions, batch.slot_mapping,
                                             batch.cu_seqlens_q, batch.context_lens, batch.block_tables))


def test_decode_feeds_each_sequence_its_last_token():
    manager = BlockManager(16, block_size=4)
    seqs = [scheduled(manager, [1, 2, 3, 4, 5], 4, 1), scheduled(manager, [6, 7], 1, 1)]
    batch = forward(manager, seqs, [1, 1])
    assert batch.is_decode
    assert batch.input_ids.tolist() == [5, 7]
    assert batch.positions.tolist() == [4, 1]
    assert batch.slot_mapping.tolist() == [4, 9]
    assert batch.context_lens.tolist() == [5, 2]


def test_decodes_and_prompt_chunks_share_a_step():
    manager = BlockManager(16, block_size=4)
    decoding = scheduled(manager, [1, 2, 3, 4, 5, 6], 5, 1)
    chunked = scheduled(manager, list(range(30, 40)), 4, 3)  # the middle chunk of a 10-token prompt
    one_token_chunk = scheduled(manager, [50, 51, 52], 1, 1)  # one new token that is not the last one
    batch = forward(manager, [decoding, chunked, one_token_chunk], [1, 3, 1])
    assert not batch.is_decode
    assert batch.input_ids.tolist() == [6, 34, 35, 36, 51]
    assert batch.positions.tolist() == [5, 4, 5, 6, 1]
    assert batch.cu_seqlens_q.tolist() == [0, 1, 4, 5]
    assert batch.context_lens.tolist() == [6, 7, 2]
    batch = forward(manager, [decoding, one_token_chunk], [1, 1])  # one token each, yet not all last tokens
    assert batch.is_decode and batch.input_ids.tolist() == [6, 51]
