"""Request results, with vLLM's field names."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop token), "length", or None while unfinished
    cumulative_logprob: float | None = None
    logprobs: list | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # None when the request was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
