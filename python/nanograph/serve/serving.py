"""ServedModel: what the API handlers share: the model's name and limits, its tokenizer (the frontend's own
instance: the engine process detokenises with the engine's), the engine, and a request's completions collected."""
from __future__ import annotations

from dataclasses import dataclass, field

from transformers import AutoTokenizer

from ..chat_template import chat_prompt_token_ids
from ..outputs import Logprob
from ..sampling_params import SamplingParams
from .async_llm import AsyncLLM, EngineUnavailable, RequestStream
from .errors import APIError, invalid_value
from .protocol import ChatMessage, SamplingRequest, Usage


@dataclass
class Completion:
    """One choice, collected from its deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ServedModel:
    def __init__(self, async_llm: AsyncLLM, name: str, tokenizer=None):
        """tokenizer: the frontend's (None: a new instance from the model folder)."""
        self.async_llm = async_llm
        self.name = name
        self.path = async_llm.info.model
        self.max_model_len = async_llm.info.max_model_len
        self.sampling_defaults = async_llm.info.sampling_defaults
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(async_llm.info.tokenizer or self.path)

    def check_model(self, model: str | None):
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.name}`", "model",
                           "model_not_found")

    def encode(self, text: str) -> list[int]:
        """Token ids as the engine's intake makes them from text."""
        return self.tokenizer.encode(text)

    def render_chat(self, messages: list[ChatMessage], chat_template_kwargs: dict | None) -> list[int]:
        try:
            return chat_prompt_token_ids(self.tokenizer, [message.model_dump() for message in messages],
                                         chat_template_kwargs)
        except Exception as exc:  # the template's own errors (a jinja raise_exception, a bad keyword)
            raise APIError(400, f"the chat template could not render the messages: {type(exc).__name__}: {exc}",
                           "messages", "invalid_value") from None

    def check_room(self, prompts: list[list[int]], max_tokens: int | None, field_name: str):
        """vLLM's rule: a prompt and max_tokens must fit in max_model_len together (a prompt too long on its own
        is the engine's error to report)."""
        if max_tokens is None:
            return
        for i, prompt in enumerate(prompts):
            if len(prompt) <= self.max_model_len < len(prompt) + max_tokens:
                which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
                raise APIError(400, f"{which} has {len(prompt)} tokens and {field_name} is {max_tokens}: "
                                    f"{len(prompt) + max_tokens} is more than max_model_len={self.max_model_len}; "
                                    f"lower {field_name} to at most {self.max_model_len - len(prompt)}, or shorten "
                                    "the prompt", field_name, "context_length_exceeded")

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None, logprobs: int | None
                        ) -> SamplingParams:
        try:
            return request.sampling_params(max_tokens, logprobs, self.sampling_defaults)
        except (ValueError, TypeError) as exc:
            raise invalid_value(exc, request) from None

    async def generate(self, request: SamplingRequest, prompts: list[list[int]], params: SamplingParams
                       ) -> RequestStream:
        """One engine request per prompt; the engine's validation errors are 400s."""
        try:
            return await self.async_llm.generate(prompts, [params] * len(prompts))
        except (ValueError, TypeError) as exc:
            raise invalid_value(exc, request) from None
        except EngineUnavailable as exc:
            raise unavailable(exc) from None
        except Exception as exc:  # the engine failed to take this request (and goes on with the others)
            raise engine_failure(f"{type(exc).__name__}: {exc}") from None

    @staticmethod
    async def collect(stream: RequestStream, n: int) -> list[Completion]:
        """Every choice of a non-streamed request (prompt i's completion j is choice i * n + j); a failure inside
        the engine is a 500."""
        completions: dict[int, Completion] = {}
        try:
            async for deltas in stream:
                for prompt_index, delta in deltas:
                    if delta.error is not None:
                        raise engine_failure(delta.error)
                    completion = completions.setdefault(prompt_index * n + delta.index, Completion())
                    completion.text += delta.text
                    completion.token_ids += delta.token_ids
                    completion.logprobs += delta.logprobs or []
                    if delta.finished:
                        completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
        except EngineUnavailable as exc:
            raise unavailable(exc) from None
        finally:
            stream.close()
        return [completions[i] for i in sorted(completions)]


def wants_usage_chunk(request: SamplingRequest) -> bool:
    """stream_options.include_usage; stream_options without stream is a 400."""
    if request.stream_options is None:
        return False
    if not request.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")
    return request.stream_options.include_usage


def engine_failure(error: str) -> APIError:
    return APIError(500, f"the request failed in the engine: {error}", code="engine_error")


def unavailable(exc: EngineUnavailable) -> APIError:
    return APIError(503, str(exc), code="engine_unavailable")


def usage(prompts: list[list[int]], num_completion_tokens: int) -> Usage:
    num_prompt_tokens = sum(map(len, prompts))
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens)
