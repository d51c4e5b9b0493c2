"""Per-request sampling parameters, validated with vLLM's messages."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def __post_init__(self):
        self.verify()

    def verify(self):
        """Raise ValueError on an invalid field; also called by the engine, as fields may change after construction."""
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
