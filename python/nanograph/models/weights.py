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

        def get(*parts: tuple[str, tuple[int, ...]]) -> torch.Tensor:
            """The named tensors, each checked against the shape config.json gives it, concatenated."""
            missing = [name for name, _ in parts if name not in file_of]
            if missing:
                raise ValueError(f"checkpoint in {str(path)!r} lacks tensor(s) {missing}")
            tensors = []
            for name, shape in parts:
                tensor = file_of[name].get_tensor(name)
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"tensor {name} in {str(path)!r} has shape {list(tensor.shape)}, but config.json "
                                     f"({_shape_fields(model_config)}) gives it {list(shape)}: the weights and "
                                     f"config.json disagree; fix config.json or use the weights it was saved with")
                tensors.append(tensor)
            return torch.cat(tensors).to(device=device, dtype=dtype)

        mc = model_config
        hidden, head_dim, inter = mc.hidden_size, mc.head_dim, mc.intermediate_size
        q_rows, kv_rows = mc.num_heads * head_dim, mc.num_kv_heads * head_dim
        weights = {"embed_tokens": get(("model.embed_tokens.weight", (mc.vocab_size, hidden))),
                   "norm": get(("model.norm.weight", (hidden,)))}
        weights["lm_head"] = weights["embed_tokens"] if mc.tie_word_embeddings else \
            get(("lm_head.weight", (mc.vocab_size, hidden)))
        for i in range(mc.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            attn = hf + "self_attn."
            rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
            weights[ours + "input_layernorm"] = get((hf + "input_layernorm.weight", (hidden,)))
            weights[ours + "qkv_proj"] = get(*((attn + p + "_proj.weight", (rows[p], hidden)) for p in "qkv"))
            if mc.qkv_bias:
                weights[ours + "qkv_bias"] = get(*((attn + p + "_proj.bias", (rows[p],)) for p in "qkv"))
            if mc.qk_norm:
                weights[ours + "q_norm"] = get((attn + "q_norm.weight", (head_dim,)))
                weights[ours + "k_norm"] = get((attn + "k_norm.weight", (head_dim,)))
            weights[ours + "o_proj"] = get((attn + "o_proj.weight", (hidden, q_rows)))
            weights[ours + "post_attention_layernorm"] = get((hf + "post_attention_layernorm.weight", (hidden,)))
            weights[ours + "gate_up_proj"] = get((hf + "mlp.gate_proj.weight", (inter, hidden)),
                                                 (hf + "mlp.up_proj.weight", (inter, hidden)))
            weights[ours + "down_proj"] = get((hf + "mlp.down_proj.weight", (hidden, inter)))
    return weights


def _shape_fields(mc: ModelConfig) -> str:
    return (f"vocab_size {mc.vocab_size}, hidden_size {mc.hidden_size}, num_attention_heads {mc.num_heads}, "
            f"num_key_value_heads {mc.num_kv_heads}, head_dim {mc.head_dim}, intermediate_size {mc.intermediate_size}")


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
