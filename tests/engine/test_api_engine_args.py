"""vLLM's engine arguments on LLM(...) (CPU, a tiny model with SmolLM2's real tokenizer): the ones nanograph does not
implement are a ValueError naming them, the accepted ones take effect; generation_config's default sampling
parameters; max_model_len's default (the model's length, capped by the KV cache)."""
import json
import re
import shutil

import pytest
import torch

from nanograph import LLM, SamplingParams
from nanograph.config import Config
from nanograph.engine_args import VLLM_ARGS
from nanograph.models.fp8 import BLOCK_SIZE, dequantize_fp8, quantize_fp8

from .test_api_inputs import save_word_tokenizer
from .tiny_models import TOKENIZER_FILES, make_tiny_model

ENGINE = dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPT = "The sky is"


@pytest.fixture(scope="module")
def folder(tiny_chat_folder):
    return tiny_chat_folder


@pytest.fixture(scope="module")
def reference(folder):
    return LLM(str(folder), **ENGINE).generate(PROMPT, GREEDY, use_tqdm=False)[0]


@pytest.mark.parametrize("name, value, supported", [
    ("pipeline_parallel_size", 4, "pipeline_parallel_size=1"),
    ("data_parallel_size", 2, "data_parallel_size=1"),
    ("quantization", "awq", "quantization='fp8'"),
    ("kv_cache_dtype", "fp8_e5m2", "kv_cache_dtype='auto' (the model's dtype), 'fp8' or 'fp8_e4m3' (both e4m3)"),
    ("cpu_offload_gb", 4, "cpu_offload_gb=0"),
    ("calculate_kv_scales", True, "calculate_kv_scales=False"),
    ("tokenizer_mode", "mistral", "tokenizer_mode='auto' or 'hf'"),
    ("load_format", "pt", "load_format='auto' or 'safetensors'"),
    ("task", "reward", "task='auto' or 'generate' or 'embed' or 'classify'"),
    ("enable_lora", True, "enable_lora=False"),
    ("speculative_config", {"method": "ngram"}, "speculative_config=None"),
    ("distributed_executor_backend", "ray", "distributed_executor_backend=None or 'uni'"),
])
def test_an_unsupported_value_is_a_value_error_naming_the_argument(folder, name, value, supported):
    expected = "^" + re.escape(f"{name}={value!r} is not supported yet: ") + ".*" + re.escape(f"; use {supported}")
    with pytest.raises(ValueError, match=expected):
        LLM(str(folder), **ENGINE, **{name: value})


def test_an_unknown_argument_is_a_value_error_naming_it(folder):
    with pytest.raises(ValueError, match="engine argument 'max_paddings' is not supported yet by nanograph; it takes "
                                         "the Config fields .*max_model_len.* and these of vLLM's: .*swap_space"):
        LLM(str(folder), max_paddings=256, **ENGINE)


def test_accepted_arguments_change_nothing_they_should_not(folder, reference):
    accepted = dict(tensor_parallel_size=1, pipeline_parallel_size=1, quantization=None, kv_cache_dtype="auto",
                    cpu_offload_gb=0, tokenizer_mode="auto", load_format="safetensors", task="generate",
                    trust_remote_code=True, swap_space=4, disable_log_stats=False, max_seq_len_to_capture=8192,
                    enable_chunked_prefill=False, disable_custom_all_reduce=True, enforce_eager=True,
                    max_num_seqs=None, dtype=None)  # None: the default, as in vLLM
    assert set(VLLM_ARGS) >= {"swap_space", "disable_log_stats", "max_seq_len_to_capture", "enable_chunked_prefill"}
    out = LLM(str(folder), **ENGINE, **accepted).generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids


def test_accepted_arguments_take_effect(folder):
    llm = LLM(str(folder), device="cpu", max_model_len=48, block_size=16, num_gpu_blocks_override=7, seed=3,
              max_num_seqs=5, max_num_batched_tokens=32, enable_prefix_caching=False)
    config = llm.llm_engine.config
    assert llm.llm_engine is llm.engine
    assert llm.engine.runner.num_kv_blocks == 7
    assert (config.seed, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
            config.enable_prefix_caching) == (3, 5, 32, 48, False)
    # The token budget chunks a 40-token prompt into two steps; the output is the unchunked one's.
    prompt = list(range(100, 140))
    chunked = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert chunked == LLM(str(folder), **ENGINE).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_quantization_fp8_runs_the_linears_in_fp8(folder):
    """quantization="fp8": the torch backend runs the linears at their FP8 values (the original ones otherwise)."""
    plain = LLM(str(folder), **ENGINE, kv_cache_dtype="auto").engine.runner.weights
    llm = LLM(str(folder), quantization="fp8", kv_cache_dtype="auto", **ENGINE)
    assert (llm.engine.config.quantization, llm.engine.config.kv_cache_dtype) == ("fp8", "auto")
    fp8, scales = quantize_fp8(plain["layers.1.down_proj"])
    got = llm.engine.runner.weights["layers.1.down_proj"]
    assert torch.equal(got, dequantize_fp8(fp8, scales, rows_per_scale=BLOCK_SIZE))
    assert not torch.equal(got, plain["layers.1.down_proj"])
    assert torch.equal(llm.engine.runner.weights["embed_tokens"], plain["embed_tokens"])


def test_a_separate_tokenizer_folder(folder, reference, tmp_path):
    weights_only = tmp_path / "weights-only"
    shutil.copytree(folder, weights_only, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    word_tokenizer = tmp_path / "words"
    save_word_tokenizer(word_tokenizer, eos_token="<end>")
    llm = LLM(str(weights_only), tokenizer=str(folder), **ENGINE)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert (out.prompt_token_ids, out.outputs[0].text) == (reference.prompt_token_ids, reference.outputs[0].text)
    # set_tokenizer: requests from now on are encoded and decoded with the new one.
    llm.set_tokenizer(word := LLM(str(weights_only), tokenizer=str(word_tokenizer), **ENGINE).get_tokenizer())
    assert llm.get_tokenizer() is word and llm.tokenizer is word
    assert llm.generate("w4 w5 w6", GREEDY, use_tqdm=False)[0].prompt_token_ids == [4, 5, 6]


def test_skip_tokenizer_init_takes_token_ids_and_gives_no_text(folder, reference):
    llm = LLM(str(folder), skip_tokenizer_init=True, **ENGINE)
    assert llm.get_tokenizer() is None
    out = llm.generate([reference.prompt_token_ids], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids and out.outputs[0].text == ""
    with pytest.raises(ValueError, match=r"has no tokenizer \(the model folder has none, or skip_tokenizer_init is "
                                         r"set\); pass prompts as token-id lists"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)


def test_a_tokenizer_folder_without_a_tokenizer_is_refused(folder, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"tokenizer='{tmp_path / 'empty'}': .* holds no tokenizer"):
        LLM(str(folder), tokenizer=str(tmp_path / "empty"), **ENGINE)


def test_lora_request_none_is_taken_and_an_adapter_refused(folder, reference):
    llm = LLM(str(folder), **ENGINE)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=None)[0]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    chat = [{"role": "user", "content": "Hi"}]
    assert llm.chat(chat, GREEDY, use_tqdm=False, lora_request=None)[0].outputs[0].token_ids
    for call in (lambda: llm.generate(PROMPT, GREEDY, lora_request=object()),
                 lambda: llm.chat(chat, GREEDY, lora_request=object())):
        with pytest.raises(ValueError, match="lora_request: nanograph runs no LoRA adapters"):
            call()


def test_generate_takes_vllms_priority_of_zeros_and_refuses_others(folder, reference):
    llm = LLM(str(folder), **ENGINE)
    for priority in (None, [0]):
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False, priority=priority)[0]
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"priority=1: this engine serves requests first come, first served; start it "
                                         r"with scheduling_policy='priority'"):
        llm.generate([PROMPT], GREEDY, priority=[1])
    with pytest.raises(ValueError, match="priority has 2 values for 1 prompts; give one per prompt"):
        llm.generate([PROMPT], GREEDY, priority=[0, 0])


def test_under_the_priority_policy_generate_serves_lower_priorities_first(folder):
    """scheduling_policy="priority": with one sequence at a time, the requests run in priority order (ties in input
    order), each with the tokens it has under fcfs."""
    prompts = ["The sky is", "One, two,", "Paris is", "A cat"]
    fcfs = LLM(str(folder), **ENGINE, max_num_seqs=1).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(folder), **ENGINE, max_num_seqs=1, scheduling_policy="priority")
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[3, -2, 3, 0])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in fcfs]
    started = sorted(range(len(prompts)), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert started == [1, 3, 0, 2]
    with pytest.raises(TypeError, match="priority must be an int, got '1'"):
        llm.generate(prompts[:1], GREEDY, priority=["1"])
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is not one nanograph has; use 'fcfs'"):
        LLM(str(folder), **ENGINE, scheduling_policy="lifo")


def test_vllms_call_options_tqdm_class_tokenization_kwargs_and_clone(folder, reference):
    """use_tqdm may be the tqdm class to show progress with; tokenization_kwargs=None is taken (others refused,
    naming it); SamplingParams.clone() is a deep copy."""
    from tqdm.auto import tqdm

    bars = []

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    llm = LLM(str(folder), **ENGINE)
    out = llm.generate([PROMPT], GREEDY, use_tqdm=Bar, tokenization_kwargs=None)[0]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert len(bars) == 1 and bars[0].n == 1 and bars[0].total == 1
    with pytest.raises(ValueError, match="tokenization_kwargs: not taken by nanograph"):
        llm.generate([PROMPT], GREEDY, tokenization_kwargs={"truncation": True})
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0})
    copy = params.clone()
    assert copy == params and copy is not params and copy.stop is not params.stop
    copy.stop.append("y")
    assert params.stop == ["x"]


def write_generation_config(folder, **fields):
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **fields}))


def test_generation_config_gives_the_default_sampling_params(folder, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    write_generation_config(model, do_sample=True, temperature=0.0, top_p=0.9, top_k=20, min_p=0.05,
                            repetition_penalty=1.2, max_new_tokens=5)
    llm = LLM(str(model), **ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.repetition_penalty) == (0.0, 5, 1.2)
    # Greedy (temperature 0) clears top_p, top_k and min_p, as SamplingParams does.
    assert defaults == SamplingParams(temperature=0.0, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.2,
                                      max_tokens=5)
    # generate() and chat() without params use them: greedy, 5 tokens, the penalty applied.
    asked = SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.2)
    by_default = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids
    assert len(by_default) == 5 and by_default == llm.generate(PROMPT, asked, use_tqdm=False)[0].outputs[0].token_ids
    messages = [{"role": "user", "content": "Hi"}]
    assert llm.chat(messages, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.chat(messages, asked, use_tqdm=False)[0].outputs[0].token_ids
    # "vllm": none of them; a folder: that folder's.
    assert LLM(str(model), generation_config="vllm", **ENGINE).get_default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, temperature=0.7, top_k=5)
    assert LLM(str(model), generation_config=str(other), **ENGINE).get_default_sampling_params() == \
        SamplingParams(temperature=0.7, top_k=5)
    # A folder whose generation_config.json sets no sampling field: vLLM's defaults.
    assert LLM(str(folder), **ENGINE).get_default_sampling_params() == SamplingParams()
    with pytest.raises(FileNotFoundError, match="generation_config='/no/such' is not a folder"):
        LLM(str(model), generation_config="/no/such", **ENGINE)


def test_override_generation_config_goes_over_the_generation_config(folder, tmp_path, caplog):
    """vLLM's override_generation_config: generation_config.json's names over what generation_config gives (the
    model folder's file, or nothing with "vllm"); names nanograph does not read are logged; a bad value is an error
    naming the argument."""
    model = tmp_path / "model"
    shutil.copytree(folder, model)
    write_generation_config(model, temperature=0.6, top_k=20, max_new_tokens=5)
    llm = LLM(str(model), override_generation_config={"temperature": 0.0, "max_new_tokens": 3}, **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=20, max_tokens=3)
    assert len(llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) == 3
    with caplog.at_level("WARNING", logger="nanograph"):
        alone = LLM(str(model), generation_config="vllm", override_generation_config={"top_p": 0.5, "do_sample": 1},
                    **ENGINE)
    assert alone.get_default_sampling_params() == SamplingParams(top_p=0.5)
    assert "override_generation_config: do_sample not read" in caplog.text
    with pytest.raises(ValueError, match="override_generation_config: .*top_p"):
        LLM(str(model), override_generation_config={"top_p": 7}, **ENGINE)
    # Checked with the Config, before any model loads, in generation_config.json's names.
    with pytest.raises(ValueError, match="override_generation_config: max_new_tokens must be at least 1, got 0"):
        Config(override_generation_config={"max_new_tokens": 0})
    with pytest.raises(ValueError, match="override_generation_config must be a dict"):
        LLM(str(model), override_generation_config="temperature=0", **ENGINE)


def test_max_model_len_defaults_to_the_models_length(folder, tmp_path):
    """The model's positions (8192 here; YaRN's scaled context for a YaRN model), unless the KV cache holds less:
    then a default is capped with a warning naming both, and a length asked for is an error naming both."""
    assert LLM(str(folder), device="cpu", max_num_seqs=2).engine.config.max_model_len == 8192
    yarn = tmp_path / "yarn"
    make_tiny_model(yarn, "qwen2-yarn-short")  # 64 positions, YaRN factor 4
    assert LLM(str(yarn), device="cpu", max_num_seqs=2).engine.config.max_model_len == 256
    with pytest.warns(UserWarning, match="the KV cache holds 128 tokens, fewer than the model's 8192; max_model_len "
                                         "is 128"):
        llm = LLM(str(folder), device="cpu", num_kv_blocks=8, block_size=16)
    assert llm.engine.config.max_model_len == 128
    out = llm.generate([[5] * 120], SamplingParams(temperature=0, max_tokens=None), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="KV cache holds 128 tokens, fewer than max_model_len=256"):
        LLM(str(folder), device="cpu", num_kv_blocks=8, block_size=16, max_model_len=256)


def test_a_kv_cache_too_small_says_what_makes_it_larger(folder):
    """num_kv_blocks (vLLM's num_gpu_blocks_override) when it was given; on the torch backend, which does not size
    its cache by gpu_memory_utilization, num_kv_blocks too."""
    with pytest.raises(ValueError, match=r"KV cache holds 64 tokens, fewer than max_model_len=128; raise num_kv_blocks "
                                         r"\(vLLM's num_gpu_blocks_override; 4 now\) or lower max_model_len"):
        LLM(str(folder), device="cpu", max_model_len=128, num_gpu_blocks_override=4, block_size=16)
    from nanograph.backends.torch_backend import TorchRunner
    from nanograph.config import Config
    from nanograph.engine.llm_engine import _more_kv_cache

    assert _more_kv_cache(Config(device="cpu"), TorchRunner).startswith(
        "raise num_kv_blocks (the torch backend sizes its cache by max_num_seqs x max_model_len, up to 1 GiB")
