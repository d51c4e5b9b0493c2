"""Model pieces shared by every backend: packed weights, the RoPE table and the head (final norm, lm_head)."""
from .head import head_logits, rms_norm
from .rope import rope_cos_sin
from .weights import load_weights

__all__ = ["head_logits", "load_weights", "rms_norm", "rope_cos_sin"]
