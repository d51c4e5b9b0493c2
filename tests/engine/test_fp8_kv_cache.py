"""The FP8 KV cache (kv_cache_dtype "fp8", e4m3 with a K and a V scale per layer) on the torch backend: the store and
read conversions, a checkpoint's scales, the cache's size, logprobs and greedy tokens against the model-dtype cache,
prefix caching and preemption unchanged, the real SmolLM2 answering "Paris", and the values nanograph refuses."""
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nanograph import LLM, SamplingParams
from nanograph.backends import torch_backend
from nanograph.backends.torch_backend import TorchRunner
from nanograph.config import Config
from nanograph.model_config import ModelConfig
from nanograph.models.kv_cache import dequantize_kv, load_kv_scales, quantize_kv

from .test_torch_backend import BLOCK, forward_batch
from .tiny_models import make_tiny_model
from .top5_rule import assert_top5_rule

E4M3 = torch.float8_e4m3fn
E4M3_RELATIVE = 2 ** -4  # the largest relative rounding error of a normal e4m3 value: half of 3 mantissa bits' spacing
E4M3_MIN_NORMAL = 2 ** -6
ENGINE = dict(device="cpu", max_model_len=128, skip_tokenizer_init=True)


@pytest.fixture(scope="module", params=["qwen3-tied", "llama3-untied"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_tiny_model(folder, request.param)
    return str(folder)


def token_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, 256, n).tolist()} for n in lengths]


def test_quantize_divides_by_the_scale_and_saturates_at_448():
    x = torch.tensor([3.0, -1000.0, 1000.0, 0.0, 0.25])
    stored = quantize_kv(x, 2.0)
    assert stored.dtype == E4M3
    assert stored.float().tolist() == [1.5, -448.0, 448.0, 0.0, 0.125]
    assert dequantize_kv(stored, 2.0, torch.float32).tolist() == [3.0, -896.0, 896.0, 0.0, 0.25]
    assert dequantize_kv(stored, 2.0, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("scale", [1.0, 0.05, 7.5])
def test_a_stored_value_keeps_e4m3_relative_precision_within_its_scaled_range(scale):
    gen = torch.Generator().manual_seed(0)
    # magnitudes from e4m3's smallest normal value to its largest, in units of the scale
    magnitude = torch.exp2(torch.empty(10_000).uniform_(-6, 8.8, generator=gen))
    x = scale * magnitude * torch.randn(10_000, generator=gen).sign()
    restored = dequantize_kv(quantize_kv(x, scale), scale, torch.float32)
    assert ((restored - x).abs() <= E4M3_RELATIVE * x.abs() * (1 + 1e-6)).all()  # float32 rounds x / scale * scale
    assert ((restored - x).abs() > 0).any()  # it is rounded


def test_config_takes_vllms_fp8_names_and_refuses_the_rest():
    for value in ("auto", "fp8", "fp8_e4m3"):
        assert Config(kv_cache_dtype=value).kv_cache_dtype == value
    for value in ("fp8_e5m2", "fp8_inc", "float16", "", None):
        with pytest.raises(ValueError) as info:
            Config(kv_cache_dtype=value)
        assert str(info.value) == (f"kv_cache_dtype={value!r} is not supported yet: nanograph's KV cache holds the "
                                   "model's dtype or FP8 e4m3; use kv_cache_dtype='auto' (the model's dtype), 'fp8' or "
                                   "'fp8_e4m3' (both e4m3)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_same_memory_holds_more_tokens_in_fp8(tiny, monkeypatch, dtype):
    """The torch backend sizes its cache by a byte budget: FP8's 1 byte per value against the model dtype's 2 or 4."""
    monkeypatch.setattr(torch_backend, "KV_CACHE_BUDGET_BYTES", 1 << 16)
    mc = ModelConfig.from_pretrained(tiny)
    auto, fp8 = (TorchRunner(mc, dtype=dtype, block_size=BLOCK, max_model_len=128, max_num_seqs=64,
                             kv_cache_dtype=kv) for kv in ("auto", "fp8"))
    assert auto.k_caches[0].dtype == dtype and fp8.k_caches[0].dtype == fp8.v_caches[1].dtype == E4M3
    bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
    assert fp8.num_kv_blocks == (1 << 16) // bytes_per_token // BLOCK
    assert fp8.num_kv_blocks == dtype.itemsize * auto.num_kv_blocks
    assert fp8.kv_cache_summary() == (f"{fp8.num_kv_blocks} blocks x {BLOCK} = {fp8.num_kv_blocks * BLOCK} tokens in "
                                      "float8_e4m3fn (1 byte per value)")


def test_the_engine_reports_the_kv_cache_dtype_and_tokens(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="nanograph"):
        LLM(tiny, **ENGINE, kv_cache_dtype="fp8_e4m3", block_size=16, num_kv_blocks=10)
    assert "KV cache: 10 blocks x 16 = 160 tokens in float8_e4m3fn (1 byte per value)" in caplog.messages


def test_teacher_forced_logprobs_stay_within_e4m3s_rounding(tiny):
    """Every prompt token's logprob (the prefill path), with the cache in float32 and in e4m3 (scale 1): the keys and
    values are rounded by at most 2^-4 of their size, and the logprobs move by well under that share of theirs."""
    prompts = token_prompts([40, 17, 63])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    logprobs = {kv: torch.tensor([next(iter(step.values())).logprob for out in
                                  LLM(tiny, **ENGINE, kv_cache_dtype=kv).generate(prompts, params, use_tqdm=False)
                                  for step in out.prompt_logprobs[1:]]) for kv in ("auto", "fp8")}
    error = (logprobs["fp8"] - logprobs["auto"]).abs()
    assert 0 < error.mean() < E4M3_RELATIVE / 2 * logprobs["auto"].abs().mean(), error.mean()
    assert error.max() < 1.0, error.max()


def test_greedy_generations_agree_with_the_model_dtype_cache_by_the_top5_rule(tiny):
    """The decode path: equal tokens, or at the first difference each side's token is in the other's top 5."""
    prompts = token_prompts([5, 12, 30, 50], seed=1)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    expected, outputs = (LLM(tiny, **ENGINE, kv_cache_dtype=kv).generate(prompts, params, use_tqdm=False)
                         for kv in ("auto", "fp8"))
    assert_top5_rule(outputs, expected)


def test_a_prefix_cache_hit_gives_the_uncached_greedy_tokens(tiny):
    shared = token_prompts([32], seed=2)[0]["prompt_token_ids"]  # 2 full blocks of 16
    first, second = ({"prompt_token_ids": shared + tail} for tail in ([7, 8, 9], [100, 101]))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cached_llm = LLM(tiny, **ENGINE, kv_cache_dtype="fp8")
    cached_llm.generate([first], params, use_tqdm=False)
    [cached] = cached_llm.generate([second], params, use_tqdm=False)
    [uncached] = LLM(tiny, **ENGINE, kv_cache_dtype="fp8", enable_prefix_caching=False).generate(
        [second], params, use_tqdm=False)
    assert cached.num_cached_tokens == 32 and uncached.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids


def test_preempted_requests_give_the_tokens_of_an_unconstrained_run(tiny):
    prompts = token_prompts([20, 25, 30, 35, 40], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    small = LLM(tiny, **ENGINE, kv_cache_dtype="fp8", block_size=16, num_kv_blocks=8, enable_prefix_caching=False)
    preempted = []
    scheduler = small.engine.scheduler
    preempt = scheduler._preempt
    scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    constrained = small.generate(prompts, params, use_tqdm=False)
    assert preempted
    unconstrained = LLM(tiny, **ENGINE, kv_cache_dtype="fp8", enable_prefix_caching=False).generate(
        prompts, params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in constrained] == [out.outputs[0].token_ids for out in unconstrained]


def with_tensors(folder, target, tensors: dict):
    """A copy of the model folder whose checkpoint also holds tensors."""
    target.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            (target / name).write_text((folder / name).read_text())
    save_file({**load_file(folder / "model.safetensors"), **tensors}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    return target


def test_a_checkpoints_kv_scales_set_what_the_cache_stores(tmp_path):
    """llm-compressor's self_attn.k_scale, ModelOpt's v_proj.v_scale and Quark's k_proj.output_scale: each divides
    what its layer stores, and multiplies what the attention reads."""
    plain = tmp_path / "plain"
    make_tiny_model(plain, "qwen3-tied")
    scaled = with_tensors(plain, tmp_path / "scaled", {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([3.0]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(0.25, dtype=torch.bfloat16)})
    mc = ModelConfig.from_pretrained(scaled)
    assert load_kv_scales(scaled, mc).tolist() == [[0.5, 3.0], [0.25, 1.0]]
    assert load_kv_scales(plain, mc).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    prompt = np.random.default_rng(0).integers(0, 256, 21).tolist()
    batch = forward_batch([(list(range(6)), 0, prompt)])
    runners = {name: TorchRunner(ModelConfig.from_pretrained(folder), block_size=BLOCK, num_kv_blocks=8,
                                 max_model_len=64, kv_cache_dtype=kv)
               for name, folder, kv in (("auto", plain, "auto"), ("plain", plain, "fp8"), ("scaled", scaled, "fp8"))}
    logprobs = {name: torch.log_softmax(runner.run(batch)[0], -1) for name, runner in runners.items()}
    caches = {name: (runner.k_caches, runner.v_caches) for name, runner in runners.items()}
    for kv, scale in ((0, 0.5), (1, 3.0)):  # layer 0 sees the same input in every runner
        expected = (caches["auto"][kv][0] / scale).clamp(-448, 448).to(E4M3)
        assert torch.equal(caches["scaled"][kv][0].view(torch.uint8), expected.view(torch.uint8)), kv
    # Layer 1's input went through layer 0's rounding: its stored keys are about 1 / 0.25 times the unscaled ones.
    for kv, scale in ((0, 0.25), (1, 1.0)):
        ratio = caches["scaled"][kv][1].float().abs().mean() / caches["plain"][kv][1].float().abs().mean()
        assert abs(ratio * scale - 1) < 0.05, (kv, ratio)
    # Read back times its scale, the scaled cache gives the next token's logprobs of the exact one as closely as the
    # unscaled one does (a read that dropped the scales would move them by several times more).
    for name in ("plain", "scaled"):
        assert (logprobs[name] - logprobs["auto"]).abs().mean() < 0.2, name


def test_missing_scales_are_one_with_a_warning_that_counts_them(tmp_path, caplog):
    plain = tmp_path / "plain"
    make_tiny_model(plain, "qwen3-tied")
    partial = with_tensors(plain, tmp_path / "partial", {"model.layers.0.self_attn.k_scale": torch.tensor(0.5)})
    mc = ModelConfig.from_pretrained(partial)
    with caplog.at_level(logging.WARNING, logger="nanograph"):
        assert load_kv_scales(partial, mc).tolist() == [[0.5, 1.0], [1.0, 1.0]]
    assert any("gives no k_scale / v_scale for 3 of its 4 layers' K and V; those scales are 1.0" in message
               for message in caplog.messages), caplog.messages
    full = with_tensors(plain, tmp_path / "full", {f"model.layers.{layer}.self_attn.{kind}_scale": torch.tensor(2.0)
                                                   for layer in range(2) for kind in "kv"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanograph"):
        assert load_kv_scales(full, mc).tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert not caplog.messages


@pytest.mark.parametrize("tensor, message", [
    (torch.ones(2), r"model.layers.1.self_attn.v_scale in '.*' has 2 values \(shape \[2\]\); nanograph's FP8 KV cache "
                    r"takes one scale per layer for K and one for V \(per-tensor\), not per-head scales"),
    (torch.tensor(0.0), r"model.layers.1.self_attn.v_scale in '.*' is 0.0; a KV cache scale must be a positive "
                        r"finite number"),
    (torch.tensor(float("nan")), r"is nan; a KV cache scale must be a positive finite number"),
])
def test_a_scale_that_is_not_one_positive_number_is_a_value_error_naming_it(tmp_path, tensor, message):
    plain = tmp_path / "plain"
    make_tiny_model(plain, "llama3-untied")
    folder = with_tensors(plain, tmp_path / "bad", {"model.layers.1.self_attn.v_scale": tensor})
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **ENGINE, kv_cache_dtype="fp8")
    LLM(str(folder), **ENGINE)  # the model dtype's cache reads no scale


@pytest.mark.slow
def test_smollm2_with_an_fp8_kv_cache_knows_the_capital_of_france():
    llm = LLM(device="cpu", kv_cache_dtype="fp8", max_model_len=256)
    assert llm.engine.runner.k_caches[0].dtype == E4M3
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
