"""Token sampling on the logits' device, one row per sequence, in vLLM's order: logprobs of the raw logits →
penalties and the min_tokens mask → greedy argmax → temperature → min_p, top-k, top-p → a Gumbel-max draw.

Per-row parameters travel as tensors (pinned, non-blocking uploads) and row subsets are chosen on the host from
the parameters, so the only host synchronisation is the copy of the results (the sampled ids, and the
logprobs when asked for)."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .logits_processors import apply_penalties, min_p_thresholds, top_k_thresholds, top_p_thresholds

if TYPE_CHECKING:
    from .engine.sequence import Sequence


class TokenLogprobs(NamedTuple):
    token_ids: list[int]  # the sampled token, then the top ones
    logprobs: list[float]
    ranks: list[int]


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class PendingSample:
    """A step's sampled token ids, still being computed on the device: the engine feeds them to the next step from
    there and reads them later with result()."""

    def __init__(self, token_ids: torch.Tensor, logprobs=None):
        self.token_ids = token_ids  # [rows] on the logits' device
        self._logprobs = logprobs  # None, or a callable giving the per-row TokenLogprobs (it synchronises)
        self._host = token_ids
        self._ready = None
        if token_ids.is_cuda:
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> SamplerOutput:
        """Waits for the device; the token ids and logprobs as host lists."""
        if self._ready is not None:
            self._ready.synchronize()
        logprobs = self._logprobs() if self._logprobs else [None] * len(self._host)
        return SamplerOutput(self._host.tolist(), logprobs)


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids=(), seed: int = 0):
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.generator = self.new_generator(seed)  # for the rows without a seed of their own

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [num_rows, vocab], one row per sequence, left unmodified."""
        return self.sample(logits, seqs).result()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """Queues the sampling of one token per row (logits [num_rows, vocab], one row per sequence, left
        unmodified) without waiting for the device."""
        params = [seq.params for seq in seqs]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = logits[self._upload(logprob_rows)].float().log_softmax(dim=-1) if logprob_rows else None
        penalty_rows = [i for i, p in enumerate(params)
                        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1]
        masked = [(i, token_id) for i, seq in enumerate(seqs) if seq.num_completion_tokens < seq.params.min_tokens
                  for token_id in seq.params.stop_token_ids + self.eos_token_ids]
        greedy = [p.is_greedy for p in params]
        if penalty_rows or masked or not all(greedy):
            logits = self._penalised_and_scaled(logits, seqs, penalty_rows, masked)
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            greedy_ids = logits.argmax(dim=-1) if any(greedy) else None  # before truncation changes the logits
            token_ids = self._draw(self._truncated(logits, params), seqs)
            if greedy_ids is not None:
                token_ids = torch.where(self._upload(greedy, torch.bool), greedy_ids, token_ids)
        if not logprob_rows:
            return PendingSample(token_ids)

        def logprobs() -> list[TokenLogprobs | None]:
            row_logprobs = [None] * len(seqs)
            for row, row_result in zip(logprob_rows, self._logprobs(raw_logprobs, token_ids, logprob_rows, params)):
                row_logprobs[row] = row_result
            return row_logprobs

        return PendingSample(token_ids, logprobs)

    def _penalised_and_scaled(self, logits: torch.Tensor, seqs: list[Sequence], penalty_rows: list[int],
                              masked: list[tuple[int, int]]) -> torch.Tensor:
        """A new float32 tensor: penalties, then division by the temperature (1 for greedy rows), then -inf at the
        stop tokens of rows short of min_tokens."""
        temperatures = self._upload([seq.params.temperature or 1.0 for seq in seqs], torch.float32)[:, None]
        scaled = logits.float() / temperatures
        if penalty_rows:
            rows = self._upload(penalty_rows)
            penalty_seqs = [seqs[i] for i in penalty_rows]
            vocab_size = logits.shape[-1]
            prompt_ids = None
            if any(seq.params.repetition_penalty != 1 for seq in penalty_seqs):
                prompt_ids = self._padded([seq.token_ids[:seq.num_prompt_tokens] for seq in penalty_seqs], vocab_size)
            penalised = apply_penalties(
                logits[rows].float(), self._padded([seq.completion_token_ids for seq in penalty_seqs], vocab_size),
                prompt_ids, *(self._upload([getattr(seq.params, name) for seq in penalty_seqs], torch.float32)
                              for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")))
            scaled[rows] = penalised / temperatures[rows]
        if masked:
            rows, token_ids = zip(*masked)
            scaled[self._upload(rows), self._upload(token_ids)] = float("-inf")
        return scaled

    def _truncated(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Mask, in place and in one pass, what min_p, top-k and top-p drop from each row."""
        vocab_size = logits.shape[-1]
        has_min_p = any(p.min_p for p in params)
        if has_min_p:
            thresholds = min_p_thresholds(logits, self._upload([p.min_p for p in params], torch.float32))
        else:
            thresholds = torch.full((len(params),), float("-inf"), device=logits.device)
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_k_rows = [i for i, p in enumerate(params) if p.top_k > 0 and p.top_p == 1]
        if top_k_rows:
            rows = self._upload(top_k_rows)
            kth = top_k_thresholds(logits[rows], self._upload([top_ks[i] for i in top_k_rows]),
                                   max(top_ks[i] for i in top_k_rows))
            thresholds[rows] = torch.maximum(thresholds[rows], kth)
        top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1]
        if top_p_rows:
            rows = self._upload(top_p_rows)
            thresholds[rows] = top_p_thresholds(logits[rows],
                                                self._upload([params[i].top_p for i in top_p_rows], torch.float32),
                                                self._upload([top_ks[i] for i in top_p_rows]), thresholds[rows])
        if has_min_p or top_k_rows or top_p_rows:
            logits.masked_fill_(logits < thresholds[:, None], float("-inf"))
        return logits

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """argmax(logits + Gumbel noise) draws from softmax(logits). A seeded row takes its noise from its own
        generator, so its draws do not depend on the rest of the batch."""
        noise = torch.empty_like(logits).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        return logits.sub_(noise.log_()).argmax(dim=-1)

    def _logprobs(self, raw_logprobs: torch.Tensor, token_ids: torch.Tensor, rows: list[int],
                  params) -> list[TokenLogprobs]:
        """The sampled token's logprob and rank (1 + the tokens more likely), then each row's top logprobs."""
        vocab_size = raw_logprobs.shape[-1]
        num_top = [vocab_size if params[i].logprobs == -1 else min(params[i].logprobs, vocab_size) for i in rows]
        sampled_ids = token_ids[self._upload(rows)][:, None]
        sampled = raw_logprobs.gather(1, sampled_ids)
        ranks = (raw_logprobs > sampled).sum(dim=-1, keepdim=True) + 1
        top_logprobs, top_ids = raw_logprobs.topk(max(num_top), dim=-1)
        ids, logprobs = torch.cat([sampled_ids, top_ids], 1).tolist(), torch.cat([sampled, top_logprobs], 1).tolist()
        return [TokenLogprobs(row_ids[:k + 1], row_logprobs[:k + 1], [rank] + list(range(1, k + 1)))
                for row_ids, row_logprobs, [rank], k in zip(ids, logprobs, ranks.tolist(), num_top)]

    def _upload(self, values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return self._to_device(torch.tensor(values, dtype=dtype))

    def _padded(self, token_lists: list[list[int]], pad: int) -> torch.Tensor:
        """int64 [len(token_lists), max_len]: each list, then pad."""
        padded = np.full((len(token_lists), max(1, max(map(len, token_lists)))), pad, dtype=np.int64)
        for row, token_ids in zip(padded, token_lists):
            row[:len(token_ids)] = token_ids
        return self._to_device(torch.from_numpy(padded))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A non-blocking copy from pinned memory: the host does not wait for the GPU work queued before."""
        return host if self.device.type == "cpu" else host.pin_memory().to(self.device, non_blocking=True)
