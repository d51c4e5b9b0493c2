"""POST /v1/responses: OpenAI's Responses API, answered by the chat pipeline (chat.py). The instructions and the input
(a string, or message, function_call and function_call_output items) become the chat's messages; tools, tool_choice
and text.format its tools, tool_choice and response_format. The reply comes back as output items: the thinking
(with a reasoning parser) as a reasoning item, the answer as a message, each tool call as a function_call; whole, or
as a stream of typed events (response.created ... response.completed). The server stores nothing:
previous_response_id and background are refused, and the conversation goes in the input."""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from pydantic import Field

from .chat import chat_completion
from .errors import APIError, parse_body
from .protocol import GUIDED_FIELDS, SAMPLING_FIELDS, ChatCompletionRequest, ChatCompletionResponse
from .protocol import Request as Body
from .serving import ServedModel
from .streaming import EventStreamResponse

# The vLLM sampling and chat fields a Responses request may add (its own n and logprobs have no place here).
CHAT_FIELDS = (*(name for name in SAMPLING_FIELDS if name not in ("n", "best_of")), *GUIDED_FIELDS,
               "structured_outputs", "chat_template", "chat_template_kwargs", "include_reasoning",
               "truncate_prompt_tokens", "priority")
LOGPROBS = "message.output_text.logprobs"  # the include that asks for the answer's logprobs
# A chat field in an error's message or param -> the Responses request's name for it.
RENAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input",
           "response_format.json_schema.schema": "text.format.schema", "response_format": "text.format"}


class TextOptions(Body):
    format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = True
    text: TextOptions | None = None
    metadata: dict | None = None
    user: str | None = None
    request_id: str | None = None  # vLLM's: the response's id
    # include "message.output_text.logprobs": each answer token's logprob and its top_logprobs most likely ones.
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    # Taken, and what this server does with them: store (nothing is stored), reasoning (the model thinks as its
    # template says), truncation "disabled" (a prompt too long is a 400).
    store: bool | None = None
    reasoning: dict | None = None
    truncation: str | None = None
    # Refused: they need stored responses, conversations or prompts.
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request that answers this one; APIError naming the field for what this server cannot do."""
        if self.previous_response_id is not None:
            raise APIError(400, "this server stores no responses, so previous_response_id cannot be followed; send "
                                "the conversation so far in input (the earlier output items included)",
                           "previous_response_id", "unsupported_value")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise APIError(400, f"this server stores no {name}s, so {name} cannot be read; send the whole "
                                    "conversation in input (and the instructions as instructions)", name,
                               "unsupported_value")
        if self.background:
            raise APIError(400, "background responses are not supported (nothing is stored to poll); set background "
                                "to false, or stream the response", "background", "unsupported_value")
        if self.truncation not in (None, "disabled"):
            raise APIError(400, f"truncation {self.truncation!r} is not supported; use 'disabled' (a prompt longer "
                                "than the model's context is a 400)", "truncation", "unsupported_value")
        for include in self.include or ():
            if include != LOGPROBS:
                raise APIError(400, f"include {include!r} is not supported; this server can include "
                                    f"{LOGPROBS!r} only", "include", "unsupported_value")
        body = {name: value for name, value in (self.model_extra or {}).items() if name in CHAT_FIELDS}
        body.update(model=self.model, messages=self._messages(), max_completion_tokens=self.max_output_tokens,
                    temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                    parallel_tool_calls=self.parallel_tool_calls, user=self.user)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools is not None:
            body["tools"] = [self._tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = self._tool_choice()
        response_format = self._response_format()
        if response_format is not None:
            body["response_format"] = response_format
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValueError as exc:
            errors = getattr(exc, "errors", lambda **_: [])(include_url=False)
            where = ".".join(str(part) for part in errors[0]["loc"]) if errors else "input"
            message = errors[0]["msg"] if errors else str(exc)
            raise APIError(400, f"{_renamed(where)}: {message}", _renamed(where).split(".")[0],
                           "invalid_type") from None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    def _messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        thought = None  # a reasoning item's text, for the assistant turn that follows it
        for i, item in enumerate(self.input):
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise APIError(400, f"input[{i}].role must be user, assistant, system or developer; got "
                                        f"{role!r}", "input", "invalid_value")
                messages.append({"role": "system" if role == "developer" else role,
                                 "content": _text(item.get("content"), f"input[{i}].content")})
                if role == "assistant" and thought is not None:
                    messages[-1]["reasoning_content"], thought = thought, None
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", i), "type": "function",
                        "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text and its calls
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                    if thought is not None:
                        messages[-1]["reasoning_content"], thought = thought, None
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                                 "content": output if isinstance(output, str) else
                                 _text(output, f"input[{i}].output")})
            elif kind == "reasoning":
                # An earlier turn's thinking goes to the template with that turn, as reasoning_content (Qwen3's
                # template keeps it for the turns after the last user message: a tool loop's).
                parts = item.get("content") or item.get("summary") or []
                thought = "\n".join(part.get("text", "") for part in parts if isinstance(part, dict)) or None
            else:
                raise APIError(400, f"input[{i}] has type {kind!r}; this server takes message, function_call, "
                                    "function_call_output and reasoning items", "input", "invalid_value")
        if not messages:
            raise APIError(400, "input is empty; give a string or at least one message", "input", "invalid_value")
        return messages

    @staticmethod
    def _tool(i: int, tool: dict) -> dict:
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}] has type {tool.get('type')!r}; this server runs function tools only "
                                "(the model's calls come back for the client to run)", "tools", "unsupported_value")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"tools[{i}].name must be a non-empty string", "tools", "invalid_value")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        return {"type": "function", "function": function}

    def _tool_choice(self) -> str | dict:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise APIError(400, f"tool_choice {choice!r} is not supported; use 'auto', 'required', 'none' or "
                                    "{\"type\": \"function\", \"name\": ...}", "tool_choice", "unsupported_value")
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def _response_format(self) -> dict | None:
        form = self.text.format if self.text is not None else None
        if form is None or form.get("type") == "text":
            return None
        if form.get("type") == "json_object":
            return {"type": "json_object"}
        if form.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {
                key: form[key] for key in ("name", "description", "schema", "strict") if key in form}}
        raise APIError(400, f"text.format.type must be text, json_object or json_schema; got {form.get('type')!r}",
                       "text", "invalid_value")


def _text(content, where: str) -> str | list[dict]:
    """A message's content for the chat: a string, or its text parts (input_text, output_text) as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of input_text parts", "input", "invalid_value")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}[{j}] has type {kind!r}; this server takes text parts only ({{\"type\": "
                                "\"input_text\", \"text\": ...}})", "input", "invalid_value")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", "input", "invalid_value")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _string(item: dict, key: str, i: int) -> str:
    if not isinstance(item.get(key), str):
        raise APIError(400, f"input[{i}].{key} must be a string", "input", "invalid_value")
    return item[key]


def _renamed(text: str) -> str:
    for chat_name, name in RENAMES.items():
        text = re.sub(rf"\b{re.escape(chat_name)}\b", name, text)
    return re.sub(r"\b(tools\[[^]]*\])\.function\.", r"\1.", text)  # a Responses tool is flat


async def create_response(served: ServedModel, raw_request: Request) -> Response | dict:
    request = await parse_body(raw_request, ResponsesRequest, CHAT_FIELDS)
    response_id = f"resp_{raw_request.headers.get('X-Request-Id') or request.request_id or uuid.uuid4().hex}"
    try:
        reply = await chat_completion(served, request.chat_request(), raw_request)
    except APIError as exc:
        raise APIError(exc.status, _renamed(exc.message), exc.param and _renamed(exc.param), exc.code) from None
    response = ResponseBuilder(request, response_id, served.name, served.sampling_defaults)
    if isinstance(reply, ChatCompletionResponse):
        return response.whole(reply)
    if isinstance(reply, EventStreamResponse):
        return EventStreamResponse(response.events(reply.body_iterator), reply.on_close)
    return reply  # the client left


class ResponseBuilder:
    """A response object and its output items, built whole from a chat response or item by item from a chat
    stream's chunks."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str, sampling_defaults: dict | None = None):
        """sampling_defaults: the model's (its generation_config.json's), which fields the request left out take."""
        self.request, self.id, self.model = request, response_id, model
        self.defaults = sampling_defaults or {}
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.status = "in_progress"
        self.error: dict | None = None
        self.sequence_number = 0

    def body(self) -> dict:
        request = self.request
        form = (request.text.format if request.text is not None else None) or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": self.status, "output": self.output, "usage": self.usage, "error": self.error,
                "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
                "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "metadata": request.metadata, "parallel_tool_calls": bool(request.parallel_tool_calls),
                "previous_response_id": None, "reasoning": request.reasoning, "store": False,
                "temperature": self._sampling("temperature", 1.0), "top_p": self._sampling("top_p", 1.0),
                "text": {"format": form},
                "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
                "tools": request.tools or [], "truncation": "disabled", "user": request.user, "background": False}

    def _sampling(self, name: str, default: float) -> float:
        """A sampling field as the reply used it: the request's, else the model's default, else vLLM's."""
        value = getattr(self.request, name)
        return value if value is not None else self.defaults.get(name, default)

    def whole(self, chat: ChatCompletionResponse) -> dict:
        choice = chat.choices[0]
        message, done = choice.message, "incomplete" if choice.finish_reason == "length" else "completed"
        if message.reasoning is not None:
            self.output.append(_reasoning_item(message.reasoning, done))
        if message.content or not self.output and not message.tool_calls:  # an empty reply: an empty message
            self.output.append(_message_item(message.content or "", done))
            if choice.logprobs is not None:
                self.output[-1]["content"][0]["logprobs"] = [entry.model_dump() for entry in choice.logprobs.content]
        for call in message.tool_calls or ():
            self.output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], done))
        self.status = done
        details = chat.usage.prompt_tokens_details
        thinking = chat.usage.completion_tokens_details
        self.usage = _usage(chat.usage.prompt_tokens, chat.usage.completion_tokens,
                            details.cached_tokens if details is not None else 0,
                            thinking.reasoning_tokens if thinking is not None else 0)
        return self.body()

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The typed events of a response, from the chat stream's SSE chunks."""
        yield self._event("response.created", response=self.body()) + \
            self._event("response.in_progress", response=self.body())
        item: _OpenItem | None = None  # the item whose deltas are arriving
        header: tuple[str, str] | None = None  # a named function's call (id, name), opened at its first arguments
        finish_reason = None
        async for text in chunks:
            events = []
            for line in text.split("\n"):
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:  # the engine failed the request: the error, then the response as it stands
                    error = chunk["error"]
                    events.append(self._event("error", code=error.get("code"), message=error.get("message"),
                                              param=error.get("param")))
                    if item is not None:
                        self._close(events, item, "incomplete")
                    self.status, self.error = "failed", {"code": error.get("code") or "server_error",
                                                         "message": error.get("message") or ""}
                    events.append(self._event("response.failed", response=self.body()))
                    yield "".join(events)
                    return
                if chunk.get("usage") and not chunk["choices"]:
                    usage = chunk["usage"]
                    self.usage = _usage(usage["prompt_tokens"], usage["completion_tokens"],
                                        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                        (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0))
                    continue
                choice = chunk["choices"][0]
                delta = choice["delta"]
                if delta.get("reasoning"):
                    item = self._open(events, item, "reasoning")
                    events.append(self._delta(item, delta["reasoning"]))
                logprobs = (choice.get("logprobs") or {}).get("content")
                if delta.get("content"):
                    item = self._open(events, item, "message")
                    events.append(self._delta(item, delta["content"]) if logprobs is None else
                                  self._delta_with_logprobs(item, delta["content"], logprobs))
                elif logprobs and not delta.get("reasoning") and not delta.get("tool_calls") and \
                        (item is None or item.kind == "message"):  # tokens without text (held back, or the end's)
                    item = self._open(events, item, "message")
                    events.append(self._delta_with_logprobs(item, "", logprobs))
                for call in delta.get("tool_calls") or ():
                    function = call.get("function") or {}
                    if call.get("id"):  # a new call: whole (a parsed one), or a named function's header
                        header = call["id"], function.get("name", "")
                    if function.get("arguments"):
                        if header is not None:
                            item, header = self._open(events, item, "function_call", *header), None
                        if item is not None and item.kind == "function_call":
                            events.append(self._delta(item, function["arguments"]))
                finish_reason = choice.get("finish_reason") or finish_reason
            if events:
                yield "".join(events)
        done = "incomplete" if finish_reason == "length" else "completed"
        closing: list[str] = []
        if header is not None:  # a named function's call with no arguments written
            item = self._open(closing, item, "function_call", *header)
        if not self.output:
            item = self._open(closing, item, "message")  # an empty reply: an empty message, as whole() gives
        if item is not None:
            self._close(closing, item, done)
        self.status = done
        closing.append(self._event(f"response.{done}", response=self.body()))
        yield "".join(closing)

    def _event(self, kind: str, **fields) -> str:
        fields = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(fields, ensure_ascii=False)}\n\n"

    def _open(self, events: list[str], current: _OpenItem | None, kind: str, call_id: str = "", name: str = ""
              ) -> _OpenItem:
        """The item that takes a delta of this kind: the current one, or a new one (the current one closed)."""
        if current is not None and current.kind == kind and kind != "function_call":
            return current
        if current is not None:
            self._close(events, current, "completed")
        item = {"message": lambda: _message_item("", "in_progress"),
                "reasoning": lambda: _reasoning_item("", "in_progress"),
                "function_call": lambda: _call_item(call_id, name, "", "in_progress")}[kind]()
        if kind != "function_call":
            item["content"] = []  # its part is announced next, and put in when the item closes
        self.output.append(item)
        new = _OpenItem(item, len(self.output) - 1)
        events.append(self._event("response.output_item.added", output_index=new.index, item=item))
        if kind != "function_call":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=new.index,
                                      content_index=0, part=_part(kind, "")))
        return new

    def _delta(self, current: _OpenItem, text: str) -> str:
        """The item's delta event (the bytes _event gives, from the item's fixed parts)."""
        current.pieces.append(text)
        number, self.sequence_number = self.sequence_number, self.sequence_number + 1
        return f"{current.head}{number}{current.middle}{_encode(text)}{current.tail}"

    def _delta_with_logprobs(self, current: _OpenItem, text: str, logprobs: list[dict]) -> str:
        current.pieces.append(text)
        current.logprobs += logprobs
        return self._event("response.output_text.delta", item_id=current.item["id"], output_index=current.index,
                           content_index=0, delta=text, logprobs=logprobs)

    def _close(self, events: list[str], current: _OpenItem, status: str):
        item, index, text = current.item, current.index, "".join(current.pieces)
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=text))
        else:
            item["content"] = [_part(item["type"], text, current.logprobs)]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=text, logprobs=current.logprobs))
            else:
                events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=text))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=item["content"][0]))
        events.append(self._event("response.output_item.done", output_index=index, item=item))


_encode = json.JSONEncoder(ensure_ascii=False).encode
DELTA_EVENTS = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
                "function_call": "response.function_call_arguments.delta"}


class _OpenItem:
    """An output item whose deltas are arriving: its text so far, in pieces, and the fixed parts of its delta events
    (each event is written around its sequence number and its text's JSON, without a dict to serialise: a stream's
    frontend work per token is then close to the chat route's)."""

    def __init__(self, item: dict, index: int):
        self.item, self.index, self.pieces = item, index, []
        self.logprobs: list[dict] = []  # the message's tokens', where the request includes them
        self.kind = item["type"]
        event_type = DELTA_EVENTS[self.kind]
        content_index = "" if self.kind == "function_call" else ', "content_index": 0'
        self.head = f'event: {event_type}\ndata: {{"type": "{event_type}", "sequence_number": '
        self.middle = f', "item_id": "{item["id"]}", "output_index": {index}{content_index}, "delta": '
        self.tail = ', "logprobs": []}\n\n' if self.kind == "message" else "}\n\n"


def _message_item(text: str, status: str) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": status, "role": "assistant",
            "content": [_part("message", text)]}


def _reasoning_item(text: str, status: str) -> dict:
    return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": status, "summary": [],
            "content": [_part("reasoning", text)]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def _part(kind: str, text: str, logprobs: list[dict] = ()) -> dict:
    """A message's (output_text) or a reasoning item's (reasoning_text) content part."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}
    return {"type": "reasoning_text", "text": text}


def _usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}
