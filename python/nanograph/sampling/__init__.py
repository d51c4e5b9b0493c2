"""Token sampling on the logits' device, one row per sequence, in vLLM's order: the grammar mask of structured
outputs (token_bitmask.py, in place) → logprobs of the logits → allowed_token_ids and logit_bias → penalties and
the min_tokens and bad_words masks → greedy argmax → temperature → min_p, top-k, top-p → a draw.

Sampler picks its path once: the core's kernels on a GPU with the core (kernel_path.py), torch ops elsewhere
(torch_path.py). Both read the batch's parameters from the per-row table (table.py) and return a PendingSample
(outputs.py), whose token ids stay on the device for the next step; the host does not wait for the device until
PendingSample.result(), except where the torch path truncates rows."""
from __future__ import annotations

import random

import torch

from .._core import core_available, require_core
from .kernel_path import KernelPath
from .outputs import PendingSample, SamplerOutput, TokenLogprobs
from .table import SampledSequence
from .token_bitmask import TokenBitmask
from .torch_path import TorchPath

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "TokenLogprobs", "seeded_generator"]


def seeded_generator(seed: int) -> random.Random:
    """A seeded sequence's own random stream, on the host: each of its draws takes one uniform (or key) from it, so
    its tokens do not depend on the rest of the batch. The seed is read as a 64-bit word (torch's reading), so that
    -s and s are different streams."""
    return random.Random(seed % 2**64)


class Sampler:
    """One token per row of a step's logits, on the path chosen for the device (self.path)."""

    def __init__(self, device: torch.device | str, eos_token_ids=(), seed: int = 0):
        """eos_token_ids: masked, with a request's stop tokens, until it has min_tokens; seed: the stream of the
        rows without a seed of their own."""
        device, eos_token_ids = torch.device(device), list(eos_token_ids)
        if device.type == "cuda" and core_available():
            self.path = KernelPath(device, eos_token_ids, seed, require_core())
            self.bitmask = TokenBitmask(device, require_core())
        else:
            self.path = TorchPath(device, eos_token_ids, seed)
            self.bitmask = TokenBitmask(device)

    def plain_greedy(self, seqs: list[SampledSequence], vocab_size: int) -> bool:
        """Whether sample() would take the plain argmax of every row of seqs (greedy, without penalties, biases,
        masks, grammars or logprobs). Decided by their parameters alone, so before their logits exist: the core can
        then take the argmax within the step."""
        return self.path.plain_greedy(seqs, vocab_size)

    def sample(self, logits: torch.Tensor, seqs: list[SampledSequence]) -> PendingSample:
        """Queues the sampling of one token per row (logits [num_rows, vocab], one row per sequence; the rows of
        sequences with a grammar are masked in place, the others left unmodified); the token ids on the device come
        as int64, or int32 from the core's argmax."""
        constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None and seq.grammar.applies]
        if constrained:
            self.bitmask.apply(logits, seqs, constrained)
        return self.path.sample(logits, seqs)
