"""Paged KV block accounting, with prefix caching over a hash chain of full blocks."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .sequence import Sequence


def hash_block(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A full block's key: it covers the whole prefix, because it chains the previous block's hash."""
    return hash((prev_hash, token_ids))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set once the block is full of computed tokens
        self.token_ids: tuple[int, ...] | None = None  # kept to reject hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Least recently freed first. A freed block keeps its cached contents until it is handed out again.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        # Prompt tokens looked up in the prefix cache and found there, over every admission (metrics).
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        # Every sequence holding blocks owns a row that mirrors its block_table, written as blocks are added, so a
        # step gathers its block tables with one numpy index instead of rebuilding them from lists.
        self.block_tables = np.zeros((64, 64), dtype=np.int32)  # rows and columns double on demand
        self.free_rows = list(range(64))
        self.row_of: dict[int, int] = {}  # id(seq) -> its row

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """The block_tables rows of seqs, which all hold blocks."""
        return np.fromiter((self.row_of[id(seq)] for seq in seqs), np.intp, len(seqs))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def allocate_prefix(self, seq: Sequence):
        """Give a sequence that holds no blocks the cached blocks of its longest cached prefix; none to one that
        computes its whole prompt (Sequence.computes_whole_prompt; its blocks are cached once computed, for others to
        use)."""
        assert not seq.block_table
        if self.enable_prefix_caching and not seq.computes_whole_prompt:
            prev_hash = None
            # The last token is never taken from the cache, so that its step yields logits.
            for i in range((seq.num_tokens - 1) // self.block_size):
                token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                prev_hash = hash_block(prev_hash, token_ids)
                block_id = self.hash_to_block_id.get(prev_hash)
                if block_id is None or self.blocks[block_id].token_ids != token_ids:
                    break
                self._ref(block_id)
                self._append_block(seq, block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def count_prefix_query(self, seq: Sequence):
        """Count the prompt of a sequence admitted for the first time, and its tokens found in the cache, in the
        prefix cache's queries and hits (vLLM's counters): once, however many steps it waited for room and however
        often it is preempted later."""
        if self.enable_prefix_caching and not seq.computes_whole_prompt:
            self.num_prefix_queried_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += seq.num_computed_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for seq's next num_new_tokens; False, changing nothing, when free blocks run out."""
        num_needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if num_needed > self.num_free_blocks:
            return False
        for _ in range(num_needed):
            block_id, _ = self.free_block_ids.popitem(last=False)
            self._forget(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            self._append_block(seq, block_id)
        return True

    def cache_full_blocks(self, seq: Sequence, num_new_tokens: int):
        """Register the blocks that the last num_new_tokens computed tokens of seq filled up."""
        if not self.enable_prefix_caching:
            return
        first = (seq.num_computed_tokens - num_new_tokens) // self.block_size
        for i in range(first, seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            prev_hash = self.blocks[seq.block_table[i - 1]].hash if i else None
            block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block.hash = hash_block(prev_hash, block.token_ids)
            self.hash_to_block_id.setdefault(block.hash, block.block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so that later prompts compute all of their tokens; False, changing nothing,
        while any sequence holds blocks."""
        if self.num_free_blocks != len(self.blocks):
            return False
        for block in self.blocks:
            block.hash = block.token_ids = None
        self.hash_to_block_id.clear()
        return True

    def deallocate(self, seq: Sequence):
        # Tail blocks are freed first, so they are also reused first: a prefix outlives its continuations.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        row = self.row_of.pop(id(seq), None)
        if row is not None:
            self.block_tables[row, :len(seq.block_table)] = 0
            self.free_rows.append(row)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _append_block(self, seq: Sequence, block_id: int):
        row = self.row_of.get(id(seq))
        if row is None:
            if not self.free_rows:
                self._grow(rows=2 * len(self.block_tables))
            row = self.row_of[id(seq)] = self.free_rows.pop()
        column = len(seq.block_table)
        if column == self.block_tables.shape[1]:
            self._grow(columns=2 * column)
        self.block_tables[row, column] = block_id
        seq.block_table.append(block_id)

    def _grow(self, rows: int | None = None, columns: int | None = None):
        old = self.block_tables
        self.block_tables = np.zeros((rows or old.shape[0], columns or old.shape[1]), dtype=np.int32)
        self.block_tables[:old.shape[0], :old.shape[1]] = old
        self.free_rows.extend(range(old.shape[0], self.block_tables.shape[0]))

    def _ref(self, block_id: int):
        if self.blocks[block_id].ref_count == 0:
            del self.free_block_ids[block_id]
        self.blocks[block_id].ref_count += 1

    def _forget(self, block: Block):
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = None
        block.token_ids = None
