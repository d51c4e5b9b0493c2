"""Prompt logprobs from a step's final hidden states: the head (final norm, lm_head) applied to a slice of tokens at a
time, so that a long prefill chunk never holds its whole [tokens, vocab] logits, keeping per token only the next
prompt token's logprob, its rank and the top ones."""
from __future__ import annotations

import torch

from ..models import head_logits
from ..sampling.outputs import CopiedSample, LogprobRows

SLICE_BYTES = 1 << 28  # the float32 logits of one slice (151,936 vocab: 441 tokens); a few such tensors live at once


@torch.inference_mode()
def prompt_logprobs(hidden: torch.Tensor, weights: dict[str, torch.Tensor], eps: float, target_ids: list[int],
                    num_top: list[int], slice_bytes: int = SLICE_BYTES) -> CopiedSample:
    """The log-softmax of the raw logits at each of hidden's tokens ([tokens, hidden_size], the final norm's input),
    read at target_ids[j] (the prompt token after token j) with its rank (1 + the tokens more likely), and the
    num_top[j] most likely tokens: a sample in CopiedSample's layout, whose token ids are the targets."""
    vocab_size = weights["lm_head"].shape[0]
    targets = torch.tensor(target_ids, dtype=torch.long, device=hidden.device)
    max_top = max(num_top)
    values = torch.empty(len(targets), 1 + max_top, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(len(targets), 1 + max_top, dtype=torch.long, device=hidden.device)
    step = max(1, slice_bytes // (4 * vocab_size))
    for start in range(0, len(targets), step):
        end = min(start + step, len(targets))
        logprobs = torch.log_softmax(head_logits(hidden[start:end], weights, eps), dim=-1)
        target = logprobs.gather(1, targets[start:end, None])
        values[start:end, :1] = target
        ids[start:end, 0] = (logprobs > target).sum(dim=-1)
        if max_top:
            top = logprobs.topk(max_top, dim=-1)
            values[start:end, 1:] = top.values
            ids[start:end, 1:] = top.indices
    return CopiedSample(targets, LogprobRows(list(range(len(targets))), num_top), values, ids)
