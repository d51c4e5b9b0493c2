"""The two blobs through which the core's sampling kernels take one call (ops.sample_packed), so that the call makes
one copy each way: the per-row parameters, packed on the host into one buffer, and the results (token ids and
logprobs) the kernels write into one buffer; every field at a 16-byte-aligned byte offset. Also the pinned host
buffers a sampler stages them in, reused from call to call.

The fields, in the order of their offsets in the layout (rows: the batch's; n: the rows with overrides):
    parameters  temperatures float32 [rows], top_ks int32 [rows], top_ps float32 [rows], min_ps float32 [rows],
                keys int64 [rows], num_logprobs int32 [rows], override_rows int32 [rows], override_source int32 [n],
                seen_tokens int32 [n, seen_width], output_counts int32 [n, seen_width], presence float32 [n],
                frequency float32 [n], repetition float32 [n], masked_tokens int32 [n, masked_width]
    results     token_ids int64 [rows], logprobs float32 [rows, logprob_columns],
                logprob_ids int64 [rows, logprob_columns]
What each holds: SampleRowsArgs and OverrideArgs in csrc/sampling.h."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from .sampler import PendingSample

ALIGNMENT = 16  # of every field's offset; the binding checks it
# The kernel's limit (ops.MAX_TOP_LOGPROBS, kMaxTopLogprobs; a GPU test keeps them equal); requests for more take
# torch's topk. A constant here, so that plans are made without the core.
MAX_TOP_LOGPROBS = 32
F32, I32, I64 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64)


class Field(NamedTuple):
    offset: int  # in bytes, from the blob's start
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def of(self, blob: np.ndarray) -> np.ndarray:
        """The field's view of blob (uint8)."""
        return blob[self.offset:self.offset + self.nbytes].view(self.dtype).reshape(self.shape)


class PackedLayout:
    """Where each field of one call lies in the two blobs, and the tuple that tells ops.sample_packed: (rows,
    logprob_columns, num_overrides, seen_width, masked_width, then each field's offset in the module docstring's
    order, parameters then results). logprob_columns: 1 + the most top logprobs a row asks the kernel for; 0 when
    it computes none."""

    def __init__(self, rows: int, logprob_columns: int, num_overrides: int, seen_width: int, masked_width: int):
        n = num_overrides
        self.rows, self.logprob_columns, self.num_overrides = rows, logprob_columns, num_overrides
        self.params, self.params_nbytes = _placed([
            ("temperatures", F32, (rows,)), ("top_ks", I32, (rows,)), ("top_ps", F32, (rows,)),
            ("min_ps", F32, (rows,)), ("keys", I64, (rows,)), ("num_logprobs", I32, (rows,)),
            ("override_rows", I32, (rows,)), ("override_source", I32, (n,)), ("seen_tokens", I32, (n, seen_width)),
            ("output_counts", I32, (n, seen_width)), ("presence", F32, (n,)), ("frequency", F32, (n,)),
            ("repetition", F32, (n,)), ("masked_tokens", I32, (n, masked_width))])
        self.results, self.results_nbytes = _placed([
            ("token_ids", I64, (rows,)), ("logprobs", F32, (rows, logprob_columns)),
            ("logprob_ids", I64, (rows, logprob_columns))])
        self.layout = (rows, logprob_columns, num_overrides, seen_width, masked_width,
                       *(field.offset for field in self.params.values()),
                       *(field.offset for field in self.results.values()))

    def pack(self, arrays: dict[str, np.ndarray], blob: np.ndarray):
        """Writes each parameter field, arrays[name] (cast to the field's dtype), into blob (uint8, at least
        params_nbytes long)."""
        for name, field in self.params.items():
            field.of(blob)[...] = arrays[name]


def _placed(fields: list[tuple[str, np.dtype, tuple[int, ...]]]) -> tuple[dict[str, Field], int]:
    """The fields one after another, each at the next aligned offset; and the bytes they span."""
    placed, end = {}, 0
    for name, dtype, shape in fields:
        offset = -(-end // ALIGNMENT) * ALIGNMENT
        placed[name] = Field(offset, math.prod(shape) * dtype.itemsize, dtype, shape)
        end = offset + placed[name].nbytes
    return placed, end


class StagingSlot:
    """One call's host buffers: the parameters packed for the device (params), the results copied back (results),
    each uint8 and pinned on a GPU; and the call that reads the results (pending)."""

    def __init__(self, pin: bool):
        self._pin = pin
        self.params = self.results = torch.empty(0, dtype=torch.uint8)
        self.params_view = self.results_view = self.params.numpy()  # numpy views of them
        self.pending: PendingSample | None = None

    def reclaim(self, layout: PackedLayout):
        """Makes the slot ready for a call of layout: its last call's results are read first (which waits for the
        device's copies from and to the slot), then the buffers grow if they must."""
        if self.pending is not None:
            self.pending.result()  # kept by the pending sample for whoever asks it later
            self.pending = None
        if len(self.params) < layout.params_nbytes:
            self.params = self._grown(self.params, layout.params_nbytes)
            self.params_view = self.params.numpy()
        if len(self.results) < layout.results_nbytes:
            self.results = self._grown(self.results, layout.results_nbytes)
            self.results_view = self.results.numpy()

    def _grown(self, buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
        """A new buffer for at least nbytes, at least twice buffer's size: a batch that grows step by step does not
        allocate each step."""
        return torch.empty(max(nbytes, 2 * len(buffer), 4096), dtype=torch.uint8, pin_memory=self._pin)


class Staging:
    """A sampler's host buffers for its packed calls, in two slots used in turn: a call packs its parameters while
    the previous call's results may still be on their way (the engine reads a step's tokens after it has queued the
    next step's sampling), and a slot's buffers are reused, not allocated, each call."""

    def __init__(self, pin: bool):
        self._slots = (StagingSlot(pin), StagingSlot(pin))
        self._turn = 0

    def slot_for(self, layout: PackedLayout) -> StagingSlot:
        slot = self._slots[self._turn]
        self._turn ^= 1
        slot.reclaim(layout)
        return slot
