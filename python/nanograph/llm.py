"""LLM: the offline-inference entry point (vLLM's interface): generate(), chat(), stream() and beam_search()."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .beam_search import BeamSearchOutput, beam_search
from .config import Config
from .engine.intake import Prompt
from .engine.llm_engine import LLMEngine
from .outputs import CompletionDelta, RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """model: a Hugging Face model folder (None: the bundled SmolLM2-135M-Instruct); kwargs: Config fields."""
        self.engine = LLMEngine.from_config(Config(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or token-id lists. Outputs come back in input order."""
        return self.engine.generate(*_requests(prompts, sampling_params), use_tqdm)

    def stream(self, prompts: Prompt | list[Prompt],
               sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[CompletionDelta]:
        """Like generate(), but yields each step's new text and token ids of every completion as they come; the
        texts of one completion's deltas concatenate to its final text."""
        return self.engine.stream(*_requests(prompts, sampling_params))

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """For each prompt (any form generate() takes), its params.beam_width best beams, best first."""
        return beam_search(self.engine, _prompt_list(prompts), params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one conversation ([{"role": ..., "content": ...}, ...]) or a list of them; a content is a string
        or a list of OpenAI-style text parts ({"type": "text", "text": ...}). chat_template_kwargs go to the chat
        template (e.g. Qwen3's enable_thinking=False)."""
        if self.tokenizer is None:
            raise ValueError("chat() needs the model folder's tokenizer, and this folder has none: add its tokenizer "
                             "files, or call generate() with token-id prompts")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt_token_ids(self.tokenizer, conversation, chat_template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def chat_prompt_token_ids(tokenizer, conversation: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """One conversation rendered by the tokenizer's chat template, the assistant's turn opened, as token ids."""
    return tokenizer.apply_chat_template([_text_message(m) for m in conversation], add_generation_prompt=True,
                                         tokenize=True, return_dict=False, **(chat_template_kwargs or {}))


def _requests(prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
              ) -> tuple[list[Prompt], list[SamplingParams]]:
    """One prompt or many, and one SamplingParams for all or one per prompt, as two lists of the same length. A
    prompt is a string, a list of token ids (numpy integers too), or vLLM's {"prompt": str} /
    {"prompt_token_ids": [...]}; the engine checks each."""
    prompts = _prompt_list(prompts)
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)) or \
            not all(isinstance(params, SamplingParams) for params in sampling_params):
        raise TypeError("sampling_params must be a SamplingParams, or a list of them (one per prompt)")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params; "
                         "pass one SamplingParams, or one per prompt")
    return prompts, list(sampling_params)


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


def _text_message(message: dict) -> dict:
    """A chat message whose content is a list of text parts, with the parts joined into one string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        raise ValueError("chat() takes text content parts only ({'type': 'text', 'text': ...})")
    return {**message, "content": "".join(part["text"] for part in content)}
