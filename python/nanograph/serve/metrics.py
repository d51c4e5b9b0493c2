"""The server's Prometheus metrics: vLLM's names under the "nanograph:" prefix, each labelled with model_name.

AsyncLLM's reader thread records everything: the gauges and the engine's counters from the state the engine
process reports after each step, the latencies and token counts from the deltas it hands out, cache_config_info
from what the engine reports once built. Latencies are per request (each prompt of an API request, its n
completions together); finish reasons are per completion, as each has its own.

A request's phases, as vLLM's: queued from its arrival at the server to the step that first scheduled it (the
engine's clock, on its deltas), then prefill to its first token, decode to its last; inference is prefill and
decode. Phases a request never reached record 0 (a request aborted while queued: its whole life as queue time)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..metrics import (E2E_BUCKETS, FINISH_REASONS, ITERATION_BUCKETS, ITL_BUCKETS, N_BUCKETS, PREFIX, TOKEN_BUCKETS,
                       TTFT_BUCKETS)
from ..outputs import CompletionDelta
from .engine_core import EngineInfo, EngineSnapshot


@dataclass
class _RequestTimes:
    arrival: float
    num_prompt_tokens: int
    n: int
    max_tokens: int
    num_open_completions: int
    first_token: float | None = None  # when the request got its first tokens; None until then
    last_token: float | None = None  # when it last got tokens
    scheduled: float | None = None  # when the engine first scheduled it; None until a delta says
    num_generated: int = 0  # over its completions
    completion_tokens: dict[int, int] | None = None  # generated tokens by completion index


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def labelled(kind, name, documentation, **kwargs):
            metric = kind(PREFIX + name, documentation, ["model_name"], registry=self.registry, **kwargs)
            return metric.labels(model_name=model_name)

        self.num_requests_running = labelled(Gauge, "num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = labelled(Gauge, "num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage_perc = labelled(Gauge, "kv_cache_usage_perc", "KV cache usage: 1 is every block in use.")
        self.prefix_cache_queries = labelled(Counter, "prefix_cache_queries",
                                             "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = labelled(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = labelled(Counter, "num_preemptions",
                                        "Sequences preempted (their KV blocks taken back).")
        self.prompt_tokens = labelled(Counter, "prompt_tokens", "Prompt tokens prefilled, once per request.")
        self.generation_tokens = labelled(Counter, "generation_tokens", "Tokens generated.")
        self.request_success = Counter(PREFIX + "request_success", "Completions finished, by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # at 0 from the start, as vLLM's, so that a rate() has a series to read
            self.request_success.labels(model_name=model_name, finished_reason=reason)
        self.time_to_first_token = labelled(Histogram, "time_to_first_token_seconds",
                                            "Seconds from a request's arrival to its first token.",
                                            buckets=TTFT_BUCKETS)
        self.inter_token_latency = labelled(Histogram, "inter_token_latency_seconds",
                                            "Seconds between the steps that give a request new tokens.",
                                            buckets=ITL_BUCKETS)
        self.e2e_request_latency = labelled(Histogram, "e2e_request_latency_seconds",
                                            "Seconds from a request's arrival to its last completion's end.",
                                            buckets=E2E_BUCKETS)
        self.request_decode_time = labelled(Histogram, "request_decode_time_seconds",
                                            "Seconds from a request's first token to its last.",
                                            buckets=E2E_BUCKETS)
        self.request_prompt_tokens = labelled(Histogram, "request_prompt_tokens", "Prompt tokens of each request.",
                                              buckets=TOKEN_BUCKETS)
        self.request_generation_tokens = labelled(Histogram, "request_generation_tokens",
                                                  "Tokens generated for each request, over its n completions.",
                                                  buckets=TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = labelled(
            Histogram, "request_max_num_generation_tokens",
            "The most tokens any one of a request's n completions generated.", buckets=TOKEN_BUCKETS)
        self.request_queue_time = labelled(Histogram, "request_queue_time_seconds",
                                           "Seconds from a request's arrival to the step that first scheduled it.",
                                           buckets=E2E_BUCKETS)
        self.request_prefill_time = labelled(Histogram, "request_prefill_time_seconds",
                                             "Seconds from a request's first scheduling to its first token.",
                                             buckets=E2E_BUCKETS)
        self.request_inference_time = labelled(Histogram, "request_inference_time_seconds",
                                               "Seconds from a request's first scheduling to its last token.",
                                               buckets=E2E_BUCKETS)
        self.iteration_tokens = labelled(Histogram, "iteration_tokens_total",
                                         "Tokens of each engine step that gave tokens: the prompts it finished "
                                         "prefilling and the tokens it generated.", buckets=ITERATION_BUCKETS)
        self.cache_config_info = None  # a Gauge labelled with the engine's cache config, once it is known
        self.request_params_n = labelled(Histogram, "request_params_n", "Each request's n.", buckets=N_BUCKETS)
        self.request_params_max_tokens = labelled(Histogram, "request_params_max_tokens",
                                                  "Each request's max_tokens (when not given: the room its prompt "
                                                  "leaves in max_model_len).", buckets=TOKEN_BUCKETS)
        self.total_prompt_tokens = 0  # the counters' values, for the periodic log line
        self.total_generation_tokens = 0
        self._requests: dict[tuple[int, int], _RequestTimes] = {}
        self._preemptions = self._prefix_queries = self._prefix_hits = 0  # the engine's counts last seen

    def record_engine_info(self, info: EngineInfo):
        """vLLM's cache_config_info: 1, labelled with the KV cache's configuration."""
        labels = {"model_name": self.model_name, **info.cache_config}
        if self.cache_config_info is not None:  # an engine built again: its config replaces the last one's
            self.registry.unregister(self.cache_config_info)
        self.cache_config_info = Gauge(PREFIX + "cache_config_info", "Information of the engine's cache config.",
                                       list(labels), registry=self.registry)
        self.cache_config_info.labels(**labels).set(1)

    def request_added(self, request: tuple[int, int], arrival: float, num_prompt_tokens: int, n: int,
                      max_tokens: int):
        """request: its stream and its prompt's index there; arrival: time.monotonic() when the server took it; n:
        its completions; max_tokens: the most each may generate."""
        self._requests[request] = _RequestTimes(arrival, num_prompt_tokens, n, max_tokens, n)

    def record_deltas(self, deltas: list[tuple[int, int, CompletionDelta]]):
        """One step's deltas: token counts, the first token's and the step-to-step latency (once per request per
        step), and, for each completion that ended, its finish reason (and the request's latency when it was the
        last)."""
        now = time.monotonic()
        wall_to_monotonic = now - time.time()  # the engine's times are time.time()'s
        stepped = set()
        generated, prompted = self.total_generation_tokens, self.total_prompt_tokens
        for stream_id, prompt_index, delta in deltas:
            request = (stream_id, prompt_index)
            times = self._requests.get(request)
            if times is None:
                continue
            if times.scheduled is None and delta.scheduled_time is not None:
                times.scheduled = min(delta.scheduled_time + wall_to_monotonic, now)
            # New tokens, or a pooling request's vector (its prompt computed: what its first token would be).
            if delta.token_ids or delta.pooled is not None:
                self.total_generation_tokens += len(delta.token_ids)
                times.num_generated += len(delta.token_ids)
                if times.completion_tokens is None:
                    times.completion_tokens = {}
                times.completion_tokens[delta.index] = times.completion_tokens.get(delta.index, 0) + \
                    len(delta.token_ids)
                if request not in stepped:
                    stepped.add(request)
                    if times.last_token is None:
                        times.first_token = now
                        self.time_to_first_token.observe(now - times.arrival)
                        self.prompt_tokens.inc(times.num_prompt_tokens)
                        self.total_prompt_tokens += times.num_prompt_tokens
                    else:
                        self.inter_token_latency.observe(now - times.last_token)
                    times.last_token = now
            if delta.finished:
                reason = "error" if delta.error is not None else delta.finish_reason
                self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
                times.num_open_completions -= 1
                if not times.num_open_completions:
                    self._request_finished(times, now)
                    del self._requests[request]
        self.generation_tokens.inc(self.total_generation_tokens - generated)
        step_tokens = self.total_generation_tokens - generated + self.total_prompt_tokens - prompted
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)

    def _request_finished(self, times: _RequestTimes, now: float):
        self.e2e_request_latency.observe(now - times.arrival)
        # vLLM's: first token to last (not to an abort's or an error's end, which brings none); 0 without tokens.
        decode = times.last_token - times.first_token if times.first_token is not None else 0.0
        self.request_decode_time.observe(decode)
        scheduled = times.scheduled if times.scheduled is not None else now
        self.request_queue_time.observe(max(0.0, scheduled - times.arrival))
        got_tokens = times.first_token is not None and times.scheduled is not None
        self.request_prefill_time.observe(max(0.0, times.first_token - scheduled) if got_tokens else 0.0)
        self.request_inference_time.observe(max(0.0, times.last_token - scheduled) if got_tokens else 0.0)
        self.request_max_num_generation_tokens.observe(max(times.completion_tokens.values())
                                                       if times.completion_tokens else 0)
        self.request_prompt_tokens.observe(times.num_prompt_tokens)
        self.request_generation_tokens.observe(times.num_generated)
        self.request_params_n.observe(times.n)
        self.request_params_max_tokens.observe(times.max_tokens)

    def record_engine(self, snapshot: EngineSnapshot):
        """The scheduler's and the KV cache's state, and the engine counters' growth since the last call."""
        self.num_requests_running.set(snapshot.num_running)
        self.num_requests_waiting.set(snapshot.num_waiting)
        self.kv_cache_usage_perc.set(1 - snapshot.num_free_blocks / snapshot.num_blocks)
        self.num_preemptions.inc(snapshot.num_preemptions - self._preemptions)
        self.prefix_cache_queries.inc(snapshot.prefix_queried_tokens - self._prefix_queries)
        self.prefix_cache_hits.inc(snapshot.prefix_hit_tokens - self._prefix_hits)
        self._preemptions = snapshot.num_preemptions
        self._prefix_queries, self._prefix_hits = snapshot.prefix_queried_tokens, snapshot.prefix_hit_tokens
