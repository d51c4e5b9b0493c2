"""One request: its n sequences (completions) of one prompt, its timings, and what it reports."""
from __future__ import annotations

import time

from ..outputs import CompletionDelta, CompletionOutput, RequestMetrics, RequestOutput
from .sequence import Sequence


class Request:
    def __init__(self, request_id: str, seqs: list[Sequence]):
        self.request_id = request_id
        self.seqs = seqs  # by completion index
        # Queued once seqs[0] has computed the prompt, so that they find its KV blocks in the prefix cache.
        self.held_back = seqs[1:]
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.num_streamed_tokens = [0] * len(seqs)
        self.finish_streamed = [False] * len(seqs)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def output(self) -> RequestOutput:
        first = self.seqs[0]
        cached = [seq.num_cached_tokens for seq in self.seqs if seq.num_cached_tokens is not None]
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.token_ids[:first.num_prompt_tokens],
            outputs=[CompletionOutput(index=seq.index, text=seq.detokenizer.output_text if seq.detokenizer else "",
                                      token_ids=seq.completion_token_ids, cumulative_logprob=seq.cumulative_logprob,
                                      logprobs=seq.logprobs, finish_reason=seq.finish_reason,
                                      stop_reason=seq.stop_reason)
                     for seq in self.seqs],
            finished=self.finished, num_cached_tokens=sum(cached) if cached else None, metrics=self.metrics)

    def take_deltas(self) -> list[CompletionDelta]:
        """What each sequence produced since the last call; a finished sequence reports once more, finished."""
        deltas = []
        for seq in self.seqs:
            i = seq.index
            known = seq.num_tokens - seq.has_pending_token  # a token on its way from the device is not out yet
            token_ids = seq.token_ids[seq.num_prompt_tokens + self.num_streamed_tokens[i]:known]
            text = seq.detokenizer.take_new_text(seq.is_finished) if seq.detokenizer else ""
            if not token_ids and not text and (self.finish_streamed[i] or not seq.is_finished):
                continue
            self.num_streamed_tokens[i] += len(token_ids)
            self.finish_streamed[i] = seq.is_finished
            deltas.append(CompletionDelta(self.request_id, i, text, token_ids, seq.is_finished, seq.finish_reason,
                                          seq.stop_reason))
        return deltas
