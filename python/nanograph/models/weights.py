"""load_weights: a safetensors checkpoint as the packed tensors every backend consumes (q|k|v, gate|up fused), with
the four linears of each layer in FP8 for an FP8 model (the checkpoint's, or quantized at load)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import SUPPORTED_QUANTIZATION
from ..model_config import ModelConfig
from .fp8 import (BLOCK_SIZE, FP8_DTYPE, PACKED_SCALE_ROWS, dequantize_fp8, expand_block_scales, gemm_block_scales,
                  quantize_fp8)
from .sharding import Shard

SCALE_SUFFIX = "_scale"  # weights[name + SCALE_SUFFIX]: an FP8 linear's packed scales
BLOCK_SCALE_SUFFIX = "_block_scale"  # the same once per 128 x 128 block, for the CUDA core's FP8 GEMM
_WHOLE = slice(None)


def load_weights(path: str | Path, model_config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 shard: Shard | None = None, *, quantization: str | None = None,
                 dequantize: bool = False) -> dict[str, torch.Tensor]:
    """Names: embed_tokens, norm, lm_head and layers.{i}.{input_layernorm, qkv_proj, qkv_bias (Qwen2), q_norm and
    k_norm (Qwen3), o_proj, post_attention_layernorm, gate_up_proj (gate rows first), down_proj}, in dtype.

    The model is FP8 when quantization is "fp8" or the checkpoint is (quantization None: as the checkpoint is). Then
    qkv_proj, o_proj, gate_up_proj and down_proj are float8_e4m3fn [N, K], each with name + "_scale": float32
    [ceil(N / 8), ceil(K / 128)], the multiplier of 8 rows by 128 columns (models/fp8.py). A piece the checkpoint
    holds in 16 or 32 bits (all of them when quantizing at load; one in an FP8 checkpoint's modules_to_not_convert)
    is quantized in 128 x 128 blocks on device, one tensor at a time, so that every linear has one format.
    dequantize: the FP8 linears come back as dtype (float(fp8) * scale), for a backend without FP8 matmuls.
    Any other tensor an FP8 checkpoint quantized (an lm_head, say) is dequantized to dtype.
    shard: the part of each tensor that one tensor-parallel rank holds (models/sharding.py), read from the files
    alone; lm_head only on rank 0. Not with FP8 weights, whose 128-column blocks a rank's cut would split."""
    if quantization not in (None, *SUPPORTED_QUANTIZATION):
        raise ValueError(f"quantization={quantization!r} is not supported; use None (the checkpoint's format) or "
                         f"one of {list(SUPPORTED_QUANTIZATION)}")
    fp8_model = "fp8" in (quantization, model_config.quantization)
    if fp8_model and shard is not None:
        raise ValueError("FP8 weights (quantization='fp8' or an FP8 checkpoint) do not run with "
                         "tensor_parallel_size > 1 yet; use tensor_parallel_size=1, or a 16-bit checkpoint without "
                         "quantization")
    files = weight_files(Path(path))
    with ExitStack() as stack:
        handles = []
        for f in files:
            try:
                handles.append(stack.enter_context(safe_open(f, framework="pt")))
            except Exception as exc:  # safetensors' own error type: a truncated or foreign file
                raise ValueError(f"cannot read the weights file {str(f)!r}: {exc}") from exc
        file_of = {name: h for h in handles for name in h.keys()}
        # The checkpoint's own name of each tensor: a base model's (transformers' Qwen3Model, say, as
        # sentence-transformers saves an embedding model) lack the "model." prefix, and may have no lm_head.
        stored = {name: name for name in file_of}
        base_model = _is_base_model(file_of)
        if base_model:
            stored = {("model." + name if not name.startswith("lm_head.") else name): name for name in file_of}
            file_of = {ours: file_of[theirs] for ours, theirs in stored.items()}

        def tensor(name: str) -> torch.Tensor:
            return file_of[name].get_tensor(stored[name])

        def read(*parts: tuple) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
            """Each named tensor on device, checked against the shape config.json gives it and cut to its index (a
            part's optional third item: the shard's rows or columns), with its checkpoint block scales when it is
            FP8 (else None); read one at a time as the caller asks."""
            missing = [name for name, *_ in parts if name not in file_of]
            if missing:
                raise ValueError(f"checkpoint in {str(path)!r} lacks tensor(s) {missing}")
            for name, shape, *index in parts:
                view = file_of[name].get_slice(stored[name])
                if (found := list(view.get_shape())) != list(shape):
                    raise ValueError(f"tensor {name} in {str(path)!r} has shape {found}, but config.json "
                                     f"({_shape_fields(model_config)}) gives it {list(shape)}: the weights and "
                                     f"config.json disagree; fix config.json or use the weights it was saved with")
                value = view[index[0]] if index else tensor(name)
                is_fp8 = value.dtype == FP8_DTYPE
                if is_fp8 and index:
                    raise ValueError(f"{name} is FP8, whose 128-column blocks a tensor-parallel rank's part would "
                                     f"split; use tensor_parallel_size=1")
                yield value.to(device), checkpoint_scales(name, value.shape).to(device) if is_fp8 else None

        def checkpoint_scales(name: str, shape: torch.Size) -> torch.Tensor:
            """An FP8 tensor's multipliers per 128 x 128 block: its weight_scale_inv (one per block, Hugging Face's
            fine-grained format), or its weight_scale (one for the whole tensor, vLLM's per-tensor format) in every
            block."""
            if name + "_scale_inv" in file_of:
                return tensor(name + "_scale_inv")
            if name + "_scale" not in file_of:
                raise ValueError(f"checkpoint in {str(path)!r} holds {name} in FP8 without its block scales "
                                 f"{name}_scale_inv (or a per-tensor {name}_scale); save the checkpoint with its "
                                 f"scales")
            scale = tensor(name + "_scale")
            if scale.numel() != 1:
                raise ValueError(f"{name}_scale in {str(path)!r} holds {scale.numel()} scales; nanograph reads FP8 "
                                 f"weights with one scale per tensor ({name}_scale) or per 128 x 128 block "
                                 f"({name}_scale_inv): use such a checkpoint, or the unquantized model with "
                                 f"quantization='fp8'")
            blocks = (-(-shape[0] // BLOCK_SIZE), -(-shape[1] // BLOCK_SIZE))
            return scale.float().reshape(1, 1).expand(blocks).contiguous()

        def get(*parts: tuple) -> torch.Tensor:
            """The named tensors concatenated in dtype (an FP8 one dequantized)."""
            return torch.cat([t.to(dtype) if scales is None else
                              dequantize_fp8(t, scales, rows_per_scale=BLOCK_SIZE).to(dtype)
                              for t, scales in read(*parts)])

        def linear(name: str, *parts: tuple) -> dict[str, torch.Tensor]:
            """weights[name], the pieces concatenated along rows, and for an FP8 model its packed scales."""
            if not fp8_model and not any(piece + "_scale_inv" in file_of for piece, *_ in parts):
                return {name: get(*parts)}
            split = [shape[0] for _, shape, *_ in parts[:-1] if shape[0] % PACKED_SCALE_ROWS]
            if split:
                raise ValueError(f"{name}: a fused piece of {split[0]} rows would split a group of "
                                 f"{PACKED_SCALE_ROWS} rows that share one FP8 scale; FP8 needs every piece's rows "
                                 f"(heads x head_dim, intermediate_size) to be a multiple of {PACKED_SCALE_ROWS}")
            fp8_pieces, scale_pieces = [], []
            for t, scales in read(*parts):
                if scales is None:
                    t, scales = quantize_fp8(t)
                fp8_pieces.append(t)
                scale_pieces.append(expand_block_scales(scales, t.shape))
            packed, packed_scales = torch.cat(fp8_pieces), torch.cat(scale_pieces)
            if dequantize:
                return {name: dequantize_fp8(packed, packed_scales).to(dtype)}
            return {name: packed, name + SCALE_SUFFIX: packed_scales}

        mc = model_config
        hidden, head_dim, inter = mc.hidden_size, mc.head_dim, mc.intermediate_size
        q_rows, kv_rows = mc.num_heads * head_dim, mc.num_kv_heads * head_dim
        cut = _cuts(shard, mc)
        embed = ("model.embed_tokens.weight", (mc.vocab_size, hidden))
        weights = {"norm": get(("model.norm.weight", (hidden,)))}
        # A checkpoint without an lm_head (a base model's, a classifier's) is pooled, never sampled (has_lm_head):
        # its embeddings stand in for the head the step computes.
        tied = mc.tie_word_embeddings or "lm_head.weight" not in file_of and (base_model or
                                                                              CLASSIFIER_WEIGHT in file_of)
        if shard is None or shard.rank == 0:
            weights["lm_head"] = get(embed if tied else ("lm_head.weight", (mc.vocab_size, hidden)))
        if tied and "lm_head" in weights:
            weights["embed_tokens"] = weights["lm_head"][cut["embed"]] if shard else weights["lm_head"]
        else:
            weights["embed_tokens"] = get((*embed, *cut["embed"]))
        for i in range(mc.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            attn = hf + "self_attn."
            rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
            weights[ours + "input_layernorm"] = get((hf + "input_layernorm.weight", (hidden,)))
            weights.update(linear(ours + "qkv_proj",
                                  *((attn + p + "_proj.weight", (rows[p], hidden), *cut[p]) for p in "qkv")))
            if mc.qkv_bias:
                weights[ours + "qkv_bias"] = get(*((attn + p + "_proj.bias", (rows[p],), *cut[p]) for p in "qkv"))
            if mc.qk_norm:
                weights[ours + "q_norm"] = get((attn + "q_norm.weight", (head_dim,)))
                weights[ours + "k_norm"] = get((attn + "k_norm.weight", (head_dim,)))
            weights.update(linear(ours + "o_proj", (attn + "o_proj.weight", (hidden, q_rows), *cut["o"])))
            weights[ours + "post_attention_layernorm"] = get((hf + "post_attention_layernorm.weight", (hidden,)))
            weights.update(linear(ours + "gate_up_proj",
                                  (hf + "mlp.gate_proj.weight", (inter, hidden), *cut["gate_up"]),
                                  (hf + "mlp.up_proj.weight", (inter, hidden), *cut["gate_up"])))
            weights.update(linear(ours + "down_proj", (hf + "mlp.down_proj.weight", (hidden, inter), *cut["down"])))
    return weights


CLASSIFIER_WEIGHT = "score.weight"  # a sequence classifier's head


def _is_base_model(names) -> bool:
    """Whether a checkpoint's tensor names are a base model's (embed_tokens.weight, not model.embed_tokens.weight)."""
    return "model.embed_tokens.weight" not in names and "embed_tokens.weight" in names


def _is_headless(names) -> bool:
    """Whether a checkpoint's tensors are a causal LM's body under another head, or none: a base model's, or a
    sequence classifier's (its score head)."""
    return _is_base_model(names) or CLASSIFIER_WEIGHT in names


def _tensor_names(path: str | Path) -> set[str]:
    names = set()
    for f in weight_files(Path(path)):
        with safe_open(f, framework="pt") as handle:
            names.update(handle.keys())
    return names


def has_lm_head(path: str | Path, model_config: ModelConfig) -> bool:
    """Whether the checkpoint can give logits: its embeddings are tied to the head, or it holds an lm_head (a base
    model's or a classifier's checkpoint may not: it can only be pooled, runner="pooling")."""
    if model_config.tie_word_embeddings:
        return True
    names = _tensor_names(path)
    return "lm_head.weight" in names or not _is_headless(names)


def load_classifier(path: str | Path, model_config: ModelConfig) -> torch.Tensor:
    """A sequence classifier's head (transformers' XForSequenceClassification: a linear `score` without bias over the
    last hidden state), float32 [num_labels, hidden_size] on the CPU."""
    for f in weight_files(Path(path)):
        with safe_open(f, framework="pt") as handle:
            if CLASSIFIER_WEIGHT in handle.keys():
                head = handle.get_tensor(CLASSIFIER_WEIGHT)
                break
    else:
        raise ValueError(f"the checkpoint in {str(path)!r} has no {CLASSIFIER_WEIGHT}, the classification head that "
                         f"its config.json's architectures (*ForSequenceClassification) promise; use the checkpoint "
                         f"saved with its head (transformers' save_pretrained of the classifier)")
    labels = getattr(model_config.hf_config, "num_labels", None)
    if head.dim() != 2 or head.shape[1] != model_config.hidden_size or labels not in (None, head.shape[0]):
        raise ValueError(f"{CLASSIFIER_WEIGHT} in {str(path)!r} has shape {list(head.shape)}, but config.json gives "
                         f"[num_labels={labels}, hidden_size={model_config.hidden_size}]: the weights and config.json "
                         f"disagree")
    if head.dtype == FP8_DTYPE:
        raise ValueError(f"{CLASSIFIER_WEIGHT} in {str(path)!r} is FP8; nanograph reads a classification head in 16 "
                         f"or 32 bits: quantize the checkpoint with `score` among the modules left unquantized "
                         f"(modules_to_not_convert), or load the 16-bit one with quantization='fp8'")
    return head.float()


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


def block_scales(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name + BLOCK_SCALE_SUFFIX for each FP8 linear of load_weights' result whose packed scales are whole 128 x 128
    blocks (models/fp8.py gemm_block_scales): what the CUDA core's block-scaled FP8 GEMM reads at prefill sizes."""
    out = {}
    for name, tensor in weights.items():
        if tensor.dtype == FP8_DTYPE and (blocks := gemm_block_scales(weights[name + SCALE_SUFFIX])) is not None:
            out[name + BLOCK_SCALE_SUFFIX] = blocks
    return out
