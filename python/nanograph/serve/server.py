"""EngineServer: uvicorn's server, whose SIGTERM and SIGINT also abort the engine's requests, and after which the
process exits 0 (uvicorn raises the signal again once it has stopped, which would end the process with it); it stops
by itself when the engine dies."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from .async_llm import AsyncLLM

logger = logging.getLogger("nanograph.serve")


class EngineServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_llm: AsyncLLM, stop_on_engine_death: bool = True):
        """stop_on_engine_death: once the engine has died the server stops (engine_died is then true), as vLLM's
        does, so that a supervisor restarts it; otherwise it stays up, answering 503."""
        super().__init__(config)
        self.async_llm = async_llm
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_died = False
        self._stop_on_death = stop_on_engine_death
        if stop_on_engine_death:
            async_llm.death_callbacks.append(self._stop_on_engine_death)

    def _stop_on_engine_death(self, exc: BaseException):
        if not self.engine_died:
            logger.error("stopping the server, whose engine has died (set NANOGRAPH_KEEP_ALIVE_ON_ENGINE_DEATH=1 to "
                         "keep it up, answering 503)")
        self.engine_died = True
        self.should_exit = True  # uvicorn's main loop reads it at its next tick

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        if self.async_llm.error is not None and self._stop_on_death:  # it died before the callback was in place
            self._stop_on_engine_death(self.async_llm.error)
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
