"""Continuous batching: which sequences run in the next step and how many of their tokens; KV blocks for them,
preemption when blocks run out, and the blocks back when a sequence ends.

Two policies, vLLM's (Config.scheduling_policy): "fcfs" serves requests in arrival order and preempts the latest
admitted sequence when KV blocks run out; "priority" serves them by (priority, arrival): the waiting queue is kept in
that order, the running sequences are stepped in that order, and the one preempted is the running sequence of the
largest priority value (the latest to arrive among equals). A waiting request never preempts a running one; it
waits for room, as in vLLM."""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from ..config import Config
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # the step reaches the sequence's end: sample its next token

    def add(self, seq: Sequence, num_new_tokens: int):
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.samples.append(num_new_tokens == seq.num_pending_tokens)

    def decodes_first(self):
        """Rows of one new token first, each kind in its order: the CUDA core sends a step's leading one-token rows
        through decode attention, the rest through prefill attention."""
        order = sorted(range(len(self.seqs)), key=lambda row: self.num_new_tokens[row] > 1)
        self.seqs = [self.seqs[row] for row in order]
        self.num_new_tokens = [self.num_new_tokens[row] for row in order]
        self.samples = [self.samples[row] for row in order]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_prefill(self) -> bool:
        """Some sequence feeds more than one token: a prompt chunk (or a preempted sequence's recompute)."""
        return self.num_tokens > len(self.seqs)


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager):
        # Every running sequence gets at least one token of each step's budget: Config holds the budget at or above
        # max_num_seqs.
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.by_priority = config.scheduling_policy == "priority"
        self.block_manager = block_manager
        # Both may still hold sequences finished since the last step (finish() is O(1)); schedule() drops them.
        self.waiting: deque[Sequence] = deque()  # hold no KV blocks
        self.running: deque[Sequence] = deque()  # hold KV blocks, in admission order
        self.num_unfinished = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=Sequence.priority_key)
        else:
            self.waiting.append(seq)
        self.num_unfinished += 1

    def add_siblings(self, seqs: list[Sequence]):
        """A running request's other completions, released once its first has computed the prompt: they keep the
        request's place, ahead of every request that came after it (behind the preempted sequences and the siblings
        released before them, at the front of the queue)."""
        if not seqs:
            return
        if self.by_priority:  # the request's place in the queue is its key's
            for seq in seqs:
                self.add(seq)
            return
        position = 0
        while position < len(self.waiting) and (self.waiting[position].first_scheduled_time is not None
                                                or self.waiting[position].index > 0):
            position += 1
        for offset, seq in enumerate(seqs):
            seq.status = SequenceStatus.WAITING
            self.waiting.insert(position + offset, seq)
        self.num_unfinished += len(seqs)

    def has_unfinished(self) -> bool:
        return self.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return sum(not seq.is_finished for seq in self.running)

    @property
    def num_waiting(self) -> int:
        return self.num_unfinished - self.num_running

    def schedule(self) -> ScheduledBatch:
        """Chunked prefill mixed with decodes: every running sequence continues, in admission order (by priority
        under that policy; a decode feeds one token; a prompt that the budget cut short, its next chunk, leaving a
        token for each sequence after it), then waiting prompts are admitted into what is left of the token
        budget, the last one possibly cut short."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        num_preemptions = self.num_preemptions
        unscheduled, self.running = self.running, deque()
        if self.by_priority:
            unscheduled = deque(sorted(unscheduled, key=Sequence.priority_key))
        while unscheduled:
            seq = unscheduled.popleft()
            if seq.is_finished:
                continue
            if seq.has_pending_token and seq.reached_length:
                self.running.append(seq)  # it ends when its pending token is read: feeding it would be wasted
                continue
            # Under fcfs the prompt cut short is the last admitted, with no sequence after it.
            num_pending = seq.num_pending_tokens
            num_new = min(num_pending, budget - len(unscheduled) if num_pending > 1 else budget)
            if self._reserve(seq, num_new, unscheduled):
                self.running.append(seq)
                batch.add(seq, num_new)
                budget -= num_new
        if self.num_preemptions == num_preemptions:  # after a preemption the cache is full: admit nobody
            self._admit(batch, budget)
        # Under fcfs the decodes lead already: a prompt mid-chunk is the last admitted, and new prompts come after it.
        if self.by_priority and batch.is_prefill:
            batch.decodes_first()
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int):
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.is_finished:
                self.waiting.popleft()
                continue
            self.block_manager.allocate_prefix(seq)
            num_new = min(seq.num_pending_tokens, budget)
            if not self.block_manager.append_slots(seq, num_new):
                self.block_manager.deallocate(seq)
                break
            if seq.num_cached_tokens is None:  # its first admission (a preempted one comes back)
                seq.num_cached_tokens = seq.num_computed_tokens
                self.block_manager.count_prefix_query(seq)
                seq.first_scheduled_time = time.time()
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            batch.add(seq, num_new)
            budget -= num_new

    def _reserve(self, seq: Sequence, num_new_tokens: int, victims: deque[Sequence]) -> bool:
        """Find KV room for seq, preempting the last of victims (running, not yet scheduled in this step: the latest
        admitted, or under the priority policy the one that comes last by priority); when none is left, preempt
        seq itself and return False."""
        while not self.block_manager.append_slots(seq, num_new_tokens):
            while victims and victims[-1].is_finished:
                victims.pop()
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(victims.pop())
        return True

    def _preempt(self, seq: Sequence):
        """Preemption by recompute: the blocks go, the tokens (generated ones too) stay to be prefilled again."""
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=Sequence.priority_key)
        else:
            self.waiting.appendleft(seq)

    def advance(self, batch: ScheduledBatch):
        """The batch's tokens are in the KV cache now (queued on the device, in order): count them, and offer the
        blocks they filled to the prefix cache. Call once the tokens they hold are known."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if not seq.is_finished:  # ended (stop token, abort) while the batch was queued: its blocks are gone
                seq.num_computed_tokens += num_new
                self.block_manager.cache_full_blocks(seq, num_new)

    def finish(self, seq: Sequence):
        """End seq, running or waiting: its blocks go back to the pool now; the queues let it go at the next
        schedule() (under the priority policy a waiting one leaves at once: better requests may keep it from the
        queue's front for as long as they come)."""
        if self.by_priority and seq.status is SequenceStatus.WAITING:
            key = seq.priority_key()
            position = bisect.bisect_left(self.waiting, key, key=Sequence.priority_key)
            while position < len(self.waiting) and self.waiting[position] is not seq:
                position += 1
            if position < len(self.waiting):
                del self.waiting[position]
        seq.status = SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)
        self.num_unfinished -= 1
