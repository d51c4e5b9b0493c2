"""LLM.get_metrics(): the engine's metrics as vLLM's metrics reader returns them (Counter, Gauge and Histogram
values), under the names of the server's /metrics ("nanograph:" for vLLM's "vllm:").

The gauges and the scheduler's and prefix cache's counters are read when asked; the request counters and histograms
count each request once, when it finishes (aborted ones too), from its RequestMetrics' times: queued from arrival to
first scheduling, prefill to its first token, decode to its last, inference the two together. The server's
inter_token_latency_seconds and iteration_tokens_total are per step, and only the server has them. The bucket bounds
are the server's (serve/metrics.py takes them from here)."""
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

    def metric(self, name: str) -> Histogram:
        buckets, total = {}, 0
        for bound, count in zip([*map(str, map(float, self.bounds)), "+Inf"], self.counts):
            total += count
            buckets[bound] = total
        return Histogram(PREFIX + name, {}, total, self.sum, buckets)


# The per-request histograms: name -> bucket bounds.
_REQUEST_HISTOGRAMS = {
    "time_to_first_token_seconds": TTFT_BUCKETS, "e2e_request_latency_seconds": E2E_BUCKETS,
    "request_queue_time_seconds": E2E_BUCKETS, "request_prefill_time_seconds": E2E_BUCKETS,
    "request_decode_time_seconds": E2E_BUCKETS, "request_inference_time_seconds": E2E_BUCKETS,
    "request_prompt_tokens": TOKEN_BUCKETS, "request_generation_tokens": TOKEN_BUCKETS,
    "request_max_num_generation_tokens": TOKEN_BUCKETS, "request_params_n": N_BUCKETS,
    "request_params_max_tokens": TOKEN_BUCKETS,
}


class EngineMetrics:
    """What LLMEngine counts of its finished requests (record_finished), and the snapshot get_metrics() returns."""

    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.histograms = {name: _Histogram(bounds) for name, bounds in _REQUEST_HISTOGRAMS.items()}

    def record_finished(self, request, max_model_len: int):
        """A request that has just finished (engine.request.Request, its metrics' finished_time set). A request
        aborted before it was scheduled counts its whole life as queue time; phases it never reached count 0."""
        first, times = request.seqs[0], request.metrics
        generated = [len(seq.completion_token_ids) for seq in request.seqs]
        self.prompt_tokens += first.num_prompt_tokens
        self.generation_tokens += sum(generated)
        for seq in request.seqs:
            reason = "error" if request.error is not None else seq.finish_reason
            self.request_success[reason if reason in self.request_success else "stop"] += 1
        end = times.finished_time
        scheduled = first.first_scheduled_time if first.first_scheduled_time is not None else end
        first_token = times.first_token_time if times.first_token_time is not None else end
        params = first.params
        max_tokens = 0 if not isinstance(params, SamplingParams) else params.max_tokens  # a pooling request: 0
        observed = {
            "time_to_first_token_seconds": first_token - times.arrival_time,
            "e2e_request_latency_seconds": end - times.arrival_time,
            "request_queue_time_seconds": scheduled - times.arrival_time,
            "request_prefill_time_seconds": max(first_token - scheduled, 0.0),
            "request_decode_time_seconds": end - first_token,
            "request_inference_time_seconds": max(end - scheduled, 0.0),
            "request_prompt_tokens": first.num_prompt_tokens,
            "request_generation_tokens": sum(generated),
            "request_max_num_generation_tokens": max(generated),
            "request_params_n": len(request.seqs),
            "request_params_max_tokens": max_tokens if max_tokens is not None
            else max(max_model_len - first.num_prompt_tokens, 1),
        }
        if times.first_token_time is None:  # it never got a token: no time to one
            del observed["time_to_first_token_seconds"]
        for name, value in observed.items():
            self.histograms[name].observe(value)

    def snapshot(self, engine) -> list[Metric]:
        """The metrics now (engine: the LLMEngine, for its scheduler's and KV cache's state)."""
        scheduler = engine.scheduler
        blocks = scheduler.block_manager
        total = len(blocks.blocks)
        metrics = [
            Gauge(PREFIX + "num_requests_running", {}, scheduler.num_running),
            Gauge(PREFIX + "num_requests_waiting", {}, scheduler.num_waiting),
            Gauge(PREFIX + "kv_cache_usage_perc", {}, (total - blocks.num_free_blocks) / total if total else 0.0),
            Counter(PREFIX + "num_preemptions", {}, scheduler.num_preemptions),
            Counter(PREFIX + "prefix_cache_queries", {}, blocks.num_prefix_queried_tokens),
            Counter(PREFIX + "prefix_cache_hits", {}, blocks.num_prefix_hit_tokens),
            Counter(PREFIX + "prompt_tokens", {}, self.prompt_tokens),
            Counter(PREFIX + "generation_tokens", {}, self.generation_tokens),
        ]
        metrics += [Counter(PREFIX + "request_success", {"finished_reason": reason}, count)
                    for reason, count in self.request_success.items()]
        metrics += [histogram.metric(name) for name, histogram in self.histograms.items()]
        return metrics
