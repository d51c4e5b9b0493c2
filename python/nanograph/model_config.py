"""ModelConfig: the decoder's shape and options, read from a Hugging Face model folder's config.json."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from .config import SUPPORTED_QUANTIZATION

# Configs written from a GGUF (and some hand-made ones) carry model_type but no "architectures".
# Mistral's decoder is Llama's; its sliding window caps the context (_max_context).
_ARCHITECTURE_BY_MODEL_TYPE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "mistral": "MistralForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURE_BY_MODEL_TYPE.values())


@dataclass
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    max_position_embeddings: int
    # The longest context served: max_position_embeddings, or YaRN's scaled length; at most a sliding window.
    max_context: int
    dtype: torch.dtype
    quantization: str | None  # the checkpoint's: "fp8" (e4m3 in 128 x 128 blocks, models/fp8.py) or None
    eos_token_ids: list[int]
    hf_config: PretrainedConfig

    @classmethod
    def from_pretrained(cls, path: str | Path, hf_overrides: dict | Callable | None = None) -> ModelConfig:
        """hf_overrides: Config.hf_overrides, applied to config.json's values before anything reads them."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model folder {str(path)!r} does not exist; pass a local folder "
                                    "holding config.json and *.safetensors")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json; pass a Hugging Face model folder")
        try:
            raw = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{str(path / 'config.json')!r} is not valid JSON: {exc}") from None
        hf = AutoConfig.from_pretrained(path)
        if isinstance(hf_overrides, dict):
            raw = {**raw, **hf_overrides}
            _override(hf, hf_overrides)
        elif hf_overrides is not None:
            hf = hf_overrides(hf)
            if not isinstance(hf, PretrainedConfig):
                raise ValueError(f"hf_overrides returned {type(hf).__name__}; a function given as hf_overrides "
                                 "returns the transformers config it was given, changed")
            _sync_rope_theta(hf)
            raw = {**raw, **hf.to_dict()}
        architecture = _architecture(raw)
        _check_supported_options(hf, architecture)
        return cls(
            path=str(path),
            architecture=architecture,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            qk_norm=architecture == "Qwen3ForCausalLM",
            qkv_bias=architecture == "Qwen2ForCausalLM",
            max_position_embeddings=hf.max_position_embeddings,
            max_context=_max_context(hf),
            dtype=_torch_dtype(hf),
            quantization=_quantization(raw.get("quantization_config")),
            eos_token_ids=_eos_token_ids(hf, path),
            hf_config=hf,
        )


def _override(hf: PretrainedConfig, overrides: dict):
    """Config.hf_overrides on the loaded config. A rope_scaling or rope_parameters dict replaces the rope
    parameters but for rope_theta, which stays unless given (Qwen's YaRN recipe gives rope_type, factor and
    original_max_position_embeddings alone); None means no scaling."""
    for key, value in overrides.items():
        if key in ("rope_scaling", "rope_parameters"):
            value = {"rope_type": "default"} if value is None else dict(value)
            if "type" in value and "rope_type" not in value:
                value["rope_type"] = value["type"]  # the older name of the field
            theta = rope_parameters(hf).get("rope_theta")  # transformers 5 keeps it there (4: an attribute)
            if theta is not None:
                value = {"rope_theta": theta, **value}
        setattr(hf, key, value)
    _sync_rope_theta(hf)


def _sync_rope_theta(hf: PretrainedConfig):
    """A rope_theta set on the config (an override, or an hf_overrides function) where transformers reads it: in
    rope_parameters, for transformers 5."""
    theta = vars(hf).get("rope_theta")
    if theta is not None and isinstance(getattr(hf, "rope_parameters", None), dict):
        hf.rope_parameters = {**hf.rope_parameters, "rope_theta": theta}


# The suffixes of the architectures that are a causal LM's body under another head: a base model (Qwen3Model, as an
# embedding model's folder gives it) has none, a sequence classifier a linear `score` over its last hidden state.
BASE_MODEL_SUFFIX, CLASSIFIER_SUFFIX = "Model", "ForSequenceClassification"


def causal_lm_architecture(name: str) -> str:
    """The causal LM whose body an architecture is (Qwen3Model and Qwen3ForSequenceClassification: Qwen3ForCausalLM)."""
    for suffix in (CLASSIFIER_SUFFIX, BASE_MODEL_SUFFIX):
        if name.endswith(suffix):
            return name.removesuffix(suffix) + "ForCausalLM"
    return name


def _architecture(raw: dict) -> str:
    names = raw.get("architectures") or [_ARCHITECTURE_BY_MODEL_TYPE.get(raw.get("model_type"), raw.get("model_type"))]
    for name in names:
        name = causal_lm_architecture(name)
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(f"unsupported architecture {names}; nanograph supports {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_supported_options(hf: PretrainedConfig, architecture: str) -> None:
    if hf.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; nanograph's MLP is SiLU-gated")
    if architecture != "Qwen2ForCausalLM" and getattr(hf, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported (only Qwen2's q/k/v bias is)")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
    if rope_type(hf) in ("longrope", "su"):
        raise ValueError("rope_type 'longrope' is not supported: it switches between two frequency tables with the "
                         "sequence length, and nanograph keeps one")


def _quantization(config: dict | None) -> str | None:
    """config.json's quantization_config: Hugging Face's fine-grained FP8 (quant_method "fp8", e4m3 weights with a
    float32 weight_scale_inv per 128 x 128 block), vLLM's per-tensor FP8 (no weight_block_size, a float32
    weight_scale per tensor; models/weights.py spreads it over the tensor's blocks), or none. Activations are
    quantized dynamically: a checkpoint with activation_scheme "static" loads, its input scales unread."""
    if config is None:
        return None
    method = config.get("quant_method")
    if method not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"config.json's quantization_config has quant_method {method!r}, which nanograph does not "
                         f"run; it loads {list(SUPPORTED_QUANTIZATION)} checkpoints (Hugging Face's fine-grained FP8, "
                         f"weight_block_size [128, 128]): use such a checkpoint or the unquantized model (which "
                         f"quantization='fp8' quantizes at load)")
    block_size = config.get("weight_block_size", [128, 128])  # transformers' FineGrainedFP8Config default
    if block_size is None or list(block_size) != [128, 128]:
        raise ValueError(f"config.json's quantization_config has weight_block_size {block_size}; nanograph's FP8 "
                         f"weights have one scale per [128, 128] block: use a checkpoint quantized with "
                         f"weight_block_size [128, 128], or the unquantized model with quantization='fp8'")
    if config.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ValueError(f"config.json's quantization_config has activation_scheme "
                         f"{config['activation_scheme']!r}; nanograph runs FP8 checkpoints of activation_scheme "
                         f"'dynamic' or 'static' (whose activations it also quantizes dynamically): use such a "
                         f"checkpoint, or the unquantized model with quantization='fp8'")
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"config.json's quantization_config has fmt {config['fmt']!r}; nanograph's FP8 weights are "
                         f"e4m3 (float8_e4m3fn): use an e4m3 checkpoint")
    return method


def rope_parameters(hf: PretrainedConfig) -> dict:
    """The config's rope parameters (transformers 5's rope_parameters, or the older rope_scaling), {} for none."""
    return getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}


def rope_type(hf: PretrainedConfig) -> str:
    params = rope_parameters(hf)
    return params.get("rope_type", params.get("type", "default"))


def _max_context(hf: PretrainedConfig) -> int:
    """YaRN stretches the original context by its factor (Qwen2.5's and Qwen3's long-context recipe keeps
    max_position_embeddings at the original length), and linear scaling, which divides every position by its
    factor, stretches max_position_embeddings (as vLLM serves both). Every other rope type serves
    max_position_embeddings: dynamic NTK scaling changes its frequencies with the length past it, and nanograph
    keeps one table. A sliding window (Mistral-7B-v0.1's 4,096) caps the context: nanograph attends over every
    position, which is the window's attention only as long as the context fits in it."""
    params = rope_parameters(hf)
    if rope_type(hf) == "yarn" and params.get("factor"):
        original = params.get("original_max_position_embeddings") or hf.max_position_embeddings
        positions = max(hf.max_position_embeddings, int(original * params["factor"]))
    elif rope_type(hf) == "linear" and params.get("factor", 1) > 1:
        positions = int(hf.max_position_embeddings * params["factor"])
    else:
        positions = hf.max_position_embeddings
    window = sliding_window(hf)
    return positions if window is None else min(positions, window)


def sliding_window(hf: PretrainedConfig) -> int | None:
    """The attention window of a config that uses one: Mistral's sliding_window; Qwen2's and Qwen3's only with
    use_sliding_window, which _check_supported_options refuses."""
    window = getattr(hf, "sliding_window", None)
    return window if getattr(hf, "use_sliding_window", True) and isinstance(window, int) and window > 0 else None


def _torch_dtype(hf: PretrainedConfig) -> torch.dtype:
    dtype = (hf.dtype if hasattr(hf, "dtype") else hf.torch_dtype) or torch.float32  # transformers 5 renamed it
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _eos_token_ids(hf: PretrainedConfig, path: Path) -> list[int]:
    ids = [hf.eos_token_id]
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        try:
            ids.append(json.loads(generation_config.read_text()).get("eos_token_id"))
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{generation_config} is not a JSON object ({exc}); fix or remove the file") from None
    flat = [i for item in ids for i in (item if isinstance(item, list) else [item]) if i is not None]
    return list(dict.fromkeys(flat))
