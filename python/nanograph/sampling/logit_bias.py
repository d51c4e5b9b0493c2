"""logit_bias and allowed_token_ids as one sparse bias per request (SparseBias, made once, when a sequence's
parameters are set), and a batch's biased rows as the padded arrays both paths read (BiasTable), made once per batch.

In vLLM's order, allowed_token_ids first masks every other token, then logit_bias adds to the logits: a bias of a
token outside allowed_token_ids adds to -inf and is dropped. Both come before penalties and temperature."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..sampling_params import SamplingParams


class SparseBias(NamedTuple):
    token_ids: np.ndarray  # int32, distinct: the tokens that get a bias (every allowed one, with bias 0 by default)
    biases: np.ndarray  # float32
    mask_others: bool  # every other token is -inf (allowed_token_ids)


def sparse_bias(params: SamplingParams) -> SparseBias | None:
    """params' bias; None when it has neither logit_bias nor allowed_token_ids."""
    bias = params.logit_bias or {}
    if params.allowed_token_ids is not None:
        token_ids = list(dict.fromkeys(params.allowed_token_ids))
        return SparseBias(np.array(token_ids, np.int32), np.array([bias.get(t, 0.0) for t in token_ids], np.float32),
                          True)
    if not bias:
        return None
    return SparseBias(np.array(list(bias), np.int32), np.array(list(bias.values()), np.float32), False)


class BiasTable(NamedTuple):
    """The biases of a batch's biased rows, one row each, padded to the longest: token -1 and bias 0."""
    rows: np.ndarray  # int64 [n]: the rows of the batch that have a bias
    token_ids: np.ndarray  # int32 [n, width]
    biases: np.ndarray  # float32 [n, width]
    mask_others: np.ndarray  # int32 [n]: 1 where every other token is -inf

    @classmethod
    def of(cls, row_biases: list[SparseBias | None]) -> BiasTable:
        rows = [row for row, bias in enumerate(row_biases) if bias is not None]
        width = max((len(row_biases[row].token_ids) for row in rows), default=0)
        token_ids = np.full((len(rows), width), -1, np.int32)
        biases = np.zeros((len(rows), width), np.float32)
        for i, row in enumerate(rows):
            bias = row_biases[row]
            token_ids[i, :len(bias.token_ids)] = bias.token_ids
            biases[i, :len(bias.biases)] = bias.biases
        mask_others = np.array([row_biases[row].mask_others for row in rows], np.int32)
        return cls(np.array(rows, np.int64), token_ids, biases, mask_others)

    @property
    def any(self) -> bool:
        return len(self.rows) > 0

    def flat(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, biases): each bias's flat position (row * vocab_size + token, int64) in the batch's logits."""
        listed = self.token_ids >= 0
        positions = self.rows[:, None] * vocab_size + self.token_ids
        return positions[listed], self.biases[listed]
