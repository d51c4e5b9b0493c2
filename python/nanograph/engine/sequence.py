"""One completion of a request: its tokens, its progress through the KV cache, and what it has produced."""
from __future__ import annotations

import random
from enum import Enum, auto

from ..outputs import Logprob
from ..pooling import PoolingState
from ..sampling.grammar import Grammar
from ..sampling.logit_bias import sparse_bias
from ..sampling.table import parameter_row
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer


# Stands in token_ids for a token sampled on the device whose value the host has not read yet; the step that
# feeds it reads it on the device (ForwardBatch.input_src).
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    HELD = auto()  # not given to the scheduler yet: a sibling waiting for the first completion's prompt blocks
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                 index: int = 0, max_num_tokens: int | None = None):
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.prompt = prompt
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        # The length rule: prompt + max_tokens, within max_model_len (Intake sets it; None: prompt + max_tokens).
        self.max_num_tokens = max_num_tokens if max_num_tokens is not None else \
            len(token_ids) + (params.max_tokens if params.max_tokens is not None else 1 << 62)
        self.params = params
        self.status = SequenceStatus.WAITING
        # Its request's place under the priority scheduling policy: priority (lower first), then arrival
        # (time.time()'s), then the order requests were queued in (LLMEngine sets all three).
        self.priority = 0
        self.arrival_time = 0.0
        self.queue_order = 0
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache; the rest are fed in the next step(s)
        self.num_cached_tokens: int | None = None  # prefix-cache hit tokens at first scheduling
        self.first_scheduled_time: float | None = None  # time.time() at first scheduling
        self.sample_row = -1  # while token_ids[-1] is PENDING_TOKEN: its row in the runner's sampled tokens
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: random.Random | None = None  # the request's own random stream, from its seed
        self.detokenizer: IncrementalDetokenizer | None = None  # None when the model has no tokenizer
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words, tokenized (Intake)
        self.grammar: Grammar | None = None  # structured outputs: where the output is in its grammar
        self.logprobs: list[dict[int, Logprob]] | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        # The request's prompt logprobs, kept by its first completion: None for the first prompt token, then one
        # dict per prompt token, appended as the prefill's chunks compute them.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            [None] if params.prompt_logprobs is not None and index == 0 else None
        # A pooling request's (embed(), encode()): its prompt pooled as the chunks are computed; it samples nothing.
        self.pooling: PoolingState | None = None

    @property
    def params(self) -> SamplingParams:
        return self._params

    @params.setter
    def params(self, params: SamplingParams):
        self._params = params
        self.sampling_row = parameter_row(params)  # the sampler reads it every step
        self.sparse_bias = sparse_bias(params)

    def priority_key(self) -> tuple[int, float, int, int]:
        return self.priority, self.arrival_time, self.queue_order, self.index

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still missing: the prompt must be computed, not cached."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt token must be computed, none taken from the prefix cache: its prompt logprobs, or a
        pooling over all of its tokens, are still to come."""
        if self.pooling is not None and self.pooling.pooling_type != "LAST":
            return self.pooling.count < self.num_prompt_tokens
        return self.needs_prompt_logprobs

    @property
    def has_pending_token(self) -> bool:
        return self.token_ids[-1] == PENDING_TOKEN

    @property
    def reached_length(self) -> bool:
        return self.num_tokens >= self.max_num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
