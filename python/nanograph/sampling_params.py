"""Per-request sampling parameters: vLLM's names, defaults and validation messages."""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-2  # lower positive temperatures are raised to this (vLLM's _MAX_TEMP): logits / T overflows


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks through the prefix cache
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and generated tokens
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None  # the request's own random stream: same seed, same output, whatever the batch
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logprobs: int | None = None  # top logprobs per generated token, the sampled token always included; -1: all
    skip_special_tokens: bool = True

    def __post_init__(self):
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or ()))
        self.verify()
        if self.temperature == 0:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def verify(self):
        """Raise ValueError on an invalid field; also called by the engine, as fields may change after construction."""
        if not isinstance(self.n, int):
            raise ValueError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:  # -1 is accepted for disabled, as vLLM does
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if not all(isinstance(token_id, int) for token_id in self.stop_token_ids or ()):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if not all(isinstance(stop_str, str) for stop_str in self.stop or ()):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not stop_str for stop_str in self.stop or ()):
            raise ValueError("stop cannot contain an empty string.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}.")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
