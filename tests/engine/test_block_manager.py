from nanograph import SamplingParams
from nanograph.engine import block_manager
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(token_ids, request_id="0"):
    return Sequence(request_id, None, token_ids, SamplingParams())


def prefill(manager: BlockManager, seq: Sequence):
    """What the scheduler and one step do to a new sequence: take cached blocks, make room, compute the rest."""
    manager.allocate_prefix(seq)
    num_new = seq.num_pending_tokens
    assert manager.append_slots(seq, num_new)
    seq.num_computed_tokens += num_new
    manager.cache_full_blocks(seq, num_new)


def test_allocation_takes_just_enough_blocks():
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(10)))
    prefill(manager, seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert manager.num_free_blocks == 5
    assert all(manager.blocks[b].ref_count == 1 for b in seq.block_table)
    assert seq.num_computed_tokens == 10


def test_append_slots_adds_a_block_only_when_crossing_a_boundary():
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(list(range(7)))
    prefill(manager, seq)
    assert manager.append_slots(seq, 1) and len(seq.block_table) == 2  # position 7 still fits block 1
    seq.num_computed_tokens += 1
    assert manager.append_slots(seq, 1) and len(seq.block_table) == 3  # position 8 opens block 2


def test_append_slots_fails_without_changes_when_blocks_run_out():
    manager = BlockManager(2, BLOCK_SIZE)
    seq = make_seq(list(range(9)))
    manager.allocate_prefix(seq)
    assert not manager.append_slots(seq, 9)
    assert seq.block_table == [] and manager.num_free_blocks == 2


def test_shared_prefix_hits_full_blocks_and_counts_references():
    manager = BlockManager(8, BLOCK_SIZE)
    first = make_seq(list(range(12)))
    prefill(manager, first)
    second = make_seq(list(range(9)) + [99, 98])
    manager.allocate_prefix(second)
    assert second.block_table == first.block_table[:2]
    assert second.num_computed_tokens == 8
    assert [manager.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]


def test_full_cache_hit_still_recomputes_the_last_token():
    manager = BlockManager(8, BLOCK_SIZE)
    prefill(manager, make_seq(list(range(12))))
    same = make_seq(list(range(12)))
    manager.allocate_prefix(same)
    assert same.num_computed_tokens == 8  # the block holding the last token is recomputed
    longer = make_seq(list(range(13)))
    manager.allocate_prefix(longer)
    assert longer.num_computed_tokens == 12 and longer.num_pending_tokens == 1


def test_hash_chain_needs_the_whole_prefix_to_match():
    manager = BlockManager(8, BLOCK_SIZE)
    prefill(manager, make_seq(list(range(12))))
    seq = make_seq([77] + list(range(1, 12)))  # same second and third blocks, different first block
    manager.allocate_prefix(seq)
    assert seq.num_computed_tokens == 0


def test_hash_collision_is_rejected_by_comparing_token_ids(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block", lambda prev_hash, token_ids: 42)
    manager = BlockManager(8, BLOCK_SIZE)
    prefill(manager, make_seq([1, 2, 3, 4, 5]))
    other = make_seq([5, 6, 7, 8, 9])
    manager.allocate_prefix(other)
    assert other.num_computed_tokens == 0 and other.block_table == []
    same = make_seq([1, 2, 3, 4, 6])
    manager.allocate_prefix(same)
    assert same.num_computed_tokens == 4


def test_free_returns_blocks_and_keeps_them_cached_until_reused():
    manager = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(list(range(9)))
    prefill(manager, seq)
    blocks = list(seq.block_table)
    manager.deallocate(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert manager.num_free_blocks == 4 and all(manager.blocks[b].ref_count == 0 for b in blocks)

    again = make_seq(list(range(9)) + [50])
    manager.allocate_prefix(again)  # hits blocks that sit in the free list
    assert again.block_table == blocks[:2] and manager.num_free_blocks == 2
    manager.deallocate(again)

    filler = make_seq([60 + i for i in range(16)])
    prefill(manager, filler)  # takes every block, so the old contents are gone
    manager.deallocate(filler)
    late = make_seq(list(range(9)))
    manager.allocate_prefix(late)
    assert late.num_computed_tokens == 0


def test_disabled_prefix_caching_never_hits():
    manager = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    prefill(manager, make_seq(list(range(12))))
    seq = make_seq(list(range(12)))
    manager.allocate_prefix(seq)
    assert seq.num_computed_tokens == 0


def test_block_table_rows_mirror_every_sequence_and_grow_on_demand():
    manager = BlockManager(400, BLOCK_SIZE)
    seqs = [make_seq(list(range(i + 1)), str(i)) for i in range(70)]  # more sequences than the first 64 rows
    seqs.append(make_seq(list(range(1000, 1300)), "long"))  # 75 blocks: more than the first 64 columns
    for seq in seqs:
        prefill(manager, seq)

    def assert_rows_mirror(seqs):
        tables = manager.block_tables[manager.rows(seqs)]
        for seq, row in zip(seqs, tables):
            assert row[:len(seq.block_table)].tolist() == seq.block_table and not row[len(seq.block_table):].any()

    assert seqs[4].block_table[0] == seqs[3].block_table[0]  # rows are written for prefix-cache hits too
    assert_rows_mirror(seqs)
    long = seqs.pop()
    long_row = manager.row_of[id(long)]
    manager.deallocate(long)
    reuser = make_seq([7, 8, 9], "reuser")
    prefill(manager, reuser)
    assert manager.row_of[id(reuser)] == long_row  # so the long table's tail must be gone from it
    assert_rows_mirror(seqs + [reuser])
