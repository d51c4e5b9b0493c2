"""The RoPE cos/sin table, with inverse frequencies from transformers' own initialisers so every rope type is right."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ..model_config import ModelConfig, rope_type


def rope_cos_sin(model_config: ModelConfig, max_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [max_positions, head_dim]: row p holds cos(p * inv_freq) then sin(p * inv_freq), each head_dim / 2
    wide and multiplied by the rope type's attention scaling, as transformers' rotary embeddings compute them."""
    inv_freq, attention_scaling = _rope_init_fn(model_config.hf_config)(model_config.hf_config)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling).to(device)


def _rope_init_fn(hf_config: PretrainedConfig):
    kind = rope_type(hf_config)
    if kind in ROPE_INIT_FUNCTIONS:
        return ROPE_INIT_FUNCTIONS[kind]
    if kind == "default":  # transformers 5 moved the default initialiser onto the rotary embedding classes
        return LlamaRotaryEmbedding.compute_default_rope_parameters
    raise ValueError(f"unsupported rope_type {kind!r}; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}")
