"""Token sampling on the logits' device, one row per sequence, in vLLM's order: logprobs of the raw logits →
penalties and the min_tokens mask → greedy argmax → temperature → min_p, top-k, top-p → a draw.

On a GPU with the core, one kernel (csrc/sample_rows.cu) samples every row from its parameters and a 64-bit key
drawn on the host (from the request's own stream when it has a seed); rows with penalties or masked tokens are
first copied out and modified. The host packs every parameter into one pinned buffer sent in one copy, launches
both kernels through one binding (ops.sample_packed), and reads the token ids and logprobs back from one results
buffer in one copy (packed_sampling.py). Elsewhere the torch path splits the rows by what they need (SamplingPlan):
greedy rows take the argmax; rows without truncation draw from the whole row; truncated rows draw among their
candidates, the largest logits found by torch.topk (no row is sorted), and only a row whose kept tokens spill past
its candidates is drawn again from the whole row; that path waits for the device once when rows are truncated.
Per-row parameters go to the device in one copy; otherwise the host does not wait until PendingSample.result()."""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .logits_processors import (TruncationParams, apply_penalties, sorted_top_p_thresholds,
                                truncation_thresholds)
from ._core import core_available, require_core
from .packed_sampling import PackedLayout, Staging, StagingSlot
from .sampling_plan import BatchRows, DeviceArrays, SamplingPlan, SeenTokens

if TYPE_CHECKING:
    from .engine.sequence import Sequence

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
    """The rows that asked for logprobs, each wanting num_top top ones."""
    rows: list[int]
    num_top: list[int]


class PendingSample:
    """A step's sampled token ids, still being computed on the device: the engine feeds them to the next step from
    there and reads them (and the logprobs) later with result(). This one, the torch path's, copies the token ids
    and the logprobs to the host tensor by tensor: values (float32 [len(logprobs.rows), 1 + n]: the sampled
    token's logprob, then the top ones) and ids (int64: the number of tokens more likely than the sampled one,
    then the top ones' ids)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: _Logprobs | None = None, values: torch.Tensor | None = None,
                 ids: torch.Tensor | None = None):
        self.token_ids = token_ids  # int64 (int32 from the core's argmax) [rows] on the logits' device
        self._logprobs = logprobs
        tensors = [token_ids] if logprobs is None else [token_ids, values, ids]
        self._host = [tensor.to("cpu", non_blocking=True) for tensor in tensors]  # pinned; result() waits for them
        self._ready = _recorded_event(token_ids.device)
        self._output: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        """Waits for the device (the first time); the token ids and logprobs as host lists."""
        if self._output is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._output = self._read()
        return self._output

    def _read(self) -> SamplerOutput:
        token_ids = self._host[0].tolist()
        if self._logprobs is None:
            return _output(token_ids)
        return _output(token_ids, self._logprobs, self._host[1].numpy(), self._host[2].numpy())


class PackedPendingSample(PendingSample):
    """The core's: the results blob of ops.sample_packed (layout.results), copied in one copy to the results buffer
    of a staging slot, which it reads through numpy views. Registers itself as the slot's reader."""

    def __init__(self, results: torch.Tensor, layout: PackedLayout, slot: StagingSlot, logprobs: _Logprobs | None):
        # Not PendingSample.__init__: one copy of the whole blob, instead of one per tensor.
        token_ids = layout.results["token_ids"]
        self.token_ids = results[token_ids.offset:token_ids.offset + token_ids.nbytes].view(torch.int64)
        self._logprobs = logprobs
        self._layout = layout
        self._host = slot.results_view
        slot.results[:layout.results_nbytes].copy_(results, non_blocking=True)
        self._ready = _recorded_event(results.device)
        self._output = None
        slot.pending = self

    def _read(self) -> SamplerOutput:
        token_ids = self._layout.results["token_ids"].of(self._host).tolist()
        if self._logprobs is None:
            return _output(token_ids)
        rows = self._logprobs.rows
        return _output(token_ids, self._logprobs, self._layout.results["logprobs"].of(self._host)[rows],
                       self._layout.results["logprob_ids"].of(self._host)[rows])


def _recorded_event(device: torch.device) -> torch.cuda.Event | None:
    """On a GPU, an event recorded now on torch's stream, which a pending sample waits for; elsewhere None."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _output(token_ids: list[int], logprobs: _Logprobs | None = None, values: np.ndarray | None = None,
            ids: np.ndarray | None = None) -> SamplerOutput:
    """The sampler's output from the token ids and, for the rows that asked for logprobs, their values and ids
    ([len(logprobs.rows), 1 + n] on the host, in PendingSample's layout)."""
    row_logprobs = [None] * len(token_ids)
    if logprobs is not None:
        values, ids = values.tolist(), ids.tolist()
        for i, (row, k) in enumerate(zip(logprobs.rows, logprobs.num_top)):
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
        self._staging = Staging(pin=self.device.type == "cuda") if self._kernel else None
        self._batch: BatchRows | None = None  # the last call's, reused while the batch stays the same

    def new_generator(self, seed: int) -> random.Random:
        """A request's own random stream, on the host: each of its draws takes one uniform from it, so a seeded row's
        tokens do not depend on the rest of the batch."""
        return random.Random(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [num_rows, vocab], one row per sequence, left unmodified."""
        return self.sample(logits, seqs).result()

    def plain_greedy(self, seqs: list[Sequence], vocab_size: int) -> bool:
        """Whether sample() would take the plain argmax of every row of seqs (greedy, without penalties, min_tokens
        masks or logprobs). Decided by their parameters alone, so before their logits exist: the core can then take
        the argmax within the step."""
        if self._batch is None or not self._batch.same(seqs, vocab_size):
            self._batch = BatchRows(seqs, vocab_size)
        return self._batch.plain_greedy

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], token_out: torch.Tensor | None = None) -> PendingSample:
        """Queues the sampling of one token per row (logits [num_rows, vocab], one row per sequence, left
        unmodified) without waiting for the device, unless the torch path truncates rows (see the module's
        docstring). token_out: an int32 [num_rows] device tensor that the core's argmax of an all-greedy batch
        may write the token ids into (the core's own buffer for the next step: no copy), or None."""
        plan = self._plan(logits, seqs)
        if self._kernel:
            if plan.plain_greedy:  # the argmax alone: no parameters to send
                if logits.dtype != torch.bfloat16:
                    return PendingSample(logits.argmax(dim=-1))
                usable = (token_out is not None and token_out.dtype == torch.int32
                          and token_out.shape == (len(seqs),) and token_out.device == logits.device)
                token_ids = token_out if usable else torch.empty(len(seqs), dtype=torch.int32, device=logits.device)
                require_core().argmax(logits, token_ids)
                return PendingSample(token_ids)
            pending = self._sample_on_core(logits, plan)
            if plan.kernel_logprobs or not plan.logprob_rows:
                return pending
            logprob_rows = torch.tensor(plan.logprob_rows, device=self.device)  # more top ones than the kernel gives
            return self._with_logprobs(logits, plan, pending.token_ids, logprob_rows)
        rows = plan.upload(self.device)  # sent when first read
        if plan.transforms:
            token_ids = self._drawn(self._penalised_and_scaled(logits, plan, rows), plan, rows)
        else:
            token_ids = logits.argmax(dim=-1)
        if not plan.logprob_rows:
            return PendingSample(token_ids)
        return self._with_logprobs(logits, plan, token_ids, rows.logprob_rows)

    def _plan(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplingPlan:
        plan = SamplingPlan(seqs, logits.shape[-1], self.eos_token_ids, self._seen,
                            self._keys if self._kernel else None, self._batch)
        self._batch = plan.batch
        return plan

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, plan: SamplingPlan, token_ids: torch.Tensor,
                       logprob_rows: torch.Tensor) -> PendingSample:
        """token_ids with the logprobs of the raw logits that the rows logprob_rows (plan.logprob_rows) ask for,
        from torch ops."""
        raw_logprobs = _rows(logits, logprob_rows).float().log_softmax(dim=-1)
        top, top_ids = raw_logprobs.topk(max(plan.num_top_logprobs), dim=-1)
        sampled = raw_logprobs.gather(1, _rows(token_ids, logprob_rows)[:, None])
        ranks = (raw_logprobs > sampled).sum(dim=-1, keepdim=True)
        return PendingSample(token_ids, _Logprobs(plan.logprob_rows, plan.num_top_logprobs),
                             torch.cat([sampled, top], 1), torch.cat([ranks, top_ids], 1))

    def _sample_on_core(self, logits: torch.Tensor, plan: SamplingPlan) -> PackedPendingSample:
        """The core's kernels through ops.sample_packed: the penalised and masked rows copied out and modified (the
        overrides), then every row sampled, with the logprobs of the rows that ask if the kernel gives them
        (plan.kernel_logprobs). One copy of the packed parameters to the device, one of the results back."""
        slot, params = self._upload(plan, logits.device)
        return self._launch(logits, plan, slot, params)

    # The core's path in two stages, which benchmarks/bench_sampler.py --host times apart.

    def _upload(self, plan: SamplingPlan, device: torch.device) -> tuple[StagingSlot, torch.Tensor]:
        """The plan's parameters packed into a staging slot and copied to the device (queued): the slot, and the
        parameters blob on the device."""
        layout = plan.layout
        slot = self._staging.slot_for(layout)
        layout.pack(plan.arrays, slot.params_view)
        return slot, slot.params[:layout.params_nbytes].to(device, non_blocking=True)

    def _launch(self, logits: torch.Tensor, plan: SamplingPlan, slot: StagingSlot,
                params: torch.Tensor) -> PackedPendingSample:
        """Queues the kernels on the uploaded parameters, then the copy of their results to slot."""
        layout = plan.layout
        results = torch.empty(layout.results_nbytes, dtype=torch.uint8, device=logits.device)
        overrides = None
        if layout.num_overrides:
            overrides = torch.empty(layout.num_overrides, logits.shape[-1], device=logits.device)
        require_core().sample_packed(logits, params, layout.layout, results, overrides)
        logprobs = _Logprobs(plan.logprob_rows, plan.num_top_logprobs) if plan.kernel_logprobs else None
        return PackedPendingSample(results, layout, slot, logprobs)

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
        if len(plan.truncated_rows) and (plan.num_candidates < logits.shape[-1] or plan.has_seeded_truncated):
            self._redraw_spilled(truncation, plan, rows, uniforms[len(plan.full_rows):], token_ids,
                                 plan.num_candidates < logits.shape[-1])
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
