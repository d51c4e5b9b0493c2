"""POST /v1/chat/completions: the messages rendered by the model's chat template, n choices, logprobs with
top_logprobs, vLLM's echo, tool calls (tool_calls.py); one response or an SSE stream of chunks (each choice's first
carries the reply's role)."""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request, Response

from ..outputs import CompletionDelta, Logprob
from ..reasoning import ReasoningSplitter, count_reasoning_tokens, reply_thinks, split_reasoning
from ..sampling_params import StructuredOutputsParams
from .async_llm import RequestStream
from .errors import APIError, parse_body
from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                       ChatDelta, ChatLogprobs, ChatResponseMessage, TokenLogprob, TopLogprob)
from .completions import token_label
from .serving import (CachedTokens, ServedModel, api_logprob, api_prompt_logprobs, make_response_id, usage,
                      wants_continuous_usage, wants_usage_chunk)
from .streaming import EventStreamResponse, TextEvents, event, sse_body, unless_disconnected
from .tool_calls import (CALL_STREAMS, NO_PARAMETERS, RequiredCallStream, ToolCall, extract_tool_calls,
                         named_function, required_calls_schema)


async def create_chat_completion(served: ServedModel, raw_request: Request) -> Response | ChatCompletionResponse:
    return await chat_completion(served, await parse_body(raw_request, ChatCompletionRequest), raw_request)


async def chat_completion(served: ServedModel, request: ChatCompletionRequest, raw_request: Request
                          ) -> Response | ChatCompletionResponse:
    """The reply to a parsed chat request: a ChatCompletionResponse, or the stream of its chunks (an
    EventStreamResponse; a 499 Response where the client left before the reply was complete)."""
    served.check_model(request.model)
    include_usage = wants_usage_chunk(request, served.force_include_usage)
    if request.top_logprobs and not request.logprobs:  # 0 asks for nothing, and is taken (as vLLM takes it)
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs", "invalid_value")
    if not request.messages:
        raise APIError(400, "messages is empty; give at least one message", "messages", "invalid_value")
    served.admit(request)
    tool_mode, function = request.tool_mode(), None
    if tool_mode is not None and not request.tools:
        raise APIError(400, f"tool_choice {request.tool_choice!r} needs tools; give the request's tools, or leave "
                            "tool_choice out", "tools", "invalid_value")
    if tool_mode == "auto" and served.tool_call_parser is None and "tool_choice" in request.model_fields_set \
            and request.tool_choice is None:
        tool_mode = None  # an explicit null is "auto" only where the server parses calls (as in vLLM)
    if tool_mode == "auto" and served.tool_call_parser is None:
        raise APIError(400, '"auto" tool choice requires nanograph serve --enable-auto-tool-choice and '
                            '--tool-call-parser to be set; or give tool_choice "none" (the tools still reach the '
                            'chat template, and a call comes back as the model\'s text) or a named function',
                       "tool_choice", "unsupported_value")
    if tool_mode == "named":
        try:
            function = named_function(request.tool_choice, request.tools)
        except ValueError as exc:
            raise APIError(400, str(exc), "tool_choice", "invalid_value") from None
    prompts = served.truncate([await served.render_chat(request.messages, request)], request)
    max_tokens, field_name = (request.max_completion_tokens, "max_completion_tokens") \
        if request.max_completion_tokens is not None else (request.max_tokens, "max_tokens")
    served.check_room(prompts, max_tokens, field_name, "messages")
    num_top = request.top_logprobs or 0
    renames = {"max_tokens": field_name, "logprobs": "top_logprobs"}
    params = served.sampling_params(request, max_tokens, num_top if request.logprobs else None, renames)
    params = served.with_prompt_logprobs(request, params, request.prompt_logprobs)
    if tool_mode == "auto" and served.tool_call_parser == "mistral":
        params = dataclasses.replace(params, skip_special_tokens=False)  # [TOOL_CALLS] is a special token
    if tool_mode in ("named", "required"):
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {'naming a function' if function else 'required'} constrains the "
                                "reply to tool calls, so the request cannot also give structured outputs "
                                "(response_format, structured_outputs, guided_*); drop one of them", "tool_choice",
                           "invalid_value")
        if function is not None:
            schema = function.get("parameters") or NO_PARAMETERS
            position = next(i for i, tool in enumerate(request.tools) if tool.get("function") is function)
            renames["structured_outputs.json"] = f"tools[{position}].function.parameters"  # the grammar's errors
        else:
            try:
                schema = required_calls_schema(request.tools, one_call=not request.parallel_tool_calls)
            except ValueError as exc:
                raise APIError(400, str(exc), "tools", "invalid_value") from None
            renames["structured_outputs.json"] = "tools[*].function.parameters"
        try:
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"the functions' parameters are not a JSON schema the server takes: {exc}",
                           "tools", "invalid_value") from None
    parse_calls = {"auto": CALL_STREAMS.get(served.tool_call_parser), "required": RequiredCallStream}.get(tool_mode)
    own_template = request.chat_template if request.chat_template is not None else \
        (request.chat_template_kwargs or {}).get("chat_template")
    with_call_id = functools.partial(served.with_call_id,
                                     chat_template=own_template if isinstance(own_template, str) else None)
    max_calls = None if request.parallel_tool_calls else 1  # a reply's tool calls kept
    response_id, model = make_response_id("chatcmpl", raw_request, request), served.name
    role, echoed = request.reply_role(served.response_role), request.echoed(served.response_role)
    # The engine has the same parser: a grammar (response_format, tool_choice) applies to the answer after the
    # thinking.
    reasoning = None
    if served.reasoning_parser is not None:
        reasoning = Reasoning(served.reasoning_parser, reply_thinks(served.tokenizer, prompts[0]),
                              request.include_reasoning, *served.think_tokens, served.tokenizer.decode,
                              served.tokenized)
    if request.stream:
        stream = await served.generate(request, prompts, params, renames)
        return EventStreamResponse(_events(stream, response_id, model, prompts, params.n, num_top, include_usage,
                                           role, echoed, wants_continuous_usage(request), parse_calls,
                                           function["name"] if function is not None else None,
                                           request.return_tokens_as_token_ids, max_calls, reasoning,
                                           served.cached_tokens(), with_call_id),
                                   stream.close)

    def message(text: str) -> tuple[ChatResponseMessage, bool]:
        """A choice's message (its thinking apart, with a reasoning parser), and whether it called tools."""
        if reasoning is None:
            return answer(text)
        thought, text = split_reasoning(reasoning.parser, text, reasoning.thinking)
        reply, called = answer(text)
        if thought is not None:
            if reasoning.include:
                reply.reasoning = reply.reasoning_content = thought
            if reply.content == "":
                reply.content = None
        return reply, called

    def answer(text: str) -> tuple[ChatResponseMessage, bool]:
        if function is not None:
            call = with_call_id(ToolCall(function["name"], text))
            return ChatResponseMessage(role=role, content=echoed, tool_calls=[call.as_dict()]), True
        if tool_mode == "auto":
            content, calls = extract_tool_calls(text, served.tool_call_parser)
            calls = [with_call_id(call) for call in calls[:max_calls]]
            if calls:
                content = echoed + content if content is not None else (echoed or None)
                return ChatResponseMessage(role=role, content=content,
                                           tool_calls=[call.as_dict() for call in calls]), True
        if parse_calls is RequiredCallStream:
            parser = RequiredCallStream()
            items = parser.feed(text) + parser.finish()
            calls = [with_call_id(item[1]).as_dict() for item in items if not isinstance(item, str)][:max_calls]
            if calls:
                return ChatResponseMessage(role=role, content=echoed + "".join(
                    item for item in items if isinstance(item, str)), tool_calls=calls), True
        return ChatResponseMessage(role=role, content=echoed + text), False

    async def complete() -> ChatCompletionResponse:
        stream = await served.generate(request, prompts, params, renames)
        cached = served.cached_tokens()
        completions = await served.collect(stream, params.n, cached)
        choices = []
        for i, c in enumerate(completions):
            reply, called = message(c.text)
            finish_reason = _finish_reason(called and parse_calls is not None, parse_calls, c.finish_reason)
            choices.append(ChatChoice(index=i, message=reply, finish_reason=finish_reason, stop_reason=c.stop_reason,
                                      logprobs=chat_logprobs(c.token_ids, c.logprobs, num_top,
                                                             request.return_tokens_as_token_ids)
                                      if request.logprobs else None))
        return ChatCompletionResponse(id=response_id, model=model, choices=choices,
                                      usage=usage(prompts, sum(len(c.token_ids) for c in completions), cached,
                                                  None if reasoning is None else
                                                  await reasoning.count_tokens([c.token_ids for c in completions])),
                                      prompt_logprobs=api_prompt_logprobs(completions[0].prompt_logprobs)
                                      if request.prompt_logprobs is not None else None)

    return await unless_disconnected(raw_request, complete())


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """How a request's replies are taken apart: the server's parser; whether a reply starts thinking (the prompt
    did not close it); whether the thinking goes into the reply (the request's include_reasoning); and what counts
    a reply's thinking's tokens: the tokenizer's <think> and </think> tokens where it has them
    (reasoning.start_token_id's, end_token_id's), else its decode, run on the tokenizer's thread (tokenized:
    ServedModel.tokenized)."""
    parser: str
    thinking: bool
    include: bool
    end_token: int | None = None
    start_token: int | None = None
    decode: Callable[[list[int]], str] | None = dataclasses.field(default=None, compare=False, repr=False)
    tokenized: Callable[..., Awaitable] | None = dataclasses.field(default=None, compare=False, repr=False)

    async def count_tokens(self, replies: list[list[int]]) -> int:
        """How many of the replies' tokens are their thinking (usage's completion_tokens_details.reasoning_tokens)."""
        def count() -> int:
            return sum(count_reasoning_tokens(token_ids, self.thinking, self.decode, self.end_token,
                                              self.start_token) for token_ids in replies)
        return count() if self.end_token is not None or not self.thinking else await self.tokenized(count)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                  as_token_ids: bool = False) -> ChatLogprobs:
    """Per token: its text (or "token_id:{id}"), logprob and its text's UTF-8 bytes, and the num_top most likely
    tokens, by rank."""
    content = []
    for token_id, top in zip(token_ids, logprobs):
        sampled = top[token_id]
        best = sorted((item for item in top.items() if item[1].rank <= num_top), key=lambda item: item[1].rank)
        content.append(TokenLogprob(token=token_label(token_id, sampled, as_token_ids),
                                    logprob=api_logprob(sampled.logprob), bytes=list(sampled.decoded_token.encode()),
                                    top_logprobs=[TopLogprob(token=token_label(top_id, entry, as_token_ids),
                                                             logprob=api_logprob(entry.logprob),
                                                             bytes=list(entry.decoded_token.encode()))
                                                  for top_id, entry in best]))
    return ChatLogprobs(content=content)


def _finish_reason(called: bool, parse_calls: type | None, finish_reason: str) -> str:
    """A choice's finish_reason: "tool_calls" where the reply's calls were parsed (vLLM's for "auto"), but for
    tool_choice "required" only where its array of calls ended ("length": a call may be missing); a named function's
    reply ends as it ended."""
    if not called or (parse_calls is RequiredCallStream and finish_reason != "stop"):
        return finish_reason
    return "tool_calls"


async def _events(stream: RequestStream, response_id: str, model: str, prompts: list[list[int]], n: int,
                  num_top: int, include_usage: bool, role: str, echoed: str,
                  continuous_usage: bool = False, parse_calls: type | None = None,
                  named: str | None = None, as_token_ids: bool = False,
                  max_calls: int | None = None, reasoning: Reasoning | None = None,
                  cached: CachedTokens | None = None,
                  with_call_id: Callable[[ToolCall], ToolCall] = lambda call: call) -> AsyncIterator[str]:
    """Each choice's role chunk (and, with echo, a chunk of the echoed content), then one chunk per step that gave a
    choice something, finish_reason on its last; with continuous_usage, each chunk carries its choice's usage so
    far. parse_calls: the class (a CALL_STREAMS parser, RequiredCallStream) the text goes through, each call
    whole in one chunk; named: the reply is the arguments of a call of that function, streamed as they come;
    as_token_ids: logprobs name tokens by id; max_calls: the parsed calls kept of each choice (None: all);
    reasoning: a choice's thinking goes out in chunks of its own (delta.reasoning; none if not
    reasoning.include), and the rest as above; cached: counts the prompt's cached tokens for the usage chunk
    (None: it reports none); with_call_id: gives a call the id it goes out with (ServedModel.with_call_id)."""
    created = int(time.time())
    num_tokens = 0
    choice_tokens = [0] * n
    reply_tokens = [[] for _ in range(n)] if reasoning else None  # each reply's token ids, for its thinking's count

    def chunk(choices: list[ChatChunkChoice], **fields) -> str:
        if continuous_usage:
            fields["usage"] = usage(prompts, choice_tokens[choices[0].index])
        return event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=choices, **fields))

    text_events = [TextEvents(lambda text, index=index: ChatCompletionChunk(
        id=response_id, created=created, model=model,
        choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=text))])) for index in range(n)]

    parsers = [parse_calls() for _ in range(n)] if parse_calls else None
    named_calls = [with_call_id(ToolCall(named, "")) for _ in range(n)] if named is not None else None

    def step_logprobs(delta: CompletionDelta) -> ChatLogprobs | None:
        return None if delta.logprobs is None else chat_logprobs(delta.token_ids, delta.logprobs, num_top,
                                                                 as_token_ids)

    def tool_chunk(delta: CompletionDelta) -> str:
        """A parsed or named choice's chunks for this delta: its content and its calls as they are complete."""
        index = delta.index
        chunks: list[ChatDelta] = []  # in the reply's order: runs of text, runs of calls
        if named_calls is not None:
            if delta.text:
                chunks.append(ChatDelta(tool_calls=[{"index": 0, "function": {"arguments": delta.text}}]))
        else:
            parser = parsers[index]
            for item in parser.feed(delta.text) + (parser.finish() if delta.finished else []):
                if isinstance(item, str):
                    if chunks and chunks[-1].content is not None:
                        chunks[-1].content += item
                    else:
                        chunks.append(ChatDelta(content=item))
                elif max_calls is None or item[0] < max_calls:
                    call = {"index": item[0], **with_call_id(item[1]).as_dict()}
                    if chunks and chunks[-1].tool_calls is not None:
                        chunks[-1].tool_calls.append(call)
                    else:
                        chunks.append(ChatDelta(tool_calls=[call]))
        logprobs = step_logprobs(delta)
        finish_reason = None
        if delta.finished:
            called = named_calls is None and parsers[index].num_calls > 0
            finish_reason = _finish_reason(called, parse_calls, delta.finish_reason)
        if not chunks and (logprobs is not None or finish_reason is not None or continuous_usage):
            chunks.append(ChatDelta(content=""))
        events = []
        for i, chat_delta in enumerate(chunks):
            last = i == len(chunks) - 1
            events.append(chunk([ChatChunkChoice(index=index, delta=chat_delta, logprobs=logprobs if i == 0 else None,
                                                 finish_reason=finish_reason if last else None,
                                                 stop_reason=delta.stop_reason if last and delta.finished else None)]))
        return "".join(events)

    splitters = [ReasoningSplitter(reasoning.parser, reasoning.thinking) for _ in range(n)] if reasoning else None
    reasoning_events = [TextEvents(lambda text, index=index: ChatCompletionChunk(
        id=response_id, created=created, model=model, choices=[ChatChunkChoice(
            index=index, delta=ChatDelta(reasoning=text, reasoning_content=text))]), fields=2)
        for index in range(n)] if reasoning else None

    def chunk_of(_, delta: CompletionDelta) -> str:
        nonlocal num_tokens
        num_tokens += len(delta.token_ids)
        if cached is not None and delta.finished:
            cached.add(0, delta)
        choice_tokens[delta.index] += len(delta.token_ids)
        if reply_tokens is not None:
            reply_tokens[delta.index] += delta.token_ids
        if splitters is None:
            return answer_chunk(delta)
        splitter = splitters[delta.index]
        pieces = splitter.feed(delta.text) + (splitter.finish() if delta.finished else [])
        thought = "".join(text for kind, text in pieces if kind == "reasoning") if reasoning.include else ""
        content = "".join(text for kind, text in pieces if kind == "content")
        if thought and not content and not delta.finished:  # one chunk: the thinking, with its tokens' logprobs
            return thought_chunk(delta.index, thought, step_logprobs(delta))
        events = thought_chunk(delta.index, thought) if thought else ""
        if not content and delta.logprobs is None and not delta.finished and not continuous_usage:
            return events
        return events + answer_chunk(dataclasses.replace(delta, text=content))

    def thought_chunk(index: int, thought: str, logprobs: ChatLogprobs | None = None) -> str:
        if logprobs is None and not continuous_usage:
            return reasoning_events[index](thought)
        return chunk([ChatChunkChoice(index=index, delta=ChatDelta(reasoning=thought, reasoning_content=thought),
                                      logprobs=logprobs)])

    def answer_chunk(delta: CompletionDelta) -> str:
        """The chunks of a delta's answer (all of its text, but with a reasoning parser)."""
        if parsers is not None or named_calls is not None:
            return tool_chunk(delta)
        if delta.logprobs is None and not delta.finished and not continuous_usage:
            return text_events[delta.index](delta.text)
        logprobs = step_logprobs(delta)
        return chunk([ChatChunkChoice(index=delta.index, delta=ChatDelta(content=delta.text), logprobs=logprobs,
                                      finish_reason=delta.finish_reason if delta.finished else None,
                                      stop_reason=delta.stop_reason if delta.finished else None)])

    async def usage_chunk() -> str:
        thought = None if reasoning is None else await reasoning.count_tokens(reply_tokens)
        return event(ChatCompletionChunk(id=response_id, created=created, model=model, choices=[],
                                         usage=usage(prompts, num_tokens, cached, thought)))

    yield "".join(chunk([ChatChunkChoice(index=index, delta=ChatDelta(role=role, content=""))])
                  for index in range(n))
    if named_calls is not None:  # the call's id, type and name, then its arguments as they come
        yield "".join(chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[
            {"index": 0, **dataclasses.replace(named_calls[index], arguments="").as_dict()}]))])
            for index in range(n))
    if echoed:
        yield "".join(chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=echoed))]) for index in range(n))
    async for events in sse_body(stream, chunk_of, usage_chunk if include_usage else None):
        yield events
