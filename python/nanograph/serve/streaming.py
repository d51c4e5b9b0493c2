"""Server-sent events as OpenAI streams them (data: {chunk} lines, then data: [DONE]), and the client's disconnect,
which aborts what its request still runs."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from ..outputs import CompletionDelta
from .async_llm import EngineUnavailable, RequestStream
from .errors import CLIENT_CLOSED_REQUEST
from .serving import engine_failure, unavailable

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


class TextEvents:
    """The events of chunks that differ in one text field alone (a choice's plain text deltas), written without
    building a model each time: the chunk is rendered once with a marker for its text, and each event is the two
    halves around the JSON string of the text, the same bytes as event() gives. With a thousand streams open, the
    models cost the frontend more than everything else it does per token."""
    MARKER = "NANOGRAPH_TEXT_MARKER"
    _encode = json.JSONEncoder(ensure_ascii=False).encode

    def __init__(self, make_chunk: Callable[[str], BaseModel], fields: int = 1):
        """make_chunk(text): the chunk for a text, which it holds in `fields` fields (a reasoning delta's two)."""
        self.make_chunk = make_chunk
        parts = event(make_chunk(self.MARKER)).split(f'"{self.MARKER}"')
        # The marker also elsewhere (a model's name): no shortcut.
        self.halves = parts if len(parts) == fields + 1 else None

    def __call__(self, text: str) -> str:
        if self.halves is None:
            return event(self.make_chunk(text))
        return self._encode(text).join(self.halves)


async def sse_body(stream: RequestStream, chunk_of: Callable[[int, CompletionDelta], str],
                   usage_chunk: Callable[[], str | Awaitable[str]] | None) -> AsyncIterator[str]:
    """The events of a stream: the chunks of each batch of deltas in one write, the usage chunk when asked (made
    by a function or a coroutine function), then [DONE]. A failure inside the engine (or an engine gone) is an
    error event in place of the rest."""
    try:
        async for deltas in stream:
            events = []
            for prompt_index, delta in deltas:
                if delta.error is not None:
                    yield "".join(events) + event(engine_failure(delta.error).body()) + DONE
                    return
                events.append(chunk_of(prompt_index, delta))
            yield "".join(events)
    except EngineUnavailable as exc:
        yield event(unavailable(exc).body()) + DONE
        return
    if usage_chunk is not None:
        chunk = usage_chunk()
        yield chunk if isinstance(chunk, str) else await chunk
    yield DONE


class EventStreamResponse(StreamingResponse):
    """An SSE response that calls on_close however it ends: sent in full, cut by a disconnect (which cancels the
    stream, even before its first event), or failed."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """The result of work, or, when the client disconnects first, work cancelled (its requests aborted) and a 499
    response that nobody reads."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def _disconnected(request: Request):
    """Returns when the client has gone: once the body is read, the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
