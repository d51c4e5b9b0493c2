"""What a sampling call gives back: PendingSample, whose token ids stay on the device for the next step while the
host reads them later, with their logprobs, as a SamplerOutput."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class TokenLogprobs(NamedTuple):
    token_ids: list[int]  # the sampled token, then the top ones
    logprobs: list[float]
    ranks: list[int]


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class LogprobRows(NamedTuple):
    """The rows that asked for logprobs, each wanting num_top top ones."""
    rows: list[int]
    num_top: list[int]


class PendingSample:
    """A step's sampled token ids, still being computed on the device: the engine feeds them to the next step from
    there (token_ids, [rows] on the logits' device) and reads them, with their logprobs, later with result(). Each
    kind reads the device's results in _read, which result() calls once."""
    token_ids: torch.Tensor
    _output: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        """Waits for the device (the first time); the token ids and logprobs as host lists."""
        if self._output is None:
            self._output = self._read()
        return self._output

    def _read(self) -> SamplerOutput:
        raise NotImplementedError


class CopiedSample(PendingSample):
    """The tensors of a sample copied to the host one by one: the token ids and, for the rows of logprobs, values
    (float32 [len(logprobs.rows), 1 + n]: the sampled token's logprob, then the top ones) and ids (int64: the number
    of tokens more likely than the sampled one, then the top ones' ids)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: LogprobRows | None = None,
                 values: torch.Tensor | None = None, ids: torch.Tensor | None = None):
        self.token_ids = token_ids  # int64 (int32 from the core's argmax) [rows] on the logits' device
        self._logprobs = logprobs
        tensors = [token_ids] if logprobs is None else [token_ids, values, ids]
        self._host = [tensor.to("cpu", non_blocking=True) for tensor in tensors]  # pinned; _read waits for them
        self._copied = recorded_event(token_ids.device)

    def _read(self) -> SamplerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        token_ids = self._host[0].tolist()
        if self._logprobs is None:
            return sampler_output(token_ids)
        return sampler_output(token_ids, self._logprobs, self._host[1].numpy(), self._host[2].numpy())


def recorded_event(device: torch.device) -> torch.cuda.Event | None:
    """On a GPU, an event recorded now on torch's stream, which the host waits for before reading what was queued
    ahead of it; elsewhere None."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def sampler_output(token_ids: list[int], logprobs: LogprobRows | None = None, values: np.ndarray | None = None,
                   ids: np.ndarray | None = None) -> SamplerOutput:
    """The output from the token ids and, for the rows that asked for logprobs, their values and ids
    ([len(logprobs.rows), 1 + n] on the host, in CopiedSample's layout)."""
    row_logprobs = [None] * len(token_ids)
    if logprobs is not None:
        values, ids = values.tolist(), ids.tolist()
        for i, (row, k) in enumerate(zip(logprobs.rows, logprobs.num_top)):
            row_logprobs[row] = TokenLogprobs([token_ids[row]] + ids[i][1:k + 1], values[i][:k + 1],
                                              [ids[i][0] + 1] + list(range(1, k + 1)))
    return SamplerOutput(token_ids, row_logprobs)
