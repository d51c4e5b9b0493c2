"""Token sampling on the logits' device: greedy, temperature, top-k and top-p, with per-row parameters."""
from __future__ import annotations

import torch

from .sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
        """logits: float32 [num_rows, vocab], one row per entry of params. Returns one token id per row."""
        greedy_ids = logits.argmax(dim=-1)
        if all(p.temperature == 0 for p in params):
            return greedy_ids.tolist()
        device = logits.device
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        is_greedy = temperatures == 0
        logits = logits / torch.where(is_greedy, 1.0, temperatures)[:, None]
        if any(p.top_k != -1 or p.top_p < 1 for p in params):
            top_ks = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
            top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            logits = mask_top_k_top_p(logits, top_ks, top_ps)
        probs = logits.softmax(dim=-1)
        # argmax(p / E) with E ~ Exp(1) draws from p, without multinomial's host synchronisation.
        sampled_ids = probs.div_(torch.empty_like(probs).exponential_(generator=self.generator)).argmax(dim=-1)
        return torch.where(is_greedy, greedy_ids, sampled_ids).tolist()


def mask_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside its row's top_k (-1: all) and outside its top_p nucleus."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[-1]
    ranks = torch.arange(vocab_size, device=logits.device)
    top_ks = torch.where(top_ks == -1, vocab_size, top_ks)
    sorted_mask = ranks[None, :] >= top_ks[:, None]
    sorted_probs = sorted_logits.masked_fill(sorted_mask, float("-inf")).softmax(dim=-1)
    # A token stays while the probability before it is within top_p, so the most likely token always stays.
    sorted_mask |= sorted_probs.cumsum(dim=-1) - sorted_probs > top_ps[:, None]
    mask = torch.empty_like(sorted_mask).scatter_(-1, sorted_ids, sorted_mask)
    return logits.masked_fill(mask, float("-inf"))
