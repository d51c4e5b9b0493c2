"""Random-weight Hugging Face model folders shaped like real checkpoints (no hub is reachable)."""
from __future__ import annotations

import os

import torch

REAL_CONFIGS = {
    # Qwen3-0.6B: QK-norm, tied embeddings.
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960),
    # Llama-3.2-1B: llama3 RoPE scaling, tied embeddings.
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen2-0.5B: QKV bias, GQA ratio 7, head_dim 64.
    "qwen2-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768),
    # Mistral-7B-Instruct-v0.3: Llama's decoder under its own architecture name, no sliding window.
    "mistral-7b-v0.3": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            intermediate_size=14336, vocab_size=32768, tie_word_embeddings=False,
                            rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=None),
    # Qwen3-8B: untied lm_head.
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960),
}


def make_random_model(folder: str, name: str, seed: int = 0, dtype=torch.bfloat16, **overrides) -> str:
    """Saves a random-weight model of config `name` into folder (reused if already there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    spec = {**REAL_CONFIGS[name], **overrides}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.save_pretrained(folder)
    return folder
