"""The RoPE cos/sin table: the original RoPE's frequencies, the scaled types' from transformers' initialisers."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..model_config import ModelConfig, rope_parameters, rope_type


def rope_cos_sin(model_config: ModelConfig, max_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [max_positions, head_dim]: row p holds cos(p * inv_freq) then sin(p * inv_freq), each head_dim / 2
    wide and multiplied by the rope type's attention scaling, as transformers' rotary embeddings compute them."""
    hf = model_config.hf_config
    if rope_type(hf) == "default":
        inv_freq, attention_scaling = _default_inv_freq(hf, model_config.head_dim), 1.0
    else:
        inv_freq, attention_scaling = _rope_init_fn(hf)(hf, None)  # device: positional in transformers 4
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling).to(device)


def _default_inv_freq(hf_config: PretrainedConfig, head_dim: int) -> torch.Tensor:
    """The original RoPE's inverse frequencies, theta^(-2i / head_dim), computed as transformers' default rotary
    embedding does (float32, partial_rotary_factor ignored as there). Written here because transformers 5 keeps that
    initialiser on the rotary embedding classes, whose modeling modules are slow to import. theta: the config's
    rope_theta attribute where it has one (transformers 4's place, and an override's), else rope_parameters'."""
    theta = vars(hf_config).get("rope_theta") or rope_parameters(hf_config).get("rope_theta") or 10000.0
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def _rope_init_fn(hf_config: PretrainedConfig):
    kind = rope_type(hf_config)
    if kind in ROPE_INIT_FUNCTIONS:
        return ROPE_INIT_FUNCTIONS[kind]
    raise ValueError(f"unsupported rope_type {kind!r}; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}")
