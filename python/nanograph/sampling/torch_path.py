"""The torch path: sampling with torch ops, where the core's kernels are not (on the CPU, or a GPU without the core).

It splits the rows by what they need (TorchPlan): greedy rows take the argmax; rows without truncation draw from
the whole row; truncated rows draw among their candidates, the largest logits found by torch.topk (no row is
sorted), and only a row whose kept tokens spill past its candidates is drawn again from the whole row. Per-row
parameters go to the device in one copy; the host waits for the device once when rows are truncated, otherwise not
until PendingSample.result()."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .batch import BatchRows
from .outputs import CopiedSample, LogprobRows, PendingSample
from .seen import SeenTokens
from .table import SampledSequence
from .torch_plan import DeviceArrays, TorchPlan
from .transforms import TruncationParams, apply_penalties, sorted_top_p_thresholds, truncation_thresholds


class _Truncation(NamedTuple):
    """The truncated rows' logits [rows, vocab], candidates [rows, k] and thresholds (floors: of top-k and min_p;
    thresholds: of all three) [rows, 1]."""
    rows: torch.Tensor
    candidates: torch.Tensor
    floors: torch.Tensor
    thresholds: torch.Tensor


class TorchPath:
    def __init__(self, device: torch.device, eos_token_ids: list[int], seed: int):
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device).manual_seed(seed)  # for the rows without a seed of their own
        self._seen = SeenTokens()
        self._batch: BatchRows | None = None  # the last call's, reused while the batch stays the same

    def plain_greedy(self, seqs: list[SampledSequence], vocab_size: int) -> bool:
        self._batch = BatchRows.of(seqs, vocab_size, self._batch)
        return self._batch.plain_greedy

    def plan(self, logits: torch.Tensor, seqs: list[SampledSequence]) -> TorchPlan:
        plan = TorchPlan(seqs, logits.shape[-1], self.eos_token_ids, self._seen, self._batch)
        self._batch = plan.batch
        return plan

    def sample(self, logits: torch.Tensor, seqs: list[SampledSequence]) -> PendingSample:
        plan = self.plan(logits, seqs)
        rows = plan.upload(self.device)  # sent when first read
        if plan.transforms:
            token_ids = self._drawn(self._penalised_and_scaled(logits, plan, rows), plan, rows)
        else:
            token_ids = _masked_whole_past_vocabulary(*_argmax(logits), logits.shape[-1])
        if not plan.batch.logprob_rows:
            return CopiedSample(token_ids)
        return with_logprobs(logits, LogprobRows(plan.batch.logprob_rows, plan.batch.num_top_logprobs), token_ids,
                             rows.logprob_rows)

    @staticmethod
    def _penalised(logits: torch.Tensor, rows: DeviceArrays) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat positions in logits of the tokens the penalised rows have seen, and their penalised logits
        (float32): penalties touch only those tokens."""
        positions = torch.add(rows.penalty_token_ids, rows.penalty_rows, alpha=logits.shape[-1])
        penalised = apply_penalties(torch.take(logits, positions).float(), rows.penalty_counts,
                                    rows.presence_penalties, rows.frequency_penalties, rows.repetition_penalties)
        return positions, penalised

    def _penalised_and_scaled(self, logits: torch.Tensor, plan: TorchPlan, rows: DeviceArrays) -> torch.Tensor:
        """A new float32 tensor: biases (allowed_token_ids, logit_bias), penalties, then division by the temperature
        (1 for greedy rows), then -inf at the masked tokens (min_tokens, bad_words)."""
        if plan.batch.biases.any:
            logits = _biased(logits, rows)
        scaled = logits.float() / rows.temperatures
        if plan.penalties.rows:
            positions, penalised = self._penalised(logits, rows)
            scaled.put_(positions, penalised.div_(rows.penalty_temperatures))
        if plan.masks.any:
            scaled.view(-1).index_fill_(0, rows.masked_positions, float("-inf"))
        return scaled

    def _drawn(self, logits: torch.Tensor, plan: TorchPlan, rows: DeviceArrays) -> torch.Tensor:
        """int64 [num_rows]: the argmax of the greedy rows, a draw from the others (full rows, then truncated ones,
        each with a uniform in (0, 1] from its own stream or the path's generator); the id past the vocabulary for
        a row whose every token is masked."""
        uniforms = 1 - torch.rand(len(plan.full_rows) + len(plan.truncated_rows), dtype=torch.float64,
                                  device=logits.device, generator=self.generator)
        if plan.has_seeded:
            uniforms.index_copy_(0, rows.seeded, rows.seeded_uniforms)
        drawn, peaks = [], []  # per group of rows: the tokens, and each row's largest logit
        if len(plan.greedy_rows):
            greedy_ids, greedy_peaks = _argmax(_rows(logits, rows.greedy_rows))
            drawn.append(greedy_ids)
            peaks.append(greedy_peaks)
        if len(plan.full_rows):
            full = _rows(logits, rows.full_rows)
            peaks.append(full.amax(dim=-1))
            drawn.append(_draw((full - peaks[-1][:, None]).exp_(), uniforms[:len(plan.full_rows)]))
        if len(plan.truncated_rows):
            truncated_ids, truncation = self._drawn_truncated(logits, plan, rows, uniforms[len(plan.full_rows):])
            drawn.append(truncated_ids)
            peaks.append(truncation.candidates[:, 0])
        token_ids, peak = (drawn[0], peaks[0]) if len(drawn) == 1 else \
            (torch.cat(drawn).index_select(0, rows.order), torch.cat(peaks).index_select(0, rows.order))
        if len(plan.truncated_rows) and (plan.num_candidates < logits.shape[-1] or plan.has_seeded_truncated):
            self._redraw_spilled(truncation, plan, rows, uniforms[len(plan.full_rows):], token_ids,
                                 plan.num_candidates < logits.shape[-1])
        return _masked_whole_past_vocabulary(token_ids, peak, logits.shape[-1])

    def _drawn_truncated(self, logits: torch.Tensor, plan: TorchPlan, rows: DeviceArrays,
                         uniforms: torch.Tensor) -> tuple[torch.Tensor, _Truncation]:
        """int64 [truncated rows]: each drawn among its candidates, where its threshold is found too (a row of
        masked tokens alone draws a position past them, read at the last: _drawn replaces its token)."""
        truncated = _rows(logits, rows.truncated_rows)
        candidates, candidate_ids = truncated.topk(plan.num_candidates, dim=-1)
        weights = (candidates - candidates[:, :1]).exp_()
        params = TruncationParams(rows.candidate_top_ks, rows.no_top_k, rows.log_min_ps,
                                  rows.top_ps if plan.has_top_p else None,
                                  rows.open_top_p if plan.has_open_top_p else None)
        floors, thresholds = truncation_thresholds(truncated, candidates, weights, params, plan.has_open_min_p)
        drawn = _draw(weights.masked_fill_(candidates < thresholds, 0), uniforms).clamp_(max=plan.num_candidates - 1)
        return (candidate_ids.gather(1, drawn[:, None]).squeeze(1),
                _Truncation(truncated, candidates, floors, thresholds))

    def _redraw_spilled(self, t: _Truncation, plan: TorchPlan, rows: DeviceArrays, uniforms: torch.Tensor,
                        token_ids: torch.Tensor, may_spill: bool):
        """Draw again, from their whole rows, the truncated rows whose kept tokens may reach past their candidates
        (the last candidate is kept; may_spill: the candidates are fewer than the vocabulary), with the exact top-p
        threshold of the sorted row; and the seeded ones, always: whether a row spills depends on the batch (its
        largest top-k sets the number of candidates), and a candidate draw (in descending order) picks another
        token than a whole-row draw (in vocabulary order) for the same uniform. The host waits here."""
        spilled = (t.candidates[:, -1:] >= t.thresholds).squeeze(1) if may_spill else \
            torch.zeros(len(t.candidates), dtype=torch.bool, device=t.candidates.device)
        if plan.has_seeded_truncated:
            spilled.index_fill_(0, rows.seeded_truncated, True)
        spilled = spilled.nonzero().squeeze(1)
        if len(spilled) == 0:
            return
        whole = t.rows.index_select(0, spilled)
        thresholds = t.thresholds.index_select(0, spilled)
        if plan.has_top_p:
            exact = sorted_top_p_thresholds(whole, rows.top_ps.index_select(0, spilled),
                                            rows.top_ks.index_select(0, spilled), t.floors.index_select(0, spilled))
            thresholds = torch.where(rows.top_ps.index_select(0, spilled) < 1, exact, thresholds)
        weights = (whole - t.candidates[:, :1].index_select(0, spilled)).exp_().masked_fill_(whole < thresholds, 0)
        token_ids.index_copy_(0, rows.truncated_rows.index_select(0, spilled),
                              _draw(weights, uniforms.index_select(0, spilled)))


def with_logprobs(logits: torch.Tensor, logprobs: LogprobRows, token_ids: torch.Tensor,
                  logprob_rows: torch.Tensor) -> CopiedSample:
    """token_ids with the logprobs of the raw logits that the rows ask for (logprob_rows: logprobs.rows on the
    device), from torch ops."""
    raw_logprobs = _rows(logits, logprob_rows).float().log_softmax(dim=-1)
    top, top_ids = raw_logprobs.topk(max(logprobs.num_top), dim=-1)
    # A row whose every token was masked drew the id past the vocabulary (its request fails on the host): its
    # logprob is read at the last token instead, so that the other rows' go on.
    sampled = raw_logprobs.gather(1, _rows(token_ids, logprob_rows).clamp(max=raw_logprobs.shape[-1] - 1)[:, None])
    ranks = (raw_logprobs > sampled).sum(dim=-1, keepdim=True)
    return CopiedSample(token_ids, logprobs, torch.cat([sampled, top], 1), torch.cat([ranks, top_ids], 1))


def _biased(logits: torch.Tensor, rows: DeviceArrays) -> torch.Tensor:
    """A float32 copy of logits with the biases added, and -inf at every other token of the allowed_token_ids rows."""
    biased = logits.to(torch.float32, copy=True)
    listed = biased.take(rows.bias_positions).add_(rows.biases)
    if len(rows.mask_others_rows):
        biased.index_fill_(0, rows.mask_others_rows, float("-inf"))
    return biased.put_(rows.bias_positions, listed)


def _rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor's rows (sorted, distinct indices): the tensor itself when they are all of them."""
    return tensor if len(rows) == len(tensor) else tensor.index_select(0, rows)


def _argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (torch's order) and its value."""
    ids = logits.argmax(dim=-1)
    return ids, logits.gather(1, ids[:, None]).squeeze(1)


def _masked_whole_past_vocabulary(token_ids: torch.Tensor, peaks: torch.Tensor, vocab: int) -> torch.Tensor:
    """token_ids, with the id past the vocabulary where the row's largest logit (peaks) is -inf: every token of that
    row was masked, and its request fails on the host, as on the kernel path."""
    return token_ids.masked_fill_(peaks == float("-inf"), vocab)


def _draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One position per row, drawn with probability proportional to weights (exp(logit - max_logit): in [0, 1],
    the max 1; 0 where the token may not be drawn), by inverse CDF with uniforms in (0, 1]. The weights are made
    whole numbers, floor(weight * 2^s), summed in float64 below 2^52, exactly in any order: a token has exactly its
    share, and one of weight 0 is never drawn. Tokens under 2^-s of the most likely (2^-34 at Qwen3's vocabulary)
    get weight 0. Overwrites weights."""
    scale = 2.0 ** (52 - weights.shape[-1].bit_length())
    cdf = weights.mul_(scale).floor_().cumsum(dim=-1, dtype=torch.float64)
    targets = cdf[:, -1:].mul(uniforms[:, None]).ceil_()
    return torch.searchsorted(cdf, targets).squeeze(1)
