"""Server-sent events as OpenAI streams them (data: {chunk} lines, then data: [DONE]), and the client's disconnect,
which aborts what its request still runs."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # the status of a response nobody reads: the client left first


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


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
