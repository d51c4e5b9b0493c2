"""The sampler's host side for one call: which rows take which path (greedy, full draw, truncated draw), and the
per-row arrays the device needs, sent in one copy."""
from __future__ import annotations

import random
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .engine.sequence import Sequence

CANDIDATES = 1024  # candidates per truncated row beyond the largest top-k; rows keeping more are drawn again


class TokenHistories:
    """int64 copies of sequences' token ids, extended each call by the tokens appended since: converting whole
    prompts and outputs from Python ints every step would cost more than the rest of the sampler. The last token
    copied is checked again, as the engine replaces a pending placeholder in place."""

    def __init__(self):
        self._token_ids: weakref.WeakKeyDictionary[Sequence, np.ndarray] = weakref.WeakKeyDictionary()

    def __call__(self, seq: Sequence) -> np.ndarray:
        token_ids, cached = seq.token_ids, self._token_ids.get(seq)
        if cached is not None and 0 < len(cached) <= len(token_ids) and token_ids[len(cached) - 1] == cached[-1]:
            if len(cached) == len(token_ids):
                return cached
            cached = np.concatenate([cached, np.array(token_ids[len(cached):], dtype=np.int64)])
        else:
            cached = np.array(token_ids, dtype=np.int64)
        self._token_ids[seq] = cached
        return cached


class SamplingPlan:
    """The host's part of one call, decided from the parameters: which rows take which path (row lists: sorted
    numpy int64), and the per-row arrays the device needs (self.arrays, sent in one copy by upload)."""

    def __init__(self, seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int], histories: TokenHistories,
                 keys: random.Random | None = None):
        """keys: the sampler's own random stream, for a plan of the core's sampling kernel (None: of the torch
        path), which takes every row's parameters and a 64-bit random key per sampled row."""
        params = [seq.params for seq in seqs]
        self.num_rows = num_rows = len(seqs)
        temperatures = np.fromiter([p.temperature for p in params], np.float32, num_rows)
        greedy = temperatures == 0
        self.greedy_rows = np.flatnonzero(greedy)
        sampled = np.flatnonzero(~greedy)
        sampled_params = [params[i] for i in sampled.tolist()]
        top_ks = np.fromiter([p.top_k for p in sampled_params], np.int64, len(sampled))
        top_ks[(top_ks <= 0) | (top_ks > vocab_size)] = vocab_size
        top_ps = np.fromiter([p.top_p for p in sampled_params], np.float32, len(sampled))
        min_ps = np.fromiter([p.min_p for p in sampled_params], np.float32, len(sampled))
        self.arrays: dict[str, np.ndarray] = {}
        self._penalties(seqs, params, vocab_size, histories)
        self._min_tokens(seqs, params, vocab_size, eos_token_ids)
        self.transforms = not greedy.all() or bool(self.penalty_rows) or self.has_masked
        self.logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.num_top_logprobs = [vocab_size if params[i].logprobs == -1 else min(params[i].logprobs, vocab_size)
                                 for i in self.logprob_rows]
        self.arrays["logprob_rows"] = np.array(self.logprob_rows, dtype=np.int64)
        if keys is not None:
            self._kernel_rows(seqs, vocab_size, temperatures, sampled, top_ks, top_ps, min_ps, keys)
            return
        truncated = (top_ks < vocab_size) | (top_ps < 1) | (min_ps > 0)
        self.full_rows = sampled[~truncated]
        self.truncated_rows = sampled[truncated]
        sampled_rows = np.concatenate([self.full_rows, self.truncated_rows])  # the order of the draws' uniforms
        self.arrays.update(temperatures=np.where(greedy, np.float32(1), temperatures)[:, None],
                           greedy_rows=self.greedy_rows, full_rows=self.full_rows, truncated_rows=self.truncated_rows)
        if sum(len(group) > 0 for group in (self.greedy_rows, self.full_rows, self.truncated_rows)) > 1:
            # The draws come greedy rows first, then full rows, then truncated ones: order puts them back.
            self.arrays["order"] = np.argsort(np.concatenate([self.greedy_rows, sampled_rows]))
        self._truncations(vocab_size, top_ks[truncated], top_ps[truncated], min_ps[truncated])
        self._seeds(seqs, sampled_rows)
        self.arrays["masked_positions"] = self.masked_rows * vocab_size + self.masked_tokens

    def _kernel_rows(self, seqs: list[Sequence], vocab_size: int, temperatures: np.ndarray, sampled: np.ndarray,
                     top_ks: np.ndarray, top_ps: np.ndarray, min_ps: np.ndarray, keys: random.Random):
        """The kernel's per-row arrays: temperature (0: greedy), top-k (0: none), top_p, min_p, the draw's key (from
        the row's own stream if it has one), and the rows it reads from the overrides (penalised and masked rows,
        copied out of the logits: penalty_rows and masked_positions then index the overrides)."""
        num_rows = self.num_rows
        row_top_ks = np.zeros(num_rows, np.int32)
        row_top_ks[sampled] = np.where(top_ks < vocab_size, top_ks, 0)
        row_top_ps = np.ones(num_rows, np.float32)
        row_top_ps[sampled] = top_ps
        row_min_ps = np.zeros(num_rows, np.float32)
        row_min_ps[sampled] = min_ps
        row_keys = np.zeros(num_rows, np.uint64)
        row_keys[sampled] = [(seqs[row].generator or keys).getrandbits(64) for row in sampled.tolist()]
        overridden = np.union1d(np.array(self.penalty_rows, dtype=np.int64), self.masked_rows)
        override_rows = np.full(num_rows, -1, np.int32)
        override_rows[overridden] = np.arange(len(overridden), dtype=np.int32)
        self.override_source = overridden
        self.arrays.update(kernel_temperatures=temperatures, top_ks=row_top_ks, top_ps=row_top_ps, min_ps=row_min_ps,
                           keys=row_keys.view(np.int64), override_rows=override_rows, override_source=overridden,
                           masked_positions=override_rows[self.masked_rows].astype(np.int64) * vocab_size
                           + self.masked_tokens)
        if self.penalty_rows:
            self.arrays["penalty_rows"] = override_rows[self.arrays["penalty_rows"]].astype(np.int64)

    def _truncations(self, vocab_size: int, top_ks: np.ndarray, top_ps: np.ndarray, min_ps: np.ndarray):
        """The truncated rows' parameters ([rows, 1]), and their number of candidates: CANDIDATES past the largest
        top-k, so that a row spills past them only when its kept tokens do (ties at its k-th logit included)."""
        self.has_top_p = self.has_open_top_p = self.has_open_min_p = False
        self.num_candidates = 0
        if not len(top_ks):
            return
        no_top_k = top_ks == vocab_size
        has_top_p = top_ps < 1
        open_top_p = has_top_p & no_top_k
        self.has_top_p = bool(has_top_p.any())
        self.has_open_top_p = bool(open_top_p.any())
        self.has_open_min_p = bool((min_ps[open_top_p] > 0).any())
        self.num_candidates = min(vocab_size, int(top_ks[~no_top_k].max(initial=0)) + CANDIDATES)
        with np.errstate(divide="ignore"):
            log_min_ps = np.log(min_ps)  # min_p = 0: -inf, no floor
        self.arrays.update(top_ks=top_ks[:, None], candidate_top_ks=np.minimum(top_ks, self.num_candidates)[:, None],
                           no_top_k=no_top_k[:, None], log_min_ps=log_min_ps[:, None], top_ps=top_ps[:, None],
                           open_top_p=np.flatnonzero(open_top_p))

    def _seeds(self, seqs: list[Sequence], sampled_rows: np.ndarray):
        """One uniform in (0, 1] from the stream of each sampled row that has its own, and its place among the
        draws' uniforms."""
        seeded = [i for i, row in enumerate(sampled_rows.tolist()) if seqs[row].generator is not None]
        self.has_seeded = bool(seeded)
        self.arrays["seeded"] = np.array(seeded, dtype=np.int64)
        self.arrays["seeded_uniforms"] = np.array(
            [(seqs[row].generator.getrandbits(53) + 1) * 2.0 ** -53 for row in sampled_rows[seeded].tolist()],
            dtype=np.float64)

    def _penalties(self, seqs: list[Sequence], params: list, vocab_size: int, histories: TokenHistories):
        """Each penalised row's seen tokens (its output, and its prompt when a row has a repetition penalty), padded
        with the row's last one (a repeat changes nothing), with the flags of those in the output, and the row's
        penalties and temperature ([rows, 1])."""
        penalised = [i for i, p in enumerate(params)
                     if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1]
        with_prompt = any(params[i].repetition_penalty != 1 for i in penalised)
        self.penalty_rows, seen, output_starts = [], [], []
        for i in penalised:
            start = 0 if with_prompt else seqs[i].num_prompt_tokens
            token_ids = histories(seqs[i])[start:]
            if len(token_ids):  # a row that has seen no token has nothing to penalise
                self.penalty_rows.append(i)
                seen.append(token_ids)
                output_starts.append(seqs[i].num_prompt_tokens - start)
        if not self.penalty_rows:
            return
        output_starts = np.array(output_starts)
        lengths = np.array([len(token_ids) for token_ids in seen])
        columns = np.arange(lengths.max())
        in_row = columns < lengths[:, None]
        token_ids = np.repeat(np.array([token_ids[-1] for token_ids in seen])[:, None], len(columns), axis=1)
        token_ids[in_row] = np.concatenate(seen)
        penalty_params = [params[i] for i in self.penalty_rows]
        temperatures = np.array([p.temperature or 1.0 for p in penalty_params], np.float32)
        self.arrays.update(
            penalty_token_ids=token_ids, penalty_rows=np.array(self.penalty_rows)[:, None],
            penalty_in_output=(in_row & (columns >= output_starts[:, None])).astype(np.float32),
            presence_penalties=np.array([p.presence_penalty for p in penalty_params], np.float32)[:, None],
            frequency_penalties=np.array([p.frequency_penalty for p in penalty_params], np.float32)[:, None],
            repetition_penalties=np.array([p.repetition_penalty for p in penalty_params], np.float32)[:, None],
            penalty_temperatures=temperatures[:, None])

    def _min_tokens(self, seqs: list[Sequence], params: list, vocab_size: int, eos_token_ids: list[int]):
        """The rows and stop tokens (EOS included) of the rows short of min_tokens, one pair per masked token."""
        masked = [(row, token_id) for row, p in enumerate(params)
                  if p.min_tokens and seqs[row].num_completion_tokens < p.min_tokens
                  for token_id in p.stop_token_ids + eos_token_ids]
        self.has_masked = bool(masked)
        self.masked_rows, self.masked_tokens = np.array(masked, dtype=np.int64).reshape(-1, 2).T

    def upload(self, device: torch.device) -> DeviceArrays:
        return DeviceArrays(self.arrays, device)


class DeviceArrays:
    """A plan's arrays on the device, by name (rows.top_ps): all packed at 8-byte-aligned offsets into one (pinned)
    buffer and sent in one copy when the first is read, each made a view of it when read (a call that reads none,
    all greedy, sends nothing)."""

    def __init__(self, arrays: dict[str, np.ndarray], device: torch.device):
        self._arrays = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
        self._device = device
        self._offsets: dict[str, int] = {}
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def __getattr__(self, name: str) -> torch.Tensor:
        if name.startswith("_") or name not in self._arrays:
            raise AttributeError(name)
        if not self._typed:
            self._send()
        array = self._arrays[name]
        view = self._typed[TORCH_DTYPES[array.dtype]].as_strided(
            array.shape, [stride // array.itemsize for stride in array.strides], self._offsets[name] // array.itemsize)
        setattr(self, name, view)
        return view

    def _send(self):
        size = 0
        for name, array in self._arrays.items():
            self._offsets[name] = size
            size += -(-array.nbytes // 8) * 8
        host = torch.empty(size, dtype=torch.uint8, pin_memory=self._device.type == "cuda")
        packed = host.numpy()
        for name, array in self._arrays.items():
            packed[self._offsets[name]:self._offsets[name] + array.nbytes] = \
                array.reshape(-1).view(np.uint8)
        on_device = host.to(self._device, non_blocking=True)
        self._typed = {dtype: on_device.view(dtype) for dtype in TORCH_DTYPES.values()}


TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32,
                 np.dtype(np.float64): torch.float64, np.dtype(np.bool_): torch.bool}
