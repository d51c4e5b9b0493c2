"""EngineStats: what the engine has done since it started, for benchmarks, logs and metrics."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0  # steps that fed some sequence more than one token
    scheduled_tokens: int = 0
    context_tokens: int = 0  # summed over steps: the tokens each scheduled sequence attends (its K and V are read)
    generated_tokens: int = 0  # sampled tokens the host has read
    device_wait_seconds: float = 0.0  # the host waiting for sampled tokens: the device was behind

    def record_step(self, num_tokens: int, is_prefill: bool, context_tokens: int):
        self.steps += 1
        self.prefill_steps += is_prefill
        self.scheduled_tokens += num_tokens
        self.context_tokens += context_tokens
