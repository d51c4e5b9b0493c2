"""What both paths take from a batch on the host: the per-row arrays its parameters decide (BatchRows, kept while the
batch stays the same), and per call the penalised rows' seen tokens and the tokens min_tokens and bad_words mask."""
from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

from .logit_bias import BiasTable
from .seen import SeenTokens
from .table import ALL_LOGPROBS, NO_LOGPROBS, SampledSequence, parameter_table


class BatchRows:
    """The batch's parameter table and what it decides: per-row arrays, and which rows need what. Parameters do not
    change while a sequence runs, so a path keeps the last batch's rows and reuses them for as long as the batch holds
    the same sequences with the same parameters (same(seqs)): decode batches stay the same for many steps."""

    def __init__(self, seqs: list[SampledSequence], vocab_size: int):
        self.seqs = list(seqs)
        self.rows = [seq.sampling_row for seq in seqs]
        self.num_rows = len(seqs)
        self.vocab_size = vocab_size
        self.table = table = parameter_table(self.rows)
        self.temperatures = table["temperature"].astype(np.float32)
        greedy = self.temperatures == 0
        self.all_greedy = bool(greedy.all())
        self.greedy_rows = np.flatnonzero(greedy)
        self.sampled = sampled = np.flatnonzero(~greedy)
        # The sampled rows' truncations; top-k vocab_size for none.
        top_ks = table["top_k"][sampled]
        top_ks[(top_ks <= 0) | (top_ks > vocab_size)] = vocab_size
        self.top_ks = top_ks
        self.top_ps = table["top_p"][sampled].astype(np.float32)
        self.min_ps = table["min_p"][sampled].astype(np.float32)
        row_penalties = np.stack([table["presence_penalty"], table["frequency_penalty"], table["repetition_penalty"]],
                                 axis=1)
        self.penalised = np.flatnonzero((row_penalties != (0, 0, 1)).any(axis=1)).tolist()
        # float32 [penalised, 3]: presence, frequency, repetition
        self.penalties = row_penalties[self.penalised].astype(np.float32)
        self.with_min_tokens = np.flatnonzero(table["min_tokens"] > 0).tolist()
        self.with_bad_words = [row for row, seq in enumerate(seqs) if seq.bad_words_token_ids]
        self.biases = BiasTable.of([seq.sparse_bias for seq in seqs])
        # With a grammar, even one still waiting for the thinking's end (it may apply from the next token on).
        self.constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        logprobs = table["logprobs"]
        self.logprob_rows = np.flatnonzero(logprobs != NO_LOGPROBS).tolist()
        self.num_top_logprobs = np.where(logprobs == ALL_LOGPROBS, vocab_size,
                                         np.minimum(logprobs, vocab_size))[self.logprob_rows].tolist()
        # No penalties, biases, masks, grammars or logprobs: the argmax of every row.
        self.plain_greedy = self.all_greedy and not self.penalised and not self.with_min_tokens \
            and not self.logprob_rows and not self.biases.any and not self.with_bad_words and not self.constrained

    @classmethod
    def of(cls, seqs: list[SampledSequence], vocab_size: int, last: BatchRows | None) -> BatchRows:
        """last, the previous call's rows, if seqs are the same batch; else seqs' own."""
        return last if last is not None and last.same(seqs, vocab_size) else cls(seqs, vocab_size)

    def same(self, seqs: list[SampledSequence], vocab_size: int) -> bool:
        """True when seqs are this batch's sequences, in its order, with the parameters it read."""
        return (len(seqs) == self.num_rows and vocab_size == self.vocab_size and all(map(operator.is_, seqs, self.seqs))
                and all(map(operator.is_, map(_sampling_row, seqs), self.rows)))


_sampling_row = operator.attrgetter("sampling_row")


class Penalties(NamedTuple):
    """The penalised rows that have seen a token (one that has seen none has nothing to penalise): their distinct
    seen tokens and output counts (SeenTokens), and their penalties."""
    rows: list[int]
    seen: list[tuple[np.ndarray, np.ndarray]]
    values: np.ndarray  # float32 [rows, 3]: presence, frequency, repetition


def penalties(seqs: list[SampledSequence], batch: BatchRows, seen: SeenTokens) -> Penalties:
    row_seen = [seen(seqs[row]) for row in batch.penalised]
    kept = [i for i, (token_ids, _) in enumerate(row_seen) if len(token_ids)]
    return Penalties([batch.penalised[i] for i in kept], [row_seen[i] for i in kept], batch.penalties[kept])


class Masks(NamedTuple):
    """The tokens masked this step, as (row, token) pairs grouped by row: min_tokens masks each stop token (EOS
    included) of each row short of its min_tokens, unless the row's structured-output grammar has ended (it then
    allows nothing but the end of text, and the grammar's end comes first); bad_words masks the last token of each bad word whose other
    tokens the row's output ends with (as vLLM, the output only)."""
    rows: np.ndarray  # int64
    tokens: np.ndarray  # int64

    @property
    def any(self) -> bool:
        return len(self.rows) > 0


def token_masks(seqs: list[SampledSequence], batch: BatchRows, eos_token_ids: list[int]) -> Masks:
    masked = [(row, token_id) for row in batch.with_min_tokens
              if seqs[row].num_completion_tokens < seqs[row].params.min_tokens
              and (seqs[row].grammar is None or not seqs[row].grammar.ended())
              for token_id in seqs[row].params.stop_token_ids + eos_token_ids]
    for row in batch.with_bad_words:
        seq = seqs[row]
        output = seq.token_ids[seq.num_prompt_tokens:]
        masked += [(row, word[-1]) for word in seq.bad_words_token_ids
                   if len(word) <= len(output) + 1 and output[len(output) - len(word) + 1:] == word[:-1]]
    if batch.with_min_tokens and batch.with_bad_words:
        masked.sort(key=operator.itemgetter(0))
    return Masks(*np.array(masked, dtype=np.int64).reshape(-1, 2).T)


def padded(rows: list[np.ndarray], fills: list, at: np.ndarray | None = None, width: int | None = None) -> np.ndarray:
    """int32 [len(fills), width (default: the longest row)]: rows[i] at row at[i] (default i), each row's rest filled
    with fills[row]."""
    at = range(len(rows)) if at is None else at.tolist()
    padded_rows = np.repeat(np.array(fills, np.int32)[:, None], width or max(map(len, rows)), axis=1)
    for i, row in zip(at, rows):
        padded_rows[i, :len(row)] = row
    return padded_rows
