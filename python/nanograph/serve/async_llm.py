"""AsyncLLM: the LLMEngine behind asyncio. One thread owns the engine and runs its step loop; coroutines hand it
requests and aborts, and each API request reads its completions' deltas from its own asyncio queue.

Only the loop thread calls the engine, so that a request or an abort never waits on a lock held through a whole
step, and the engine's state is read between steps only. The thread steps while anything is unfinished and
sleeps on an event otherwise. If it dies (an error outside any request), the engine is marked dead: open streams
and new requests get EngineUnavailable."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

from ..engine.llm_engine import LLMEngine
from ..outputs import CompletionDelta
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics

logger = logging.getLogger("nanograph.serve")


class EngineUnavailable(RuntimeError):
    """The engine loop has died, or the server is shutting down."""


class RequestStream:
    """One API request's engine requests (one per prompt) as one async stream of (prompt index, delta) lists, ending
    once every completion has reported its last delta. Each item is all that has arrived since the last one, so
    that a reader behind the engine (a slow client, a busy event loop) catches up in one write. close() aborts
    what is unfinished."""

    def __init__(self, async_llm: AsyncLLM, loop: asyncio.AbstractEventLoop, num_completions: int):
        self.async_llm = async_llm
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, CompletionDelta] | BaseException] = asyncio.Queue()
        self.request_ids: list[str] = []  # written by the loop thread
        self.num_open = num_completions
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[tuple[int, CompletionDelta]]:
        if not self.num_open:
            raise StopAsyncIteration
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                self.num_open = 0
                raise item
            if item[1].finished:
                self.num_open -= 1
        return items

    def close(self):
        if not self.closed:
            self.closed = True
            if self.num_open:
                self.async_llm.submit(("abort", self))


class AsyncLLM:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, log_interval: float = 10.0):
        self.engine = engine
        self.metrics = metrics
        self.log_interval = log_interval
        self.error: BaseException | None = None  # why the loop died
        self.stopping = False
        self._commands: deque[tuple] = deque()
        self._commands_lock = threading.Lock()  # taken only to queue or drain commands, never across a step
        self._wake = threading.Event()
        # Each unfinished engine request: its stream, its prompt's index there, and its completions still open.
        self._requests: dict[str, list] = {}
        self._last_log = (time.monotonic(), 0, 0, None)  # time, prompt and generation tokens, the line's state
        self._thread = threading.Thread(target=self._run, name="nanograph-engine-loop", daemon=True)

    def start(self):
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self.stopping

    async def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> RequestStream:
        """Queue one engine request per prompt (token ids), all or none: an invalid one raises the engine's
        ValueError or TypeError ("prompt i: ..." when there are several) and none runs."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, loop, sum(request_params.n for request_params in params))
        added = loop.create_future()
        self.submit(("add", stream, prompts, params, added))
        try:
            await added
        except BaseException:  # a cancelled caller, too: what was queued is aborted
            stream.close()
            raise
        return stream

    def abort_all(self):
        """Refuse new requests and abort every unfinished one (their streams end with "abort"); the loop then
        stops. Callable from any thread (not from a signal handler, as it takes the command lock)."""
        self.stopping = True
        self.submit(("stop",))

    def join(self, timeout: float | None = None):
        self._thread.join(timeout)

    def submit(self, command: tuple):
        """Queue a command for the loop thread: ("add", stream, prompts, params, future), ("abort", stream) or
        ("stop",). An add is refused at once (its future fails) once the loop has died or is stopping."""
        with self._commands_lock:
            if command[0] == "add" and (self.error is not None or self.stopping):
                _settle(command[4], self._unavailable())
                return
            self._commands.append(command)
        self._wake.set()

    def _unavailable(self) -> EngineUnavailable:
        if self.error is not None:
            return EngineUnavailable(f"the engine loop has died ({type(self.error).__name__}: {self.error}); "
                                     "restart the server")
        return EngineUnavailable("the server is shutting down")

    # The loop thread.

    def _run(self):
        try:
            while True:
                self._wake.clear()
                if not self._apply_commands():
                    break
                busy = self.engine.has_unfinished()
                if busy:
                    self.engine.step()  # its outputs are the deltas' too
                self._deliver(self.engine.take_deltas())
                self.metrics.record_engine(self.engine)
                self._log_stats()
                if not busy:
                    self._wake.wait(self.log_interval)
        except BaseException as exc:
            logger.exception("the engine loop died; the server answers 503 from now on")
            self._die(exc)

    def _apply_commands(self) -> bool:
        """Queue the new requests and apply the aborts; False once a stop was applied (its aborts delivered)."""
        with self._commands_lock:
            commands, self._commands = self._commands, deque()
        for command in commands:
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "abort":
                self._abort(command[1].request_ids)
            else:
                self._abort(list(self._requests))
                self._deliver(self.engine.take_deltas())
                self.metrics.record_engine(self.engine)
                return False
        return True

    def _add(self, stream: RequestStream, prompts: list[list[int]], params: list[SamplingParams],
             added: asyncio.Future):
        for prompt_index, (prompt, request_params) in enumerate(zip(prompts, params)):
            try:
                request_id = self.engine.add_request(prompt, request_params, stream=True)
            except (ValueError, TypeError) as exc:
                self._abort(stream.request_ids)
                _settle(added, type(exc)(f"prompt {prompt_index}: {exc}") if len(prompts) > 1 else exc)
                return
            stream.request_ids.append(request_id)
            self._requests[request_id] = [stream, prompt_index, request_params.n]
            self.metrics.request_added(request_id, len(prompt), request_params.n)
        _settle(added, None)

    def _abort(self, request_ids: list[str]):
        """The engine ends them at once, freeing their blocks; their last deltas come with the next take."""
        for request_id in request_ids:
            self.engine.abort_request(request_id)

    def _deliver(self, deltas: list[CompletionDelta]):
        """Hand the deltas to their streams: one call into each event loop per step."""
        if not deltas:
            return
        self.metrics.record_deltas(deltas)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for delta in deltas:
            entry = self._requests.get(delta.request_id)
            if entry is None:
                continue
            stream, prompt_index, _ = entry
            by_loop.setdefault(stream.loop, []).append((stream.queue, (prompt_index, delta)))
            if delta.finished:
                entry[2] -= 1
                if not entry[2]:
                    del self._requests[delta.request_id]
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody reads its streams any more
                self._abort([request_id for request_id, (stream, *_) in self._requests.items()
                             if stream.loop is loop])

    def _die(self, exc: BaseException):
        with self._commands_lock:
            self.error = exc
            commands, self._commands = self._commands, deque()
        for command in commands:
            if command[0] == "add":
                _settle(command[4], self._unavailable())
        for stream, *_ in self._requests.values():
            if not stream.loop.is_closed():
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, self._unavailable())
        self._requests.clear()

    def _log_stats(self):
        """One line per interval while there is something to say: running and waiting sequences, prompt and
        generation throughput since the last line, KV cache use."""
        now = time.monotonic()
        since, prompt_tokens, generation_tokens, state = self._last_log
        if now - since < self.log_interval:
            return
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        metrics = self.metrics
        new_state = (scheduler.num_running, scheduler.num_waiting)
        prompt_rate = (metrics.total_prompt_tokens - prompt_tokens) / (now - since)
        generation_rate = (metrics.total_generation_tokens - generation_tokens) / (now - since)
        if new_state != (0, 0) or prompt_rate or generation_rate or state != new_state:
            logger.info("engine: %d running, %d waiting; prompt %.1f tok/s, generation %.1f tok/s; KV cache %.1f%% "
                        "of %d blocks in use", *new_state, prompt_rate, generation_rate,
                        100 * (1 - blocks.num_free_blocks / len(blocks.blocks)), len(blocks.blocks))
        self._last_log = (now, metrics.total_prompt_tokens, metrics.total_generation_tokens, new_state)


def _settle(future: asyncio.Future, exc: BaseException | None):
    """Resolve an add's future from any thread (unless its awaiting coroutine has gone)."""
    def settle():
        if not future.done():
            future.set_result(None) if exc is None else future.set_exception(exc)

    loop = future.get_loop()
    if not loop.is_closed():
        loop.call_soon_threadsafe(settle)


def _put_all(items: list[tuple[asyncio.Queue, tuple[int, CompletionDelta]]]):
    for queue, item in items:
        queue.put_nowait(item)
