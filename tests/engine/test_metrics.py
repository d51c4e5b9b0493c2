"""LLM.get_metrics() (vLLM's): the engine's gauges and counters, and each finished request counted once in the
request counters and histograms, aborted ones too."""
import time

from nanograph import LLM, SamplingParams
from nanograph.metrics import Counter, Gauge, Histogram

from .fake_model import fake_engine, reference_completion
from .tiny_models import make_tiny_model


def by_name(metrics) -> dict:
    """The metrics by name and labels (but model_name, which every one carries)."""
    found = {}
    for metric in metrics:
        assert metric.labels["model_name"]
        key = metric.name + "".join(f"{{{k}={v}}}" for k, v in sorted(metric.labels.items()) if k != "model_name")
        assert key not in found, key
        found[key] = metric
    return found


def check_histogram(histogram: Histogram):
    counts = list(histogram.buckets.values())
    assert counts == sorted(counts) and counts[-1] == histogram.count  # cumulative, +Inf last
    assert list(histogram.buckets)[-1] == "+Inf"


def test_finished_and_aborted_requests_are_counted_once():
    engine = fake_engine(max_model_len=64)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=2, seed=1),
              SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)]
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == reference_completion([3, 4, 5], 5)
    aborted = engine.add_request([12, 13], SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.abort_request(aborted)

    metrics = by_name(engine.get_metrics())
    assert all(isinstance(m, (Counter, Gauge, Histogram)) for m in metrics.values())
    assert all(name.startswith("nanograph:") for name in metrics)
    assert metrics["nanograph:num_requests_running"].value == metrics["nanograph:num_requests_waiting"].value == 0
    assert metrics["nanograph:kv_cache_usage_perc"].value == 0
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert generated == 5 + 3 * 2 + 4
    # The aborted request never got a token (its first was on its way, and is dropped): its prompt counts nowhere.
    assert metrics["nanograph:prompt_tokens"].value == 3 + 2 + 4
    assert metrics["nanograph:generation_tokens"].value == generated
    assert metrics["nanograph:request_success{finished_reason=length}"].value == 4  # completions, n=2 counts 2
    assert metrics["nanograph:request_success{finished_reason=abort}"].value == 1
    assert metrics["nanograph:request_success{finished_reason=stop}"].value == 0
    assert metrics["nanograph:request_success{finished_reason=error}"].value == 0
    assert metrics["nanograph:prefix_cache_queries"].value >= metrics["nanograph:prefix_cache_hits"].value >= 0

    histograms = {name: m for name, m in metrics.items() if isinstance(m, Histogram)}
    for histogram in histograms.values():
        check_histogram(histogram)
    assert histograms["nanograph:e2e_request_latency_seconds"].count == 4
    assert histograms["nanograph:request_queue_time_seconds"].count == 4
    assert histograms["nanograph:time_to_first_token_seconds"].count == 3  # not the aborted one's
    assert histograms["nanograph:request_prompt_tokens"].sum == 11
    assert histograms["nanograph:request_generation_tokens"].sum == generated
    assert histograms["nanograph:request_max_num_generation_tokens"].sum == 5 + 3 + 4
    assert histograms["nanograph:request_params_n"].sum == 1 + 2 + 1 + 1
    assert histograms["nanograph:request_params_max_tokens"].sum == 5 + 3 + 4 + 50
    assert histograms["nanograph:request_params_n"].buckets == {"1.0": 3, "2.0": 4, "5.0": 4, "10.0": 4,
                                                                "20.0": 4, "+Inf": 4}
    assert list(histograms["nanograph:request_prompt_tokens"].buckets)[-2:] == ["1e+06", "+Inf"]


def test_an_abort_ends_no_phase_it_never_reached():
    """Decode and inference end at a request's last token, not at its abort; a request aborted before its first
    token has no prefill, decode or inference time (all 0)."""
    engine = fake_engine(max_model_len=64)
    never = engine.add_request([3, 4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # its prefill; its first token is on its way
    engine.abort_request(never)
    decoding = engine.add_request([5, 6], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    time.sleep(0.3)  # idle after its last token
    engine.abort_request(decoding)
    histograms = by_name(engine.get_metrics())
    assert histograms["nanograph:e2e_request_latency_seconds"].sum >= 0.3
    assert histograms["nanograph:request_decode_time_seconds"].sum < 0.25
    assert histograms["nanograph:request_inference_time_seconds"].sum < 0.25
    assert histograms["nanograph:request_prefill_time_seconds"].count == 2
    assert histograms["nanograph:time_to_first_token_seconds"].count == 1


def test_the_gauges_see_requests_in_flight():
    engine = fake_engine(max_model_len=64, num_kv_blocks=64, block_size=4)
    engine.add_request([3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    metrics = by_name(engine.get_metrics())
    assert metrics["nanograph:num_requests_running"].value == 2
    assert metrics["nanograph:num_requests_waiting"].value == 0
    assert 0 < metrics["nanograph:kv_cache_usage_perc"].value <= 4 / 64  # 2 + 1 blocks, or one more
    assert metrics["nanograph:request_success{finished_reason=length}"].value == 0
    # The token counters move as tokens come, not when requests finish.
    engine.step()
    metrics = by_name(engine.get_metrics())
    assert metrics["nanograph:prompt_tokens"].value == 5 + 2
    assert metrics["nanograph:generation_tokens"].value == engine.stats.generated_tokens >= 2


def test_llm_get_metrics(tmp_path):
    make_tiny_model(tmp_path / "model", "qwen3-tied")
    llm = LLM(str(tmp_path / "model"), device="cpu", max_model_len=64, skip_tokenizer_init=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 2, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    metrics = by_name(llm.get_metrics())
    assert metrics["nanograph:generation_tokens"].value == 6
    assert metrics["nanograph:prompt_tokens"].value == 8
    assert metrics["nanograph:time_to_first_token_seconds"].count == 2
    assert metrics["nanograph:prompt_tokens"].labels["model_name"] == str(tmp_path / "model")


def test_a_pooling_request_is_counted_with_no_tokens_to_generate(tmp_path):
    make_tiny_model(tmp_path / "model", "qwen3-tied")
    llm = LLM(str(tmp_path / "model"), device="cpu", max_model_len=64, skip_tokenizer_init=True, runner="pooling")
    llm.embed([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], use_tqdm=False)
    metrics = by_name(llm.get_metrics())
    assert metrics["nanograph:request_params_max_tokens"].sum == 0
    assert metrics["nanograph:request_generation_tokens"].sum == 0
    assert metrics["nanograph:prompt_tokens"].value == 5
    assert metrics["nanograph:request_success{finished_reason=stop}"].value == 2


def test_the_per_step_histograms_and_the_cache_config():
    """inter_token_latency_seconds: each step that gives a request tokens after its first; iteration_tokens_total: each
    step that gives tokens, its finished prompts' tokens and its generated ones (as the server counts them)."""
    engine = fake_engine(max_model_len=64, num_kv_blocks=32, block_size=4)
    engine.generate([[3, 4, 5]], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)], use_tqdm=False)
    metrics = by_name(engine.get_metrics())
    assert metrics["nanograph:inter_token_latency_seconds"].count == 5
    check_histogram(metrics["nanograph:inter_token_latency_seconds"])
    steps = metrics["nanograph:iteration_tokens_total"]
    assert (steps.count, steps.sum) == (6, 3 + 6)  # the prefill's step (3 + 1 tokens), then 5 of one token
    assert steps.buckets["1.0"] == 5 and steps.buckets["8.0"] == 6
    [info] = [m for m in metrics.values() if m.name == "nanograph:cache_config_info"]
    assert info.value == 1
    assert {k: info.labels[k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype")} == \
        {"block_size": "4", "num_gpu_blocks": "32", "enable_prefix_caching": "True", "cache_dtype": "auto"}
