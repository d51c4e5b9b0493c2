"""The sampler's per-row parameter table: each sequence's SamplingParams as one row of the structured dtype ROW,
made when its parameters are set (Sequence.sampling_row) and stacked per batch, so that the sampler reads a batch's
parameters as named columns (table["top_p"]). Fields keep SamplingParams' precision; each path casts what it sends.
A row is kept as its bytes: a batch's table is then one join, not one conversion per row."""
from __future__ import annotations

import random
from typing import Protocol

import numpy as np

from ..sampling_params import SamplingParams
from .grammar import Grammar
from .logit_bias import SparseBias

NO_LOGPROBS = -2  # the logprobs field of a row that asks for none (SamplingParams.logprobs None)
ALL_LOGPROBS = -1  # of one that asks for the whole vocabulary

ROW = np.dtype([("temperature", np.float64), ("top_k", np.int64), ("top_p", np.float64), ("min_p", np.float64),
                ("presence_penalty", np.float64), ("frequency_penalty", np.float64),
                ("repetition_penalty", np.float64), ("min_tokens", np.int64), ("logprobs", np.int64)])


def parameter_row(params: SamplingParams) -> bytes:
    """params' row of the table, as the bytes of one ROW."""
    logprobs = NO_LOGPROBS if params.logprobs is None else params.logprobs
    return np.array((params.temperature, params.top_k, params.top_p, params.min_p, params.presence_penalty,
                     params.frequency_penalty, params.repetition_penalty, params.min_tokens, logprobs), ROW).tobytes()


def parameter_table(rows: list[bytes]) -> np.ndarray:
    """ROW [len(rows)], read-only: a batch's rows (parameter_row), one per sequence."""
    return np.frombuffer(b"".join(rows), ROW)


class SampledSequence(Protocol):
    """What the sampler reads of a sequence (engine.sequence.Sequence)."""
    params: SamplingParams
    sampling_row: bytes  # parameter_row(params)
    generator: random.Random | None  # the request's own random stream, if it has a seed
    sparse_bias: SparseBias | None  # sparse_bias(params)
    bad_words_token_ids: list[list[int]]  # each bad word's tokens
    grammar: Grammar | None  # structured outputs' matcher, if the request has a grammar
    token_ids: list[int]  # the prompt's, then the output's
    num_prompt_tokens: int

    @property
    def num_completion_tokens(self) -> int: ...
