"""Request results, with vLLM's field names, and the deltas that streaming yields."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float  # log-softmax of the model's raw logits, before penalties and temperature
    rank: int  # 1 for the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.time() seconds
    first_token_time: float | None = None
    last_token_time: float | None = None  # when it last got tokens
    finished_time: float | None = None
    first_scheduled_time: float | None = None  # when the engine first scheduled one of its sequences
    time_in_queue: float | None = None  # first_scheduled_time - arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were requested
    logprobs: list[dict[int, Logprob]] | None  # per generated token: the sampled token and the top ones
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string), "length", "abort"; None: running
    stop_reason: int | str | None = None  # the stop token id or stop string; None for the tokenizer's EOS, length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the text given, or rendered by chat(); None for token ids given without their text
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per completion (SamplingParams.n), by index
    finished: bool
    # Prompt tokens served from the prefix cache (of n completions, the most any took: at most the prompt's length).
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when a failure inside a step ended the request (its finish_reason is "abort")
    # SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token the token and the top ones
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class CompletionDelta:
    """What one step added to one completion: the stream's unit. Its texts concatenate to the final text (with
    SamplingParams.output_kind CUMULATIVE each holds everything so far instead; FINAL_ONLY: one, at the end)."""
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # of token_ids, when the request asked for logprobs
    error: str | None = None  # on the last delta of a request that a failure inside a step ended
    scheduled_time: float | None = None  # the request's RequestMetrics.first_scheduled_time (None: not yet)
    # On a completion's last delta, where the request asked for them: RequestOutput.prompt_logprobs.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # On a completion's last delta: its prompt's tokens found in the prefix cache (None: never scheduled).
    num_cached_tokens: int | None = None
    cumulative_logprob: float | None = None  # the completion's so far, when the request asked for logprobs
    pooled: object | None = None  # a pooling request's last delta: its vector (a float32 numpy array)
