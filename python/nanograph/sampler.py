"""Token sampling on the logits' device, one row per sequence, in vLLM's order: logprobs of the raw logits →
penalties and the min_tokens mask → greedy argmax → temperature → min_p, top-k, top-p → a draw.

On a GPU with the core, one kernel (csrc/sample_rows.cu) samples every row from its parameters and a 64-bit key
drawn on the host (from the request's own stream when it has a seed); rows with penalties or masked tokens are
first copied out and modified. Elsewhere the torch path splits the rows by what they need (SamplingPlan): greedy
rows take the argmax; rows without truncation draw from the whole row; truncated rows draw among their candidates,
the largest logits found by torch.topk (no row is sorted), and only a row whose kept tokens spill past its
candidates is drawn again from the whole row; that path waits for the device once when rows are truncated.
Per-row parameters go to the device in one copy; otherwise the host does not wait until PendingSample.result()."""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .logits_processors import (TruncationParams, apply_penalties, sorted_top_p_thresholds,
                                truncation_thresholds)
from ._core import core_available, require_core
from .sampling_plan import DeviceArrays, SamplingPlan, SeenTokens

if TYPE_CHECKING:
    from .engine.sequence import Sequence

MAX_TOP_LOGPROBS = 32  # the kernel's limit (kMaxTopLogprobs); requests for more take torch's topk

class TokenLogprobs(NamedTuple):
    token_ids: list[int]  # the sampled token, then the top ones
    logprobs: list[float]
    ranks: list[int]


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class _Truncation(NamedTuple):
    """The truncated rows' logits [rows, vocab], candidates [rows, k] and thresholds (floors: of top-k and min_p;
    thresholds: of all three) [rows, 1]."""
    rows: torch.Tensor
    candidates: torch.Tensor
    floors: torch.Tensor
    thresholds: torch.Tensor


class _Logprobs(NamedTuple):
    """The logprobs a call computed, on the device, for rows (those that asked), each wanting num_top top ones; row
    rows[i]'s are at[i] of values (float32: the sampled token's logprob, then the top ones) and ids (int64: the
    number of tokens more likely than the sampled one, then the top ones' ids)."""
    rows: list[int]
    num_top: list[int]
    at: list[int]
    values: torch.Tensor
    ids: torch.Tensor


class PendingSample:
    """A step's sampled token ids, still being computed on the device: the engine feeds them to the next step from
    there and reads them (and the logprobs) later with result()."""

    def __init__(self, token_ids: torch.Tensor, logprobs: _Logprobs | None = None):
        self.token_ids = token_ids  # int64 [rows] on the logits' device
        self._logprobs = logprobs
        tensors = [token_ids] if logprobs is None else [token_ids, logprobs.values, logprobs.ids]
        self._host = [tensor.to("cpu", non_blocking=True) for tensor in tensors]  # pinned; result() waits for them
        self._ready = None
        if token_ids.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> SamplerOutput:
        """Waits for the device; the token ids and logprobs as host lists."""
        if self._ready is not None:
            self._ready.synchronize()
        token_ids = self._host[0].tolist()
        row_logprobs = [None] * len(token_ids)
        if self._logprobs is not None:
            at = self._logprobs.at
            values, ids = self._host[1].numpy()[at].tolist(), self._host[2].numpy()[at].tolist()
            for i, (row, k) in enumerate(zip(self._logprobs.rows, self._logprobs.num_top)):
                row_logprobs[row] = TokenLogprobs([token_ids[row]] + ids[i][1:k + 1], values[i][:k + 1],
                                                  [ids[i][0] + 1] + list(range(1, k + 1)))
        return SamplerOutput(token_ids, row_logprobs)


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids=(), seed: int = 0):
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(self.device).manual_seed(seed)  # for the rows without a seed of their own
        self._seen = SeenTokens()
        # On a GPU with the core, one kernel samples every row; its draws take 64-bit keys from the host.
        self._kernel = self.device.type == "cuda" and core_available()
        self._keys = np.random.Generator(np.random.PCG64(seed))

    def new_generator(self, seed: int) -> random.Random:
        """A request's own random stream, on the host: each of its draws takes one uniform from it, so a seeded row's
        tokens do not depend on the rest of the batch."""
        return random.Random(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [num_rows, vocab], one row per sequence, left unmodified."""
        return self.sample(logits, seqs).result()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """Queues the sampling of one token per row (logits [num_rows, vocab], one row per sequence, left
        unmodified) without waiting for the device, unless the torch path truncates rows (see the module's
        docstring)."""
        plan = SamplingPlan(seqs, logits.shape[-1], self.eos_token_ids, self._seen,
                            self._keys if self._kernel else None)
        rows = plan.upload(self.device)  # sent when first read
        if self._kernel and max(plan.num_top_logprobs, default=0) <= MAX_TOP_LOGPROBS:
            return self._sample_on_core(logits, plan, rows)
        if plan.logprob_rows:
            raw_logprobs = _rows(logits, rows.logprob_rows).float().log_softmax(dim=-1)
            top, top_ids = raw_logprobs.topk(max(plan.num_top_logprobs), dim=-1)
        if self._kernel:
            token_ids = self._sample_on_core(logits, plan, rows, with_logprobs=False).token_ids
        elif plan.transforms:
            token_ids = self._drawn(self._penalised_and_scaled(logits, plan, rows), plan, rows)
        else:
            token_ids = logits.argmax(dim=-1)
        if not plan.logprob_rows:
            return PendingSample(token_ids)
        sampled = raw_logprobs.gather(1, _rows(token_ids, rows.logprob_rows)[:, None])
        ranks = (raw_logprobs > sampled).sum(dim=-1, keepdim=True)
        return PendingSample(token_ids, _Logprobs(plan.logprob_rows, plan.num_top_logprobs,
                                                  list(range(len(plan.logprob_rows))),
                                                  torch.cat([sampled, top], 1), torch.cat([ranks, top_ids], 1)))

    def _sample_on_core(self, logits: torch.Tensor, plan: SamplingPlan, rows: DeviceArrays,
                        with_logprobs: bool = True) -> PendingSample:
        """The core's kernels: the penalised and masked rows copied out and modified (the overrides), then every
        row sampled, with the logprobs of the rows that ask (at most MAX_TOP_LOGPROBS top ones)."""
        core = require_core()
        token_ids = torch.empty(plan.num_rows, dtype=torch.int64, device=logits.device)
        overrides = override_rows = None
        if len(plan.override_source):
            overrides = torch.empty(len(plan.override_source), logits.shape[-1], device=logits.device)
            core.prepare_overrides(logits, rows.override_source, overrides, rows.seen_tokens, rows.output_counts,
                                   rows.penalties[0], rows.penalties[1], rows.penalties[2], rows.masked_tokens)
            override_rows = rows.override_rows
        num_logprobs = values = ids = None
        if with_logprobs and plan.logprob_rows:
            width = 1 + max(plan.num_top_logprobs)
            values = torch.empty(plan.num_rows, width, device=logits.device)
            ids = torch.empty(plan.num_rows, width, dtype=torch.int64, device=logits.device)
            num_logprobs = rows.num_logprobs
        core.sample_rows(logits, rows.kernel_temperatures, rows.top_ks, rows.top_ps, rows.min_ps, rows.keys,
                         token_ids, None, overrides, override_rows, num_logprobs, values, ids)
        if values is None:
            return PendingSample(token_ids)
        return PendingSample(token_ids, _Logprobs(plan.logprob_rows, plan.num_top_logprobs, plan.logprob_rows,
                                                  values, ids))

    @staticmethod
    def _penalised(logits: torch.Tensor, rows: DeviceArrays) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat positions in logits of the tokens the penalised rows have seen, and their penalised logits
        (float32): penalties touch only those tokens."""
        positions = torch.add(rows.penalty_token_ids, rows.penalty_rows, alpha=logits.shape[-1])
        penalised = apply_penalties(torch.take(logits, positions).float(), rows.penalty_counts,
                                    rows.presence_penalties, rows.frequency_penalties, rows.repetition_penalties)
        return positions, penalised

    def _penalised_and_scaled(self, logits: torch.Tensor, plan: SamplingPlan, rows: DeviceArrays) -> torch.Tensor:
        """A new float32 tensor: penalties, then division by the temperature (1 for greedy rows), then -inf at the
        stop tokens of rows short of min_tokens."""
        scaled = logits.float() / rows.temperatures
        if plan.penalty_rows:
            positions, penalised = self._penalised(logits, rows)
            scaled.put_(positions, penalised.div_(rows.penalty_temperatures))
        if plan.has_masked:
            scaled.view(-1).index_fill_(0, rows.masked_positions, float("-inf"))
        return scaled

    def _drawn(self, logits: torch.Tensor, plan: SamplingPlan, rows: DeviceArrays) -> torch.Tensor:
        """int64 [num_rows]: the argmax of the greedy rows, a draw from the others (full rows, then truncated ones,
        each with a uniform in (0, 1] from its own stream or the sampler's generator)."""
        uniforms = 1 - torch.rand(len(plan.full_rows) + len(plan.truncated_rows), dtype=torch.float64,
                                  device=logits.device, generator=self.generator)
        if plan.has_seeded:
            uniforms.index_copy_(0, rows.seeded, rows.seeded_uniforms)
        drawn = []
        if len(plan.greedy_rows):
            drawn.append(_rows(logits, rows.greedy_rows).argmax(dim=-1))
        if len(plan.full_rows):
            full = _rows(logits, rows.full_rows)
            drawn.append(_draw((full - full.amax(dim=-1, keepdim=True)).exp_(), uniforms[:len(plan.full_rows)]))
        if len(plan.truncated_rows):
            truncated_ids, truncation = self._drawn_truncated(logits, plan, rows, uniforms[len(plan.full_rows):])
            drawn.append(truncated_ids)
        token_ids = drawn[0] if len(drawn) == 1 else torch.cat(drawn).index_select(0, rows.order)
        if len(plan.truncated_rows) and plan.num_candidates < logits.shape[-1]:
            self._redraw_spilled(truncation, plan, rows, uniforms[len(plan.full_rows):], token_ids)
        return token_ids

    def _drawn_truncated(self, logits: torch.Tensor, plan: SamplingPlan, rows: DeviceArrays,
                         uniforms: torch.Tensor) -> tuple[torch.Tensor, _Truncation]:
        """int64 [truncated rows]: each drawn among its candidates, where its threshold is found too."""
        truncated = _rows(logits, rows.truncated_rows)
        candidates, candidate_ids = truncated.topk(plan.num_candidates, dim=-1)
        weights = (candidates - candidates[:, :1]).exp_()
        params = TruncationParams(rows.candidate_top_ks, rows.no_top_k, rows.log_min_ps,
                                  rows.top_ps if plan.has_top_p else None,
                                  rows.open_top_p if plan.has_open_top_p else None)
        floors, thresholds = truncation_thresholds(truncated, candidates, weights, params, plan.has_open_min_p)
        drawn = _draw(weights.masked_fill_(candidates < thresholds, 0), uniforms)
        return (candidate_ids.gather(1, drawn[:, None]).squeeze(1),
                _Truncation(truncated, candidates, floors, thresholds))

    def _redraw_spilled(self, t: _Truncation, plan: SamplingPlan, rows: DeviceArrays, uniforms: torch.Tensor,
                        token_ids: torch.Tensor):
        """Draw again, from their whole rows, the truncated rows whose kept tokens may reach past their candidates
        (the last candidate is kept), with the exact top-p threshold of the sorted row. The host waits here."""
        spilled = (t.candidates[:, -1:] >= t.thresholds).squeeze(1).nonzero().squeeze(1)
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


def _rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor's rows (sorted, distinct indices): the tensor itself when they are all of them."""
    return tensor if len(rows) == len(tensor) else tensor.index_select(0, rows)


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
