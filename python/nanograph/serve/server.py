"""EngineServer: uvicorn's server, whose SIGTERM and SIGINT also abort the engine's requests, and after which the
process exits 0 (uvicorn raises the signal again once it has stopped, which would end the process with it)."""
from __future__ import annotations

import asyncio
import contextlib
import signal

import uvicorn

from .async_llm import AsyncLLM


class EngineServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_llm: AsyncLLM):
        super().__init__(config)
        self.async_llm = async_llm
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame):
        """uvicorn stops accepting and waits for open responses, which end at once: their requests are aborted.
        The abort goes through the event loop, as a signal handler must not take the engine pipe's lock."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.async_llm.abort_all)
        super().handle_exit(sig, frame)
