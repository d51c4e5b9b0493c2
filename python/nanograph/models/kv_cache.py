"""The KV cache's element type (Config.kv_cache_dtype), and the FP8 cache's scales and conversions.

"auto" keeps keys and values in the model's dtype. "fp8" (also spelt "fp8_e4m3") keeps them in e4m3 with
per-tensor scales, vLLM's k_scale / v_scale model: one float32 scale for K and one for V in each layer, shared by
every head and token. A value x is stored as e4m3(clamp(x / scale, -448, 448)) and read back as
float(e4m3) * scale, so a stored value keeps e4m3's relative precision (2^-4) while |x| <= 448 * scale and
saturates beyond. The scales come from a checkpoint calibrated for an FP8 KV cache (`load_kv_scales`); without
them a scale is 1.0, as in vLLM, which covers keys and values up to 448 in magnitude."""
from __future__ import annotations

import logging
import math
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..model_config import ModelConfig
from .fp8 import FP8_DTYPE, FP8_MAX
from .weights import weight_files

logger = logging.getLogger("nanograph")

# A layer's K and V scale as checkpoints name them under model.layers.{i}.self_attn.: llm-compressor's (vLLM's own
# name), ModelOpt's, and Quark's and compressed-tensors' older output scales of k_proj / v_proj.
SCALE_NAMES = {"k": ("k_scale", "k_proj.k_scale", "k_proj.output_scale"),
               "v": ("v_scale", "v_proj.v_scale", "v_proj.output_scale")}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: the model's for "auto", else float8_e4m3fn."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def kv_bytes_per_token(model_config: ModelConfig, num_kv_heads: int, dtype: torch.dtype) -> int:
    """Bytes that one token's K and V take in every layer: 1 per value in FP8, twice that in a 16-bit dtype."""
    return 2 * model_config.num_layers * num_kv_heads * model_config.head_dim * dtype.itemsize


def load_kv_scales(path: str | Path, model_config: ModelConfig) -> torch.Tensor:
    """float32 [num_layers, 2]: each layer's K scale and V scale from the checkpoint (SCALE_NAMES), 1.0 where it
    gives none (with a warning, as vLLM gives). A scale must be one positive, finite number."""
    scales = torch.ones(model_config.num_layers, 2)
    missing = 0
    with ExitStack() as stack:
        files = [stack.enter_context(safe_open(f, framework="pt")) for f in weight_files(Path(path))]
        file_of = {name: f for f in files for name in f.keys()}
        for layer in range(model_config.num_layers):
            for column, kind in enumerate("kv"):
                names = [f"model.layers.{layer}.self_attn.{name}" for name in SCALE_NAMES[kind]]
                found = [name for name in names if name in file_of]
                if found:
                    scales[layer, column] = _scale_value(found[0], file_of[found[0]].get_tensor(found[0]), path)
                else:
                    missing += 1
    if missing:
        logger.warning("FP8 KV cache: %s gives no k_scale / v_scale for %d of its %d layers' K and V; those scales "
                       "are 1.0, which keeps e4m3's precision for keys and values up to 448 in magnitude and "
                       "saturates larger ones. A checkpoint calibrated for an FP8 KV cache carries its own scales.",
                       str(path), missing, 2 * model_config.num_layers)
    return scales


def _scale_value(name: str, tensor: torch.Tensor, path) -> float:
    if tensor.numel() != 1:
        raise ValueError(f"{name} in {str(path)!r} has {tensor.numel()} values (shape {list(tensor.shape)}); "
                         f"nanograph's FP8 KV cache takes one scale per layer for K and one for V (per-tensor), not "
                         f"per-head scales; use a checkpoint calibrated per tensor, or kv_cache_dtype='auto'")
    value = tensor.float().item()
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} in {str(path)!r} is {value}; a KV cache scale must be a positive finite number")
    return value


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Keys or values as the FP8 cache stores them: e4m3(clamp(x / scale, -448, 448)), computed in float32."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the attention reads from the FP8 cache: float(e4m3) * scale, in dtype."""
    return (stored.float() * scale).to(dtype)
