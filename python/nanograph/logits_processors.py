"""Logit transforms of the sampler, in vLLM's semantics, batched over rows with per-row parameter tensors.

Every tensor of logits is float32 [rows, vocab]; per-row parameters are [rows]. Truncations (min_p, top-k, top-p)
are expressed as one threshold logit per row, so that the caller masks the whole batch in a single pass."""
from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, output_ids: torch.Tensor, prompt_ids: torch.Tensor | None,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """output_ids, prompt_ids: int64 [rows, max_len], padded with vocab (prompt_ids None: no row has a repetition
    penalty). Repetition divides positive and multiplies negative logits of every token seen in the prompt or the
    output; then frequency is subtracted per output occurrence and presence once per output token."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab + 1, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=counts.dtype))
    counts = counts[:, :vocab]
    in_output = counts > 0
    if prompt_ids is not None:
        seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device).scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | in_output
        repetition = repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * in_output


def min_p_thresholds(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); min_p = 0 gives -inf (keep all)."""
    return logits.amax(dim=-1) + min_ps.log()


def top_k_thresholds(logits: torch.Tensor, top_ks: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """The k-th largest logit of each row (top_ks in [1, vocab], max_top_k their maximum)."""
    return logits.topk(max_top_k, dim=-1).values.gather(1, top_ks[:, None] - 1).squeeze(1)


def top_p_thresholds(logits: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor,
                     floors: torch.Tensor) -> torch.Tensor:
    """The smallest logit of each row's nucleus: the fewest most likely tokens whose probability reaches top_p,
    computed (as vLLM does) on the distribution left by the row's top-k (vocab: none) and its floor (min_p)."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits.masked_fill_((ranks >= top_ks[:, None]) | (sorted_logits < floors[:, None]), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token stays while the probability of the tokens before it is below top_p: the most likely always stays.
    kept = ((probs.cumsum(dim=-1) - probs) < top_ps[:, None]) & (sorted_logits > float("-inf"))
    num_kept = kept.sum(dim=-1, keepdim=True)
    return sorted_logits.gather(1, num_kept - 1).squeeze(1)
