"""AsyncLLM: the engine behind asyncio, in a process of its own (serve/engine_core.py). The HTTP frontend and the
step loop then never wait on each other's Python work, so a thousand open streams do not slow the steps.

Coroutines hand requests and aborts to the engine process over a pipe; a reader thread takes its messages and
hands each step's deltas to the streams' event loops, one call per loop per step. Each API request reads its
completions' deltas from its own asyncio queue. If the engine loop dies (an error outside any request) or its
process ends, open streams and new requests get EngineUnavailable."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING

from ..engine.intake import Prompt
from ..engine.llm_engine import LLMEngine, check_rpc_method
from ..outputs import CompletionDelta
from ..pooling import PoolingParams
from ..sampling_params import SamplingParams
from .engine_core import EngineInfo, EngineSnapshot, num_completions, run_engine_process, widen_pipe

if TYPE_CHECKING:
    from .metrics import ServerMetrics

logger = logging.getLogger("nanograph.serve")


class EngineUnavailable(RuntimeError):
    """The engine loop has died, or the engine is shut down (the server is shutting down)."""


class RequestStream:
    """One API request's engine requests (one per prompt) as one async stream of (prompt index, delta) lists, ending
    once every completion has reported its last delta. Each item is all that has arrived since the last one, so
    that a reader behind the engine (a slow client, a busy event loop) catches up in one write. close() aborts
    what is unfinished."""

    def __init__(self, async_llm: AsyncLLM, stream_id: int, loop: asyncio.AbstractEventLoop, num_completions: int):
        self.async_llm = async_llm
        self.stream_id = stream_id
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, CompletionDelta] | BaseException] = asyncio.Queue()
        self.num_open = num_completions
        self.closed = False
        # Each prompt's text (None for token ids given alone) and token ids as the engine queued them, once added,
        # where generate() was asked for them.
        self.prompts: list[tuple[str | None, list[int]]] | None = None

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
                self.async_llm.abort(self.stream_id)


class AsyncLLM:
    def __init__(self, make_engine: Callable[[], LLMEngine], metrics: ServerMetrics | None,
                 log_interval: float | None = 10.0):
        """make_engine: builds the engine in the engine process (picklable, e.g. a partial of
        LLMEngine.from_config); metrics: the server's, None for none; log_interval: seconds between stats lines
        (which need metrics), None for none."""
        self.make_engine = make_engine
        self.metrics = metrics
        self.log_interval = log_interval if metrics is not None else None
        self.info: EngineInfo | None = None  # once started
        self.snapshot: EngineSnapshot | None = None  # the engine's state after its latest step
        self.error: BaseException | None = None  # why the engine loop died
        self.stopping = False
        self._send_lock = threading.Lock()  # a pipe takes one writer at a time
        # Taken to register a request (checking that the engine is there) and to fail everything when it is gone, so
        # that no request registers after the failure and waits for ever.
        self._state_lock = threading.Lock()
        self._stream_ids = count()
        # Each open stream, and its completions not yet finished; each add waiting for the engine's word.
        self._streams: dict[int, list] = {}
        self._adds: dict[int, tuple[asyncio.Future, float, list[tuple[int, int, int]]]] = {}  # + arrival, sizes
        self._call_ids = count()
        self._calls: dict[int, asyncio.Future] = {}  # each engine call (_call) waiting for its answer
        self._last_log = (time.monotonic(), 0, 0, None)  # time, prompt and generation tokens, the line's state
        self._process: multiprocessing.Process | None = None
        # Called (on the reader thread) with the error once the engine has died, after open requests have failed.
        self.death_callbacks: list[Callable[[BaseException], None]] = []
        self._reader = threading.Thread(target=self._read, name="nanograph-engine-output", daemon=True)

    def start(self) -> EngineInfo:
        """Start the engine process and wait until its engine is built; its error if it cannot be."""
        context = multiprocessing.get_context("spawn")  # the frontend may hold threads, or a device context
        commands_in, self._commands = context.Pipe(duplex=False)
        self._outputs, outputs_out = context.Pipe(duplex=False)
        widen_pipe(self._commands)
        widen_pipe(outputs_out)
        self._process = context.Process(target=run_engine_process, args=(self.make_engine, commands_in, outputs_out),
                                        name="nanograph-engine", daemon=True)
        self._process.start()
        commands_in.close()
        outputs_out.close()
        try:
            message = self._outputs.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine process exited with code {self._process.exitcode} before its engine "
                               "was built; see the log above") from None
        except BaseException:  # Ctrl-C or SIGTERM while the engine loads: it must not go on loading alone
            self.close()
            raise
        if message[0] == "failed":
            self._process.join()
            raise message[1]
        self.info = message[1]
        if self.metrics is not None:
            self.metrics.record_engine_info(self.info)
        self._reader.start()
        return self.info

    def close(self):
        """End the engine process at once (a start given up); nothing is delivered after this."""
        if self._process is not None and self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)

    @property
    def is_running(self) -> bool:
        return self._reader.is_alive() and self.error is None and not self.stopping

    async def generate(self, prompts: list[Prompt], params: list[SamplingParams | PoolingParams], priority: int = 0,
                       report_prompts: bool = False) -> RequestStream:
        """Queue one engine request per prompt (token ids, or any prompt the engine takes), all or none: an
        invalid one raises the engine's ValueError or TypeError ("prompt i: ..." when there are several) and none
        runs. priority: the engine's add_request's, for each; report_prompts: the stream's prompts then hold each
        prompt's text and token ids as the engine queued them."""
        loop = asyncio.get_running_loop()
        stream_id = next(self._stream_ids)
        completions = sum(map(num_completions, params))
        stream = RequestStream(self, stream_id, loop, completions)
        added = loop.create_future()
        with self._state_lock:
            if not self.is_running:
                raise self._unavailable()
            self._streams[stream_id] = [stream, completions]
            self._adds[stream_id] = (added, time.monotonic(), [
                (len(prompt), num_completions(p), self._max_tokens(p, len(prompt)))
                for prompt, p in zip(prompts, params)] if self.metrics is not None else [])
        self._send(("add", stream_id, prompts, params, priority, report_prompts))
        try:
            stream.prompts = await added
        except BaseException:  # a cancelled caller, too: what was queued is aborted (and counted, once it ends)
            stream.close()
            raise
        return stream

    def _max_tokens(self, params: SamplingParams | PoolingParams, prompt_len: int) -> int:
        """What the metrics count as a request's max_tokens: its own, else the room its prompt leaves (a pooling
        request generates nothing: 0)."""
        if not isinstance(params, SamplingParams):
            return 0
        return params.max_tokens if params.max_tokens is not None else max(self.info.max_model_len - prompt_len, 1)

    async def reset_prefix_cache(self) -> bool:
        """The engine's LLMEngine.reset_prefix_cache(): False, changing nothing, while a request holds KV blocks."""
        return await self._call("reset_prefix_cache")

    async def start_profile(self, profile_prefix: str | None = None):
        """The engine's LLMEngine.start_profile(): its RuntimeError without a profiler."""
        await self._call("start_profile", profile_prefix)

    async def stop_profile(self):
        """The engine's LLMEngine.stop_profile(), answered once the trace is written."""
        await self._call("stop_profile")

    async def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort"):
        """The engine's LLMEngine.sleep(level, tags=tags, mode=mode)."""
        await self._call("sleep", level, tags, mode)

    async def wake_up(self, tags: list[str] | None = None):
        """The engine's LLMEngine.wake_up(tags)."""
        await self._call("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._call("is_sleeping")

    async def call(self, method: str, *args):
        """One of the engine's methods that collective_rpc runs (llm_engine.RPC_METHODS), in the engine process."""
        check_rpc_method(method)
        return await self._call(method, *args)

    async def _call(self, method: str, *args):
        """LLMEngine.<method>(*args) in the engine process, between its steps: its answer, or its error raised
        here."""
        call_id = next(self._call_ids)
        answer = asyncio.get_running_loop().create_future()
        with self._state_lock:
            if not self.is_running:
                raise self._unavailable()
            self._calls[call_id] = answer
        self._send(("call", call_id, method, args))
        return await answer

    def abort(self, stream_id: int):
        """End a stream's unfinished requests; callable from any thread."""
        self._send(("abort", stream_id))

    def abort_all(self):
        """Refuse new requests and abort every unfinished one (their streams end with "abort"); the engine process
        then exits. Callable from any thread."""
        if not self.stopping:
            self.stopping = True
            self._send(("stop",))

    def join(self, timeout: float | None = None):
        """Wait for the engine process to end (after abort_all); past the timeout it is terminated."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._reader.is_alive():
            self._reader.join(timeout)
        if self._process is not None:
            self._process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self._process.is_alive():
                logger.warning("the engine process did not end within %s s: terminating it", timeout)
                self._process.terminate()
                self._process.join(5)

    def _send(self, command: tuple):
        with self._send_lock:
            try:
                self._commands.send(command)
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass  # the engine process is gone; the reader reports why

    def _unavailable(self) -> EngineUnavailable:
        if self.error is not None:
            return EngineUnavailable(f"the engine loop has died ({type(self.error).__name__}: {self.error}); "
                                     "restart the server (or start a new engine)")
        return EngineUnavailable("the engine is shut down, or shutting down with the server")

    # The reader thread.

    def _read(self):
        try:
            while True:
                if not self._outputs.poll(self.log_interval):
                    self._log_stats()
                    continue
                message = self._outputs.recv()
                if message[0] == "step":
                    # The counters and the state first: whoever holds a step's deltas sees both up to that step.
                    self.snapshot = message[2]
                    if self.metrics is not None:
                        self.metrics.record_deltas(message[1])
                        self.metrics.record_engine(message[2])
                    self._deliver(message[1])
                    self._log_stats()
                elif message[0] == "added":
                    self._answer_add(*message[1:])
                elif message[0] == "answer":
                    answer = self._calls.pop(message[1], None)
                    if answer is not None:
                        _settle(answer, message[3], message[2])
                elif message[0] == "dead":
                    logger.error("the engine loop died: %s: %s", type(message[1]).__name__, message[1])
                    self._die(message[1])
                    return
                else:  # stopped, its aborts delivered
                    self._die(None)
                    return
        except (EOFError, OSError):
            self._process.join(5)
            if self.stopping:
                self._die(None)
                return
            code = self._process.exitcode
            how = f"code {code}" if code is None or code >= 0 else f"signal {_signal_name(-code)}"
            logger.error("the engine process exited (%s)", how)
            self._die(RuntimeError(f"the engine process exited ({how})"))
        except BaseException as exc:  # a defect here: the server must answer 503, not wait for ever
            logger.exception("the engine's output reader failed; the server answers 503 from now on")
            self._die(exc)

    def _answer_add(self, stream_id: int, error: BaseException | None, prompts: list | None = None):
        """The engine's word on an add (and the prompts it queued, where asked); the metrics count an API request's
        prompts once they are queued."""
        add = self._adds.pop(stream_id, None)
        if add is None:  # the engine is gone meanwhile: _die has answered it
            return
        future, arrival, sizes = add
        if error is not None:
            self._streams.pop(stream_id, None)
        else:
            for prompt_index, (num_prompt_tokens, n, max_tokens) in enumerate(sizes):
                self.metrics.request_added((stream_id, prompt_index), arrival, num_prompt_tokens, n, max_tokens)
        _settle(future, error, prompts)

    def _deliver(self, routed: list[tuple[int, int, CompletionDelta]]):
        """Hand the deltas to their streams: one call into each event loop per step."""
        if not routed:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream_id, prompt_index, delta in routed:
            entry = self._streams.get(stream_id)
            if entry is None:
                continue
            stream = entry[0]
            by_loop.setdefault(stream.loop, []).append((stream.queue, (prompt_index, delta)))
            if delta.finished:
                entry[1] -= 1
                if not entry[1]:
                    self._streams.pop(stream_id, None)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody reads its streams any more
                for stream_id, (stream, _) in list(self._streams.items()):
                    if stream.loop is loop:
                        self.abort(stream_id)

    def _die(self, exc: BaseException | None):
        """The engine is gone (exc: why, or None after a stop): what still waits on it gets EngineUnavailable."""
        with self._state_lock:
            if exc is not None:
                self.error = exc
            self.stopping = True  # nothing registers from now on
            adds, self._adds = self._adds, {}
            calls, self._calls = self._calls, {}
            streams, self._streams = self._streams, {}
        self._send(("stop",))  # an engine process still running (the reader failed) aborts all and exits
        unavailable = self._unavailable()
        for future, *_ in adds.values():
            _settle(future, unavailable)
        for future in calls.values():
            _settle(future, unavailable)
        for stream, _ in streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, unavailable)
            except RuntimeError:  # its event loop has closed: nobody reads that stream
                pass
        if exc is not None:
            if not self.death_callbacks:
                logger.error("the server answers 503 from now on")
            for callback in self.death_callbacks:
                callback(exc)

    def _log_stats(self):
        """One line per interval while there is something to say: running and waiting sequences, prompt and
        generation throughput since the last line, KV cache use."""
        now = time.monotonic()
        since, prompt_tokens, generation_tokens, state = self._last_log
        if self.log_interval is None or now - since < self.log_interval or self.snapshot is None:
            return
        snapshot, metrics = self.snapshot, self.metrics
        new_state = (snapshot.num_running, snapshot.num_waiting)
        prompt_rate = (metrics.total_prompt_tokens - prompt_tokens) / (now - since)
        generation_rate = (metrics.total_generation_tokens - generation_tokens) / (now - since)
        if new_state != (0, 0) or prompt_rate or generation_rate or state != new_state:
            logger.info("engine: %d running, %d waiting; prompt %.1f tok/s, generation %.1f tok/s; KV cache %.1f%% "
                        "of %d blocks in use", *new_state, prompt_rate, generation_rate,
                        100 * (1 - snapshot.num_free_blocks / snapshot.num_blocks), snapshot.num_blocks)
        self._last_log = (now, metrics.total_prompt_tokens, metrics.total_generation_tokens, new_state)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _settle(future: asyncio.Future, exc: BaseException | None, result=None):
    """Resolve an add's future from any thread (unless its awaiting coroutine has gone)."""
    def settle():
        if not future.done():
            future.set_result(result) if exc is None else future.set_exception(exc)

    loop = future.get_loop()
    if not loop.is_closed():
        loop.call_soon_threadsafe(settle)


def _put_all(items: list[tuple[asyncio.Queue, tuple[int, CompletionDelta]]]):
    for queue, item in items:
        queue.put_nowait(item)
