"""ServedModel: what the API handlers share: the model's name and limits, its tokenizer (the frontend's own
instance: the engine process detokenises with the engine's), the engine, and a request's completions collected."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from ..chat_template import ChatOptionError, ChatTemplateError, chat_prompt_token_ids
from ..engine.intake import check_prompt_token_ids, truncated
from ..engine.llm_engine import EngineSleeping, NoTokenLeftError
from ..outputs import CompletionDelta, Logprob
from ..reasoning import end_token_id, start_token_id
from ..sampling.grammar import StructuredOutputError
from ..pooling import PoolingParams
from ..sampling_params import SamplingParams, check_truncate_prompt_tokens
from .async_llm import AsyncLLM, EngineUnavailable, RequestStream
from .errors import APIError, invalid_value
from .protocol import (ChatMessage, CompletionTokensDetails, PoolingRequest, PromptLogprob, PromptLogprobs,
                       PromptTokensDetails, SamplingRequest, Usage)
from .tool_calls import ToolCall, mistral_call_id


_CHECKS_NINE_CHARACTER_IDS = re.compile(r"\.id\s*\|\s*length\s*[!=]=\s*9\b")


def _checks_call_ids(template: str | dict | None) -> bool:
    """Whether a chat template (or any of a tokenizer's named ones) checks tool call ids for 9 characters."""
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(text, str) and _CHECKS_NINE_CHARACTER_IDS.search(text) for text in texts)


@dataclass
class Completion:
    """One choice, collected from its deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # where the request asked for them


class ServedModel:
    def __init__(self, async_llm: AsyncLLM, names: str | list[str], tokenizer=None,
                 trust_request_chat_template: bool = False, chat_template: str | None = None,
                 content_format: str = "auto", trust_remote_code: bool = False, response_role: str = "assistant",
                 tool_call_parser: str | None = None, prompt_tokens_details: bool = False,
                 return_tokens_as_token_ids: bool = False, default_chat_template_kwargs: dict | None = None,
                 force_include_usage: bool = False):
        """names: what clients may call the model, the first in responses; tokenizer: the frontend's (None: a new
        instance from the model folder, loaded as the engine's); chat_template: the server's in place of the
        tokenizer's; content_format: how the template sees a content (chat_template.render_chat's); response_role: a
        chat reply's role when add_generation_prompt is on."""
        self.async_llm = async_llm
        self.response_role = response_role
        self.tool_call_parser = tool_call_parser  # tool_calls.TOOL_CALL_PARSERS; None: no "auto" tool choice
        self.prompt_tokens_details = prompt_tokens_details  # usage reports the prompt tokens the prefix cache held
        # Logprobs name tokens "token_id:{id}" where a request does not say (vLLM's --return-tokens-as-token-ids).
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        # The chat template's keywords where a request does not give them (vLLM's --default-chat-template-kwargs,
        # e.g. Qwen3's {"enable_thinking": false}).
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        self.force_include_usage = force_include_usage  # every stream's last chunk is its usage (vLLM's flag)
        # The engine's (reasoning.REASONING_PARSERS), which applies grammars after the thinking; None: a reply is
        # all content.
        self.reasoning_parser = async_llm.info.reasoning_parser
        self.runner = async_llm.info.runner  # "pooling": an embedding model or a classifier, else "generate"
        self.pooling_task = async_llm.info.pooling_task  # "embed" (/v1/embeddings) or "classify" (/classify)
        self.labels = async_llm.info.labels  # a classifier's class names
        self.score_activation = async_llm.info.score_activation  # a cross-encoder's score of its logit
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_template = chat_template
        self.content_format = content_format
        self.names = [names] if isinstance(names, str) else list(names)
        self.name = self.names[0]
        self.path = async_llm.info.model
        self.max_model_len = async_llm.info.max_model_len
        self.sampling_defaults = async_llm.info.sampling_defaults
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(async_llm.info.tokenizer or self.path,
                                                                    trust_remote_code=trust_remote_code)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # </think>'s and <think>'s tokens, where the tokenizer has them: what counts a reply's thinking's tokens
        # (usage).
        self.think_tokens = (end_token_id(self.tokenizer), start_token_id(self.tokenizer)) \
            if self.reasoning_parser is not None else (None, None)
        # Mistral's chat templates raise on a tool call id that is not 9 characters long, so the calls this server
        # returns, which a client sends back in the next turn, get such ids where the template checks for them or
        # the parser is Mistral's (named and required tool choices too).
        self.template_checks_call_ids = _checks_call_ids(chat_template
                                                         or getattr(self.tokenizer, "chat_template", None))

    def with_call_id(self, call: ToolCall, chat_template: str | None = None) -> ToolCall:
        """call, its id one that the chat template takes back (see template_checks_call_ids): the request's own
        chat_template where it brought one, else the model's."""
        checks = self.template_checks_call_ids if chat_template is None else _checks_call_ids(chat_template)
        if (checks or self.tool_call_parser == "mistral") and len(call.id) != 9:
            call.id = mistral_call_id()
        return call

    def check_model(self, model: str | None):
        if model and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{', '.join(f'`{name}`' for name in self.names)}", "model", "model_not_found")

    async def tokenized(self, function, *args, **kwargs):
        """function(*args, **kwargs) on the tokenizer's thread: a long prompt's encoding or chat rendering (seconds
        for a few MB of text) leaves the event loop free for the other requests' streams, and the tokenizer is
        used by one thread at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                functools.partial(function, *args, **kwargs))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids as the engine's intake makes them from text (without the tokenizer's special tokens if not
        add_special_tokens)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def render_chat(self, messages: list[ChatMessage], request) -> list[int]:
        """render_chat_now, on the tokenizer's thread."""
        return await self.tokenized(self.render_chat_now, messages, request)

    def render_chat_now(self, messages: list[ChatMessage], request) -> list[int]:
        """request: a chat or tokenize request (its chat_template_kwargs, add_generation_prompt,
        continue_final_message, chat_template and tools). A template of the request's own (chat_template, or in
        chat_template_kwargs) runs only on a server started with --trust-request-chat-template, as vLLM's."""
        if not self.trust_request_chat_template and (request.chat_template is not None or
                                                     "chat_template" in (request.chat_template_kwargs or {})):
            raise APIError(400, "this server renders chats with the model's own template; a request's chat_template "
                                "needs a server started with --trust-request-chat-template", "chat_template",
                           "invalid_value")
        try:
            return chat_prompt_token_ids(self.tokenizer, [message.model_dump() for message in messages],
                                         chat_template_kwargs={**self.default_chat_template_kwargs,
                                                               **(request.chat_template_kwargs or {})},
                                         chat_template=request.chat_template if request.chat_template is not None
                                         else self.chat_template,
                                         add_generation_prompt=request.add_generation_prompt,
                                         continue_final_message=request.continue_final_message, tools=request.tools,
                                         content_format=self.content_format,
                                         # vLLM's chats: the template writes the special tokens, unless asked
                                         add_special_tokens="add_special_tokens" in request.model_fields_set
                                         and request.add_special_tokens)
        except ChatOptionError as exc:
            raise APIError(400, str(exc), exc.field, "invalid_value") from None
        except ChatTemplateError as exc:  # the template's own errors (a jinja raise_exception, a bad keyword)
            raise APIError(400, str(exc), "messages", "invalid_value") from None
        except Exception as exc:  # the tokenizer's, on the rendered text
            raise APIError(400, f"the rendered messages could not be tokenized: {type(exc).__name__}: {exc}",
                           "messages", "invalid_value") from None

    def admit(self, request: SamplingRequest):
        """A 400 for the first field the request asks for that this server cannot honour; the server's defaults
        for the fields it left out (return_tokens_as_token_ids: --return-tokens-as-token-ids)."""
        unsupported = request.unsupported()
        if unsupported is not None:
            raise APIError(400, unsupported[1], unsupported[0], "unsupported_value")
        if request.return_tokens_as_token_ids is None:
            request.return_tokens_as_token_ids = self.return_tokens_as_token_ids

    def truncate(self, prompts: list[list[int]], request: SamplingRequest | PoolingRequest) -> list[list[int]]:
        """vLLM's truncate_prompt_tokens, before check_room: each prompt's last k tokens (-1: max_model_len)."""
        k = request.truncate_prompt_tokens
        if k is None:
            return prompts
        try:
            check_truncate_prompt_tokens(k)
            return [truncated(prompt, k, self.max_model_len) for prompt in prompts]
        except ValueError as exc:
            raise invalid_value(exc, request) from None

    def check_token_ids(self, prompts: list[list[int]], request: SamplingRequest):
        """The engine's check of prompts given as token ids, for a request that decodes them before the engine
        sees them (echo): a 400 naming the prompt, not the tokenizer's error."""
        for i, prompt in enumerate(prompts):
            try:
                check_prompt_token_ids(prompt, self.async_llm.info.vocab_size)
            except ValueError as exc:
                raise invalid_value(ValueError(f"prompt {i}: {exc}" if len(prompts) > 1 else str(exc)),
                                    request) from None

    def check_room(self, prompts: list[list[int]], max_tokens: int | None, field_name: str, prompt_field: str):
        """vLLM's rule: a prompt must be shorter than max_model_len (one that fills it leaves no room for output),
        and a prompt and max_tokens must fit in it together. The messages start as vLLM's ("This model's maximum
        context length is ..."), which clients recognise, with code context_length_exceeded. prompt_field: the
        request's field for the prompt (prompt, messages)."""
        limit = self.max_model_len
        for i, prompt in enumerate(prompts):
            which = f" (prompt {i})" if len(prompts) > 1 else ""
            if len(prompt) >= limit:
                room = "which leaves no room for output" if len(prompt) == limit else "more than it can hold"
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request "
                                    f"has {len(prompt)} input tokens{which}, {room}; shorten the {prompt_field} to "
                                    f"fewer than {limit} tokens (or set truncate_prompt_tokens)",
                               field_name if len(prompt) == limit and max_tokens is not None else prompt_field,
                               "context_length_exceeded")
            if max_tokens is not None and len(prompt) + max_tokens > limit:
                raise APIError(400, f"{field_name} is too large: {max_tokens}. This model's maximum context length "
                                    f"is {limit} tokens and your request has {len(prompt)} input tokens{which} "
                                    f"({max_tokens} > {limit} - {len(prompt)}); lower {field_name} to at most "
                                    f"{limit - len(prompt)}, or shorten the {prompt_field}", field_name,
                               "context_length_exceeded")

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        renames: dict[str, str] | None = None) -> SamplingParams:
        """renames: SamplingParams' field name -> the request's (max_tokens -> max_completion_tokens), for the
        error messages."""
        try:
            return request.sampling_params(max_tokens, logprobs, self.sampling_defaults)
        except (ValueError, TypeError) as exc:
            raise invalid_value(exc, request, renames) from None

    @staticmethod
    def with_prompt_logprobs(request: SamplingRequest, params: SamplingParams, k: int | None,
                             field_name: str = "prompt_logprobs") -> SamplingParams:
        """params asking for k prompt logprobs (None: params as they are); a k SamplingParams refuses is a 400
        naming field_name, the request's field that asked for them."""
        if k is None:
            return params
        try:
            return dataclasses.replace(params, prompt_logprobs=k)
        except (ValueError, TypeError) as exc:
            raise invalid_value(exc, request, {"prompt_logprobs": field_name}) from None

    async def generate(self, request: SamplingRequest | PoolingRequest, prompts: list[list[int]],
                       params: SamplingParams | PoolingParams, renames: dict[str, str] | None = None
                       ) -> RequestStream:
        """One engine request per prompt; the engine's validation errors are 400s."""
        try:
            return await self.async_llm.generate(prompts, [params] * len(prompts), request.priority)
        except (ValueError, TypeError) as exc:
            raise invalid_value(exc, request, renames) from None
        except EngineUnavailable as exc:
            raise unavailable(exc) from None
        except EngineSleeping as exc:  # POST /sleep, until POST /wake_up
            raise APIError(503, str(exc), code="engine_sleeping") from None
        except Exception as exc:  # the engine failed to take this request (and goes on with the others)
            raise engine_failure(f"{type(exc).__name__}: {exc}") from None

    def cached_tokens(self) -> CachedTokens | None:
        """A response's count of cached prompt tokens, where usage reports them (None: it does not)."""
        return CachedTokens() if self.prompt_tokens_details else None

    @staticmethod
    async def collect(stream: RequestStream, n: int, cached: CachedTokens | None = None) -> list[Completion]:
        """Every choice of a non-streamed request (prompt i's completion j is choice i * n + j), the prompts' cached
        tokens counted into cached; a failure inside the engine is a 500."""
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
                        completion.prompt_logprobs = delta.prompt_logprobs
                        if cached is not None:
                            cached.add(prompt_index, delta)
        except EngineUnavailable as exc:
            raise unavailable(exc) from None
        finally:
            stream.close()
        return [completions[i] for i in sorted(completions)]


def api_logprob(logprob: float) -> float:
    """A logprob as the API gives it: -inf (a token the request's constraints masked) as -9999.0, vLLM's floor, since
    JSON has no infinity."""
    return max(logprob, -9999.0)


def api_prompt_logprobs(prompt_logprobs: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs of a response: each prompt token's entries by token id (the first token's null)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {token_id: PromptLogprob(logprob=api_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in entry.items()} for entry in prompt_logprobs]


def wants_usage_chunk(request: SamplingRequest, force: bool = False) -> bool:
    """stream_options.include_usage, or any stream where force (--enable-force-include-usage); stream_options with a
    field but without stream is a 400 (an empty one is taken, as vLLM takes it)."""
    options = request.stream_options
    if options is not None and not request.stream and (options.model_fields_set or options.model_extra):
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")
    if not request.stream:
        return False
    return force or (options is not None and bool(options.include_usage))


def make_response_id(prefix: str, raw_request, request: SamplingRequest) -> str:
    """A response's id, as vLLM makes it: the prefix and the client's X-Request-Id header, else the request's
    request_id field, else a fresh uuid."""
    return f"{prefix}-{raw_request.headers.get('X-Request-Id') or request.request_id or uuid.uuid4().hex}"


# Errors the engine ends a request with that the request itself caused: a grammar llguidance cannot follow, or
# constraints that leave no token to sample. Each is a 400; any other is a 500.
REQUEST_CAUSED = tuple(f"{error.__name__}: " for error in (StructuredOutputError, NoTokenLeftError))


def engine_failure(error: str) -> APIError:
    """The response for a request the engine ended with an error (its output's error: "Type: message")."""
    for prefix in REQUEST_CAUSED:
        if error.startswith(prefix):
            return APIError(400, error[len(prefix):], code="invalid_value")
    return APIError(500, f"the request failed in the engine: {error}", code="engine_error")


def unavailable(exc: EngineUnavailable) -> APIError:
    return APIError(503, str(exc), code="engine_unavailable")


def wants_continuous_usage(request: SamplingRequest) -> bool:
    """vLLM's stream_options.continuous_usage_stats, which counts only beside include_usage."""
    options = request.stream_options
    return options is not None and bool(options.include_usage) and options.continuous_usage_stats


def usage(prompts: list[list[int]], num_completion_tokens: int, cached: CachedTokens | None = None,
          reasoning_tokens: int | None = None) -> Usage:
    """The usage of a response; with cached (the server's --enable-prompt-tokens-details), its prompts' tokens
    found in the prefix cache; with reasoning_tokens (a chat under a reasoning parser), its replies' thinking's
    tokens."""
    num_prompt_tokens = sum(map(len, prompts))
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens,
                 prompt_tokens_details=None if cached is None else PromptTokensDetails(cached_tokens=cached.total),
                 completion_tokens_details=None if reasoning_tokens is None else
                 CompletionTokensDetails(reasoning_tokens=reasoning_tokens))


class CachedTokens:
    """A response's prompt tokens found in the prefix cache, per prompt, as its completions finish (a prompt's
    completions may find different amounts: the largest counts, as in RequestOutput.num_cached_tokens)."""

    def __init__(self):
        self.by_prompt: dict[int, int] = {}

    def add(self, prompt_index: int, delta: CompletionDelta):
        if delta.num_cached_tokens is not None:
            self.by_prompt[prompt_index] = max(self.by_prompt.get(prompt_index, 0), delta.num_cached_tokens)

    @property
    def total(self) -> int:
        return sum(self.by_prompt.values())
