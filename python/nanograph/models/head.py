"""The model's head in torch: the final RMSNorm and lm_head over hidden states, rounded as transformers rounds them
(RMSNorm in float32, cast back to the model dtype, then scaled; lm_head in the model dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def head_logits(hidden: torch.Tensor, weights: dict[str, torch.Tensor], eps: float) -> torch.Tensor:
    """float32 logits [tokens, vocab] of the last layer's output plus residual, hidden [tokens, hidden_size]."""
    return F.linear(rms_norm(hidden, weights["norm"], eps), weights["lm_head"]).float()
