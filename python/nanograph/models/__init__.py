"""Model loading shared by every backend: packed weights and the RoPE table."""
from .rope import rope_cos_sin
from .weights import load_weights

__all__ = ["load_weights", "rope_cos_sin"]
