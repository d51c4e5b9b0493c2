"""LLMEngine: request intake and validation, the step loop (schedule → run → sample → postprocess), results."""
from __future__ import annotations

import time
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
from ..outputs import CompletionOutput, RequestOutput
from ..sampler import Sampler
from ..sampling_params import SamplingParams
from .batch import build_forward_batch
from .block_manager import BlockManager
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: Config, model_config: ModelConfig, runner, tokenizer):
        kv_tokens = runner.num_kv_blocks * runner.block_size
        if kv_tokens < config.max_model_len:
            raise ValueError(f"KV cache holds {kv_tokens} tokens, fewer than max_model_len={config.max_model_len}; "
                             "raise gpu_memory_utilization (or num_kv_blocks) or lower max_model_len")
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.runner = runner
        self.tokenizer = tokenizer
        block_manager = BlockManager(runner.num_kv_blocks, runner.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, block_manager, set(model_config.eos_token_ids))
        self.sampler = Sampler(runner.device, config.seed)
        self._request_ids = count()

    @classmethod
    def from_config(cls, config: Config) -> LLMEngine:
        model = config.model or default_model_path()
        model_config = ModelConfig.from_pretrained(model)
        config = replace(config, model=model,
                         max_model_len=min(config.max_model_len, model_config.max_position_embeddings))
        return cls(config, model_config, make_runner(config, model_config), _load_tokenizer(model))

    def add_request(self, prompt: Prompt, params: SamplingParams) -> str:
        """Queue one request and return its id; an invalid request raises ValueError and changes nothing."""
        return self._add(prompt, self._validated_token_ids(prompt, params), params)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[RequestOutput], ScheduledBatch]:
        """Run one batch; return the requests it finished, and the batch (for throughput accounting)."""
        batch = self.scheduler.schedule()
        logits = self.runner.run(build_forward_batch(batch.seqs, batch.num_new_tokens, self.runner.block_size))
        rows = [i for i, samples in enumerate(batch.samples) if samples]
        if len(rows) < len(batch.seqs):  # prompts cut short by the token budget sample nothing yet
            logits = logits[rows]
        token_ids = self.sampler(logits, [batch.seqs[i].params for i in rows]) if rows else []
        finished = self.scheduler.postprocess(batch, token_ids)
        return [self._request_output(seq) for seq in finished], batch

    def generate(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        """Run every request to completion; outputs in input order. All are validated before any is queued."""
        token_ids = []
        for i, (prompt, request_params) in enumerate(zip(prompts, params)):
            try:
                token_ids.append(self._validated_token_ids(prompt, request_params))
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None
        index = {self._add(*request): i for i, request in enumerate(zip(prompts, token_ids, params))}
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        throughput = {"prefill": 0.0, "decode": 0.0}
        with tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as bar:
            while self.has_unfinished():
                start = time.perf_counter()
                finished, batch = self.step()
                throughput["prefill" if batch.is_prefill else "decode"] = \
                    batch.num_tokens / (time.perf_counter() - start)
                bar.set_postfix({name: f"{tok_s:.0f}tok/s" for name, tok_s in throughput.items()}, refresh=False)
                for output in finished:
                    if output.request_id in index:  # requests queued with add_request before are not ours
                        outputs[index[output.request_id]] = output
                        bar.update(1)
        return outputs

    def _validated_token_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        params.verify()
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
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.config.max_model_len}")
        return token_ids

    def _add(self, prompt: Prompt, token_ids: list[int], params: SamplingParams) -> str:
        request_id = str(next(self._request_ids))
        self.scheduler.add(Sequence(request_id, prompt if isinstance(prompt, str) else None, token_ids, params))
        return request_id

    def _request_output(self, seq: Sequence) -> RequestOutput:
        completion = seq.completion_token_ids
        text = self.tokenizer.decode(completion, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            outputs=[CompletionOutput(index=0, text=text, token_ids=completion, finish_reason=seq.finish_reason)],
            finished=True, num_cached_tokens=seq.num_cached_tokens)


def _load_tokenizer(model: str):
    """The folder's tokenizer, or None for a folder without one (prompts must then be token ids)."""
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(model) / name).is_file() for name in files):
        return None
    return AutoTokenizer.from_pretrained(model)
