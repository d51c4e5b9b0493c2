"""The sampler's host side for one call: the per-row arrays the device needs, sent in one copy. For the core's
kernels, every row's parameters, its draw's key and the rows to override (penalties, min_tokens masks), packed into
one buffer of the layout ops.sample_packed reads (packed_sampling.py); for the torch path, also which rows take
which path (greedy, full draw, truncated draw), sent as DeviceArrays."""
from __future__ import annotations

import functools
import operator
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from .packed_sampling import MAX_TOP_LOGPROBS, PackedLayout

if TYPE_CHECKING:
    from .engine.sequence import Sequence

CANDIDATES = 1024  # candidates per truncated row beyond the largest top-k; rows keeping more are drawn again
SEEN_WIDTH_STEP = 64  # the kernels' seen-token columns come in multiples of this


class SeenTokens:
    """Per sequence, the distinct tokens its penalties look at (its output, and its prompt too when it has a
    repetition penalty) and how often each occurs in its output, kept up to date incrementally: recounting whole
    prompts and outputs from Python ints every step would cost more than the rest of the sampler."""

    def __init__(self):
        self._seen: weakref.WeakKeyDictionary[Sequence, _Seen] = weakref.WeakKeyDictionary()

    def __call__(self, seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """int32 (token ids, output counts) of seq's distinct seen tokens."""
        start = 0 if seq.params.repetition_penalty != 1 else seq.num_prompt_tokens
        seen, token_ids = self._seen.get(seq), seq.token_ids
        # Rebuilt if the tokens it counted changed (the last one is checked: a placeholder replaced in place).
        if (seen is None or seen.start != start or seen.consumed > len(token_ids)
                or (seen.consumed > start and token_ids[seen.consumed - 1] != seen.last)):
            seen = self._seen[seq] = _Seen(start)
        if seen.consumed < len(token_ids):
            seen.extend(token_ids, seq.num_prompt_tokens)
        return seen.token_ids[:seen.size], seen.counts[:seen.size]


class _Seen:
    def __init__(self, start: int):
        self.start = self.consumed = start
        self.last = -1  # the last token counted
        self.index: dict[int, int] = {}
        self.token_ids = np.empty(64, np.int32)
        self.counts = np.zeros(64, np.int32)
        self.size = 0

    def extend(self, token_ids: list[int], num_prompt_tokens: int):
        for position in range(self.consumed, len(token_ids)):
            token_id = token_ids[position]
            if token_id < 0:  # a token the host has not read yet
                break
            i = self.index.get(token_id)
            if i is None:
                i = self.index[token_id] = self.size
                if i == len(self.token_ids):
                    self.token_ids = np.concatenate([self.token_ids, np.empty_like(self.token_ids)])
                    self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
                self.token_ids[i] = token_id
                self.size += 1
            if position >= num_prompt_tokens:
                self.counts[i] += 1
            self.consumed, self.last = position + 1, token_id


class BatchRows:
    """What a plan takes from its sequences' parameters alone: per-row arrays, and which rows need what. Parameters do
    not change while a sequence runs, so a sampler keeps the last batch's and reuses it for as long as the batch holds
    the same sequences with the same parameters (same(seqs)): decode batches stay the same for many steps."""

    def __init__(self, seqs: list[Sequence], vocab_size: int):
        self.seqs = list(seqs)
        self.rows = [seq.sampling_row for seq in seqs]  # SamplingParams.numeric_row
        self.num_rows = num_rows = len(seqs)
        self.vocab_size = vocab_size
        self.table = table = np.array(self.rows).reshape(num_rows, 9)
        self.temperatures = table[:, 0].astype(np.float32)
        greedy = self.temperatures == 0
        self.all_greedy = bool(greedy.all())
        self.greedy_rows = np.flatnonzero(greedy)
        self.sampled = sampled = np.flatnonzero(~greedy)
        top_ks = table[sampled, 1].astype(np.int64)
        top_ks[(top_ks <= 0) | (top_ks > vocab_size)] = vocab_size
        self.top_ks, self.top_ps, self.min_ps = top_ks, table[sampled, 2].astype(np.float32), \
            table[sampled, 3].astype(np.float32)
        self.penalised = np.flatnonzero((table[:, 4] != 0) | (table[:, 5] != 0) | (table[:, 6] != 1)).tolist()
        self.with_min_tokens = np.flatnonzero(table[:, 7] > 0).tolist()
        logprobs = table[:, 8]
        self.logprob_rows = np.flatnonzero(logprobs != -2).tolist()
        self.num_top_logprobs = np.where(logprobs == -1, vocab_size,
                                         np.minimum(logprobs, vocab_size))[self.logprob_rows].astype(int).tolist()
        # No penalties, masks or logprobs: the argmax of every row.
        self.plain_greedy = self.all_greedy and not self.penalised and not self.with_min_tokens \
            and not self.logprob_rows
        self.seeded = [row for row in sampled.tolist() if seqs[row].generator is not None]
        # The kernels' per-row fields (PackedLayout's): top-k 0 and top_p 1 for none, min_p 0, -1 logprobs for none.
        self.kernel_top_ks = np.zeros(num_rows, np.int32)
        self.kernel_top_ks[sampled] = np.where(top_ks < vocab_size, top_ks, 0)
        self.kernel_top_ps = np.ones(num_rows, np.float32)
        self.kernel_top_ps[sampled] = self.top_ps
        self.kernel_min_ps = np.zeros(num_rows, np.float32)
        self.kernel_min_ps[sampled] = self.min_ps
        self.kernel_num_logprobs = np.full(num_rows, -1, np.int32)
        self.kernel_num_logprobs[self.logprob_rows] = self.num_top_logprobs

    def same(self, seqs: list[Sequence], vocab_size: int) -> bool:
        """True when seqs are this batch's sequences, in its order, with the parameters it read."""
        return (len(seqs) == self.num_rows and vocab_size == self.vocab_size and all(map(operator.is_, seqs, self.seqs))
                and all(map(operator.is_, map(_sampling_row, seqs), self.rows)))


_sampling_row = operator.attrgetter("sampling_row")


class SamplingPlan:
    """The host's part of one call, decided from the parameters: the per-row arrays the device needs (self.arrays:
    for the core's kernels, the fields of self.layout, packed by the sampler; for the torch path, sent in one copy
    by upload) and, for the torch path, which rows take which path (row lists: sorted numpy int64)."""

    def __init__(self, seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int], seen: SeenTokens,
                 keys: np.random.Generator | None = None, batch: BatchRows | None = None):
        """keys: the sampler's own random stream, for a plan of the core's sampling kernel (None: of the torch
        path), which takes every row's parameters and a 64-bit random key per sampled row. batch: the previous
        call's BatchRows, reused if seqs are the same batch (self.batch is the one used)."""
        if batch is None or not batch.same(seqs, vocab_size):
            batch = BatchRows(seqs, vocab_size)
        self.batch = b = batch
        self.num_rows = num_rows = b.num_rows
        self.greedy_rows = b.greedy_rows
        sampled, top_ks, top_ps, min_ps = b.sampled, b.top_ks, b.top_ps, b.min_ps
        self.arrays: dict[str, np.ndarray] = {}
        self._penalties(seqs, b.table, b.penalised, seen)
        self._min_tokens(seqs, b.with_min_tokens, eos_token_ids)
        self.transforms = not b.all_greedy or bool(self.penalty_rows) or self.has_masked
        self.logprob_rows = b.logprob_rows
        self.num_top_logprobs = b.num_top_logprobs
        self.plain_greedy = b.plain_greedy  # the core's path then takes the argmax, without the kernels' fields
        if keys is not None:
            if not self.plain_greedy:
                self._kernel_rows(seqs, keys)
            return
        greedy = b.temperatures == 0
        temperatures = b.temperatures
        truncated = (top_ks < vocab_size) | (top_ps < 1) | (min_ps > 0)
        self.full_rows = sampled[~truncated]
        self.truncated_rows = sampled[truncated]
        sampled_rows = np.concatenate([self.full_rows, self.truncated_rows])  # the order of the draws' uniforms
        self.arrays.update(logprob_rows=np.array(self.logprob_rows, dtype=np.int64),
                           temperatures=np.where(greedy, np.float32(1), temperatures)[:, None],
                           greedy_rows=self.greedy_rows, full_rows=self.full_rows, truncated_rows=self.truncated_rows)
        if sum(len(group) > 0 for group in (self.greedy_rows, self.full_rows, self.truncated_rows)) > 1:
            # The draws come greedy rows first, then full rows, then truncated ones: order puts them back.
            self.arrays["order"] = np.argsort(np.concatenate([self.greedy_rows, sampled_rows]))
        self._truncations(vocab_size, top_ks[truncated], top_ps[truncated], min_ps[truncated])
        self._seeds(seqs, sampled_rows)
        self.arrays["masked_positions"] = self.masked_rows * vocab_size + self.masked_tokens
        if self.penalty_rows:
            self._torch_penalties(b.table[self.penalty_rows, 0])

    def _kernel_rows(self, seqs: list[Sequence], keys: np.random.Generator):
        """The kernels' fields (PackedLayout's): per row, temperature (0: greedy), top-k (0: none), top_p, min_p, the
        draw's key (from the row's own stream if it has one), the number of top logprobs (-1: none) and its
        override (-1: none); per override, the row copied out of the logits (penalised or with masked tokens), its
        seen tokens (-1 padding), their output counts, its penalties and its masked tokens (-1 padding)."""
        b = self.batch
        num_rows = self.num_rows
        row_keys = np.zeros(num_rows, np.uint64)
        row_keys[b.sampled] = keys.integers(0, 2**64, len(b.sampled), dtype=np.uint64, endpoint=False)
        if b.seeded:
            row_keys[b.seeded] = [seqs[row].generator.getrandbits(64) for row in b.seeded]
        self.override_source = overridden = np.union1d(np.array(self.penalty_rows, np.int64), self.masked_rows)
        num = len(overridden)
        override_rows = np.full(num_rows, -1, np.int32)
        override_rows[overridden] = np.arange(num, dtype=np.int32)
        seen_tokens = np.full((num, 1 if num else 0), -1, np.int32)
        output_counts = np.zeros_like(seen_tokens)
        penalties = np.zeros((num, 3), np.float32)  # presence, frequency, repetition
        penalties[:, 2] = 1
        if self.penalty_rows:
            at = override_rows[self.penalty_rows]
            # Widths rounded up, so that the layout (and its cached offsets) changes rarely as rows see new tokens.
            width = -(-max(len(token_ids) for token_ids, _ in self.seen) // SEEN_WIDTH_STEP) * SEEN_WIDTH_STEP
            seen_tokens = _padded([token_ids for token_ids, _ in self.seen], [-1] * num, at, num, width)
            output_counts = _padded([counts for _, counts in self.seen], [0] * num, at, num, width)
            penalties[at] = self.penalties
        masked_tokens = np.full((num, 1 if num else 0), -1, np.int32)
        if self.has_masked:
            at = override_rows[self.masked_rows]
            firsts = np.flatnonzero(np.r_[True, at[1:] != at[:-1]])  # pairs come grouped by row
            column = np.arange(len(at)) - np.repeat(firsts, np.diff(np.r_[firsts, len(at)]))  # within its row
            masked_tokens = np.full((num, column.max() + 1), -1, np.int32)
            masked_tokens[at, column] = self.masked_tokens
        # The kernel gives at most MAX_TOP_LOGPROBS top logprobs; the sampler asks torch when a row wants more.
        self.kernel_logprobs = bool(self.logprob_rows) and max(self.num_top_logprobs) <= MAX_TOP_LOGPROBS
        self.layout = packed_layout(num_rows, 1 + max(self.num_top_logprobs) if self.kernel_logprobs else 0, num,
                                    seen_tokens.shape[1], masked_tokens.shape[1])
        self.arrays.update(temperatures=b.temperatures, top_ks=b.kernel_top_ks, top_ps=b.kernel_top_ps,
                           min_ps=b.kernel_min_ps, keys=row_keys.view(np.int64), num_logprobs=b.kernel_num_logprobs,
                           override_rows=override_rows,
                           override_source=overridden, seen_tokens=seen_tokens, output_counts=output_counts,
                           presence=penalties[:, 0], frequency=penalties[:, 1], repetition=penalties[:, 2],
                           masked_tokens=masked_tokens)

    def _truncations(self, vocab_size: int, top_ks: np.ndarray, top_ps: np.ndarray, min_ps: np.ndarray):
        """The truncated rows' parameters ([rows, 1]), and their number of candidates: CANDIDATES past the largest
        top-k, so that a row spills past them only when its kept tokens do (ties at its k-th logit included)."""
        self.has_top_p = self.has_open_top_p = self.has_open_min_p = False
        self.num_candidates = 0
        if not len(top_ks):
            return
        no_top_k = top_ks == vocab_size
        has_top_p = top_ps < 1
        open_top_p = has_top_p & no_top_k
        self.has_top_p = bool(has_top_p.any())
        self.has_open_top_p = bool(open_top_p.any())
        self.has_open_min_p = bool((min_ps[open_top_p] > 0).any())
        self.num_candidates = min(vocab_size, int(top_ks[~no_top_k].max(initial=0)) + CANDIDATES)
        with np.errstate(divide="ignore"):
            log_min_ps = np.log(min_ps)  # min_p = 0: -inf, no floor
        self.arrays.update(top_ks=top_ks[:, None], candidate_top_ks=np.minimum(top_ks, self.num_candidates)[:, None],
                           no_top_k=no_top_k[:, None], log_min_ps=log_min_ps[:, None], top_ps=top_ps[:, None],
                           open_top_p=np.flatnonzero(open_top_p))

    def _seeds(self, seqs: list[Sequence], sampled_rows: np.ndarray):
        """One uniform in (0, 1] from the stream of each sampled row that has its own, and its place among the
        draws' uniforms."""
        seeded = [i for i, row in enumerate(sampled_rows.tolist()) if seqs[row].generator is not None]
        self.has_seeded = bool(seeded)
        self.arrays["seeded"] = np.array(seeded, dtype=np.int64)
        # The seeded truncated rows, by their place among the truncated rows (which follow the full ones): the
        # torch path draws them from their whole rows, so that their token does not depend on the batch.
        seeded_truncated = [i - len(self.full_rows) for i in seeded if i >= len(self.full_rows)]
        self.has_seeded_truncated = bool(seeded_truncated)
        self.arrays["seeded_truncated"] = np.array(seeded_truncated, dtype=np.int64)
        self.arrays["seeded_uniforms"] = np.array(
            [(seqs[row].generator.getrandbits(53) + 1) * 2.0 ** -53 for row in sampled_rows[seeded].tolist()],
            dtype=np.float64)

    def _penalties(self, seqs: list[Sequence], table: np.ndarray, penalised: list[int], seen: SeenTokens):
        """The penalised rows' distinct seen tokens and their output counts (SeenTokens: self.seen), and the rows'
        penalties (self.penalties float32 [rows, 3]: presence, frequency, repetition)."""
        self.penalty_rows = penalised
        self.seen = [seen(seqs[i]) for i in self.penalty_rows]
        # A row that has seen no token has nothing to penalise.
        self.penalty_rows = [i for i, (token_ids, _) in zip(self.penalty_rows, self.seen) if len(token_ids)]
        self.seen = [row_seen for row_seen in self.seen if len(row_seen[0])]
        self.penalties = table[self.penalty_rows, 4:7].astype(np.float32)

    def _torch_penalties(self, temperatures: np.ndarray):
        """For the torch path: the penalised rows [rows, 1], their penalties and temperature (temperatures: 0 for
        greedy), and their seen tokens [rows, n] and output counts, padded with each row's first one (a repeat writes
        the same value)."""
        token_ids = [row_token_ids for row_token_ids, _ in self.seen]
        counts = [row_counts for _, row_counts in self.seen]
        self.arrays.update(
            penalty_rows=np.array(self.penalty_rows)[:, None],
            presence_penalties=self.penalties[:, 0:1], frequency_penalties=self.penalties[:, 1:2],
            repetition_penalties=self.penalties[:, 2:3],
            penalty_temperatures=np.where(temperatures == 0, 1, temperatures).astype(np.float32)[:, None],
            penalty_token_ids=_padded(token_ids, [row[0] for row in token_ids]).astype(np.int64),
            penalty_counts=_padded(counts, [row[0] for row in counts]).astype(np.float32))

    def _min_tokens(self, seqs: list[Sequence], with_min_tokens: list[int], eos_token_ids: list[int]):
        """The rows and stop tokens (EOS included) of the rows short of min_tokens, one pair per masked token."""
        masked = [(row, token_id) for row in with_min_tokens
                  if seqs[row].num_completion_tokens < seqs[row].params.min_tokens
                  for token_id in seqs[row].params.stop_token_ids + eos_token_ids]
        self.has_masked = bool(masked)
        self.masked_rows, self.masked_tokens = np.array(masked, dtype=np.int64).reshape(-1, 2).T

    def upload(self, device: torch.device) -> DeviceArrays:
        return DeviceArrays(self.arrays, device)


def _padded(rows: list[np.ndarray], fills: list, at=None, num_rows: int | None = None,
            width: int | None = None) -> np.ndarray:
    """int32 [num_rows, width (default: the longest row)]: rows[i] at row at[i] (default i), each row's rest filled
    with fills[row]."""
    at = range(len(rows)) if at is None else at.tolist()
    padded = np.repeat(np.array(fills, np.int32)[:, None], width or max(map(len, rows)), axis=1)
    for i, row in zip(at, rows):
        padded[i, :len(row)] = row
    return padded


@functools.lru_cache(maxsize=64)
def packed_layout(*shape: int) -> PackedLayout:
    """PackedLayout(*shape), made once per shape (layouts are not modified)."""
    return PackedLayout(*shape)


class DeviceArrays:
    """A plan's arrays on the device, by name (rows.top_ps): all packed at 8-byte-aligned offsets into one (pinned)
    buffer and sent in one copy when the first is read, each made a view of it when read (a call that reads none,
    all greedy, sends nothing)."""

    def __init__(self, arrays: dict[str, np.ndarray], device: torch.device):
        self._arrays = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
        self._device = device
        self._offsets: dict[str, int] = {}
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def __getattr__(self, name: str) -> torch.Tensor:
        if name.startswith("_") or name not in self._arrays:
            raise AttributeError(name)
        if not self._typed:
            self._send()
        array = self._arrays[name]
        view = self._typed[TORCH_DTYPES[array.dtype]].as_strided(
            array.shape, [stride // array.itemsize for stride in array.strides], self._offsets[name] // array.itemsize)
        setattr(self, name, view)
        return view

    def _send(self):
        size = 0
        for name, array in self._arrays.items():
            self._offsets[name] = size
            size += -(-array.nbytes // 8) * 8
        host = torch.empty(size, dtype=torch.uint8, pin_memory=self._device.type == "cuda")
        packed = host.numpy()
        for name, array in self._arrays.items():
            packed[self._offsets[name]:self._offsets[name] + array.nbytes] = \
                array.reshape(-1).view(np.uint8)
        on_device = host.to(self._device, non_blocking=True)
        self._typed = {dtype: on_device.view(dtype) for dtype in TORCH_DTYPES.values()}


TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32,
                 np.dtype(np.float64): torch.float64, np.dtype(np.bool_): torch.bool}
