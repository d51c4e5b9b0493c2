"""POST /v1/chat/completions: the messages rendered by the model's chat template, n choices, logprobs with
top_logprobs, vLLM's echo; one response or an SSE stream of chunks (each choice's first carries the reply's role)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response

from ..outputs import CompletionDelta, Logprob
from .async_llm import RequestStream
from .errors import APIError, parse_body
from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                       ChatDelta, ChatLogprobs, ChatResponseMessage, TokenLogprob, TopLogprob)
from .serving import ServedModel, usage, wants_continuous_usage, wants_usage_chunk
from .streaming import EventStreamResponse, TextEvents, event, sse_body, unless_disconnected


async def create_chat_completion(served: ServedModel, raw_request: Request) -> Response | ChatCompletionResponse:
    request = await parse_body(raw_request, ChatCompletionRequest)
    served.check_model(request.model)
    include_usage = wants_usage_chunk(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs", "invalid_value")
    if not request.messages:
        raise APIError(400, "messages is empty; give at least one message", "messages", "invalid_value")
    served.check_supported(request)
    prompts = served.truncate([await served.render_chat(request.messages, request)], request)
    max_tokens, field_name = (request.max_completion_tokens, "max_completion_tokens") \
        if request.max_completion_tokens is not None else (request.max_tokens, "max_tokens")
    served.check_room(prompts, max_tokens, field_name, "messages")
    num_top = request.top_logprobs or 0
    renames = {"max_tokens": field_name, "logprobs": "top_logprobs"}
    params = served.sampling_params(request, max_tokens, num_top if request.logprobs else None, renames)
    response_id, model = f"chatcmpl-{uuid.uuid4().hex}", served.name
    role, echoed = request.reply_role(served.response_role), request.echoed(served.response_role)
    if request.stream:
        stream = await served.generate(request, prompts, params, renames)
        return EventStreamResponse(_events(stream, response_id, model, prompts, params.n, num_top, include_usage,
                                           role, echoed, wants_continuous_usage(request)), stream.close)

    async def complete() -> ChatCompletionResponse:
        stream = await served.generate(request, prompts, params, renames)
        completions = await served.collect(stream, params.n)
        choices = [ChatChoice(index=i, message=ChatResponseMessage(role=role, content=echoed + c.text),
                              finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason,
                              logprobs=chat_logprobs(c.token_ids, c.logprobs, num_top) if request.logprobs else None)
                   for i, c in enumerate(completions)]
        return ChatCompletionResponse(id=response_id, model=model, choices=choices,
                                      usage=usage(prompts, sum(len(c.token_ids) for c in completions)))

    return await unless_disconnected(raw_request, complete())


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int) -> ChatLogprobs:
    """Per token: its text, logprob and UTF-8 bytes, and the num_top most likely tokens, by rank."""
    content = []
    for token_id, top in zip(token_ids, logprobs):
        sampled = top[token_id]
        best = sorted((entry for entry in top.values() if entry.rank <= num_top), key=lambda entry: entry.rank)
        content.append(TokenLogprob(token=sampled.decoded_token, logprob=sampled.logprob,
                                    bytes=list(sampled.decoded_token.encode()),
                                    top_logprobs=[TopLogprob(token=entry.decoded_token, logprob=entry.logprob,
                                                             bytes=list(entry.decoded_token.encode()))
                                                  for entry in best]))
    return ChatLogprobs(content=content)


async def _events(stream: RequestStream, response_id: str, model: str, prompts: list[list[int]], n: int,
                  num_top: int, include_usage: bool, role: str, echoed: str,
                  continuous_usage: bool = False) -> AsyncIterator[str]:
    """Each choice's role chunk (and, with echo, a chunk of the echoed content), then one chunk per step that gave a
    choice something, finish_reason on its last; with continuous_usage, each chunk carries its choice's usage so
    far."""
    created = int(time.time())
    num_tokens = 0
    choice_tokens = [0] * n

    def chunk(choices: list[ChatChunkChoice], **fields) -> str:
        if continuous_usage:
            fields["usage"] = usage(prompts, choice_tokens[choices[0].index])
        return event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=choices, **fields))

    text_events = [TextEvents(lambda text, index=index: ChatCompletionChunk(
        id=response_id, created=created, model=model,
        choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=text))])) for index in range(n)]

    def chunk_of(_, delta: CompletionDelta) -> str:
        nonlocal num_tokens
        num_tokens += len(delta.token_ids)
        choice_tokens[delta.index] += len(delta.token_ids)
        if delta.logprobs is None and not delta.finished and not continuous_usage:
            return text_events[delta.index](delta.text)
        logprobs = None if delta.logprobs is None else chat_logprobs(delta.token_ids, delta.logprobs, num_top)
        return chunk([ChatChunkChoice(index=delta.index, delta=ChatDelta(content=delta.text), logprobs=logprobs,
                                      finish_reason=delta.finish_reason if delta.finished else None,
                                      stop_reason=delta.stop_reason if delta.finished else None)])

    def usage_chunk() -> str:
        return event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[],
                                         usage=usage(prompts, num_tokens)))

    yield "".join(chunk([ChatChunkChoice(index=index, delta=ChatDelta(role=role, content=""))])
                  for index in range(n))
    if echoed:
        yield "".join(chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=echoed))]) for index in range(n))
    async for events in sse_body(stream, chunk_of, usage_chunk if include_usage else None):
        yield events
