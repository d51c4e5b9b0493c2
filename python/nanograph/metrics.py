"""LLM.get_metrics(): the engine's metrics as vLLM's metrics reader returns them (Counter, Gauge and Histogram
values), under the names of the server's /metrics ("nanograph:" for vLLM's "vllm:").

The gauges, the scheduler's and prefix cache's counters and the generated tokens are read when asked; prompt tokens
count at a request's first token; request_success (per completion) and the histograms count each request once, when
it finishes (aborted ones too), from its RequestMetrics' times: queued from arrival to first scheduling, prefill to its
first token, decode to its last, inference the two together. inter_token_latency_seconds counts each step that gives
a request tokens after its first (one observation for its n completions, as the server's), iteration_tokens_total
each step that gives tokens (the prompts it finished and the tokens it generated). Each metric is labelled with
model_name; cache_config_info (1) with the KV cache's configuration too. The bucket bounds are the server's
(serve/metrics.py takes them from here)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .sampling_params import SamplingParams

PREFIX = "nanograph:"
# Seconds, in a 1-2.5-5 series over the range each latency spans, from a fast GPU to a loaded CPU.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # request_success's finished_reason values
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
# Tokens per request (prompt, generated, max_tokens): a 1-2-5 series up to a million, past any model's context.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5)) + (1e6,)
N_BUCKETS = (1, 2, 5, 10, 20)  # request_params_n, as vLLM's
# Tokens an engine step computed for the requests it gave tokens to: powers of two, as vLLM's without CUDA graphs.
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound (Prometheus' "le", "+Inf" last) -> observations at or below it


class _Histogram:
    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float):
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def metric(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets, total = {}, 0
        for bound, count in zip([*map(_bound_label, self.bounds), "+Inf"], self.counts):
            total += count
            buckets[bound] = total
        return Histogram(name, dict(labels), total, self.sum, buckets)


def _bound_label(bound: float) -> str:
    """A bucket's upper bound as Prometheus' text format writes its "le" label: 0.25, 1.0, 1e+06."""
    bound = float(bound)
    return "%g" % bound if bound >= 1e6 else repr(bound)


def cache_config_labels(config, runner) -> dict[str, str]:
    """vLLM's cache_config_info labels that apply here (config: the engine's Config, runner: its Runner)."""
    labels = {"block_size": runner.block_size, "cache_dtype": config.kv_cache_dtype,
              "enable_prefix_caching": config.enable_prefix_caching,
              "gpu_memory_utilization": config.gpu_memory_utilization, "num_gpu_blocks": runner.num_kv_blocks,
              "num_gpu_blocks_override": config.num_kv_blocks}
    return {name: str(value) for name, value in labels.items()}


# The per-request histograms: name -> bucket bounds.
_REQUEST_HISTOGRAMS = {
    "time_to_first_token_seconds": TTFT_BUCKETS, "e2e_request_latency_seconds": E2E_BUCKETS,
    "request_queue_time_seconds": E2E_BUCKETS, "request_prefill_time_seconds": E2E_BUCKETS,
    "request_decode_time_seconds": E2E_BUCKETS, "request_inference_time_seconds": E2E_BUCKETS,
    "request_prompt_tokens": TOKEN_BUCKETS, "request_generation_tokens": TOKEN_BUCKETS,
    "request_max_num_generation_tokens": TOKEN_BUCKETS, "request_params_n": N_BUCKETS,
    "request_params_max_tokens": TOKEN_BUCKETS,
}
# The per-step ones.
_STEP_HISTOGRAMS = {"inter_token_latency_seconds": ITL_BUCKETS, "iteration_tokens_total": ITERATION_BUCKETS}


class EngineMetrics:
    """What LLMEngine counts of its requests (record_first_token, record_finished), and the snapshot get_metrics()
    returns. model_name: the model's label on every metric, as the server's."""

    def __init__(self, model_name: str | None, cache_config: dict[str, str] | None = None):
        self.labels = {"model_name": str(model_name)}
        self.cache_config = cache_config or {}
        self.prompt_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.histograms = {name: _Histogram(bounds)
                           for name, bounds in {**_REQUEST_HISTOGRAMS, **_STEP_HISTOGRAMS}.items()}

    def record_next_tokens(self, seconds: float):
        """A request's tokens after its first, seconds after its last ones (one observation per step)."""
        self.histograms["inter_token_latency_seconds"].observe(seconds)

    def record_step(self, tokens: int):
        """A step that gave tokens: the prompt tokens of the requests whose first token it gave, and the tokens it
        generated."""
        if tokens:
            self.histograms["iteration_tokens_total"].observe(tokens)

    def record_first_token(self, request):
        """A request's first tokens: its prompt is prefilled (counted once, as the server counts it)."""
        self.prompt_tokens += request.seqs[0].num_prompt_tokens

    def record_finished(self, request, max_model_len: int):
        """A request that has just finished (engine.request.Request, its metrics' finished_time set), as the server
        records one: phases it never reached count 0 (aborted while queued: its whole life is queue time), decode
        and inference end at its last token, and a completion that a failure ended counts as "error"."""
        first, times = request.seqs[0], request.metrics
        generated = [len(seq.completion_token_ids) for seq in request.seqs]
        for seq in request.seqs:
            failed = request.error is not None and seq.finish_reason == "abort"
            self.request_success["error" if failed else seq.finish_reason] += 1
        end = times.finished_time
        scheduled = first.first_scheduled_time if first.first_scheduled_time is not None else end
        first_token, last_token = times.first_token_time, times.last_token_time
        if first.pooling is not None or not isinstance(first.params, SamplingParams):
            max_tokens = 0  # a pooling request generates nothing
        else:
            max_tokens = first.params.max_tokens if first.params.max_tokens is not None \
                else max(max_model_len - first.num_prompt_tokens, 1)
        observed = {
            "e2e_request_latency_seconds": max(end - times.arrival_time, 0.0),
            "request_queue_time_seconds": max(scheduled - times.arrival_time, 0.0),
            "request_prefill_time_seconds": 0.0 if first_token is None else max(first_token - scheduled, 0.0),
            "request_decode_time_seconds": 0.0 if first_token is None else last_token - first_token,
            "request_inference_time_seconds": 0.0 if first_token is None else max(last_token - scheduled, 0.0),
            "request_prompt_tokens": first.num_prompt_tokens,
            "request_generation_tokens": sum(generated),
            "request_max_num_generation_tokens": max(generated),
            "request_params_n": len(request.seqs),
            "request_params_max_tokens": max_tokens,
        }
        if first_token is not None:  # no time to a first token it never got
            observed["time_to_first_token_seconds"] = max(first_token - times.arrival_time, 0.0)
        for name, value in observed.items():
            self.histograms[name].observe(value)

    def snapshot(self, engine) -> list[Metric]:
        """The metrics now (engine: the LLMEngine, for its scheduler's and KV cache's state and its token count)."""
        scheduler = engine.scheduler
        blocks = scheduler.block_manager
        total = len(blocks.blocks)
        labels = self.labels
        metrics = [
            Gauge(PREFIX + "num_requests_running", labels, scheduler.num_running),
            Gauge(PREFIX + "num_requests_waiting", labels, scheduler.num_waiting),
            Gauge(PREFIX + "kv_cache_usage_perc", labels, (total - blocks.num_free_blocks) / total if total else 0.0),
            Counter(PREFIX + "num_preemptions", labels, scheduler.num_preemptions),
            Counter(PREFIX + "prefix_cache_queries", labels, blocks.num_prefix_queried_tokens),
            Counter(PREFIX + "prefix_cache_hits", labels, blocks.num_prefix_hit_tokens),
            Counter(PREFIX + "prompt_tokens", labels, self.prompt_tokens),
            Counter(PREFIX + "generation_tokens", labels, engine.stats.generated_tokens),
        ]
        metrics += [Counter(PREFIX + "request_success", {**labels, "finished_reason": reason}, count)
                    for reason, count in self.request_success.items()]
        metrics += [histogram.metric(PREFIX + name, labels) for name, histogram in self.histograms.items()]
        metrics.append(Gauge(PREFIX + "cache_config_info", {**labels, **self.cache_config}, 1.0))
        return metrics
