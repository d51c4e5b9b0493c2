"""AsyncLLMEngine: vLLM's asynchronous engine interface, for serving from one's own asyncio code. The engine runs in a
process of its own (the server's AsyncLLM), so that its steps and the caller's event loop never wait on each other's
Python work; generate() is an async generator of RequestOutputs.

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model="Qwen/Qwen3-0.6B"))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(output.outputs[0].text)  # everything so far (vLLM's default output_kind, CUMULATIVE)
    engine.shutdown()

The engine process is started with multiprocessing's spawn: a script that builds an engine at its top level needs
`if __name__ == "__main__":`, as with vLLM."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from functools import partial

import torch

from .engine.intake import Prompt, prompt_parts
from .engine.llm_engine import LLMEngine, check_no_lora, check_no_tokenization_kwargs, load_tokenizer
from .engine_args import AsyncEngineArgs, EngineArgs
from .inputs import TokensPrompt, check_utf8
from .outputs import CompletionDelta, CompletionOutput, RequestMetrics, RequestOutput
from .pooling import PoolingOutput, PoolingParams, PoolingRequestOutput
from .sampling_params import RequestOutputKind, SamplingParams
from .serve import async_llm as engine_process
from .serve.engine_core import EngineInfo

logger = logging.getLogger("nanograph")

# vLLM's name: the engine process has died, or the engine was shut down.
EngineDeadError = engine_process.EngineUnavailable


class AsyncLLMEngine:
    def __init__(self, model: str | None = None, **kwargs):
        """Start an engine process for model (as LLM(model, **kwargs): vLLM's engine arguments) and wait until its
        engine is built; an argument nanograph does not take raises here, before anything starts."""
        engine_args = kwargs.pop("engine_args", None) or AsyncEngineArgs(model, **kwargs)
        self.config = engine_args.create_engine_config()
        self._async_llm = engine_process.AsyncLLM(partial(LLMEngine.from_config, self.config), metrics=None)
        self._async_llm.death_callbacks.append(
            lambda exc: logger.error("the engine has died: its requests and new ones raise EngineDeadError"))
        self.info: EngineInfo = self._async_llm.start()
        # This process's own tokenizer, loaded as the engine's (None where the engine has none): text prompts are
        # encoded here, on a thread of its own, one prompt at a time.
        self.tokenizer = None if self.config.skip_tokenizer_init or self.info.tokenizer is None else \
            load_tokenizer(self.info.tokenizer, self.config.trust_remote_code)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # The unfinished requests' ids -> the stream that runs each (-1 while its add is on its way), and the ids
        # aborted while their add was on its way.
        self._stream_ids: dict[str, int] = {}
        self._aborted_while_adding: set[str] = set()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context=None,
                         stat_loggers=None) -> AsyncLLMEngine:
        """vLLM's constructor. start_engine_loop: True only (the engine process starts here); usage_context and
        stat_loggers (None only) are accepted for vLLM's calls."""
        if start_engine_loop is not True:
            raise ValueError("start_engine_loop=False is not supported: the engine process starts with the engine; "
                             "leave it out")
        if stat_loggers is not None:
            raise ValueError("stat_loggers is not supported: nanograph's AsyncLLMEngine logs no periodic stats "
                             "(`nanograph serve` exports them as Prometheus metrics); leave it out")
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"engine_args must be an AsyncEngineArgs (or EngineArgs), got "
                            f"{type(engine_args).__name__}")
        return cls(engine_args=engine_args)

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None, request_id: str, *,
                       lora_request=None, trace_headers=None, priority: int = 0,
                       tokenization_kwargs: dict | None = None, data_parallel_rank: int | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request, yielding its outputs as they come. prompt: a string, a list of token ids, a TextPrompt or
        a TokensPrompt; sampling_params None: the model's defaults (LLM.get_default_sampling_params()). Each
        output holds, as sampling_params.output_kind asks: everything so far of every completion begun (None or
        CUMULATIVE, vLLM's default), only what is new since the last output and only of the completions it
        changed (DELTA), or one output once all have finished (FINAL_ONLY); the last output has finished=True.
        Several steps' worth comes as one output when the caller reads more slowly than the engine steps.

        request_id: any string no unfinished request of this engine has (a ValueError otherwise). An invalid
        request raises the engine's ValueError or TypeError, naming the field; closing the generator, or cancelling
        the task that reads it, aborts the request. lora_request, tokenization_kwargs (None only), trace_headers
        and data_parallel_rank (None or 0) are vLLM's; priority: under scheduling_policy="priority", lower first."""
        _check_vllm_arguments(lora_request, tokenization_kwargs, data_parallel_rank)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        kind = sampling_params.output_kind
        if kind is None:
            kind = RequestOutputKind.CUMULATIVE
        arrival = time.time()
        # The engine process sends deltas, whatever the caller reads: the outputs are built here.
        engine_params = dataclasses.replace(sampling_params, output_kind=RequestOutputKind.DELTA)
        output = None
        # aclosing: closing this generator closes the run at once, which aborts the request.
        async with aclosing(self._run(prompt, engine_params, request_id, priority)) as run:
            async for prompt_text, prompt_token_ids, deltas in run:
                if output is None:
                    output = _Output(request_id, prompt_text, prompt_token_ids, sampling_params.n, kind, arrival)
                result = output.add(deltas)
                if result is not None:
                    yield result

    async def encode(self, prompt: Prompt, pooling_params: PoolingParams | None, request_id: str, *,
                     lora_request=None, trace_headers=None, priority: int = 0,
                     tokenization_kwargs: dict | None = None, truncate_prompt_tokens: int | None = None
                     ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """vLLM's: one prompt's pooling, on an engine built with runner="pooling" (LLM.encode()'s), as one
        PoolingRequestOutput once its prompt is computed (an aborted request yields one with outputs None). The
        other arguments are generate()'s."""
        _check_vllm_arguments(lora_request, tokenization_kwargs)
        if pooling_params is None:
            pooling_params = PoolingParams()
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        if truncate_prompt_tokens is not None:
            pooling_params = dataclasses.replace(pooling_params, truncate_prompt_tokens=truncate_prompt_tokens)
        arrival = time.time()
        async with aclosing(self._run(prompt, pooling_params, request_id, priority)) as run:
            async for prompt_text, prompt_token_ids, deltas in run:
                last = deltas[-1]
                if last.finished:
                    yield PoolingRequestOutput(
                        request_id, None if last.pooled is None else PoolingOutput(torch.from_numpy(last.pooled)),
                        prompt_token_ids,
                        prompt=prompt_text, num_cached_tokens=last.num_cached_tokens,
                        metrics=RequestMetrics(arrival, finished_time=time.time(),
                                               first_scheduled_time=last.scheduled_time), error=last.error)

    async def _run(self, prompt: Prompt, params: SamplingParams | PoolingParams, request_id: str, priority: int
                   ) -> AsyncGenerator[tuple[str | None, list[int], list[CompletionDelta]], None]:
        """Queue one request in the engine process and yield its prompt as queued with each batch of its deltas;
        closing the generator aborts what is unfinished."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if not self.is_running:
            raise self.dead_error
        if request_id in self._stream_ids:
            raise ValueError(f"request_id {request_id!r} is already running; give each unfinished request its own "
                             "id")
        self._stream_ids[request_id] = -1  # taken while the add is on its way
        try:
            prompt = await self._encoded(prompt)
            stream = await self._async_llm.generate([prompt], [params], priority, report_prompts=True)
        except BaseException:
            del self._stream_ids[request_id]
            self._aborted_while_adding.discard(request_id)
            raise
        self._stream_ids[request_id] = stream.stream_id
        if request_id in self._aborted_while_adding:
            self._aborted_while_adding.discard(request_id)
            self._async_llm.abort(stream.stream_id)
        [(prompt_text, prompt_token_ids)] = stream.prompts
        try:
            async for items in stream:
                yield prompt_text, prompt_token_ids, [delta for _, delta in items]
        finally:
            stream.close()  # aborts what is unfinished: the caller stopped reading
            del self._stream_ids[request_id]

    async def _encoded(self, prompt: Prompt) -> Prompt:
        """A text prompt as its token ids (with its text), encoded here on the tokenizer's thread as the engine
        would encode it, so that a long prompt holds up neither the caller's event loop nor the engine's steps."""
        text, token_ids = prompt_parts(prompt)
        if token_ids is not None or self.tokenizer is None:
            return prompt  # the engine's own check says what is wrong with it, if anything
        check_utf8(text, "prompt")
        token_ids = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self.tokenizer.encode,
                                                                     text)
        return TokensPrompt(prompt_token_ids=token_ids, prompt=text)

    async def abort(self, request_id: str | Iterable[str]):
        """End these requests (unknown or finished ids are skipped), also one whose generate() has yet to hear
        that the engine queued it; each one's generator then yields its last output, finish_reason "abort", and
        ends."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            stream_id = self._stream_ids.get(one)
            if stream_id == -1:
                self._aborted_while_adding.add(one)
            elif stream_id is not None:
                self._async_llm.abort(stream_id)

    def shutdown(self, timeout: float = 30.0):
        """Abort what runs and end the engine process; the engine takes no requests after this."""
        self._async_llm.abort_all()
        self._async_llm.join(timeout)
        self._tokenizer_thread.shutdown(wait=False)

    @property
    def is_running(self) -> bool:
        return self._async_llm.is_running

    @property
    def is_stopped(self) -> bool:
        return self._async_llm.stopping

    @property
    def errored(self) -> bool:
        return self._async_llm.error is not None

    @property
    def dead_error(self) -> BaseException:
        return self._async_llm._unavailable()

    async def check_health(self):
        """Raises EngineDeadError when the engine process has died (or was shut down)."""
        if not self.is_running:
            raise self.dead_error

    async def get_tokenizer(self, lora_request=None):
        """The model's tokenizer (this process's own instance, loaded as the engine's; None where it has none)."""
        check_no_lora(lora_request)
        return self.tokenizer

    async def get_model_config(self) -> EngineInfo:
        """What the engine runs: model (its folder), tokenizer, max_model_len, max_num_seqs, vocab_size, device."""
        return self.info

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults, as LLM.get_default_sampling_params() gives them."""
        return SamplingParams(**self.info.sampling_defaults)

    async def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort"):
        """vLLM's: LLM.sleep(level, tags=tags, mode=mode) in the engine process (enable_sleep_mode=True)."""
        await self._async_llm.sleep(level, tags, mode)

    async def wake_up(self, tags: list[str] | None = None):
        """vLLM's: LLM.wake_up(tags) in the engine process."""
        await self._async_llm.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return await self._async_llm.is_sleeping()

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """vLLM's: LLM.collective_rpc in the engine process ("reload_weights"); arguments go by position only."""
        if kwargs:
            raise ValueError(f"collective_rpc passes its arguments to the engine process by position; got kwargs "
                             f"{sorted(kwargs)}: pass them in args")
        return [await self._async_llm.call(method, *args)]

    async def reset_prefix_cache(self, device=None, reset_running_requests: bool = False) -> bool:
        """vLLM's: forget every cached prompt prefix; False, changing nothing, while a request holds KV blocks.
        device: vLLM's older argument, taken and ignored; reset_running_requests: False only."""
        if reset_running_requests:
            raise ValueError("reset_running_requests=True is not supported: running requests keep their KV blocks; "
                             "abort them first, or pass False")
        return await self._async_llm.reset_prefix_cache()

    async def start_profile(self, profile_prefix: str | None = None):
        """vLLM's: start the profiler of the engine's profiler_config (LLM.start_profile())."""
        await self._async_llm.start_profile(profile_prefix)

    async def stop_profile(self):
        """vLLM's: end the profile, writing its trace (LLM.stop_profile())."""
        await self._async_llm.stop_profile()


AsyncLLM = AsyncLLMEngine  # vLLM V1's name


def _check_vllm_arguments(lora_request, tokenization_kwargs: dict | None, data_parallel_rank: int | None = None):
    """vLLM's per-request arguments that nanograph takes at their defaults only."""
    check_no_lora(lora_request)
    check_no_tokenization_kwargs(tokenization_kwargs)
    if data_parallel_rank not in (None, 0):
        raise ValueError(f"data_parallel_rank={data_parallel_rank!r}: nanograph runs one engine; pass None")


class _Output:
    """One request's RequestOutputs, built from the engine's deltas as the caller's output_kind asks."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int,
                 kind: RequestOutputKind, arrival: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = kind
        self.completions: list[CompletionOutput | None] = [None] * n  # everything so far, by index
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.num_cached_tokens: int | None = None
        self.prompt_logprobs = None
        self.error: str | None = None

    def add(self, deltas: list[CompletionDelta]) -> RequestOutput | None:
        """The output for these deltas (None when FINAL_ONLY and not all completions have finished)."""
        changed: dict[int, CompletionOutput] = {}
        for delta in deltas:
            self._record(delta)
            new = changed.get(delta.index)
            if new is None:
                new = changed[delta.index] = CompletionOutput(delta.index, "", [], None, None)
            new.text += delta.text
            new.token_ids += delta.token_ids
            if delta.logprobs is not None:
                new.logprobs = (new.logprobs or []) + delta.logprobs
            new.cumulative_logprob = delta.cumulative_logprob
            new.finish_reason, new.stop_reason = delta.finish_reason, delta.stop_reason
        finished = all(completion is not None and completion.finished() for completion in self.completions)
        if self.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.kind is RequestOutputKind.DELTA:
            outputs = [new for _, new in sorted(changed.items())]
        else:
            outputs = [_copy(completion) for completion in self.completions if completion is not None]
        if finished:
            self.metrics.finished_time = time.time()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             self.num_cached_tokens, dataclasses.replace(self.metrics), self.error,
                             self.prompt_logprobs)

    def _record(self, delta: CompletionDelta):
        """delta into the completion's running totals and the request's metrics."""
        completion = self.completions[delta.index]
        if completion is None:
            completion = self.completions[delta.index] = CompletionOutput(
                delta.index, "", [], None, [] if delta.logprobs is not None else None)
        completion.text += delta.text
        completion.token_ids.extend(delta.token_ids)  # the outputs hold copies (_copy)
        if delta.logprobs is not None:
            completion.logprobs.extend(delta.logprobs)
        completion.cumulative_logprob = delta.cumulative_logprob
        completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
        metrics = self.metrics
        if delta.scheduled_time is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = delta.scheduled_time
            metrics.time_in_queue = delta.scheduled_time - metrics.arrival_time
        if delta.token_ids and metrics.first_token_time is None:
            metrics.first_token_time = time.time()
        if delta.finished:
            if delta.num_cached_tokens is not None:
                self.num_cached_tokens = max(self.num_cached_tokens or 0, delta.num_cached_tokens)
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs = delta.prompt_logprobs
            self.error = self.error or delta.error


def _copy(completion: CompletionOutput) -> CompletionOutput:
    """A snapshot the caller may keep: later outputs do not change it."""
    return dataclasses.replace(completion, token_ids=list(completion.token_ids),
                               logprobs=None if completion.logprobs is None else list(completion.logprobs))
