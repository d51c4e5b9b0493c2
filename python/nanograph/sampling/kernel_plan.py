"""The kernel path's host side for one call: every row's parameters, its draw's key and the rows to override
(biases, penalties, masked tokens), as the fields of the parameters blob (PackedLayout), which the path packs."""
from __future__ import annotations

import numpy as np

from .batch import BatchRows, padded, penalties, token_masks
from .packed_layout import PackedFormat, PackedLayout
from .seen import SeenTokens
from .table import SampledSequence

SEEN_WIDTH_STEP = 64  # the kernels' seen-token columns come in multiples of this


class KernelBatchRows(BatchRows):
    """BatchRows with the sampled rows that have a stream of their own (seeded), and the parameters blob's per-row
    fields that the parameters alone decide (row_fields, by field name): top-k 0 and top_p 1 for none, min_p 0,
    -1 logprobs for none."""

    def __init__(self, seqs: list[SampledSequence], vocab_size: int):
        super().__init__(seqs, vocab_size)
        sampled = self.sampled
        self.seeded = [row for row in sampled.tolist() if seqs[row].generator is not None]
        top_ks = np.zeros(self.num_rows, np.int32)
        top_ks[sampled] = np.where(self.top_ks < vocab_size, self.top_ks, 0)
        top_ps = np.ones(self.num_rows, np.float32)
        top_ps[sampled] = self.top_ps
        min_ps = np.zeros(self.num_rows, np.float32)
        min_ps[sampled] = self.min_ps
        num_logprobs = np.full(self.num_rows, -1, np.int32)
        num_logprobs[self.logprob_rows] = self.num_top_logprobs
        self.row_fields = dict(temperatures=self.temperatures, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps,
                               num_logprobs=num_logprobs)


class KernelPlan:
    """The parameters blob's fields (self.arrays, by field name) and their layout; none for a plain-greedy batch
    (layout None), whose argmax needs no parameters."""

    def __init__(self, seqs: list[SampledSequence], vocab_size: int, eos_token_ids: list[int], seen: SeenTokens,
                 keys: np.random.Generator, format: PackedFormat, batch: KernelBatchRows | None = None):
        """keys: the path's own random stream, for the 64-bit key of each sampled row without a stream of its own.
        batch: the previous call's rows, reused if seqs are the same batch (self.batch is the one used)."""
        self.batch = b = KernelBatchRows.of(seqs, vocab_size, batch)
        self.penalties = penalties(seqs, b, seen)
        self.masks = token_masks(seqs, b, eos_token_ids)
        self.plain_greedy = b.plain_greedy
        self.kernel_logprobs = False  # whether the kernel gives the logprobs the rows ask for
        self.layout: PackedLayout | None = None
        if not self.plain_greedy:
            self._fields(seqs, keys, format)

    def _fields(self, seqs: list[SampledSequence], keys: np.random.Generator, format: PackedFormat):
        """Per row, temperature (0: greedy), top-k (0: none), top_p, min_p, the draw's key (from the row's own
        stream if it has one), the number of top logprobs (-1: none) and its override (-1: none); per override, the
        row copied out of the logits (biased, penalised or with masked tokens), its seen tokens (-1 padding), their
        output counts, its penalties, its masked tokens (-1 padding), its biased tokens (-1 padding), their biases
        and whether every other token is masked."""
        b, p, m = self.batch, self.penalties, self.masks
        row_keys = np.zeros(b.num_rows, np.uint64)
        row_keys[b.sampled] = keys.integers(0, 2**64, len(b.sampled), dtype=np.uint64, endpoint=False)
        if b.seeded:
            row_keys[b.seeded] = [seqs[row].generator.getrandbits(64) for row in b.seeded]
        biases = b.biases
        self.override_source = overridden = np.union1d(np.union1d(np.array(p.rows, np.int64), m.rows), biases.rows)
        num = len(overridden)
        override_rows = np.full(b.num_rows, -1, np.int32)
        override_rows[overridden] = np.arange(num, dtype=np.int32)
        seen_tokens = np.full((num, 1 if num else 0), -1, np.int32)
        output_counts = np.zeros_like(seen_tokens)
        penalty_values = np.zeros((num, 3), np.float32)  # presence, frequency, repetition
        penalty_values[:, 2] = 1
        if p.rows:
            at = override_rows[p.rows]
            # Widths rounded up, so that the layout (and its cached offsets) changes rarely as rows see new tokens.
            width = -(-max(len(token_ids) for token_ids, _ in p.seen) // SEEN_WIDTH_STEP) * SEEN_WIDTH_STEP
            seen_tokens = padded([token_ids for token_ids, _ in p.seen], [-1] * num, at, width)
            output_counts = padded([counts for _, counts in p.seen], [0] * num, at, width)
            penalty_values[at] = p.values
        masked_tokens = np.full((num, 1 if num else 0), -1, np.int32)
        if m.any:
            at = override_rows[m.rows]
            firsts = np.flatnonzero(np.r_[True, at[1:] != at[:-1]])  # pairs come grouped by row
            column = np.arange(len(at)) - np.repeat(firsts, np.diff(np.r_[firsts, len(at)]))  # within its row
            masked_tokens = np.full((num, column.max() + 1), -1, np.int32)
            masked_tokens[at, column] = m.tokens
        biased_tokens = np.full((num, max(biases.token_ids.shape[1], 1) if num else 0), -1, np.int32)
        bias_values = np.zeros(biased_tokens.shape, np.float32)
        mask_others = np.zeros(num, np.int32)
        if biases.any:
            at = override_rows[biases.rows]
            biased_tokens[at, :biases.token_ids.shape[1]] = biases.token_ids
            bias_values[at, :biases.biases.shape[1]] = biases.biases
            mask_others[at] = biases.mask_others
        # The kernel gives at most format.max_top_logprobs; the path asks torch when a row wants more.
        self.kernel_logprobs = bool(b.logprob_rows) and max(b.num_top_logprobs) <= format.max_top_logprobs
        logprob_columns = 1 + max(b.num_top_logprobs) if self.kernel_logprobs else 0
        self.layout = format.layout(rows=b.num_rows, logprob_columns=logprob_columns, num_overrides=num,
                                    seen_width=seen_tokens.shape[1], masked_width=masked_tokens.shape[1],
                                    bias_width=biased_tokens.shape[1])
        self.arrays = dict(b.row_fields, keys=row_keys.view(np.int64), override_rows=override_rows,
                           override_source=overridden, seen_tokens=seen_tokens, output_counts=output_counts,
                           presence=penalty_values[:, 0], frequency=penalty_values[:, 1],
                           repetition=penalty_values[:, 2], masked_tokens=masked_tokens,
                           biased_tokens=biased_tokens, biases=bias_values, mask_others=mask_others)
