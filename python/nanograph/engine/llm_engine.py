"""LLMEngine: request intake and validation, the step loop, results and streamed deltas.

The loop keeps the device busy while the host works: a step queues its batch on the device first, then waits for
the tokens the previous step sampled and applies them (stop checks, text, outputs), then queues its own sampling.
The tokens a batch feeds that the host has not read yet stay on the device (PENDING_TOKEN, ForwardBatch.input_src).
A sequence that stops on a token the host had not read yet was fed in one step too many; that step's row is
dropped."""
from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from itertools import count
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..backends import make_runner
from ..config import Config
from ..default_model import default_model_path
from ..model_config import ModelConfig
from ..outputs import CompletionDelta, Logprob, RequestOutput
from ..sampling import PendingSample, Sampler, TokenLogprobs
from ..sampling_params import SamplingParams
from .batch import build_forward_batch
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .request import Request
from .scheduler import ScheduledBatch, Scheduler
from .sequence import PENDING_TOKEN, Sequence, SequenceStatus

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: Config, model_config: ModelConfig, runner, tokenizer):
        kv_tokens = runner.num_kv_blocks * runner.block_size
        if kv_tokens < config.max_model_len:
            raise ValueError(f"KV cache holds {kv_tokens} tokens, fewer than max_model_len={config.max_model_len}; "
                             "raise gpu_memory_utilization (or num_kv_blocks) or lower max_model_len")
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.max_context = model_config.max_context
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = set(model_config.eos_token_ids)
        block_manager = BlockManager(runner.num_kv_blocks, runner.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, block_manager, self.eos_token_ids)
        self.sampler = Sampler(runner.device, sorted(self.eos_token_ids), config.seed)
        # The core takes an all-greedy batch's argmax within its step (CudaRunner.run_greedy).
        self._core_greedy = hasattr(runner, "run_greedy")
        self.requests: dict[str, Request] = {}  # unfinished
        self._request_ids = count()
        self._in_flight: tuple[list[Sequence], PendingSample] | None = None  # sampled, not read yet
        self.device_wait_seconds = 0.0  # host time spent waiting for sampled tokens (the device was behind)

    @classmethod
    def from_config(cls, config: Config) -> LLMEngine:
        model = config.model or default_model_path()
        model_config = ModelConfig.from_pretrained(model)
        positions = model_config.max_context
        if config.max_model_len > positions and config.max_model_len != Config.max_model_len:
            # An explicit length past the model's positions (the default is capped without a word).
            warnings.warn(f"max_model_len {config.max_model_len} is more than the model's {positions} positions "
                          f"(max_position_embeddings, or YaRN's scaled context); using {positions}", stacklevel=3)
        config = replace(config, model=model, max_model_len=min(config.max_model_len, positions))
        tokenizer = _load_tokenizer(model)
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and 0 <= eos < model_config.vocab_size and eos not in model_config.eos_token_ids:
            # The tokenizer's end-of-text token ends a completion too, as in vLLM: a fine-tune often sets it
            # (e.g. <|im_end|>) while config.json keeps the base model's.
            model_config = replace(model_config, eos_token_ids=[*model_config.eos_token_ids, eos])
        return cls(config, model_config, make_runner(config, model_config), tokenizer)

    def add_request(self, prompt: Prompt, params: SamplingParams) -> str:
        """Queue one request and return its id; an invalid request raises ValueError and changes nothing."""
        return self._queue(prompt, *self._validated(prompt, params))

    def abort_request(self, request_id: str):
        """End an unfinished request wherever its sequences are; they finish with reason "abort". Ids of finished
        or unknown requests are ignored, as a request may finish while its abort is on its way."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if seq.is_finished:
                continue
            if seq.has_pending_token:  # its token, still on its way from the device, is not part of the output
                seq.token_ids.pop()
            if seq in request.held_back:
                seq.status = SequenceStatus.FINISHED
            else:
                self.scheduler.finish(seq)
            seq.finish_reason = "abort"
        request.held_back = []

    def has_unfinished(self) -> bool:
        # A sequence stays running or waiting until the token that ends it has been read.
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[RequestOutput], ScheduledBatch]:
        """Queue one batch, and apply the tokens of the one before; return the requests that finished, and the batch
        (for throughput accounting; empty when only the previous step's tokens were left to apply)."""
        batch = self.scheduler.schedule()
        logits = greedy = None
        if batch.seqs:
            forward_batch = build_forward_batch(batch, self.scheduler.block_manager)
            if self._core_greedy and self.sampler.plain_greedy(batch.seqs, self.vocab_size):
                greedy = self.runner.run_greedy(forward_batch)  # the argmax comes with the step
            else:
                logits = self.runner.run(forward_batch)
        finished = self._apply_sampled()
        if not batch.seqs:
            return finished, batch
        self.scheduler.advance(batch)
        # Prompts cut short by the token budget sample nothing yet, nor do sequences that ended meanwhile.
        rows = [i for i, (seq, samples) in enumerate(zip(batch.seqs, batch.samples)) if samples and not seq.is_finished]
        if rows:
            seqs = [batch.seqs[i] for i in rows]
            if greedy is not None:  # the core left sequence i's token at sampled_tokens[i]
                pending, sample_rows = greedy.rows(rows), rows
            else:
                pending = self.sampler.sample(logits if len(rows) == len(batch.seqs) else logits[rows], seqs)
                self.runner.publish_sampled(pending.token_ids)
                sample_rows = range(len(rows))
            for row, seq in zip(sample_rows, seqs):
                seq.token_ids.append(PENDING_TOKEN)
                seq.sample_row = row
            self._in_flight = (seqs, pending)
        return finished, batch

    def _apply_sampled(self) -> list[RequestOutput]:
        """Read the tokens the last step sampled and apply them; return the requests this finished."""
        if self._in_flight is None:
            return []
        seqs, pending = self._in_flight
        self._in_flight = None
        start = time.perf_counter()
        sampled = pending.result()
        self.device_wait_seconds += time.perf_counter() - start
        self.scheduler.postprocess(seqs, sampled.token_ids)
        now = time.time()
        requests = {}
        for seq, logprobs in zip(seqs, sampled.logprobs):
            request = self.requests.get(seq.request_id)
            if request is None:  # aborted
                continue
            self._postprocess(seq, logprobs)
            requests[seq.request_id] = request
        finished = []
        for request in requests.values():
            request.metrics.first_token_time = request.metrics.first_token_time or now
            for sibling in request.held_back:  # the prompt's blocks are cached now
                self.scheduler.add(sibling)
            request.held_back = []
            if request.finished:
                request.metrics.finished_time = now
                finished.append(self.requests.pop(request.request_id).output())
        return finished

    def generate(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        """Run every request to completion; outputs in input order. All are validated before any is queued."""
        index = {request_id: i for i, request_id in enumerate(self._queue_all(prompts, params))}
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        throughput = {"prefill": 0.0, "decode": 0.0}
        try:
            with tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as bar:
                while self.has_unfinished():
                    start = time.perf_counter()
                    finished, batch = self.step()
                    if batch.seqs:
                        throughput["prefill" if batch.is_prefill else "decode"] = \
                            batch.num_tokens / (time.perf_counter() - start)
                    bar.set_postfix({name: f"{tok_s:.0f}tok/s" for name, tok_s in throughput.items()},
                                    refresh=False)
                    for output in finished:
                        if output.request_id in index:  # requests queued with add_request before are not ours
                            outputs[index[output.request_id]] = output
                            bar.update(1)
        except BaseException:
            # An error (or an interrupt) ends this call's requests, so that the next call does not run them.
            for request_id in index:
                self.abort_request(request_id)
            raise
        return outputs

    def stream(self, prompts: list[Prompt], params: list[SamplingParams]) -> Iterator[CompletionDelta]:
        """Run the requests to completion, yielding after each step what it added to each of their completions.
        All are validated before any is queued; closing the iterator early aborts the unfinished ones."""
        requests = [self.requests[request_id] for request_id in self._queue_all(prompts, params)]
        try:
            while True:
                # While the caller holds a delta, another caller's steps (or an abort) may advance or end the
                # requests: the check comes before the take, so a last take follows every end.
                done = all(request.finished for request in requests)
                for request in requests:
                    yield from request.take_deltas()
                if done:
                    break
                if not all(request.finished for request in requests):
                    self.step()
        finally:
            for request in requests:
                if not request.finished:
                    self.abort_request(request.request_id)

    def _queue_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        validated = []
        for i, (prompt, request_params) in enumerate(zip(prompts, params)):
            try:
                validated.append(self._validated(prompt, request_params))
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None
        request_ids = []
        try:
            for prompt, request in zip(prompts, validated):
                request_ids.append(self._queue(prompt, *request))
        except BaseException:  # all or nothing: what was queued before the failure is taken back
            for request_id in request_ids:
                self.abort_request(request_id)
            raise
        return request_ids

    def _validated(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids, and the request's own copy of params (validated again: fields may have changed
        since construction), with max_tokens resolved."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer; pass prompts as token-id lists")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt or not token_ids:
            raise ValueError("prompt is empty; give at least one token")
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError("prompt token ids must be a flat list of integers")
        outside = (ids < 0) | (ids >= self.vocab_size)
        if outside.any():
            position = int(outside.argmax())
            raise ValueError(f"prompt token id {token_ids[position]} at position {position} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.config.max_model_len}: "
                             f"shorten the prompt, or raise max_model_len (the model takes up to "
                             f"{self.max_context} positions)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model folder has none; use stop_token_ids")
        for token_id in params.stop_token_ids or ():
            if isinstance(token_id, int) and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"stop_token_ids holds {token_id}, outside the vocabulary [0, {self.vocab_size})")
        room = max(1, self.config.max_model_len - len(token_ids))
        if params.max_tokens is None and params.min_tokens > room:
            raise ValueError(f"min_tokens={params.min_tokens} does not fit: the {len(token_ids)}-token prompt "
                             f"leaves {room} of max_model_len={self.config.max_model_len}; lower min_tokens or "
                             f"raise max_model_len")
        return token_ids, replace(params, max_tokens=params.max_tokens or room)

    def _queue(self, prompt: Prompt, token_ids: list[int], params: SamplingParams) -> str:
        request_id = str(next(self._request_ids))
        seqs = []
        for index in range(params.n):
            seq_params = params if params.n == 1 else \
                replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            seq = Sequence(request_id, prompt if isinstance(prompt, str) else None, token_ids, seq_params, index)
            if seq_params.seed is not None:
                seq.generator = self.sampler.new_generator(seq_params.seed)
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, seq_params)
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, seqs)
        self.scheduler.add(seqs[0])
        return request_id

    def _postprocess(self, seq: Sequence, logprobs: TokenLogprobs | None):
        """Record the token the scheduler appended: its logprobs, its text, and why it ended the sequence."""
        token_id = seq.token_ids[-1]
        if logprobs is not None:
            decoded = seq.detokenizer.decode_each(logprobs.token_ids) if seq.detokenizer else [None] * len(
                logprobs.token_ids)
            seq.logprobs.append({t: Logprob(lp, rank, text)
                                 for t, lp, rank, text in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks,
                                                              decoded)})
            seq.cumulative_logprob += logprobs.logprobs[0]
        stopped_by_token = seq.finish_reason == "stop"
        if stopped_by_token and (token_id not in self.eos_token_ids or seq.params.ignore_eos):
            seq.stop_reason = token_id
        if seq.detokenizer is None:
            return
        stop_string = seq.detokenizer.update(token_id, stopped_by_token)
        if stop_string is not None:
            if not seq.is_finished:
                self.scheduler.finish(seq)
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif seq.is_finished:
            seq.detokenizer.flush()


def _load_tokenizer(model: str):
    """The folder's tokenizer, or None for a folder without one (prompts must then be token ids)."""
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(model) / name).is_file() for name in files):
        return None
    return AutoTokenizer.from_pretrained(model)
