"""One request: its n sequences (completions) of one prompt, its timings, and what it reports."""
from __future__ import annotations

import time

from ..outputs import CompletionDelta, CompletionOutput, RequestMetrics, RequestOutput
from ..pooling import PoolingOutput, PoolingRequestOutput
from ..sampling_params import RequestOutputKind
from .sequence import Sequence, SequenceStatus


class Request:
    def __init__(self, request_id: str, seqs: list[Sequence], owner: object | None = None):
        self.request_id = request_id
        self.seqs = seqs  # by completion index
        # The call that collects the request's output (a generate or stream call); None: whoever calls step().
        self.owner = owner
        # The siblings stay HELD until seqs[0] has computed the prompt, so that they find its KV blocks in the
        # prefix cache (without one, the engine releases them at once).
        for seq in seqs[1:]:
            seq.status = SequenceStatus.HELD
        self.error: str | None = None  # why the engine ended it, when a step failed on it
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.num_streamed_tokens = [0] * len(seqs)
        self.num_streamed_logprobs = [0] * len(seqs)
        self.finish_streamed = [False] * len(seqs)
        # Deltas taken for some siblings by a take_deltas call that then raised on another's text: the next
        # call returns them first.
        self._taken: list[CompletionDelta] = []

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def held_siblings(self) -> list[Sequence]:
        """The siblings still held back (all of them, or none)."""
        return [seq for seq in self.seqs[1:] if seq.status is SequenceStatus.HELD]

    def output(self) -> RequestOutput | PoolingRequestOutput:
        first = self.seqs[0]
        if first.first_scheduled_time is not None and self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = first.first_scheduled_time
            self.metrics.time_in_queue = first.first_scheduled_time - self.metrics.arrival_time
        cached = [seq.num_cached_tokens for seq in self.seqs if seq.num_cached_tokens is not None]
        if first.pooling is not None:
            data = first.pooling.data
            return PoolingRequestOutput(
                request_id=self.request_id, outputs=None if data is None else PoolingOutput(data),
                prompt_token_ids=first.token_ids[:first.num_prompt_tokens], finished=self.finished,
                prompt=first.prompt, num_cached_tokens=max(cached) if cached else None, metrics=self.metrics,
                error=self.error)
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.token_ids[:first.num_prompt_tokens],
            outputs=[CompletionOutput(index=seq.index, text=seq.detokenizer.text if seq.detokenizer else "",
                                      token_ids=seq.completion_token_ids, cumulative_logprob=seq.cumulative_logprob,
                                      logprobs=seq.logprobs, finish_reason=seq.finish_reason,
                                      stop_reason=seq.stop_reason)
                     for seq in self.seqs],
            finished=self.finished, num_cached_tokens=max(cached) if cached else None, metrics=self.metrics,
            error=self.error, prompt_logprobs=first.prompt_logprobs)

    def take_deltas(self) -> list[CompletionDelta]:
        """What each sequence produced since the last call (as its params' output_kind asks: the new part, all of it
        so far, or all of it once finished); a finished sequence reports once more, finished. A sibling whose text
        fails to decode raises, and the deltas taken before it come with the next call."""
        for seq in self.seqs:
            i, kind = seq.index, seq.params.output_kind
            if kind is None:
                kind = RequestOutputKind.DELTA
            if kind is RequestOutputKind.FINAL_ONLY and not seq.is_finished:
                continue
            known = seq.num_tokens - seq.has_pending_token  # a token on its way from the device is not out yet
            token_ids = seq.token_ids[seq.num_prompt_tokens + self.num_streamed_tokens[i]:known]
            text = seq.detokenizer.take_new_text(seq.is_finished) if seq.detokenizer else ""
            if not token_ids and not text and (self.finish_streamed[i] or not seq.is_finished):
                continue
            logprobs = None
            if seq.logprobs is not None:
                logprobs = seq.logprobs[self.num_streamed_logprobs[i]:]
                self.num_streamed_logprobs[i] = len(seq.logprobs)
            self.num_streamed_tokens[i] += len(token_ids)
            self.finish_streamed[i] = seq.is_finished
            if kind is not RequestOutputKind.DELTA:
                token_ids = seq.token_ids[seq.num_prompt_tokens:known]
                text = seq.detokenizer.streamed_text if seq.detokenizer else ""
                logprobs = None if seq.logprobs is None else list(seq.logprobs)
            self._taken.append(CompletionDelta(self.request_id, i, text, token_ids, seq.is_finished,
                                               seq.finish_reason, seq.stop_reason, logprobs,
                                               self.error if seq.is_finished else None,
                                               self.seqs[0].first_scheduled_time,
                                               self.seqs[0].prompt_logprobs if seq.is_finished else None,
                                               seq.num_cached_tokens if seq.is_finished else None,
                                               seq.cumulative_logprob,
                                               _vector(seq)))
        deltas, self._taken = self._taken, []
        return deltas


def _vector(seq: Sequence):
    """A pooling sequence's vector once computed, as a numpy array (it crosses the engine process's pipe as plain
    bytes); None otherwise."""
    return seq.pooling.data.numpy() if seq.pooling is not None and seq.pooling.data is not None else None
