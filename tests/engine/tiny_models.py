"""Tiny random Hugging Face models (hidden 64, 2 layers) of every supported architecture, saved as model folders."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6)

TINY_CONFIGS = {
    "qwen3-tied": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
                       tie_word_embeddings=True, rope_theta=1e6),
    "qwen3-yarn-untied": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=24,
                              tie_word_embeddings=False, rope_theta=1e4,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 64}),
    "llama3-untied": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                          rope_theta=1e4, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}),
    "qwen2-tied": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                       rope_theta=1e6),
    # Mistral: Llama's decoder; a sliding window shorter than the positions caps the context (v0.1's 4,096 of
    # 32,768; v0.3 has none).
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], tie_word_embeddings=False,
                    rope_theta=1e6, sliding_window=128),
    # Qwen2.5's long-context recipe: max_position_embeddings stays the original length, YaRN stretches it 4x.
    "qwen2-yarn-short": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                             rope_theta=1e4, max_position_embeddings=64,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}
# SmolLM2's vocabulary and positions, for SmolLM2's real tokenizer (make_tiny_chat_model).
SMOLLM2_SHAPED = dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True, rope_theta=1e4,
                      vocab_size=49152, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_chat_model(folder, seed: int = 0):
    """A tiny random model with SmolLM2-135M-Instruct's real tokenizer and chat template (from the default model's
    folder). Returns the HF model."""
    model = _save_random_model(folder, {**_COMMON, **SMOLLM2_SHAPED}, seed)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(_default_folder()) / name, Path(folder) / name)
    return model


def make_tiny_model(folder, name: str, seed: int = 0, config_overrides: dict | None = None, **save_kwargs):
    """Saves a float32 model with weights large enough to give peaked logits (HF's 0.02 init is near flat) and
    non-unit norms, so a swapped or missing tensor changes the output. config_overrides: config.json fields over
    TINY_CONFIGS[name]'s. Returns the HF model (eval mode)."""
    return _save_random_model(folder, {**_COMMON, **TINY_CONFIGS[name], **(config_overrides or {})}, seed,
                              **save_kwargs)


def make_tiny_classifier(folder, name: str, num_labels: int, seed: int = 0, with_tokenizer: bool = False,
                         config_overrides: dict | None = None):
    """make_tiny_model's model of TINY_CONFIGS[name] (or SmolLM2's shape with its tokenizer, with_tokenizer) as a
    sequence classifier (transformers' XForSequenceClassification: a `score` head of num_labels rows, no lm_head).
    Returns the HF model."""
    from transformers import AutoModelForSequenceClassification

    base = SMOLLM2_SHAPED if with_tokenizer else TINY_CONFIGS[name]
    architecture = base["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    spec = {**_COMMON, **base, "architectures": [architecture], "num_labels": num_labels,
            "id2label": {i: f"class_{i}" for i in range(num_labels)}, **(config_overrides or {})}
    model = _save_random_model(folder, spec, seed, auto_class=AutoModelForSequenceClassification)
    if with_tokenizer:
        for file in TOKENIZER_FILES:
            shutil.copy(Path(_default_folder()) / file, Path(folder) / file)
    return model


def _default_folder():
    from nanograph.default_model import default_model_path
    return default_model_path()


def _save_random_model(folder, spec: dict, seed: int, auto_class=None, **save_kwargs):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = (auto_class or AutoModelForCausalLM).from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder, **save_kwargs)
    return model
