"""Logit transforms of the torch path, in vLLM's semantics, batched over rows with per-row parameter tensors:
penalties, and the truncations min_p, top-k and top-p.

Logits are float32 [rows, width]; per-row parameters are [rows, 1]. Truncations (min_p, top-k, top-p) come out as one
threshold logit per row: the row keeps the tokens whose logit reaches it. They are computed on each row's candidates,
its k largest logits in descending order (torch.topk), so that no full row is sorted; sorted_top_p_thresholds, which
sorts, serves the rows whose nucleus does not close within the candidates."""
from __future__ import annotations

from typing import NamedTuple

import torch


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """logits: [rows, n], the logits of tokens each row has seen (in the prompt or the output, repeats allowed);
    counts: how often each of those tokens occurs in the row's output (SeenTokens). Repetition divides positive
    and multiplies negative logits; then frequency is subtracted per output occurrence, and presence once."""
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    return repeated.addcmul_(counts, frequency, value=-1).addcmul_(counts.sign(), presence, value=-1)


class TruncationParams(NamedTuple):
    """Per-row parameters of min_p, top-k and top-p, [rows, 1] (open_rows excepted)."""
    top_ks: torch.Tensor  # int64 in [1, number of candidates]: the row's top-k, else the number of candidates
    no_top_k: torch.Tensor  # bool: the row has no top-k
    log_min_ps: torch.Tensor  # float32: log(min_p), -inf for none
    top_ps: torch.Tensor | None  # float32, 1 for none; None: no row has a top-p
    open_rows: torch.Tensor | None  # int64 [n]: the rows with a top-p but no top-k; None: no such row


def truncation_thresholds(logits: torch.Tensor, candidates: torch.Tensor, weights: torch.Tensor,
                          params: TruncationParams, open_min_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(floors, thresholds) [rows, 1]: the threshold of top-k and min_p, and the one of all three, found among each
    row's candidates (its k largest logits, descending; weights: exp(candidate - max)). A top-p without a top-k
    needs the probability mass of the whole row (logits [rows, vocab]; open_min_p: one of those rows has a min_p).
    A row's threshold is exact where its last candidate falls below it; elsewhere use sorted_top_p_thresholds."""
    floors = truncation_floors(candidates, params.top_ks, params.no_top_k, params.log_min_ps)
    if params.top_ps is None:
        return floors, floors
    left = weights * left_to_top_p(candidates, floors, params.top_ks)
    masses = left.sum(dim=-1, keepdim=True)
    if params.open_rows is not None:
        rows = params.open_rows
        masses.index_copy_(0, rows, _masses(logits.index_select(0, rows), candidates[:, :1].index_select(0, rows),
                                            floors.index_select(0, rows) if open_min_p else None))
    return floors, torch.where(params.top_ps < 1, nucleus_thresholds(candidates, left, masses, params.top_ps), floors)


def truncation_floors(candidates: torch.Tensor, top_ks: torch.Tensor, no_top_k: torch.Tensor,
                      log_min_ps: torch.Tensor) -> torch.Tensor:
    """The threshold of top-k and min_p together: the k-th largest logit (top_ks in [1, width]; -inf where no_top_k),
    or max_logit + log(min_p) (prob < min_p * max_prob <=> logit < that; min_p = 0 gives -inf), the higher."""
    kth = candidates.gather(1, top_ks - 1).masked_fill_(no_top_k, float("-inf"))
    return torch.maximum(candidates[:, :1] + log_min_ps, kth)


def left_to_top_p(candidates: torch.Tensor, floors: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """bool: the candidates that top-k (by rank, as vLLM cuts the sorted row) and the floor leave to top-p."""
    ranks = torch.arange(candidates.shape[1], device=candidates.device)
    return (ranks < top_ks) & (candidates >= floors)


def nucleus_thresholds(candidates: torch.Tensor, weights: torch.Tensor, masses: torch.Tensor,
                       top_ps: torch.Tensor) -> torch.Tensor:
    """The smallest logit of each row's nucleus: the fewest most likely tokens whose probability reaches top_p.
    weights: exp(logit - max_logit) of the candidates left to top-p, 0 for the others; masses: the sum of those
    weights over the whole row. A nucleus that does not close within the candidates gives the last of them."""
    # A token stays while the probability of the tokens before it is below top_p: the most likely always stays.
    before = weights.cumsum(dim=-1).sub_(weights)
    kept = (before < top_ps * masses) & (weights > 0)
    return torch.where(kept, candidates, float("inf")).amin(dim=-1, keepdim=True)


def sorted_top_p_thresholds(logits: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor,
                            floors: torch.Tensor) -> torch.Tensor:
    """nucleus_thresholds on whole rows, sorted: exact for any nucleus (top_ks: int64 [rows, 1], vocab for none)."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    weights = (sorted_logits - sorted_logits[:, :1]).exp_().mul_(left_to_top_p(sorted_logits, floors, top_ks))
    return nucleus_thresholds(sorted_logits, weights, weights.sum(dim=-1, keepdim=True), top_ps)


def _masses(logits: torch.Tensor, maxima: torch.Tensor, floors: torch.Tensor | None) -> torch.Tensor:
    """[rows, 1]: the sum of exp(logit - max) over each row's logits that reach its floor (None: all)."""
    weights = (logits - maxima).exp_()
    if floors is not None:
        weights.masked_fill_(logits < floors, 0)
    return weights.sum(dim=-1, keepdim=True)
