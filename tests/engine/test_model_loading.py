"""ModelConfig and load_weights on tiny random HF checkpoints: fields, packed tensors, shards, clear errors."""
import json

import pytest
import torch

from nanograph.model_config import ModelConfig
from nanograph.models import load_weights

from .tiny_models import TINY_CONFIGS, make_tiny_model

EXPECTED = {  # architecture, head_dim, qk_norm, qkv_bias, tied
    "qwen3-tied": ("Qwen3ForCausalLM", 32, True, False, True),
    "qwen3-yarn-untied": ("Qwen3ForCausalLM", 24, True, False, False),
    "llama3-untied": ("LlamaForCausalLM", 16, False, False, False),
    "qwen2-tied": ("Qwen2ForCausalLM", 16, False, True, True),
    "qwen2-yarn-short": ("Qwen2ForCausalLM", 16, False, True, True),
    "mistral": ("MistralForCausalLM", 16, False, False, False),
}


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_tiny_model(folder, request.param)


def test_config_fields(tiny):
    name, folder, _ = tiny
    mc = ModelConfig.from_pretrained(folder)
    assert (mc.architecture, mc.head_dim, mc.qk_norm, mc.qkv_bias, mc.tie_word_embeddings) == EXPECTED[name]
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (64, 2, 4, 2)
    # YaRN: 64 x 4 for the short one; Mistral's sliding window caps its 256 positions.
    assert (mc.vocab_size, mc.intermediate_size, mc.max_context) == (256, 96, 128 if name == "mistral" else 256)
    assert mc.max_position_embeddings == (64 if name == "qwen2-yarn-short" else 256)
    assert mc.dtype == torch.float32


def hf_packed_weights(model, mc):
    hf = dict(model.named_parameters(remove_duplicate=False))
    expected = {"embed_tokens": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"],
                "lm_head": hf["lm_head.weight"]}
    for i in range(mc.num_layers):
        layer, attn = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        ours = f"layers.{i}."
        expected[ours + "input_layernorm"] = hf[layer + "input_layernorm.weight"]
        expected[ours + "qkv_proj"] = torch.cat([hf[attn + p + "_proj.weight"] for p in "qkv"])
        if mc.qkv_bias:
            expected[ours + "qkv_bias"] = torch.cat([hf[attn + p + "_proj.bias"] for p in "qkv"])
        if mc.qk_norm:
            expected[ours + "q_norm"] = hf[attn + "q_norm.weight"]
            expected[ours + "k_norm"] = hf[attn + "k_norm.weight"]
        expected[ours + "o_proj"] = hf[attn + "o_proj.weight"]
        expected[ours + "post_attention_layernorm"] = hf[layer + "post_attention_layernorm.weight"]
        expected[ours + "gate_up_proj"] = torch.cat([hf[layer + f"mlp.{p}_proj.weight"] for p in ("gate", "up")])
        expected[ours + "down_proj"] = hf[layer + "mlp.down_proj.weight"]
    return expected


def test_packed_weights_equal_hf_params(tiny):
    _, folder, model = tiny
    mc = ModelConfig.from_pretrained(folder)
    weights = load_weights(folder, mc, torch.float32, "cpu")
    expected = hf_packed_weights(model, mc)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert (weights["lm_head"] is weights["embed_tokens"]) == mc.tie_word_embeddings
    assert weights["layers.0.qkv_proj"].shape == ((4 + 2 * 2) * mc.head_dim, 64)


def test_weights_cast_to_requested_dtype(tiny):
    _, folder, _ = tiny
    weights = load_weights(folder, ModelConfig.from_pretrained(folder), torch.bfloat16, "cpu")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_sharded_checkpoint_loads(tmp_path):
    model = make_tiny_model(tmp_path, "llama3-untied", max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    mc = ModelConfig.from_pretrained(tmp_path)
    weights = load_weights(tmp_path, mc, torch.float32, "cpu")
    for name, tensor in hf_packed_weights(model, mc).items():
        assert torch.equal(weights[name], tensor), name


def test_eos_token_ids_merge_generation_config(tmp_path):
    make_tiny_model(tmp_path, "qwen2-tied")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == [7, 9]


def test_a_malformed_generation_config_is_named(tmp_path):
    make_tiny_model(tmp_path, "qwen2-tied")
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config.json is not a JSON object .*fix or remove the file"):
        ModelConfig.from_pretrained(tmp_path)


def test_linear_rope_scaling_stretches_the_context_and_matches_hf_past_it(tmp_path):
    """Linear scaling divides every position by its factor: the model serves max_position_embeddings x factor
    positions (as vLLM), and past max_position_embeddings its logprobs are transformers'. Dynamic NTK scaling keeps
    max_position_embeddings (its frequencies change with the length past it)."""
    from nanograph import LLM, SamplingParams

    linear = {"max_position_embeddings": 64, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    hf = make_tiny_model(tmp_path / "linear", "llama3-untied", config_overrides=linear)
    assert ModelConfig.from_pretrained(tmp_path / "linear").max_context == 256
    make_tiny_model(tmp_path / "dynamic", "llama3-untied", config_overrides={
        "max_position_embeddings": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    assert ModelConfig.from_pretrained(tmp_path / "dynamic").max_context == 64

    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(str(tmp_path / "linear"), device="cpu", max_model_len=256, max_num_seqs=1, max_logprobs=-1)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=-1),
                         use_tqdm=False)
    got = torch.tensor([[entry[token].logprob for token in range(256)] for entry in out.prompt_logprobs[1:]])
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_folder_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")


def test_folder_without_weights(tmp_path):
    make_tiny_model(tmp_path, "qwen3-tied")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    mc = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights"):
        load_weights(tmp_path, mc, torch.float32, "cpu")


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_pretrained(tmp_path)


def test_architecture_from_model_type_when_architectures_absent(tmp_path):
    make_tiny_model(tmp_path, "llama3-untied")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(tmp_path).architecture == "LlamaForCausalLM"


def test_broken_checkpoints_name_the_file_at_fault(tmp_path):
    """A config.json that is not JSON, a shard the index names but the folder lacks, a truncated safetensors file and
    a missing tensor each raise an error naming the file or tensor (ValueError or FileNotFoundError, not KeyError)."""
    make_tiny_model(tmp_path, "llama3-untied", max_shard_size="40KB")
    mc = ModelConfig.from_pretrained(tmp_path)
    config_text = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config_text[:-5])
    with pytest.raises(ValueError, match=r"config\.json' is not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(config_text)

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = tmp_path / sorted(set(index["weight_map"].values()))[1]
    data = shard.read_bytes()
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"names shard\(s\) \['{shard.name}'\] that are not in the folder"):
        load_weights(tmp_path, mc, torch.float32, "cpu")
    shard.write_bytes(data[:20])
    with pytest.raises(ValueError, match=rf"cannot read the weights file .*{shard.name}"):
        load_weights(tmp_path, mc, torch.float32, "cpu")
    shard.write_bytes(data)

    from safetensors.torch import load_file, save_file
    holder = tmp_path / index["weight_map"].pop("model.norm.weight")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    tensors = load_file(holder)
    del tensors["model.norm.weight"]
    save_file(tensors, holder, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) \['model.norm.weight'\]"):
        load_weights(tmp_path, mc, torch.float32, "cpu")


def test_a_sliding_window_caps_the_context(tmp_path):
    """Mistral's sliding window (128 here, of 256 positions) is the longest context served: a longer max_model_len
    is capped with a warning that says so, and a prompt within it matches transformers (whose window then covers
    every position)."""
    from nanograph import LLM, SamplingParams

    hf = make_tiny_model(tmp_path, "mistral")
    with pytest.warns(UserWarning, match="max_model_len 200 is more than the model's 128 positions.*sliding window"):
        llm = LLM(str(tmp_path), device="cpu", max_model_len=200, skip_tokenizer_init=True)
    assert llm.llm_engine.config.max_model_len == 128
    prompt = list(range(3, 120))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    assert out.token_ids == expected.tolist()
