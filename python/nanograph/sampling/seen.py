"""SeenTokens: per sequence, the distinct tokens its penalties look at and how often each occurs in its output."""
from __future__ import annotations

import weakref

import numpy as np

from .table import SampledSequence


class SeenTokens:
    """Per sequence, the distinct tokens its penalties look at (its output, and its prompt too when it has a
    repetition penalty) and how often each occurs in its output, kept up to date incrementally: recounting whole
    prompts and outputs from Python ints every step would cost more than the rest of the sampler."""

    def __init__(self):
        self._seen: weakref.WeakKeyDictionary[SampledSequence, _Seen] = weakref.WeakKeyDictionary()

    def __call__(self, seq: SampledSequence) -> tuple[np.ndarray, np.ndarray]:
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
