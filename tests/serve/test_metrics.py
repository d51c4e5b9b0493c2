"""GET /metrics: vLLM's names under nanograph:, exact counts after a known set of requests, the prefix cache's hit
tokens, and running, waiting and KV usage back to 0 after client aborts."""
import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .server_process import MAX_MODEL_LEN

MODEL_NAME = "SmolLM2-135M-Instruct"
PROMPTS = [f"Request number {i} asks for a short story about" for i in range(10)]


def scrape(server) -> dict:
    """{(sample name, finished_reason or None): value}, every sample labelled with the model's name."""
    response = httpx.get(server.base_url + "/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_created") or "le" in sample.labels:
                continue
            assert sample.labels["model_name"] == MODEL_NAME, sample
            samples[sample.name, sample.labels.get("finished_reason")] = sample.value
    return samples


def grew(before: dict, after: dict, name: str, reason: str | None = None) -> float:
    return after.get((f"nanograph:{name}", reason), 0) - before.get((f"nanograph:{name}", reason), 0)


def wait_idle(server, seconds: float = 5) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        samples = scrape(server)
        if all(samples[f"nanograph:{gauge}", None] == 0 for gauge in
               ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")):
            return samples
        assert time.monotonic() < deadline, f"the engine is not idle: {samples}"
        time.sleep(0.05)


def test_the_names_are_vllms(server):
    names = {name for name, _ in scrape(server)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_sum",
                 "e2e_request_latency_seconds_count", "request_decode_time_seconds_count", "request_prompt_tokens_sum",
                 "request_generation_tokens_sum", "request_params_n_count", "request_params_max_tokens_sum",
                 "request_max_num_generation_tokens_sum", "request_queue_time_seconds_count",
                 "request_prefill_time_seconds_sum", "request_inference_time_seconds_count",
                 "iteration_tokens_total_count", "cache_config_info"):
        assert f"nanograph:{name}" in names
    # Every finish reason has its series from the start, as vLLM's.
    reasons = {reason for name, reason in scrape(server) if name == "nanograph:request_success_total"}
    assert reasons >= {"stop", "length", "abort", "error"}


def test_counts_are_exact_after_ten_requests_of_ten_tokens(server, client, model, tokenizer):
    before = wait_idle(server)

    async def send_all():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 10, "ignore_eos": True, "temperature": 0})
                for prompt in PROMPTS))

    responses = asyncio.run(send_all())
    assert all(response.json()["usage"]["completion_tokens"] == 10 for response in responses)
    after = wait_idle(server)
    prompt_tokens = sum(len(tokenizer.encode(prompt)) for prompt in PROMPTS)
    assert grew(before, after, "time_to_first_token_seconds_count") == 10
    assert grew(before, after, "e2e_request_latency_seconds_count") == 10
    assert grew(before, after, "inter_token_latency_seconds_count") == 90  # one per step after the first token
    assert grew(before, after, "generation_tokens_total") == 100
    assert grew(before, after, "prompt_tokens_total") == prompt_tokens
    assert grew(before, after, "request_success_total", "length") == 10
    assert grew(before, after, "prefix_cache_queries_total") == prompt_tokens
    assert grew(before, after, "num_preemptions_total") == 0
    assert 0 < grew(before, after, "time_to_first_token_seconds_sum") < 10 * grew(
        before, after, "e2e_request_latency_seconds_sum")
    # vLLM's per-request histograms: one observation per request, at its end.
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_params_max_tokens", "request_decode_time_seconds", "request_max_num_generation_tokens",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_inference_time_seconds"):
        assert grew(before, after, f"{name}_count") == 10, name
    assert grew(before, after, "request_max_num_generation_tokens_sum") == 100
    # Every step that gave these requests tokens: the prompts it finished and the tokens it generated.
    assert grew(before, after, "iteration_tokens_total_sum") == prompt_tokens + 100
    assert 10 <= grew(before, after, "iteration_tokens_total_count") <= 100
    # Queued, then prefilling: together the time to the first token (the same arrival and first token; the
    # engine's clock read for the scheduling), and prefill then decode make up inference.
    queue, prefill = (grew(before, after, f"request_{name}_time_seconds_sum") for name in ("queue", "prefill"))
    assert queue > 0 and prefill > 0
    assert abs(queue + prefill - grew(before, after, "time_to_first_token_seconds_sum")) < 0.01
    assert abs(grew(before, after, "request_inference_time_seconds_sum") - prefill -
               grew(before, after, "request_decode_time_seconds_sum")) < 0.01
    assert grew(before, after, "request_prompt_tokens_sum") == prompt_tokens
    assert grew(before, after, "request_generation_tokens_sum") == 100
    assert grew(before, after, "request_params_n_sum") == 10
    assert grew(before, after, "request_params_max_tokens_sum") == 100
    # Decode time runs from the first token to the last: the end-to-end latency less the time to the first token.
    decode = grew(before, after, "request_decode_time_seconds_sum")
    assert 0 < decode <= grew(before, after, "e2e_request_latency_seconds_sum") - grew(
        before, after, "time_to_first_token_seconds_sum") + 1e-6


def test_request_histograms_count_n_completions_as_one_request_and_fill_in_max_tokens(server, client, model):
    """Two completions of one prompt are one request (their tokens summed); a chat without max_tokens may take
    the room its prompt leaves in max_model_len, and that is its max_tokens."""
    before = wait_idle(server)
    client.completions.create(model=model, prompt="Once upon a time", n=2, max_tokens=7, temperature=1,
                              seed=3, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    chat = client.chat.completions.create(model=model, messages=messages,
                                          extra_body={"guided_choice": ["yes", "no"]})
    after = wait_idle(server)
    chat_prompt = chat.usage.prompt_tokens
    assert grew(before, after, "request_params_n_count") == 2
    assert grew(before, after, "request_params_n_sum") == 3
    assert grew(before, after, "request_params_max_tokens_sum") == 7 + (MAX_MODEL_LEN - chat_prompt)
    assert grew(before, after, "request_generation_tokens_sum") == 14 + chat.usage.completion_tokens
    # The longest of a request's completions: 7 of the two (both ran to max_tokens), and the chat's one.
    assert grew(before, after, "request_max_num_generation_tokens_sum") == 7 + chat.usage.completion_tokens


def test_cache_config_info_labels_the_kv_cache(server):
    """vLLM's cache_config_info: 1, with the KV cache's configuration as labels."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    [sample] = [sample for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == "nanograph:cache_config_info"]
    assert sample.value == 1
    labels = dict(sample.labels)
    assert int(labels.pop("num_gpu_blocks")) > 0
    assert labels == {"model_name": MODEL_NAME, "block_size": "16", "cache_dtype": "auto",
                      "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
                      "num_gpu_blocks_override": "None"}


def test_prefix_cache_hits_count_the_cached_tokens(server, client, model, tokenizer):
    shared = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 3
    prompt_ids = tokenizer.encode(shared)
    assert len(prompt_ids) > 40
    before = wait_idle(server)
    for _ in range(2):
        client.completions.create(model=model, prompt=prompt_ids, max_tokens=1)
    after = wait_idle(server)
    assert grew(before, after, "prefix_cache_queries_total") == 2 * len(prompt_ids)
    # The second finds the first's full blocks, but for the one that holds the last prompt token.
    assert grew(before, after, "prefix_cache_hits_total") == 16 * ((len(prompt_ids) - 1) // 16)


WAIT_SECONDS = 30  # the longest the gauges may take to show the running requests


def test_gauges_follow_a_running_request_and_return_to_zero_after_aborts(server, model):
    before = wait_idle(server)
    long = {"model": model, "prompt": "Count with me:", "max_tokens": 400, "ignore_eos": True}

    async def abort_some():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            async def cut_stream():
                async with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            return  # leaving the block closes the connection mid-stream

            streams = [asyncio.ensure_future(cut_stream()) for _ in range(3)]
            waits = [asyncio.ensure_future(http.post("/v1/completions", json=long)) for _ in range(2)]
            deadline = time.monotonic() + WAIT_SECONDS
            while True:
                seen = await asyncio.to_thread(scrape, server)
                if seen["nanograph:num_requests_running", None] > 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            for wait in waits:  # their clients leave: the connections close before the responses
                wait.cancel()
            await asyncio.gather(*streams, *waits, return_exceptions=True)
            return seen

    seen = asyncio.run(abort_some())
    assert seen["nanograph:num_requests_running", None] > 0 and seen["nanograph:kv_cache_usage_perc", None] > 0
    after = wait_idle(server)
    assert grew(before, after, "request_success_total", "abort") == 5
    assert grew(before, after, "generation_tokens_total") < 5 * 400


def test_an_engine_built_again_replaces_its_cache_config_info():
    from prometheus_client import generate_latest

    from nanograph.serve.engine_core import EngineInfo
    from nanograph.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    for blocks in ("100", "200"):
        metrics.record_engine_info(EngineInfo("m", None, 64, {}, 4, 100, "cpu", "", {"num_gpu_blocks": blocks}))
    text = generate_latest(metrics.registry).decode()
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "nanograph:cache_config_info"]
    assert [dict(sample.labels) for sample in samples] == [{"model_name": "m", "num_gpu_blocks": "200"}]


def test_phases_of_a_request_aborted_while_queued_and_of_one_without_tokens():
    """Queued and never scheduled: all of its time is queue time, no prefill or inference. Scheduled and aborted
    before its first token: queue time up to the scheduling, prefill and inference 0."""
    from nanograph.outputs import CompletionDelta
    from nanograph.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    now = time.monotonic()
    metrics.request_added((1, 0), now - 2.0, 5, 1, 10)
    metrics.record_deltas([(1, 0, CompletionDelta("a", 0, "", [], True, "abort"))])
    metrics.request_added((2, 0), now - 3.0, 5, 1, 10)
    scheduled = time.time() - 1.0  # the engine's clock: a second ago
    metrics.record_deltas([(2, 0, CompletionDelta("b", 0, "", [], True, "abort", scheduled_time=scheduled))])

    def value(name, suffix):
        return metrics.registry.get_sample_value(f"nanograph:{name}_{suffix}", {"model_name": "m"})

    assert value("request_queue_time_seconds", "count") == 2
    assert value("request_queue_time_seconds", "sum") == pytest.approx(2.0 + 2.0, abs=0.05)
    assert value("request_prefill_time_seconds", "sum") == 0 and value("request_inference_time_seconds", "sum") == 0
    assert value("request_max_num_generation_tokens", "sum") == 0
    assert value("iteration_tokens_total", "count") == 0  # no step gave tokens
