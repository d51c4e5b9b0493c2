"""POST /v1/completions: prompts (text or token ids, one or many), n choices each, logprobs, echo; one response
or an SSE stream of chunks."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request, Response

from ..outputs import CompletionDelta, Logprob
from .async_llm import RequestStream
from .errors import APIError, parse_body
from .protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from .serving import (CachedTokens, ServedModel, api_logprob, api_prompt_logprobs, make_response_id, usage,
                      wants_continuous_usage, wants_usage_chunk)
from .streaming import DONE, EventStreamResponse, TextEvents, event, sse_body, unless_disconnected


async def create_completion(served: ServedModel, raw_request: Request) -> Response | CompletionResponse:
    request = await parse_body(raw_request, CompletionRequest)
    served.check_model(request.model)
    include_usage = wants_usage_chunk(request, served.force_include_usage)
    # vLLM's echo with logprobs: each choice's logprobs start with its prompt's (the first token's null).
    echo_logprobs = request.echo and request.logprobs is not None
    if echo_logprobs and request.stream:
        raise APIError(400, "echo with logprobs asks for the prompt's logprobs, which are served on non-streamed "
                            "requests; set stream to false, or drop echo or logprobs", "echo", "invalid_value")
    served.admit(request)
    prompts, texts = await encode_prompts(served, request.prompt, request.add_special_tokens)
    kept = served.truncate(prompts, request)
    texts = [text if len(cut) == len(whole) else None for text, cut, whole in zip(texts, kept, prompts)]
    prompts = kept
    served.check_room(prompts, request.max_tokens, "max_tokens", "prompt")
    echo_only = request.echo and request.max_tokens == 0  # vLLM's: the prompts come back, and nothing is generated
    params = served.sampling_params(request, 1 if echo_only else request.max_tokens, request.logprobs)
    asked = [k for k in (request.logprobs if echo_logprobs else None, request.prompt_logprobs) if k is not None]
    params = served.with_prompt_logprobs(request, params, (-1 if -1 in asked else max(asked)) if asked else None,
                                         "prompt_logprobs" if request.prompt_logprobs is not None else "logprobs")
    if request.echo:
        served.check_token_ids(prompts, request)
    echoed = [await served.tokenized(served.tokenizer.decode, token_ids) if text is None else text
              for text, token_ids in zip(texts, prompts)] if request.echo else [""] * len(prompts)
    response_id, model = make_response_id("cmpl", raw_request, request), served.name
    if echo_only and params.prompt_logprobs is None:
        # The engine checks it as any request (a 400 where it would refuse one); nothing is generated.
        (await served.generate(request, prompts, params)).close()
        choices = [CompletionChoice(index=i, text=echoed[i // params.n], finish_reason="length")
                   for i in range(len(prompts) * params.n)]
        if request.stream:
            return EventStreamResponse(_echo_events(response_id, model, prompts, choices, include_usage,
                                                    wants_continuous_usage(request)), lambda: None)
        return CompletionResponse(id=response_id, model=model, choices=choices,
                                  usage=usage(prompts, 0, served.cached_tokens()))
    if request.stream:
        stream = await served.generate(request, prompts, params)
        return EventStreamResponse(_events(stream, response_id, model, prompts, echoed, params.n, include_usage,
                                           wants_continuous_usage(request), request.return_tokens_as_token_ids,
                                           served.cached_tokens()),
                                   stream.close)

    async def complete() -> CompletionResponse:
        stream = await served.generate(request, prompts, params)
        cached = served.cached_tokens()
        completions = await served.collect(stream, params.n, cached)
        choices = []
        for i, c in enumerate(completions):
            logprobs = None
            if request.logprobs is not None:
                logprobs, offset = CompletionLogprobs(), 0
                if echo_logprobs:
                    offset = await _echoed_prompt_logprobs(served, logprobs, prompts[i // params.n],
                                                           c.prompt_logprobs, request.logprobs,
                                                           request.return_tokens_as_token_ids)
                if not echo_only:
                    completion_logprobs(c.token_ids, c.logprobs, offset, request.return_tokens_as_token_ids, logprobs)
            choices.append(CompletionChoice(
                index=i, text=echoed[i // params.n] + ("" if echo_only else c.text),
                finish_reason="length" if echo_only else c.finish_reason,
                stop_reason=None if echo_only else c.stop_reason, logprobs=logprobs,
                prompt_logprobs=api_prompt_logprobs(c.prompt_logprobs)))
        generated = 0 if echo_only else sum(len(c.token_ids) for c in completions)
        return CompletionResponse(id=response_id, model=model, choices=choices,
                                  usage=usage(prompts, generated, cached))

    return await unless_disconnected(raw_request, complete())


async def _echoed_prompt_logprobs(served: ServedModel, result: CompletionLogprobs, prompt: list[int],
                                  entries: list[dict[int, Logprob] | None], k: int, as_token_ids: bool) -> int:
    """An echoed prompt's tokens into result, as vLLM gives them: the first with no logprob and no alternatives,
    each other with its logprob and the k most likely tokens (-1: all); returns the text offset after them."""
    first_text = await served.tokenized(served.tokenizer.decode, prompt[:1])
    if first_text.endswith("\ufffd"):
        first_text = ""  # the first bytes of a character, whose text the token completing it gives
    result.tokens.append(f"token_id:{prompt[0]}" if as_token_ids else first_text)
    result.token_logprobs.append(None)
    result.top_logprobs.append(None)
    result.text_offset.append(0)
    tops = [top_entries(entry, target, k) for entry, target in zip(entries[1:], prompt[1:])]
    return completion_logprobs(prompt[1:], tops, len(first_text), as_token_ids, result)[1]


def top_entries(entry: dict[int, Logprob], token_id: int, k: int) -> dict[int, Logprob]:
    """A position's logprobs cut to its token and the k most likely (-1: all)."""
    return {top_id: lp for top_id, lp in entry.items() if top_id == token_id or k == -1 or lp.rank <= k}


def prompt_list(prompt, field: str = "prompt") -> list[str] | list[list[int]]:
    """A request's prompt field (a string, strings, token ids, or lists of them) as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, f"{field} is empty; give a string, a list of strings, token ids or lists of token ids",
                       field, "invalid_value")
    return [prompt] if isinstance(prompt[0], int) else prompt


async def encode_prompts(served: ServedModel, prompt, add_special_tokens: bool, field: str = "prompt"
                         ) -> tuple[list[list[int]], list[str | None]]:
    """The prompts as token ids (text encoded with the tokenizer's special tokens, a BOS, if add_special_tokens),
    and as text (None for one given as token ids). field: the request's name for them."""
    prompt = prompt_list(prompt, field)
    if isinstance(prompt[0], str):
        return await served.tokenized(lambda: [served.encode(text, add_special_tokens) for text in prompt]), prompt
    return prompt, [None] * len(prompt)


def token_label(token_id: int, logprob: Logprob, as_token_id: bool) -> str:
    """A token as logprobs name it: its text, or "token_id:{id}" (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_token_id else logprob.decoded_token


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], text_offset: int,
                        as_token_ids: bool = False, result: CompletionLogprobs | None = None
                        ) -> tuple[CompletionLogprobs, int]:
    """The legacy logprobs object of these tokens (each token's top alternatives include it; appended to result
    where given), and the text offset after them (the offsets count the text, also where the tokens are named by
    id)."""
    result = CompletionLogprobs() if result is None else result
    for token_id, top in zip(token_ids, logprobs):
        sampled = top[token_id]
        result.tokens.append(token_label(token_id, sampled, as_token_ids))
        result.token_logprobs.append(api_logprob(sampled.logprob))
        result.top_logprobs.append({token_label(top_id, entry, as_token_ids): api_logprob(entry.logprob)
                                    for top_id, entry in top.items()})
        result.text_offset.append(text_offset)
        text_offset += len(sampled.decoded_token)
    return result, text_offset


async def _echo_events(response_id: str, model: str, prompts: list[list[int]], choices: list[CompletionChoice],
                       include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """The stream of an echo of the prompts alone: one chunk per choice, then the usage chunk when asked."""
    created = int(time.time())
    n = len(choices) // len(prompts)
    for choice in choices:
        yield event(CompletionResponse(id=response_id, created=created, model=model, choices=[choice],
                                       usage=usage([prompts[choice.index // n]], 0) if continuous_usage else None))
    if include_usage:
        yield event(CompletionResponse(id=response_id, created=created, model=model, choices=[],
                                       usage=usage(prompts, 0)))
    yield DONE


def _events(stream: RequestStream, response_id: str, model: str, prompts: list[list[int]], echoed: list[str],
            n: int, include_usage: bool, continuous_usage: bool = False, as_token_ids: bool = False,
            cached: CachedTokens | None = None) -> AsyncIterator[str]:
    """One chunk per choice per step that gave it something (echo's prompt in its first), finish_reason on its
    last; with continuous_usage, each chunk carries its choice's usage so far (its own prompt's tokens); cached:
    counts the prompts' cached tokens for the usage chunk (None: it reports none)."""
    created = int(time.time())
    offsets, num_tokens = {}, 0
    choice_tokens = [0] * (len(prompts) * n)
    text_events: dict[int, TextEvents] = {}  # each choice's, once its first chunk is out

    def chunk_of(prompt_index: int, delta: CompletionDelta) -> str:
        nonlocal num_tokens
        index = prompt_index * n + delta.index
        text = delta.text
        num_tokens += len(delta.token_ids)
        if cached is not None and delta.finished:
            cached.add(prompt_index, delta)
        choice_tokens[index] += len(delta.token_ids)
        plain = text_events.get(index)
        if plain is None:
            text = echoed[prompt_index] + text
            text_events[index] = TextEvents(lambda text: CompletionResponse(
                id=response_id, created=created, model=model, choices=[CompletionChoice(index=index, text=text)]))
        elif delta.logprobs is None and not delta.finished and not continuous_usage:
            return plain(text)
        logprobs = None
        if delta.logprobs is not None:
            logprobs, offsets[index] = completion_logprobs(delta.token_ids, delta.logprobs, offsets.get(index, 0),
                                                           as_token_ids)
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=delta.finish_reason if delta.finished else None,
                                  stop_reason=delta.stop_reason if delta.finished else None)
        return event(CompletionResponse(id=response_id, created=created, model=model, choices=[choice],
                                        usage=usage([prompts[prompt_index]], choice_tokens[index])
                                        if continuous_usage else None))

    def usage_chunk() -> str:
        return event(CompletionResponse(id=response_id, created=created, model=model, choices=[],
                                        usage=usage(prompts, num_tokens, cached)))

    return sse_body(stream, chunk_of, usage_chunk if include_usage else None)
