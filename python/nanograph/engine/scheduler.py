"""Continuous batching: which sequences run in the next step, how many of their tokens, and what happens after."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..config import Config
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    is_prefill: bool
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # the step reaches the sequence's end: sample its next token

    def add(self, seq: Sequence, num_new_tokens: int):
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.samples.append(num_new_tokens == seq.num_pending_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager, eos_token_ids: set[int]):
        # A decode step feeds one token per running sequence, so the token budget caps the running set too.
        self.max_num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()  # hold no KV blocks
        self.running: deque[Sequence] = deque()  # hold KV blocks, in admission order

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Prefill when any prompt is waiting and fits, else decode every running sequence."""
        batch = self._schedule_prefill()
        return batch if batch.seqs else self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=True)
        budget = self.max_num_batched_tokens
        # A prompt that the token budget cut short last step is admitted last, and continues first.
        if self.running and self.running[-1].num_pending_tokens > 1:
            seq = self.running.pop()
            num_new = min(seq.num_pending_tokens, budget)
            if self._reserve(seq, num_new):
                self.running.append(seq)
                batch.add(seq, num_new)
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.block_manager.allocate_prefix(seq)
            num_new = min(seq.num_pending_tokens, budget)
            if not self.block_manager.append_slots(seq, num_new):
                self.block_manager.deallocate(seq)
                break
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            batch.add(seq, num_new)
            budget -= num_new
        return batch

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=False)
        while self.running:
            seq = self.running.popleft()
            if self._reserve(seq, 1):
                batch.add(seq, 1)
        self.running = deque(batch.seqs)
        return batch

    def _reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Find KV room for seq (not in running), preempting the latest admitted sequences; else preempt seq."""
        while not self.block_manager.append_slots(seq, num_new_tokens):
            if not self.running:
                self._preempt(seq)
                return False
            self._preempt(self.running.pop())
        return True

    def _preempt(self, seq: Sequence):
        """Preemption by recompute: the blocks go, the tokens (generated ones too) stay to be prefilled again."""
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence]:
        """Advance the batch by its computed tokens and sampled tokens (one per sampling row); return the finished."""
        finished = []
        sampled = iter(sampled_token_ids)
        for seq, num_new, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq, num_new)
            if not samples:
                continue
            seq.token_ids.append(next(sampled))
            seq.finish_reason = self._finish_reason(seq)
            if seq.finish_reason:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence) -> str | None:
        token_id, params = seq.token_ids[-1], seq.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in (params.stop_token_ids or ()):
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
