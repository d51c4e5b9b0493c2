"""Structured outputs' grammar mask, applied to the logits in place before either path samples: each step the
matchers of the constrained rows fill one bitmask row each on the host (grammar.py), the bitmask and the rows'
indices go to the device in one copy, and every token a row's bitmask leaves out becomes -inf, with one kernel on a
GPU with the core (_C.apply_token_bitmask), torch ops elsewhere. As in vLLM, the mask comes before the sampler, so a
constrained row's logprobs are those of the masked logits."""
from __future__ import annotations

import torch

from .grammar import bitmask_words
from .table import SampledSequence


class TokenBitmask:
    def __init__(self, device: torch.device, core=None):
        """core: nanograph._C, whose kernel applies the mask; None: torch ops."""
        self.device = device
        self._core = core

    def apply(self, logits: torch.Tensor, seqs: list[SampledSequence], rows: list[int]):
        """Masks, in place, the tokens that the grammars of seqs[row] for row in rows (distinct) do not allow next
        in logits[row] ([len(seqs), vocab])."""
        words = bitmask_words(logits.shape[-1])
        n = len(rows)
        # One pinned buffer: the bitmask [n, words], then the rows [n].
        host = torch.empty(n * (words + 1), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        packed = host.numpy()
        bitmask = packed[:n * words].reshape(n, words)
        for i, row in enumerate(rows):
            seqs[row].grammar.fill(bitmask, i)
        packed[n * words:] = rows
        on_device = host.to(self.device, non_blocking=True)
        device_bitmask, device_rows = on_device[:n * words].view(n, words), on_device[n * words:]
        if self._core is not None:
            self._core.apply_token_bitmask(logits, device_bitmask, device_rows)
        else:
            _apply(logits, device_bitmask, device_rows)


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor):
    """torch ops: logits[rows[i], t] = -inf where bit t % 32 of bitmask[i, t // 32] is 0."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :logits.shape[-1]].bool()
    rows = rows.long()
    with torch.inference_mode():  # the torch runner's logits are inference tensors
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
