import numpy as np

from nanograph import SamplingParams
from nanograph.engine.batch import build_forward_batch
from nanograph.engine.sequence import Sequence


def make_seq(token_ids, block_table, num_computed_tokens):
    seq = Sequence("0", None, token_ids, SamplingParams())
    seq.block_table, seq.num_computed_tokens = block_table, num_computed_tokens
    return seq


def test_prefill_with_a_cached_prefix_starts_at_its_computed_tokens():
    fresh = make_seq([11, 12, 13], block_table=[5], num_computed_tokens=0)
    cached = make_seq(list(range(20, 30)), block_table=[2, 7, 3], num_computed_tokens=8)
    batch = build_forward_batch([fresh, cached], [3, 2], block_size=4)
    assert batch.input_ids.tolist() == [11, 12, 13, 28, 29]
    assert batch.positions.tolist() == [0, 1, 2, 8, 9]
    assert batch.slot_mapping.tolist() == [20, 21, 22, 12, 13]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 5]
    assert batch.context_lens.tolist() == [3, 10]
    assert batch.block_tables.tolist() == [[5, 0, 0], [2, 7, 3]]
    assert not batch.is_decode and batch.num_seqs == 2 and batch.num_tokens == 5
    assert all(a.dtype == np.int32 for a in (batch.input_ids, batch.positions, batch.slot_mapping,
                                             batch.cu_seqlens_q, batch.context_lens, batch.block_tables))


def test_decode_feeds_each_sequence_its_last_token():
    seqs = [make_seq([1, 2, 3, 4, 5], [9, 4], 4), make_seq([6, 7], [1], 1)]
    batch = build_forward_batch(seqs, [1, 1], block_size=4)
    assert batch.is_decode
    assert batch.input_ids.tolist() == [5, 7]
    assert batch.positions.tolist() == [4, 1]
    assert batch.slot_mapping.tolist() == [16, 5]
    assert batch.context_lens.tolist() == [5, 2]
