"""load_weights: a safetensors checkpoint as the packed tensors every backend consumes (q|k|v, gate|up fused)."""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..model_config import ModelConfig


def load_weights(path: str | Path, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
    """Names: embed_tokens, norm, lm_head and layers.{i}.{input_layernorm, qkv_proj, qkv_bias (Qwen2), q_norm and
    k_norm (Qwen3), o_proj, post_attention_layernorm, gate_up_proj (gate rows first), down_proj}."""
    files = weight_files(Path(path))
    with ExitStack() as stack:
        handles = []
        for f in files:
            try:
                handles.append(stack.enter_context(safe_open(f, framework="pt")))
            except Exception as exc:  # safetensors' own error type: a truncated or foreign file
                raise ValueError(f"cannot read the weights file {str(f)!r}: {exc}") from exc
        file_of = {name: h for h in handles for name in h.keys()}

        def get(*names: str) -> torch.Tensor:
            missing = [n for n in names if n not in file_of]
            if missing:
                raise ValueError(f"checkpoint in {str(path)!r} lacks tensor(s) {missing}")
            parts = [file_of[n].get_tensor(n) for n in names]
            return torch.cat(parts).to(device=device, dtype=dtype)

        weights = {"embed_tokens": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
        weights["lm_head"] = weights["embed_tokens"] if model_config.tie_word_embeddings else get("lm_head.weight")
        for i in range(model_config.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            attn = hf + "self_attn."
            weights[ours + "input_layernorm"] = get(hf + "input_layernorm.weight")
            weights[ours + "qkv_proj"] = get(*(attn + p + "_proj.weight" for p in "qkv"))
            if model_config.qkv_bias:
                weights[ours + "qkv_bias"] = get(*(attn + p + "_proj.bias" for p in "qkv"))
            if model_config.qk_norm:
                weights[ours + "q_norm"] = get(attn + "q_norm.weight")
                weights[ours + "k_norm"] = get(attn + "k_norm.weight")
            weights[ours + "o_proj"] = get(attn + "o_proj.weight")
            weights[ours + "post_attention_layernorm"] = get(hf + "post_attention_layernorm.weight")
            weights[ours + "gate_up_proj"] = get(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
            weights[ours + "down_proj"] = get(hf + "mlp.down_proj.weight")
    return weights


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards an index names, else every *.safetensors in the folder."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        absent = [shard.name for shard in shards if not shard.is_file()]
        if absent:
            raise FileNotFoundError(f"{str(index)!r} names shard(s) {absent} that are not in the folder")
        return shards
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r}; "
                                "save the model with save_pretrained(..., safe_serialization=True)")
    return files
