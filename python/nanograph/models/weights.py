"""load_weights: a safetensors checkpoint as the packed tensors every backend consumes (q|k|v, gate|up fused)."""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..model_config import ModelConfig
from .sharding import Shard

_WHOLE = slice(None)


def load_weights(path: str | Path, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, shard: Shard | None = None) -> dict[str, torch.Tensor]:
    """Names: embed_tokens, norm, lm_head and layers.{i}.{input_layernorm, qkv_proj, qkv_bias (Qwen2), q_norm and
    k_norm (Qwen3), o_proj, post_attention_layernorm, gate_up_proj (gate rows first), down_proj}.
    shard: the part of each tensor that one tensor-parallel rank holds (models/sharding.py), read from the files
    alone; lm_head only on rank 0."""
    files = weight_files(Path(path))
    with ExitStack() as stack:
        handles = []
        for f in files:
            try:
                handles.append(stack.enter_context(safe_open(f, framework="pt")))
            except Exception as exc:  # safetensors' own error type: a truncated or foreign file
                raise ValueError(f"cannot read the weights file {str(f)!r}: {exc}") from exc
        file_of = {name: h for h in handles for name in h.keys()}

        def get(*parts: tuple) -> torch.Tensor:
            """The named tensors, each checked against the shape config.json gives it, cut to its index (a
            part's optional third item, the shard's rows or columns), concatenated."""
            missing = [name for name, *_ in parts if name not in file_of]
            if missing:
                raise ValueError(f"checkpoint in {str(path)!r} lacks tensor(s) {missing}")
            tensors = []
            for name, shape, *index in parts:
                view = file_of[name].get_slice(name)
                if (found := list(view.get_shape())) != list(shape):
                    raise ValueError(f"tensor {name} in {str(path)!r} has shape {found}, but config.json "
                                     f"({_shape_fields(model_config)}) gives it {list(shape)}: the weights and "
                                     f"config.json disagree; fix config.json or use the weights it was saved with")
                tensors.append(view[index[0]] if index else file_of[name].get_tensor(name))
            return torch.cat(tensors).to(device=device, dtype=dtype)

        mc = model_config
        hidden, head_dim, inter = mc.hidden_size, mc.head_dim, mc.intermediate_size
        q_rows, kv_rows = mc.num_heads * head_dim, mc.num_kv_heads * head_dim
        cut = _cuts(shard, mc)
        embed = ("model.embed_tokens.weight", (mc.vocab_size, hidden))
        weights = {"norm": get(("model.norm.weight", (hidden,)))}
        if shard is None or shard.rank == 0:
            weights["lm_head"] = get(embed if mc.tie_word_embeddings else ("lm_head.weight", (mc.vocab_size, hidden)))
        if mc.tie_word_embeddings and "lm_head" in weights:
            weights["embed_tokens"] = weights["lm_head"][cut["embed"]] if shard else weights["lm_head"]
        else:
            weights["embed_tokens"] = get((*embed, *cut["embed"]))
        for i in range(mc.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            attn = hf + "self_attn."
            rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
            weights[ours + "input_layernorm"] = get((hf + "input_layernorm.weight", (hidden,)))
            weights[ours + "qkv_proj"] = get(*((attn + p + "_proj.weight", (rows[p], hidden), *cut[p]) for p in "qkv"))
            if mc.qkv_bias:
                weights[ours + "qkv_bias"] = get(*((attn + p + "_proj.bias", (rows[p],), *cut[p]) for p in "qkv"))
            if mc.qk_norm:
                weights[ours + "q_norm"] = get((attn + "q_norm.weight", (head_dim,)))
                weights[ours + "k_norm"] = get((attn + "k_norm.weight", (head_dim,)))
            weights[ours + "o_proj"] = get((attn + "o_proj.weight", (hidden, q_rows), *cut["o"]))
            weights[ours + "post_attention_layernorm"] = get((hf + "post_attention_layernorm.weight", (hidden,)))
            weights[ours + "gate_up_proj"] = get((hf + "mlp.gate_proj.weight", (inter, hidden), *cut["gate_up"]),
                                                 (hf + "mlp.up_proj.weight", (inter, hidden), *cut["gate_up"]))
            weights[ours + "down_proj"] = get((hf + "mlp.down_proj.weight", (hidden, inter), *cut["down"]))
    return weights


def _cuts(shard: Shard | None, mc: ModelConfig) -> dict[str, tuple]:
    """The index into each split tensor of the part that shard holds: (index,), or () for the whole tensor."""
    if shard is None:
        return dict.fromkeys(("q", "k", "v", "o", "gate_up", "down", "embed"), ())

    def span(heads_or_rows: range, width: int = 1) -> slice:
        return slice(heads_or_rows.start * width, heads_or_rows.stop * width)

    q, kv = span(shard.q_heads(mc), mc.head_dim), span(shard.kv_heads(mc), mc.head_dim)
    inter = span(shard.intermediate(mc))
    return {"q": (q,), "k": (kv,), "v": (kv,), "o": ((_WHOLE, q),), "gate_up": (inter,), "down": ((_WHOLE, inter),),
            "embed": (span(shard.vocab(mc)),)}


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
