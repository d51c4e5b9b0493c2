"""LLMEngine: the step loop, requests in and results out.

A step reads like the algorithm: schedule a batch → queue its forward → apply the tokens the previous step sampled
(stop checks, text, outputs) → queue this step's sampling. The device runs step N + 1's forward while the host
applies step N's tokens; a token the host has not read yet stays on the device (PENDING_TOKEN), where the next
forward reads it (ForwardBatch.input_src). A sequence that stops on such a token was fed one step too many; that
step's row is dropped.

Calls from several threads are serialised on the engine. generate() and stream() own the requests they queue; a
new generate() or stream() ends the requests of streams still open (they finish with "abort"), so that an
abandoned stream holds no KV blocks. Requests queued with add_request() are returned by step(), whichever call ran
the step that finished them."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from itertools import count
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..backends import make_runner
from ..backends.base import Pending, PendingTokens, Runner
from ..config import Config
from ..engine_args import EngineArgs
from ..default_model import default_model_path
from ..generation_defaults import sampling_defaults
from ..hub import model_folder, tokenizer_folder
from ..metrics import EngineMetrics, Metric, cache_config_labels
from ..model_config import BASE_MODEL_SUFFIX, CLASSIFIER_SUFFIX, ModelConfig
from ..models.weights import has_lm_head, load_classifier
from ..outputs import CompletionDelta, Logprob, RequestOutput
from ..pooling import Pooler, PoolingParams, PoolingRequestOutput, is_classifier
from ..profiler import EngineProfiler
from ..sampling import TokenLogprobs
from ..sampling_params import SamplingParams
from .batch import build_forward_batch
from .block_manager import BlockManager
from .detokenizer import LOGPROB_CONTEXT_TOKENS
from .intake import Intake, Prompt
from .request import Request
from .scheduler import ScheduledBatch, Scheduler
from .sequence import PENDING_TOKEN, Sequence, SequenceStatus
from .stats import EngineStats
from .stop_checker import StopChecker

logger = logging.getLogger("nanograph")


class NoTokenLeftError(ValueError):
    """A request whose own constraints left no token to sample: the request's to change, not the engine's fault."""


SLEEP_LEVELS = (1, 2)  # LLMEngine.sleep's: 1 keeps the weights in host memory, 2 lets them go
SLEEP_TAGS = ("weights", "kv_cache")  # what sleep() frees and wake_up(tags) restores, in the order it restores them
SLEEP_MODES = ("abort", "wait")  # what sleep() does with unfinished requests (vLLM's "keep" is not implemented)


def _sleep_tags(tags, call: str) -> set[str]:
    """sleep's or wake_up's tags (one tag, or a list of them) as a set, checked."""
    wanted = {tags} if isinstance(tags, str) else set(tags)
    if not wanted or not wanted <= set(SLEEP_TAGS):
        raise ValueError(f"{call} tags must be among {', '.join(map(repr, SLEEP_TAGS))}, got {tags!r}")
    return wanted


class EngineSleeping(RuntimeError):
    """A request queued while the engine sleeps (LLMEngine.sleep): wake_up() first."""


class _Stream:
    """The owner of one stream() call's requests."""


class LLMEngine:
    def __init__(self, config: Config, model_config: ModelConfig, runner: Runner, tokenizer):
        kv_tokens = runner.num_kv_blocks * runner.block_size
        if kv_tokens < config.max_model_len:
            raise ValueError(f"KV cache holds {kv_tokens} tokens, fewer than max_model_len={config.max_model_len}; "
                             f"{_more_kv_cache(config, runner)} or lower max_model_len")
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.model_config = model_config
        self.runner = runner
        # SamplingParams fields from the model's generation_config.json (generation_config="auto"), or a folder's,
        # and override_generation_config's over them.
        self.sampling_defaults = sampling_defaults(_generation_config_folder(config), config.override_generation_config)
        # runner="pooling": the model is an embedding model; its requests pool their prompts and sample nothing.
        self.pooler = Pooler.for_model(model_config, config.pooler_config, runner.device, config.pooling_task) \
            if config.runner == "pooling" else None
        self.metrics = EngineMetrics(config.model, cache_config_labels(config, runner))  # get_metrics()'s
        profiler_config = config.profiler_config
        self.profiler = EngineProfiler(profiler_config, runner.device) \
            if profiler_config is not None and profiler_config.profiler is not None else None
        self.intake = Intake(config, model_config.vocab_size, model_config.max_context, tokenizer,
                             model_config.eos_token_ids, self.pooler)
        self.stop_checker = StopChecker(set(model_config.eos_token_ids), getattr(tokenizer, "eos_token_id", None))
        self.scheduler = Scheduler(config, BlockManager(runner.num_kv_blocks, runner.block_size,
                                                        config.enable_prefix_caching))
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}  # unfinished
        self._request_ids = count()
        self._queue_order = count()  # the order requests were queued in (the priority policy's last tie-break)
        self._in_flight: tuple[list[Sequence], PendingTokens] | None = None  # sampled, not read yet
        # Prompt logprobs queued by the last step, not read yet: each sequence with its first target position and
        # count, in the order of the pending result's tokens.
        self._prompt_logprobs_in_flight: tuple[list[tuple[Sequence, int, int]], Pending] | None = None
        self._unclaimed: list[RequestOutput] = []  # step()'s, finished while generate() or stream() ran the steps
        self._open_streams: set[_Stream] = set()
        self._streamed: dict[str, Request] = {}  # add_request(stream=True)'s, until their last delta is taken
        self._touched: dict[str, None] = {}  # the streamed requests that got tokens or ended since the last take
        self._lock = threading.RLock()
        if config.enable_sleep_mode and not runner.supports_sleep:
            raise ValueError(f"enable_sleep_mode=True: the {type(runner).__name__} has no sleep mode (the CUDA core "
                             f"and the torch backend with tensor_parallel_size=1 have it); leave enable_sleep_mode "
                             f"out")
        self._asleep: set[str] = set()  # the SLEEP_TAGS that sleep() freed and wake_up() has not restored
        self._implied: set[str] = set()  # those of them freed only because the runner frees them with the weights

    @classmethod
    def from_config(cls, config: Config) -> LLMEngine:
        """The engine for a Config: the model and tokenizer found (a folder, a Hub id, or the default model), the
        runner built, max_model_len settled."""
        model = model_folder(config.model, config.revision, config.download_dir) if config.model \
            else default_model_path()
        tokenizer_path = model if config.tokenizer is None else \
            tokenizer_folder(config.tokenizer, config.tokenizer_revision, config.download_dir)
        model_config = ModelConfig.from_pretrained(model, config.hf_overrides)
        if config.runner == "auto":  # vLLM's rule: a base model's or a classifier's architecture pools
            names = getattr(model_config.hf_config, "architectures", None) or []
            pools = config.pooling_task is not None or names and all(
                name.endswith((BASE_MODEL_SUFFIX, CLASSIFIER_SUFFIX)) for name in names)
            config = replace(config, runner="pooling" if pools else "generate")
        if config.runner == "generate" and (is_classifier(model_config.hf_config) or
                                            not has_lm_head(model, model_config)):
            raise ValueError(f"{model} holds a model's weights without an lm_head (an embedding model's or a "
                             f"classifier's), so it gives no logits to sample: run it with runner='pooling' "
                             f"(embed(), classify()), or use a causal LM's folder")
        tokenizer = None if config.skip_tokenizer_init else \
            load_tokenizer(tokenizer_path, config.trust_remote_code, given=config.tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and 0 <= eos < model_config.vocab_size and eos not in model_config.eos_token_ids:
            # The tokenizer's end-of-text token ends a completion too, as in vLLM: a fine-tune often sets it
            # (e.g. <|im_end|>) while config.json keeps the base model's.
            model_config = replace(model_config, eos_token_ids=[*model_config.eos_token_ids, eos])
        asked = config.max_model_len
        config = replace(config, model=model, tokenizer=tokenizer_path,
                         max_model_len=_model_len(asked, model_config.max_context))
        runner = make_runner(config, model_config)
        logger.info("KV cache: %s", runner.kv_cache_summary())
        kv_tokens = runner.num_kv_blocks * runner.block_size
        if kv_tokens < config.max_model_len and asked is None:
            # The default length (the model's) is capped; a length asked for is an error (in __init__), as in vLLM.
            warnings.warn(f"the KV cache holds {kv_tokens} tokens, fewer than the model's {config.max_model_len}; "
                          f"max_model_len is {kv_tokens} ({_more_kv_cache(config, runner)} for more)",
                          stacklevel=3)
            config = replace(config, max_model_len=kv_tokens)
        try:
            return cls(config, model_config, runner, tokenizer)
        except BaseException:
            runner.shutdown()  # a tensor-parallel runner's workers end with it
            raise

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's constructor: the engine for EngineArgs(model=..., ...)."""
        return cls.from_config(engine_args.create_engine_config())

    @property
    def tokenizer(self):
        """The tokenizer that encodes text prompts and decodes outputs (None: prompts must be token ids)."""
        return self.intake.tokenizer

    def set_tokenizer(self, tokenizer):
        """Use another tokenizer for requests queued from now on."""
        with self._lock:
            self.intake.use_tokenizer(tokenizer)

    # Requests in and out.

    def add_request(self, prompt: Prompt, params: SamplingParams | PoolingParams, request_id: str | None = None,
                    stream: bool = False, *, arrival_time: float | None = None, lora_request=None,
                    priority: int = 0, **vllm_kwargs) -> str:
        """Queue one request and return its id (request_id, or a new one); step() returns its output once it has
        finished. stream: take_deltas() also reports what each step adds to it. An invalid request raises
        (ValueError, TypeError) and changes nothing. vLLM's order, add_request(request_id, prompt, params,
        arrival_time), is taken too, and its keywords: arrival_time (the request's metrics count from it),
        lora_request=None, priority (an int: under scheduling_policy "priority", lower values are served first; else
        0), tokenization_kwargs=None and trace_headers=None."""
        if isinstance(request_id, (SamplingParams, PoolingParams)) and isinstance(prompt, str) and \
                not isinstance(params, (SamplingParams, PoolingParams)):
            prompt, params, request_id = params, request_id, prompt
            if stream is not False and stream is not True:  # vLLM's fourth argument is an arrival time
                arrival_time, stream = stream, False
        _check_vllm_request_kwargs(lora_request, vllm_kwargs)
        self._check_priority(priority)
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))):
            raise TypeError(f"arrival_time must be a time in seconds (time.time()'s), got {arrival_time!r}")
        with self._lock:
            if request_id is not None and (not isinstance(request_id, str) or self._id_in_use(request_id)):
                raise ValueError(f"request_id must be a string that no unfinished request has, nor a finished one "
                                 f"whose output step() or take_deltas() has yet to return; got {request_id!r}")
            request_id = self._queue(self.intake.validate(prompt, params), None, request_id, priority,
                                     None if arrival_time is None else float(arrival_time))
            if stream:
                self._streamed[request_id] = self.requests[request_id]
            return request_id

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: the requests not finished yet, and those queued with add_request whose output step() has yet to
        return."""
        with self._lock:
            return len(self.requests) + len(self._unclaimed)

    def abort_request(self, request_id: str | Iterable[str]):
        """End an unfinished request (or each of a list of them, as vLLM takes) wherever its sequences are; they
        finish with reason "abort" and their blocks are free at once. Ids of finished or unknown requests are
        ignored, as a request may finish while its abort is on its way."""
        with self._lock:
            for one in request_id if isinstance(request_id, Iterable) and not isinstance(request_id, str) \
                    else [request_id]:
                request = self.requests.get(one)
                if request is not None:
                    self._end(request)

    def has_unfinished(self) -> bool:
        with self._lock:
            # A sequence stays running or waiting until the token that ends it has been read, and a request queued
            # with add_request until step() has returned its output (generate() may have finished it).
            return self.scheduler.has_unfinished() or bool(self._unclaimed)

    has_unfinished_requests = has_unfinished  # vLLM's name

    def get_tokenizer(self):
        return self.tokenizer

    def step(self) -> list[RequestOutput]:
        """Run one step: queue a batch, and apply the tokens of the one before. Returns the requests queued with
        add_request that have finished since the last call."""
        with self._lock:
            outputs, self._unclaimed = self._unclaimed, []
            for owner, output in self._step()[0]:
                if owner is None:
                    outputs.append(output)
            return outputs

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the prefix cache; False, changing nothing, while a request holds KV blocks."""
        with self._lock:
            return self.scheduler.block_manager.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's metrics (metrics.py)."""
        with self._lock:
            return self.metrics.snapshot(self)

    def start_profile(self, profile_prefix: str | None = None):
        """vLLM's: start the profiler of Config.profiler_config (profiler.py); profile_prefix begins the trace's file
        name. A RuntimeError without a profiler; a profile already running goes on (a warning says so)."""
        with self._lock:
            self._configured_profiler().start(profile_prefix)

    def stop_profile(self):
        """vLLM's: end the profile start_profile() began, writing its trace (none running: a warning)."""
        with self._lock:
            self._configured_profiler().stop()

    def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort"):
        """vLLM's (with enable_sleep_mode=True): free the device memory of the KV cache, whose contents (the prefix
        cache's too) are forgotten, and of the weights: level 1 keeps a copy in host memory, level 2 none (wake_up()
        reads the checkpoint again). tags ("weights", "kv_cache") sleep those alone, over the level, as vLLM's
        (weights slept by tag keep no copy; on the CUDA core the KV cache sleeps with the weights it is built over).
        mode, what becomes of unfinished requests: "abort" (vLLM's default) ends them with reason "abort", "wait" runs
        the engine's steps until they have finished. Asleep, the engine refuses requests (EngineSleeping) until
        wake_up(). A part asleep already stays as it sleeps, as in vLLM."""
        with self._lock:
            if not self.config.enable_sleep_mode:
                raise RuntimeError("sleep mode is not enabled: build the engine with enable_sleep_mode=True "
                                   "(nanograph serve: --enable-sleep-mode)")
            if mode not in SLEEP_MODES:
                raise ValueError(f"mode must be 'abort' (unfinished requests end with reason 'abort') or 'wait' "
                                 f"(they run to their end first), got {mode!r}")
            if tags is None:
                if isinstance(level, bool) or level not in SLEEP_LEVELS:
                    raise ValueError(f"level must be 1 (weights kept in host memory) or 2 (weights let go, read "
                                     f"from the checkpoint on wake_up), got {level!r}")
                wanted, keep_weights = set(SLEEP_TAGS), level == 1
            else:
                wanted, keep_weights = _sleep_tags(tags, "sleep"), False
            wanted -= self._asleep  # as in vLLM, a part asleep already stays as it sleeps
            if not wanted:
                return
            if mode == "abort":
                for request in list(self.requests.values()):
                    self._end(request)
            while self.scheduler.has_unfinished():
                self._unclaimed += [output for owner, output in self._step()[0] if owner is None]
            # What a step left in flight belongs to requests that have ended: dropped, as the next step would drop
            # it; the runner waits for the device before it frees anything.
            self._in_flight = self._prompt_logprobs_in_flight = None
            if not self.scheduler.block_manager.reset_prefix_cache():
                raise RuntimeError("sleep: KV blocks are still held with no request unfinished; nothing was freed")
            self._free(wanted, keep_weights)

    def _free(self, wanted: set[str], keep_weights: bool):
        """The runner frees wanted and what goes with them, asleep from here: a runner that fails partway has freed
        some of its parts, which wake_up() restores."""
        freed = self.runner.tags_freed(wanted) - self._asleep
        self._implied |= freed - wanted  # freed along with another part, woken with it
        self._asleep |= freed
        self.runner.sleep(freed, keep_weights)

    def wake_up(self, tags: list[str] | None = None):
        """vLLM's: restore what sleep() freed: tags "weights" and "kv_cache" (None: both), the weights first, and
        with them what slept only because they did (the CUDA core's KV cache, built over them; on that runner the
        KV cache alone is refused while the weights sleep). Parts awake already are left as they are. Weights slept
        without a copy (level 2) come back as memory alone; their values are read from the checkpoint once nothing
        sleeps any more, unless reload_weights() has read them first: vLLM's level-2 order (wake_up(["weights"]),
        reload_weights(), wake_up(["kv_cache"])) reads the checkpoint once."""
        with self._lock:
            wanted = set(SLEEP_TAGS) if tags is None else _sleep_tags(tags, "wake_up")
            if "weights" in wanted:
                wanted |= self._implied  # what slept with the weights wakes with them
            tied = "kv_cache" in self.runner.tags_freed({"weights"})  # the KV cache is built over the weights
            if tied and "kv_cache" in wanted & self._asleep and "weights" in self._asleep - wanted:
                raise ValueError("wake_up(tags=['kv_cache']): the weights are asleep, and the KV cache comes back "
                                 "over them; wake the weights first (tags=['weights']), or both (tags=None)")
            for tag in SLEEP_TAGS:  # the weights first
                if tag in wanted & self._asleep:
                    self.runner.wake_up({tag})
                    self._asleep.discard(tag)
                    self._implied.discard(tag)
            if not self._asleep and self.runner.weights_unread:  # slept without a copy, not reloaded since
                try:
                    self.reload_weights()  # a classifier's head too: body and head from one checkpoint
                except BaseException:
                    # Their memory is back, not their values: asleep again as after level 2, for a wake_up to read.
                    self._free({"weights"}, keep_weights=False)
                    raise

    def reload_weights(self):
        """vLLM's worker call (LLM.collective_rpc("reload_weights")): read the model's checkpoint again into the
        weights in place, e.g. after a trainer wrote new weights there, or into the weights that wake_up(tags=
        ["weights"]) brought back after sleep(level=2). Steps from here read the new values; the prefix cache's
        blocks, computed with the old ones, stay until reset_prefix_cache(), as in vLLM."""
        with self._lock:
            self.runner.reload_weights()
            if self.pooler is not None and self.pooler.classifier is not None:  # a classifier's head is the pooler's
                self.pooler.classifier.copy_(load_classifier(self.model_config.path, self.model_config))

    def is_sleeping(self) -> bool:
        """vLLM's: whether any part sleep() freed is still asleep (requests are refused until none is)."""
        with self._lock:
            return bool(self._asleep)

    def _configured_profiler(self) -> EngineProfiler:
        if self.profiler is None:
            raise RuntimeError("no profiler is configured: pass profiler_config={\"profiler\": \"torch\", "
                               "\"torch_profiler_dir\": DIR} (nanograph serve: --profiler-config)")
        return self.profiler

    def shutdown(self):
        """Release what the runner holds outside this process (a tensor-parallel runner's worker processes, after
        which its steps fail); a profile still running ends, its trace written."""
        with self._lock:
            try:
                if self.profiler is not None and self.profiler.running:
                    self.profiler.stop()
            finally:
                self.runner.shutdown()

    def take_deltas(self) -> list[CompletionDelta]:
        """What the steps since the last call added to each request queued with add_request(stream=True) (or all of
        it so far, as its SamplingParams.output_kind asks); a finished (or aborted) request reports once more,
        finished, and is then forgotten here."""
        with self._lock:
            deltas = []
            while self._touched:
                request_id = next(iter(self._touched))
                del self._touched[request_id]
                request = self._streamed.get(request_id)
                if request is None:  # a failed take ended it, and it was taken then
                    continue
                deltas += self._take(request)
                if request.finished:
                    del self._streamed[request_id]
            return deltas

    def _take(self, request: Request) -> list[CompletionDelta]:
        """request.take_deltas(); where its text (read here, without stop strings) fails to decode, the request
        ends with the text it had (it may have ended, aborted, before its text was read) and reports that."""
        try:
            return request.take_deltas()
        except Exception as exc:
            if self.requests.get(request.request_id) is request:  # not ended yet (its id may be another's by now)
                self._unclaimed += [output for owner, output in self._fail({request.request_id}, exc)
                                    if owner is None]
            for seq in request.seqs:
                if seq.detokenizer is not None:
                    seq.detokenizer.discard_pending()
            return request.take_deltas()

    def generate(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool | Callable = True,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every request to completion; outputs in input order. All are validated before any is queued.
        use_tqdm: whether to show a progress bar, or the tqdm class that shows it; priority: each request's (see
        add_request)."""
        progress = use_tqdm if callable(use_tqdm) else tqdm
        with self._lock:
            owner = object()
            index = {request_id: i for i, request_id in enumerate(self._queue_all(prompts, params, owner, priority))}
            outputs: list[RequestOutput | None] = [None] * len(prompts)
            throughput = {"prefill": 0.0, "decode": 0.0}
            try:
                with progress(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as bar:
                    remaining = len(prompts)
                    while remaining:
                        start = time.perf_counter()
                        finished, batch = self._step()
                        if batch.seqs:
                            throughput["prefill" if batch.is_prefill else "decode"] = \
                                batch.num_tokens / (time.perf_counter() - start)
                        bar.set_postfix({name: f"{tok_s:.0f}tok/s" for name, tok_s in throughput.items()},
                                        refresh=False)
                        failed = None
                        for request_owner, output in finished:  # every output routed before any error is raised
                            if request_owner is owner:
                                if output.error is not None and failed is None:
                                    failed = f"request {index[output.request_id]} failed: {output.error}"
                                outputs[index[output.request_id]] = output
                                remaining -= 1
                                bar.update(1)
                            elif request_owner is None:
                                self._unclaimed.append(output)
                        if failed is not None:
                            raise RuntimeError(failed)
            except BaseException:
                # An error (or an interrupt) ends this call's requests, so that the next call does not run them.
                for request_id in index:
                    self.abort_request(request_id)
                raise
            return outputs

    def stream(self, prompts: list[Prompt], params: list[SamplingParams]) -> Iterator[CompletionDelta]:
        """Run the requests to completion, yielding after each step what it added to each of their completions.
        All are validated before any is queued; closing the iterator early (or dropping it) aborts the unfinished
        ones, and so does a later generate() or stream() call on the engine."""
        owner = _Stream()
        with self._lock:
            request_ids = self._queue_all(prompts, params, owner)
            requests = [self.requests[request_id] for request_id in request_ids]
            self._open_streams.add(owner)
        try:
            while True:
                with self._lock:
                    # The check comes before the take, so that a last take follows every end.
                    done = all(request.finished for request in requests)
                    deltas = [delta for request in requests for delta in self._take(request)]
                yield from deltas
                if done:
                    break
                with self._lock:
                    if not all(request.finished for request in requests):
                        self._unclaimed += [output for request_owner, output in self._step()[0]
                                            if request_owner is None]
        finally:
            with self._lock:
                self._open_streams.discard(owner)
                for request in requests:  # its own requests only: a finished one's id may be another's by now
                    if self.requests.get(request.request_id) is request:
                        self._end(request)

    # The step.

    def _step(self) -> tuple[list[tuple[object, RequestOutput]], ScheduledBatch]:
        """One step; the requests it finished, each with its owner, and the batch it queued (empty when only the
        previous step's tokens were left to apply)."""
        if self.profiler is not None and self.profiler.running:
            with self.profiler.step():
                return self._run_step()
        return self._run_step()

    def _run_step(self) -> tuple[list[tuple[object, RequestOutput]], ScheduledBatch]:
        batch = self.scheduler.schedule()
        failure = prompt_logprobs = None
        if batch.seqs:
            forward_batch = build_forward_batch(batch, self.scheduler.block_manager)
            self.stats.record_step(batch.num_tokens, batch.is_prefill, int(forward_batch.context_lens.sum()))
            try:
                with self._forward_range(batch):
                    self.runner.forward(forward_batch, batch.seqs)
                prompt_logprobs = self._queue_prompt_logprobs(batch, forward_batch.cu_seqlens_q)
                if self.pooler is not None:
                    self._pool(batch, forward_batch.cu_seqlens_q)
            except Exception as exc:  # the forward of these requests failed: they end, the others go on
                failure = exc
        finished = self._apply_prompt_logprobs()
        self._prompt_logprobs_in_flight = prompt_logprobs
        finished += self._apply_sampled()
        if batch.seqs:
            if failure is not None:
                finished += self._fail({seq.request_id for seq in batch.seqs}, failure)
            else:
                finished += self._queue_sampling(batch)
                self.scheduler.advance(batch)
                if self.pooler is not None:
                    finished += self._finish_pooled(batch)
        return finished, batch

    def _forward_range(self, batch: ScheduledBatch):
        """The profiler's range of a batch's forward (nothing unless it records)."""
        if self.profiler is None or not self.profiler.recording:
            return contextlib.nullcontext()
        return self.profiler.range(f"nanograph.forward {'prefill' if batch.is_prefill else 'decode'}: "
                                   f"{len(batch.seqs)} sequences, {batch.num_tokens} tokens")

    def _queue_prompt_logprobs(self, batch: ScheduledBatch, cu_seqlens_q: np.ndarray
                               ) -> tuple[list[tuple[Sequence, int, int]], Pending] | None:
        """Queue the logprobs of the prompt tokens that this step's chunks predict, for the sequences still missing
        some: token i of a chunk predicts token i + 1 of the prompt; the prompt's last token predicts the first
        sampled one, not a prompt token. A recomputed prompt (after a preemption) skips the targets it has."""
        spans, token_rows, target_ids, num_top = [], [], [], []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if not seq.needs_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            first, end = max(start, len(seq.prompt_logprobs) - 1), min(start + num_new, seq.num_prompt_tokens - 1)
            if first >= end:
                continue
            k = seq.params.prompt_logprobs
            spans.append((seq, first + 1, end - first))
            token_rows.append(np.arange(first, end) - start + cu_seqlens_q[i])
            target_ids += seq.token_ids[first + 1:end + 1]
            num_top += [self.vocab_size if k == -1 else min(k, self.vocab_size)] * (end - first)
        if not spans:
            return None
        return spans, self.runner.prompt_logprobs(np.concatenate(token_rows), target_ids, num_top)

    def _pool(self, batch: ScheduledBatch, cu_seqlens_q: np.ndarray):
        """Pool the final hidden states of this step's prompt tokens into their sequences' pooling."""
        spans, token_rows = [], []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.pooling is None or seq.is_finished:
                continue
            start = seq.num_computed_tokens
            rows = seq.pooling.rows_to_pool(start, num_new, batch.samples[i])
            if rows:
                spans.append((seq, rows))
                token_rows.append(np.arange(rows.start, rows.stop) - start + cu_seqlens_q[i])
        if spans:
            hidden = self.runner.pooled_hidden(np.concatenate(token_rows))
            offset = 0
            for seq, rows in spans:
                seq.pooling.add(hidden[offset:offset + len(rows)], rows.start)
                offset += len(rows)

    def _finish_pooled(self, batch: ScheduledBatch) -> list[tuple[object, PoolingRequestOutput]]:
        """The pooling requests whose prompt the batch completed finish (once their blocks are offered to the prefix
        cache), with their embeddings, brought to the host together."""
        done = [seq for seq, samples in zip(batch.seqs, batch.samples)
                if samples and seq.pooling is not None and not seq.is_finished]
        if not done:
            return []
        vectors = [self.pooler.finish(seq.pooling.result()[None], seq.pooling.params)[0] for seq in done]
        now, finished = time.time(), []
        for seq, data in zip(done, torch.cat(vectors).cpu().split([len(v) for v in vectors])):
            seq.pooling.data = data.clone()  # its own storage, not a view of the step's
            seq.finish_reason = "stop"
            self.scheduler.finish(seq)
            request = self.requests.pop(seq.request_id)
            request.metrics.first_token_time = request.metrics.last_token_time = request.metrics.finished_time = now
            self.metrics.record_first_token(request)
            self.metrics.record_finished(request, self.config.max_model_len)
            if seq.request_id in self._streamed:
                self._touched[seq.request_id] = None
            finished.append((request.owner, request.output()))
        self.metrics.record_step(sum(seq.num_prompt_tokens for seq in done))
        return finished

    def _apply_prompt_logprobs(self) -> list[tuple[object, RequestOutput]]:
        """Read the prompt logprobs the last step queued and append them to their sequences, in prompt order; the
        requests that failed in it (their tokenizer on a token's text)."""
        if self._prompt_logprobs_in_flight is None:
            return []
        spans, pending = self._prompt_logprobs_in_flight
        self._prompt_logprobs_in_flight = None
        logprobs = pending.result().logprobs
        offset, failed = 0, []
        for seq, first_target, num_targets in spans:
            try:
                for target, token_logprobs in enumerate(logprobs[offset:offset + num_targets], start=first_target):
                    if target == len(seq.prompt_logprobs) and not seq.is_finished:
                        context = seq.token_ids[max(0, target - LOGPROB_CONTEXT_TOKENS):target]
                        seq.prompt_logprobs.append(self._logprob_dict(seq, token_logprobs, context))
            except Exception as exc:
                failed += self._fail({seq.request_id}, exc)
            offset += num_targets
        return failed

    def _queue_sampling(self, batch: ScheduledBatch) -> list[tuple[object, RequestOutput]]:
        """Queue the sampling of the batch's rows that reach their sequence's end (prompts cut short by the token
        budget sample nothing yet, nor do sequences that ended meanwhile); the requests that failed in it."""
        rows = [i for i, (seq, samples) in enumerate(zip(batch.seqs, batch.samples))
                if samples and not seq.is_finished and seq.pooling is None]
        if not rows:
            return []
        seqs = [batch.seqs[i] for i in rows]
        states = [seq.generator.getstate() if seq.generator is not None else None for seq in seqs]
        failed = []
        try:
            pending = self.runner.sample(rows, seqs)
        except Exception as exc:
            failed = self._fail(self._failing_requests(rows, seqs, states), exc)
            survivors = [i for i, seq in enumerate(seqs) if not seq.is_finished]
            if not survivors:
                return failed
            rows, seqs = [rows[i] for i in survivors], [seqs[i] for i in survivors]
            _restore(seqs, [states[i] for i in survivors])
            try:
                pending = self.runner.sample(rows, seqs)
            except Exception as retry_exc:  # the survivors fail together: they end too, and all are reported
                return failed + self._fail({seq.request_id for seq in seqs}, retry_exc)
        for row, seq in zip(pending.rows, seqs):
            seq.token_ids.append(PENDING_TOKEN)
            seq.sample_row = row
        self._in_flight = (seqs, pending)
        return failed

    def _failing_requests(self, rows: list[int], seqs: list[Sequence], states: list) -> set[str]:
        """The requests whose rows fail to sample on their own (the whole batch's when none does): each is tried
        alone, its random streams put back after the try."""
        by_request: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            by_request.setdefault(seq.request_id, []).append(i)
        failing = set()
        for request_id, members in by_request.items():
            try:
                _restore([seqs[i] for i in members], [states[i] for i in members])
                self.runner.sample([rows[i] for i in members], [seqs[i] for i in members])
            except Exception:
                failing.add(request_id)
        return failing or set(by_request)

    def _fail(self, request_ids: set[str], exc: Exception) -> list[tuple[object, RequestOutput]]:
        """End these requests (finish reason "abort", the error on their output)."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._end(request, f"{type(exc).__name__}: {exc}")
                ended.append((request.owner, _failed_output(request)))
        return ended

    def _apply_sampled(self) -> list[tuple[object, RequestOutput]]:
        """Read the tokens the last step sampled and apply them; return the requests this finished."""
        if self._in_flight is None:
            return []
        seqs, pending = self._in_flight
        self._in_flight = None
        start = time.perf_counter()
        sampled = pending.result()
        self.stats.device_wait_seconds += time.perf_counter() - start
        now = time.time()
        generated_before = self.stats.generated_tokens
        requests, masked, invalid, ungrammatical, broken = {}, set(), set(), set(), {}
        for seq, token_id, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs):
            if seq.is_finished:  # aborted while its token was on its way: the token is dropped
                continue
            if not 0 <= token_id < self.vocab_size:
                (masked if _masks_tokens(seq) else invalid).add(seq.request_id)
                continue
            try:
                grammar = seq.grammar
                if grammar is not None and grammar.applies and not grammar.advance(token_id):
                    ungrammatical.add(seq.request_id)
                    continue
                seq.token_ids[-1] = token_id
                self.stats.generated_tokens += 1
                if logprobs is not None:
                    self._record_logprobs(seq, logprobs)
                if self.stop_checker.check(seq):
                    self.scheduler.finish(seq)
                elif grammar is not None and not grammar.applies:
                    answer = grammar.thinking.ends_at(token_id, seq.detokenizer)
                    if answer is not None:  # the grammar applies from here, to the answer's text so far too
                        grammar.thinking = None
                        if answer and not grammar.advance_text(answer):
                            ungrammatical.add(seq.request_id)
            except Exception as exc:  # its grammar, or its tokenizer on its text: that request ends, the rest go on
                broken.setdefault(seq.request_id, exc)
                continue
            requests[seq.request_id] = self.requests[seq.request_id]
            if seq.request_id in self._streamed:
                self._touched[seq.request_id] = None
        finished = []
        if masked:
            finished += self._fail(masked, NoTokenLeftError(
                f"a token id outside the vocabulary [0, {self.vocab_size}) was sampled: most likely every token was "
                "masked (the request's allowed_token_ids, bad_words, min_tokens and structured_outputs together "
                "left none)"))
        if invalid:  # nothing of the request's own masked them: the model's fault, not the request's
            finished += self._fail(invalid, RuntimeError(
                f"a token id outside the vocabulary [0, {self.vocab_size}) was sampled for a request that masks no "
                "token: its logits were all NaN or -inf"))
        invalid |= masked
        if ungrammatical:
            finished += self._fail(ungrammatical - invalid, RuntimeError(
                "a token its structured_outputs grammar does not allow was sampled"))
        for request_id, exc in broken.items():
            finished += self._fail({request_id} - invalid - ungrammatical, exc)
        ended = invalid | ungrammatical | broken.keys()
        step_tokens = self.stats.generated_tokens - generated_before
        for request in requests.values():
            if request.request_id in ended:
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
                self.metrics.record_first_token(request)
                step_tokens += request.seqs[0].num_prompt_tokens
            else:
                self.metrics.record_next_tokens(now - request.metrics.last_token_time)
            request.metrics.last_token_time = now
            self.scheduler.add_siblings(request.held_siblings())  # the prompt's blocks are cached now
            if request.finished:
                request.metrics.finished_time = now
                del self.requests[request.request_id]
                self.metrics.record_finished(request, self.config.max_model_len)
                finished.append((request.owner, request.output()))
        self.metrics.record_step(step_tokens)
        return finished

    def _record_logprobs(self, seq: Sequence, logprobs: TokenLogprobs):
        """The logprobs of seq's newest token (token_ids[-1])."""
        context = seq.token_ids[-1 - LOGPROB_CONTEXT_TOKENS:-1]
        seq.logprobs.append(self._logprob_dict(seq, logprobs, context))
        seq.cumulative_logprob += logprobs.logprobs[0]

    @staticmethod
    def _logprob_dict(seq: Sequence, logprobs: TokenLogprobs, context: list[int]) -> dict[int, Logprob]:
        """One token's logprobs as vLLM gives them: the token first, then the top ones, each with its text as the
        token after context (the tokens before its position)."""
        decoded = seq.detokenizer.decode_each(logprobs.token_ids, context) if seq.detokenizer else \
            [None] * len(logprobs.token_ids)
        return {t: Logprob(lp, rank, text) for t, lp, rank, text in
                zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks, decoded)}

    # Queueing and ending.

    def _queue_all(self, prompts: list[Prompt], params: list[SamplingParams], owner: object,
                   priority: list[int] | None = None) -> list[str]:
        """All or nothing: every request is validated before any is queued."""
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority has {len(priority)} values for {len(prompts)} prompts; give one per "
                                 "prompt")
            for value in priority:
                self._check_priority(value)
        validated = []
        for i, (prompt, request_params) in enumerate(zip(prompts, params)):
            try:
                validated.append(self.intake.validate(prompt, request_params))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"request {i}: {exc}") from None
        self._end_open_streams()  # only once the new call is known to be valid
        request_ids = []
        try:
            for i, valid in enumerate(validated):
                request_ids.append(self._queue(valid, owner, priority=priority[i] if priority is not None else 0))
        except BaseException:  # what was queued before the failure is taken back
            for request_id in request_ids:
                self.abort_request(request_id)
            raise
        return request_ids

    def _check_priority(self, priority):
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority={priority}: this engine serves requests first come, first served; start it "
                             f"with scheduling_policy='priority' (--scheduling-policy priority) to order them by "
                             f"priority, or pass priority=0")

    def _id_in_use(self, request_id: str) -> bool:
        """Whether a request of that id is unfinished, or finished with its output not yet returned."""
        return request_id in self.requests or request_id in self._streamed or \
            any(output.request_id == request_id for output in self._unclaimed)

    def _queue(self, valid, owner: object | None, request_id: str | None = None, priority: int = 0,
               arrival_time: float | None = None) -> str:
        if self._asleep:
            freed = " and ".join(name for tag, name in (("weights", "weights"), ("kv_cache", "KV cache"))
                                 if tag in self._asleep)
            raise EngineSleeping(f"the engine is asleep, its {freed} freed (sleep()); call wake_up() (the server: "
                                 f"POST /wake_up) before queueing requests")
        if request_id is None:
            request_id = str(next(self._request_ids))
            while self._id_in_use(request_id):
                request_id = str(next(self._request_ids))
        request = self.intake.request(request_id, valid, owner)
        self.requests[request_id] = request
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        queue_order = next(self._queue_order)
        for seq in request.seqs:  # its place under the priority policy
            seq.priority, seq.arrival_time, seq.queue_order = priority, request.metrics.arrival_time, queue_order
        # Without a prefix cache, no prompt blocks to wait for: the siblings queue with the first.
        for seq in request.seqs[:1] if self.config.enable_prefix_caching else request.seqs:
            self.scheduler.add(seq)
        return request_id

    def _end(self, request: Request, error: str | None = None):
        """End an unfinished request with reason "abort": its sequences leave the queues and free their blocks."""
        del self.requests[request.request_id]
        if request.request_id in self._streamed:
            self._touched[request.request_id] = None
        for seq in request.seqs:
            if seq.is_finished:
                continue
            if seq.has_pending_token:  # its token, still on its way from the device, is not part of the output
                seq.token_ids.pop()
            if seq.status is SequenceStatus.HELD:
                seq.status = SequenceStatus.FINISHED
            else:
                self.scheduler.finish(seq)
            seq.finish_reason, seq.stop_reason = "abort", None
        request.error = error
        request.metrics.finished_time = time.time()
        self.metrics.record_finished(request, self.config.max_model_len)

    def _end_open_streams(self):
        """A new call needs the engine: the requests of streams still open end."""
        if not self._open_streams:
            return
        for request in [request for request in self.requests.values() if request.owner in self._open_streams]:
            self._end(request)
        self._open_streams.clear()


RPC_METHODS = ("reload_weights",)  # the engine's methods that collective_rpc runs by name, as vLLM's workers have them


def check_rpc_method(method):
    if not isinstance(method, str) or method not in RPC_METHODS:
        raise ValueError(f"collective_rpc runs {', '.join(map(repr, RPC_METHODS))}; got {method!r} (nanograph runs no "
                         f"worker extensions or functions)")


def check_no_lora(lora_request):
    """vLLM's lora_request: None only."""
    if lora_request is not None:
        raise ValueError("lora_request: nanograph runs no LoRA adapters; pass lora_request=None (or merge the "
                         "adapter into the model's weights)")


def check_no_tokenization_kwargs(tokenization_kwargs):
    """vLLM's tokenization_kwargs: None only."""
    if tokenization_kwargs is not None:
        raise ValueError("tokenization_kwargs: not taken by nanograph (prompts are encoded as the tokenizer does by "
                         "default); pass tokenization_kwargs=None, or pre-tokenized prompts")


def _check_vllm_request_kwargs(lora_request, kwargs: dict):
    """add_request's vLLM keywords that nanograph has no use for: each must be its default."""
    check_no_lora(lora_request)
    unknown = [name for name in kwargs if name not in ("tokenization_kwargs", "trace_headers")]
    if unknown:
        raise TypeError(f"add_request() got an unexpected keyword argument {unknown[0]!r}")
    given = [name for name, value in kwargs.items() if value is not None]
    if given:
        raise ValueError(f"{given[0]}: not taken by nanograph's add_request; pass {given[0]}=None")


def _more_kv_cache(config: Config, runner: Runner) -> str:
    """What gives this engine a larger KV cache, in words."""
    if config.num_kv_blocks is not None:
        return f"raise num_kv_blocks (vLLM's num_gpu_blocks_override; {config.num_kv_blocks} now)"
    return runner.more_kv_cache


def _masks_tokens(seq: Sequence) -> bool:
    """Whether the sequence's own parameters mask any token (so that they may have masked all of them)."""
    params = seq.params
    return bool(params.allowed_token_ids or params.bad_words or params.min_tokens or seq.grammar is not None)


def _failed_output(request: Request) -> RequestOutput:
    """A failed request's output; where its tokenizer cannot decode its newest tokens (what failed, often), with
    the text decoded before them."""
    try:
        return request.output()
    except Exception:
        for seq in request.seqs:
            if seq.detokenizer is not None:
                seq.detokenizer.discard_pending()
        return request.output()


def _restore(seqs, states):
    for seq, state in zip(seqs, states):
        if state is not None:
            seq.generator.setstate(state)


def _model_len(asked: int | None, positions: int) -> int:
    """max_model_len before the KV cache is sized: the model's positions (max_position_embeddings, or the context
    that YaRN or linear scaling stretches it to, at most its sliding window) unless a length was asked for, which
    is capped at them."""
    if asked is None:
        return positions
    if asked > positions:
        warnings.warn(f"max_model_len {asked} is more than the model's {positions} positions "
                      f"(max_position_embeddings, or its context stretched by YaRN or linear scaling, at most its "
                      f"sliding window); using {positions}", stacklevel=4)
    return min(asked, positions)


def _generation_config_folder(config: Config) -> str | None:
    """Where the default sampling parameters come from: None for "vllm" (none)."""
    if config.generation_config == "vllm":
        return None
    if config.generation_config == "auto":
        return config.model
    if not Path(config.generation_config).is_dir():
        raise FileNotFoundError(f"generation_config={config.generation_config!r} is not a folder; pass 'auto' (the "
                                "model folder's generation_config.json), 'vllm' (no defaults) or a folder holding a "
                                "generation_config.json")
    return config.generation_config


def load_tokenizer(folder: str, trust_remote_code: bool, given: str | None = None):
    """The folder's tokenizer, or None for a model folder without one (prompts must then be token ids). given: the
    tokenizer argument, whose folder must hold one."""
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(folder) / name).is_file() for name in files):
        if given is not None:
            raise ValueError(f"tokenizer={given!r}: {folder} holds no tokenizer ({', '.join(files)}); give a "
                             "tokenizer folder or Hub id, or leave tokenizer unset for the model's")
        return None
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
