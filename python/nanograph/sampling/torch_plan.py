"""The torch path's host side for one call: which rows take which draw (the argmax, a draw from the whole row, a
draw among a truncated row's candidates), and the per-row arrays its ops read, sent in one copy (DeviceArrays)."""
from __future__ import annotations

import numpy as np
import torch

from .batch import BatchRows, padded, penalties, token_masks
from .seen import SeenTokens
from .table import SampledSequence

CANDIDATES = 1024  # candidates per truncated row beyond the largest top-k; rows keeping more are drawn again


class TorchPlan:
    """The rows' groups (sorted numpy int64) and flags that decide the torch path's ops, and the arrays those ops
    read on the device (self.arrays, sent by upload)."""

    def __init__(self, seqs: list[SampledSequence], vocab_size: int, eos_token_ids: list[int], seen: SeenTokens,
                 batch: BatchRows | None = None):
        """batch: the previous call's BatchRows, reused if seqs are the same batch (self.batch is the one used)."""
        self.batch = b = BatchRows.of(seqs, vocab_size, batch)
        self.penalties = p = penalties(seqs, b, seen)
        self.masks = m = token_masks(seqs, b, eos_token_ids)
        self.transforms = not b.all_greedy or bool(p.rows) or m.any or b.biases.any  # else the raw logits' argmax
        self.greedy_rows = b.greedy_rows
        truncated = (b.top_ks < vocab_size) | (b.top_ps < 1) | (b.min_ps > 0)
        self.full_rows = b.sampled[~truncated]
        self.truncated_rows = b.sampled[truncated]
        sampled_rows = np.concatenate([self.full_rows, self.truncated_rows])  # the order of the draws' uniforms
        self.arrays: dict[str, np.ndarray] = dict(
            logprob_rows=np.array(b.logprob_rows, dtype=np.int64),
            temperatures=np.where(b.temperatures == 0, np.float32(1), b.temperatures)[:, None],
            greedy_rows=self.greedy_rows, full_rows=self.full_rows, truncated_rows=self.truncated_rows)
        if sum(len(group) > 0 for group in (self.greedy_rows, self.full_rows, self.truncated_rows)) > 1:
            # The draws come greedy rows first, then full rows, then truncated ones: order puts them back.
            self.arrays["order"] = np.argsort(np.concatenate([self.greedy_rows, sampled_rows]))
        self._truncations(vocab_size, b.top_ks[truncated], b.top_ps[truncated], b.min_ps[truncated])
        self._seeds(seqs, sampled_rows)
        self.arrays["masked_positions"] = m.rows * vocab_size + m.tokens
        if b.biases.any:
            self.arrays["bias_positions"], self.arrays["biases"] = b.biases.flat(vocab_size)
            self.arrays["mask_others_rows"] = b.biases.rows[b.biases.mask_others.astype(bool)]
        if p.rows:
            self._penalties(b.table["temperature"][p.rows])

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

    def _seeds(self, seqs: list[SampledSequence], sampled_rows: np.ndarray):
        """One uniform in (0, 1] from the stream of each sampled row that has its own, and its place among the
        draws' uniforms."""
        seeded = [i for i, row in enumerate(sampled_rows.tolist()) if seqs[row].generator is not None]
        self.has_seeded = bool(seeded)
        self.arrays["seeded"] = np.array(seeded, dtype=np.int64)
        # The seeded truncated rows, by their place among the truncated rows (which follow the full ones): the
        # torch path draws them from their whole rows, so that their token does not depend on the batch.
        seeded_truncated = [i - len(self.full_rows) for i in seeded if i >= len(self.full_rows)]
        self.has_seeded_truncated = bool(seeded_truncated)
        self.arrays["seeded_truncated"] = np.array(seeded_truncated, dtype=np.int64)
        self.arrays["seeded_uniforms"] = np.array(
            [(seqs[row].generator.getrandbits(53) + 1) * 2.0 ** -53 for row in sampled_rows[seeded].tolist()],
            dtype=np.float64)

    def _penalties(self, temperatures: np.ndarray):
        """The penalised rows [rows, 1], their penalties and temperature (temperatures: 0 for greedy), and their seen
        tokens [rows, n] and output counts, padded with each row's first one (a repeat writes the same value)."""
        p = self.penalties
        token_ids = [row_token_ids for row_token_ids, _ in p.seen]
        counts = [row_counts for _, row_counts in p.seen]
        self.arrays.update(
            penalty_rows=np.array(p.rows)[:, None],
            presence_penalties=p.values[:, 0:1], frequency_penalties=p.values[:, 1:2],
            repetition_penalties=p.values[:, 2:3],
            penalty_temperatures=np.where(temperatures == 0, 1, temperatures).astype(np.float32)[:, None],
            penalty_token_ids=padded(token_ids, [row[0] for row in token_ids]).astype(np.int64),
            penalty_counts=padded(counts, [row[0] for row in counts]).astype(np.float32))

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
