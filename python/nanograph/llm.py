"""LLM: the offline-inference entry point (vLLM's interface): generate(), chat(), stream() and beam_search(); embed()
and encode() for a model run as an embedding model (runner="pooling")."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from .beam_search import BeamSearchOutput, beam_search
from .chat_template import render_chat
from .config import POOLING_TASKS
from .engine.intake import Prompt
from .engine.llm_engine import LLMEngine, check_no_lora, check_no_tokenization_kwargs, check_rpc_method
from .engine_args import engine_config
from .inputs import TokensPrompt
from .metrics import Metric
from .outputs import CompletionDelta, RequestOutput
from .pooling import (TASK_NOUNS, ClassificationRequestOutput, EmbeddingRequestOutput, PoolingParams,
                      PoolingRequestOutput, ScoringRequestOutput, classifier_scores, cosine_scores, pair_token_ids,
                      pair_truncation, score_pairs)
from .sampling_params import BeamSearchParams, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """model: a Hugging Face model folder or Hub id (e.g. "Qwen/Qwen3-0.6B", fetched into the Hub cache;
        revision= picks a branch, tag or commit); None: the bundled SmolLM2-135M-Instruct.

        kwargs: vLLM's engine arguments. Config's fields (max_model_len, dtype, quantization ("fp8": weights quantized
        at load; an FP8 checkpoint runs as such without it), kv_cache_dtype ("fp8": an e4m3 KV cache with a K and a V
        scale per layer), max_num_seqs, gpu_memory_utilization, enforce_eager, enable_prefix_caching, seed,
        tensor_parallel_size, tokenizer, generation_config, ...) take effect; the rest of vLLM's
        (pipeline_parallel_size, cpu_offload_gb, swap_space, ...) are listed in engine_args.VLLM_ARGS with the values
        nanograph implements or ignores, and any other value is a ValueError naming the argument."""
        self.engine = LLMEngine.from_config(engine_config(model, **kwargs))

    def shutdown(self):
        """End the engine's worker processes (tensor_parallel_size > 1), also done at interpreter exit."""
        self.engine.shutdown()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine."""
        return self.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def set_tokenizer(self, tokenizer):
        """Encode and decode requests queued from now on with tokenizer."""
        self.engine.set_tokenizer(tokenizer)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prompt prefix, so that later requests compute all of their prompt tokens
        (after a change of weights, or to time prefills from a cold cache). Returns False, changing nothing, while
        a request holds KV blocks (a stream still running)."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's metrics, as vLLM's metrics reader returns them (Counter, Gauge and
        Histogram values; metrics.py), named as the server's /metrics names them ("nanograph:num_requests_running",
        "nanograph:time_to_first_token_seconds", ...). Requests count once they have finished."""
        return self.engine.get_metrics()

    def start_profile(self, profile_prefix: str | None = None):
        """vLLM's: start the profiler that profiler_config= configures (e.g. {"profiler": "torch",
        "torch_profiler_dir": "./traces"}; profiler.py), recording the engine's steps until stop_profile().
        profile_prefix: the trace file's name begins with it."""
        self.engine.start_profile(profile_prefix)

    def stop_profile(self):
        """vLLM's: end the profile, writing its trace into torch_profiler_dir."""
        self.engine.stop_profile()

    def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort"):
        """vLLM's (with enable_sleep_mode=True): free the device memory of the KV cache (its contents, the prefix
        cache's too, are forgotten) and of the weights, which level 1 keeps in host memory and level 2 lets go (wake_up
        reads the checkpoint again); tags ("weights", "kv_cache") sleep those alone. mode: unfinished requests are
        aborted ("abort") or run to their end first ("wait"). Until wake_up(), requests are refused."""
        self.engine.sleep(level, tags=tags, mode=mode)

    def wake_up(self, tags: list[str] | None = None):
        """vLLM's: restore what sleep() freed: "weights", "kv_cache" or both (None); the weights come first."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
                       ) -> list:
        """vLLM's call of a method on every worker, with its results in a list (one worker here): the engine's
        methods of RPC_METHODS by name ("reload_weights"); functions and worker extensions are not run."""
        check_rpc_method(method)
        return [getattr(self.engine, method)(*args, **(kwargs or {}))]

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams that generate(), chat() and stream() use when given none: the model folder's
        generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as
        max_tokens) over SamplingParams' defaults, as vLLM does (generation_config="vllm": the defaults alone)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request=None, priority: list[int] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a TextPrompt or TokensPrompt, or a list of those. Outputs come back
        in input order. use_tqdm: show a progress bar, or the tqdm class to show it with (vLLM's). lora_request:
        vLLM's, None only (nanograph runs no LoRA adapters); priority: vLLM's, one int per prompt (lower first)
        with scheduling_policy="priority", else None or zeros; tokenization_kwargs: vLLM's, None only."""
        check_no_lora(lora_request)
        check_no_tokenization_kwargs(tokenization_kwargs)
        prompts, params = self._requests(prompts, sampling_params)
        return self.engine.generate(prompts, params, use_tqdm, priority)

    def stream(self, prompts: Prompt | list[Prompt],
               sampling_params: SamplingParams | list[SamplingParams] | None = None,
               lora_request=None) -> Iterator[CompletionDelta]:
        """Like generate(), but yields each step's new text and token ids of every completion as they come; the
        texts of one completion's deltas concatenate to its final text (SamplingParams.output_kind: CUMULATIVE
        yields all so far each time, FINAL_ONLY only the finished completion)."""
        check_no_lora(lora_request)
        return self.engine.stream(*self._requests(prompts, sampling_params))

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """For each prompt (any form generate() takes), its params.beam_width best beams, best first (vLLM's
        arguments, in its order)."""
        check_no_lora(lora_request)
        return beam_search(self.engine, _prompt_list(prompts), params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool | Callable = True,
             lora_request=None, chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None,
             tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one conversation ([{"role": ..., "content": ...}, ...]) or a list of them; a content is a string
        or a list of OpenAI-style text parts ({"type": "text", "text": ...}). vLLM's arguments, in its order:
        chat_template replaces the tokenizer's; chat_template_content_format gives the template each content as one
        string ("string") or as a list of text parts ("openai"), by default ("auto") as the template reads it;
        add_generation_prompt opens the assistant's turn; continue_final_message (with add_generation_prompt=False)
        leaves the last message open for the model to continue; tools and chat_template_kwargs (e.g. Qwen3's
        enable_thinking=False) go to the template; mm_processor_kwargs: None only (text models). Each output's prompt
        is the rendered text."""
        check_no_lora(lora_request)
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs: nanograph serves text models, with no multimodal processor; pass "
                             "mm_processor_kwargs=None")
        if self.tokenizer is None:
            raise ValueError("chat() needs the model folder's tokenizer, and this folder has none: add its tokenizer "
                             "files, or call generate() with token-id prompts")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = render_chat(self.tokenizer, conversation, chat_template, add_generation_prompt,
                               continue_final_message, tools, chat_template_kwargs, chat_template_content_format)
            prompts.append(TokensPrompt(prompt_token_ids=self.tokenizer.encode(text, add_special_tokens=False),
                                        prompt=text))
        return self.generate(prompts, sampling_params, use_tqdm, tokenization_kwargs=tokenization_kwargs)

    def embed(self, prompts: Prompt | list[Prompt], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable = True, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              lora_request=None, tokenization_kwargs: dict | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (an LLM built with runner="pooling"), in input order: output.outputs.embedding is
        a list of floats. truncate_prompt_tokens keeps each prompt's last tokens (-1: max_model_len);
        pooling_params (one for all or one per prompt) may ask for a Matryoshka model's leading dimensions and
        whether to normalize."""
        return [EmbeddingRequestOutput.from_base(output) for output in self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            lora_request=lora_request, pooling_task="embed", tokenization_kwargs=tokenization_kwargs)]

    def classify(self, prompts: Prompt | list[Prompt], *, use_tqdm: bool | Callable = True,
                 pooling_params: PoolingParams | list[PoolingParams] | None = None, lora_request=None,
                 tokenization_kwargs: dict | None = None) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities from a sequence classifier (a folder whose architectures are
        *ForSequenceClassification), in input order: output.outputs.probs, one per class (in config.json's id2label
        order); PoolingParams(use_activation=False) gives the logits instead."""
        return [ClassificationRequestOutput.from_base(output) for output in self.encode(
            prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="classify",
            tokenization_kwargs=tokenization_kwargs)]

    def encode(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | list[PoolingParams] | None = None,
               *, truncate_prompt_tokens: int | None = None, use_tqdm: bool | Callable = True, lora_request=None,
               pooling_task: str | None = None, tokenization_kwargs: dict | None = None
               ) -> list[PoolingRequestOutput]:
        """embed()'s or classify()'s pooling, as the model does it (pooling_task "embed", "classify" or None), each
        output's outputs.data a float32 tensor (vLLM's)."""
        check_no_lora(lora_request)
        check_no_tokenization_kwargs(tokenization_kwargs)
        pooler = self.engine.pooler
        if pooler is None:
            raise ValueError("embed(), classify(), encode() and score() need a pooling model: build the LLM with "
                             "runner='pooling' (vLLM's task='embed' is taken too), or from a sequence classifier's "
                             "folder (architectures *ForSequenceClassification); this one generates text")
        if pooling_task not in (None, *POOLING_TASKS):
            raise ValueError(f"pooling_task={pooling_task!r} is not one nanograph has; pass "
                             f"{' or '.join(map(repr, POOLING_TASKS))}, or None")
        if pooling_task not in (None, pooler.task):
            raise ValueError(f"pooling_task={pooling_task!r}: this model is {TASK_NOUNS[pooler.task]}, which "
                             f"nanograph runs for {pooler.task!r} only; call {pooler.task}() (or use "
                             f"{TASK_NOUNS[pooling_task]}'s folder)")
        prompts, params = _requests(prompts, PoolingParams() if pooling_params is None else pooling_params,
                                    PoolingParams)
        if truncate_prompt_tokens is not None:
            params = [replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self.engine.generate(prompts, params, use_tqdm)

    def score(self, data_1: Prompt | list[Prompt], data_2: Prompt | list[Prompt], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool | Callable = True,
              pooling_params: PoolingParams | None = None, lora_request=None,
              tokenization_kwargs: dict | None = None) -> list[ScoringRequestOutput]:
        """vLLM's score(), pairing one first text with each second one, or as many with as many in order. On an
        embedding model: the cosine similarity of each pair's embeddings (outputs.score in [-1, 1]). On a
        cross-encoder (a classifier of one label): its probability for the pair's texts read together, the
        tokenizer's encoding of the pair (outputs.score in [0, 1] with a sigmoid); truncate_prompt_tokens then
        bounds each pair's tokens, the tokenizer cutting the longer text first."""
        firsts, seconds = _prompt_list(data_1), _prompt_list(data_2)
        pairs = score_pairs(firsts, seconds)  # the sides pair up, before anything runs
        pooler = self.engine.pooler
        if pooler is not None and pooler.task == "classify":
            if pooler.num_labels != 1:
                raise ValueError(f"score() on a classifier needs a cross-encoder, a classifier of one label; this "
                                 f"one has {pooler.num_labels} ({', '.join(pooler.labels)}): use classify()")
            if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
                raise TypeError("score()'s pooling_params is one PoolingParams for every pair, or None")
            params = pooling_params or PoolingParams()
            k = pair_truncation(params.truncate_prompt_tokens if truncate_prompt_tokens is None
                                else truncate_prompt_tokens, self.engine.config.max_model_len)
            prompts = [TokensPrompt(prompt_token_ids=pair_token_ids(self.tokenizer, *pair, max_length=k))
                       for pair in pairs]
            logits = self.encode(prompts, replace(params, truncate_prompt_tokens=None, use_activation=False),
                                 use_tqdm=use_tqdm, lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
            return classifier_scores(logits, "identity" if params.use_activation is False else pooler.score_activation)
        outputs = self.encode(firsts + seconds, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        return cosine_scores(score_pairs(outputs[:len(firsts)], outputs[len(firsts):]))

    def _requests(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
                  ) -> tuple[list[Prompt], list[SamplingParams]]:
        return _requests(prompts, self.get_default_sampling_params() if sampling_params is None else sampling_params)


def _requests(prompts: Prompt | list[Prompt], params, kind: type = SamplingParams) -> tuple[list[Prompt], list]:
    """One prompt or many, and one params of `kind` (SamplingParams, PoolingParams) for all or one per prompt, as
    two lists of the same length. A prompt is a string, a list of token ids (numpy integers too), or vLLM's
    TextPrompt {"prompt": str} / TokensPrompt {"prompt_token_ids": [...]}; the engine checks each."""
    prompts = _prompt_list(prompts)
    name = "sampling_params" if kind is SamplingParams else "pooling_params"
    if isinstance(params, kind):
        params = [params] * len(prompts)
    if not isinstance(params, (list, tuple)) or not all(isinstance(one, kind) for one in params):
        raise TypeError(f"{name} must be a {kind.__name__}, or a list of them (one per prompt)")
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} {name.replace('_', ' ')}; pass one "
                         f"{kind.__name__}, or one per prompt")
    return prompts, list(params)


def _prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """One prompt or many as a list of prompts."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, a dict with 'prompt' or 'prompt_token_ids', "
                        f"or a list of those; got {type(prompts).__name__}")
    return list(prompts)


def _is_token_ids(prompts) -> bool:
    """Whether prompts is one prompt of token ids rather than a list of prompts."""
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    return isinstance(prompts, (list, tuple)) and bool(prompts) and \
        isinstance(prompts[0], (int, np.integer)) and not isinstance(prompts[0], bool)
