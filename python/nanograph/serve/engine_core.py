"""The engine process: it owns the LLMEngine and runs its step loop, apart from the HTTP frontend, so that neither
waits on the other's Python work (one interpreter lock each). AsyncLLM starts it and talks to it over two pipes.

In: ("add", stream_id, prompts, params (SamplingParams, or PoolingParams for an embedding model), priority,
report_prompts), ("abort", stream_id), ("call", call_id, method, args) (LLMEngine.<method>(*args), one of
ENGINE_CALLS), ("stop",), read by a thread of their own so that the frontend never blocks on a full pipe while a
step runs. Out, sent by a thread of their own so that a step never waits on a frontend that is behind, in this order of
events:
("ready", EngineInfo) once the engine is built (or ("failed", error) when it cannot be);
("added", stream_id, error or None[, prompts]) for each add, all its prompts queued or none (prompts: each one's text
and token ids as queued, where the add asked for them);
("answer", call_id, result, error) for each call (the method's result and None, or None and the error it raised);
("step", [(stream_id, prompt index, CompletionDelta), ...], EngineSnapshot) after each step that produced
deltas, and whenever the state the frontend reports changed; ("dead", error) when the loop died outside any
request; ("stopped",) after a stop, its aborts delivered."""
from __future__ import annotations

import fcntl
import pickle
import queue
import signal
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ..engine.llm_engine import EngineSleeping, LLMEngine
from ..metrics import cache_config_labels
from ..pooling import PoolingParams
from ..sampling_params import SamplingParams


# The LLMEngine methods the frontend may call between steps (AsyncLLM._call).
ENGINE_CALLS = ("reset_prefix_cache", "start_profile", "stop_profile", "sleep", "wake_up", "is_sleeping",
                "reload_weights")


@dataclass(frozen=True)
class EngineInfo:
    """What the frontend needs to know of the engine, sent once it is built."""
    model: str  # the model folder the engine loaded
    tokenizer: str | None  # the folder of its tokenizer
    max_model_len: int
    sampling_defaults: dict  # SamplingParams fields from the model's generation_config.json (vLLM's defaults)
    max_num_seqs: int
    vocab_size: int
    device: str
    kv_cache: str  # what the KV cache holds, in words (Runner.kv_cache_summary)
    cache_config: dict[str, str]  # vLLM's cache_config_info labels that apply here
    reasoning_parser: str | None = None  # Config.reasoning_parser: how replies' thinking is taken apart
    runner: str = "generate"  # Config.runner: "pooling" for an embedding model or a classifier
    pooling_task: str | None = None  # a pooling model's: "embed" or "classify" (Pooler.task)
    labels: tuple[str, ...] = ()  # a classifier's class names
    score_activation: str | None = None  # a classifier's (Pooler.score_activation): a cross-encoder's score of its logit
    profiler: str | None = None  # Config.profiler_config's profiler, if any: the server then serves /start_profile
    sleep_mode: bool = False  # Config.enable_sleep_mode: the engine may sleep (the server's /sleep, in dev mode)


@dataclass(frozen=True)
class EngineSnapshot:
    """The scheduler's and the KV cache's state, and the engine's running counts, after a step."""
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int


def engine_info(engine: LLMEngine) -> EngineInfo:
    config, runner, pooler = engine.config, engine.runner, engine.pooler
    return EngineInfo(config.model, config.tokenizer, config.max_model_len, dict(engine.sampling_defaults),
                      config.max_num_seqs, engine.vocab_size, str(runner.device), runner.kv_cache_summary(),
                      cache_config_labels(config, runner), config.reasoning_parser,
                      config.runner, pooler and pooler.task, pooler.labels if pooler else (),
                      pooler and pooler.score_activation, engine.profiler and engine.profiler.config.profiler,
                      config.enable_sleep_mode)


def snapshot(engine: LLMEngine) -> EngineSnapshot:
    scheduler = engine.scheduler
    blocks = scheduler.block_manager
    return EngineSnapshot(scheduler.num_running, scheduler.num_waiting, blocks.num_free_blocks, len(blocks.blocks),
                          scheduler.num_preemptions, blocks.num_prefix_queried_tokens, blocks.num_prefix_hit_tokens)


def num_completions(params: SamplingParams | PoolingParams) -> int:
    """The completions a request makes: its n, or one pooled vector."""
    return params.n if isinstance(params, SamplingParams) else 1


def run_engine_process(make_engine: Callable[[], LLMEngine], commands: Connection, outputs: Connection):
    """The engine process's entry point. Ctrl-C reaches the whole process group: the frontend alone handles it and
    stops this loop with a command. A frontend gone (its end of the pipe closed) stops it too. SIGTERM keeps its
    default action: the frontend's multiprocessing ends a daemon child with it when the frontend exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = make_engine()
    except BaseException as exc:
        _send(outputs, ("failed", _portable(exc)))
        return
    EngineCore(engine, commands, outputs).run()


class EngineCore:
    def __init__(self, engine: LLMEngine, commands: Connection, outputs: Connection):
        self.engine = engine
        self.outputs = outputs
        self._commands: deque[tuple] = deque()
        self._wake = threading.Condition()
        self._streams: dict[int, list[str]] = {}  # an API request's engine requests
        self._origin: dict[str, tuple[int, int, int]] = {}  # engine request -> stream, prompt index, open completions
        self._reader = threading.Thread(target=self._read, args=(commands,), name="nanograph-engine-input",
                                        daemon=True)
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        # sleep(mode="wait") calls, answered once the requests running at the call have finished: until then the
        # loop steps on (deltas and aborts flow) and refuses new requests.
        self._sleeps_waiting: list[tuple[int, tuple]] = []
        self._writer = threading.Thread(target=self._write, name="nanograph-engine-output")

    def run(self):
        # A server's first structured request then costs no stall of every stream (llguidance's tokenizer).
        self.engine.intake.grammars.prepare()
        self._send(("ready", engine_info(self.engine)))
        self._reader.start()
        self._writer.start()
        try:
            self._loop()
        finally:
            try:
                self.engine.shutdown()
            finally:
                self._outbox.put(None)
                self._writer.join()

    def _loop(self):
        last = None
        try:
            while True:
                if not self._apply_commands():
                    break
                busy = self.engine.has_unfinished()
                if busy:
                    self.engine.step()
                deltas = self.engine.take_deltas()
                state = snapshot(self.engine)
                if deltas or state != last:
                    self._send(("step", self._route(deltas), state))
                    last = state
                if self._sleeps_waiting and not self.engine.has_unfinished():
                    for call_id, args in self._sleeps_waiting:
                        self._send(("answer", call_id, *self._call("sleep", args)))
                    self._sleeps_waiting = []
                    continue  # the sleep may have ended streams (their deltas go out first)
                if not busy:
                    with self._wake:
                        self._wake.wait_for(lambda: self._commands)
        except BaseException as exc:
            self._send(("dead", _portable(exc)))

    def _read(self, commands: Connection):
        """Every command, as soon as it arrives; a closed pipe (the frontend gone) is a stop."""
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):
                command = ("stop",)
            with self._wake:
                self._commands.append(command)
                self._wake.notify()
            if command[0] == "stop":
                return

    def _apply_commands(self) -> bool:
        """Queue the new requests and apply the aborts; False once a stop was applied (its aborts delivered)."""
        with self._wake:
            commands, self._commands = self._commands, deque()
        for command in commands:
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "abort":
                self._abort(self._streams.get(command[1], []))
            elif command[0] == "call":
                call_id, method, args = command[1:]
                if method == "sleep" and args[2:3] == ("wait",) and self.engine.has_unfinished():
                    self._sleeps_waiting.append((call_id, args))
                else:
                    self._send(("answer", call_id, *self._call(method, args)))
            else:
                self._abort(list(self._origin))
                self._send(("step", self._route(self.engine.take_deltas()), snapshot(self.engine)))
                self._send(("stopped",))
                return False
        return True

    def _call(self, method: str, args: tuple) -> tuple[object, BaseException | None]:
        """LLMEngine.<method>(*args) (one of ENGINE_CALLS): its result and None, or None and its error (the caller's
        to raise: a refused call never ends the loop)."""
        if method not in ENGINE_CALLS:
            return None, ValueError(f"the engine takes no call {method!r}; it takes {', '.join(ENGINE_CALLS)}")
        try:
            return getattr(self.engine, method)(*args), None
        except Exception as exc:
            return None, _portable(exc)

    def _add(self, stream_id: int, prompts: list, params: list[SamplingParams], priority: int = 0,
             report_prompts: bool = False):
        """All of an API request's prompts, or none: an invalid one aborts those queued before it (their last
        deltas go to a stream the frontend has dropped). Any error in an add is that request's, never the loop's.
        report_prompts: the answer carries each prompt's text and token ids as queued."""
        if self._sleeps_waiting:
            self._send(("added", stream_id, EngineSleeping("the engine is going to sleep (POST /sleep?mode=wait): it "
                                                           "takes no new request until POST /wake_up")))
            return
        request_ids = self._streams[stream_id] = []
        for prompt_index, (prompt, request_params) in enumerate(zip(prompts, params)):
            try:
                request_id = self.engine.add_request(prompt, request_params, stream=True, priority=priority)
            except Exception as exc:
                self._abort(request_ids)
                if not request_ids:
                    del self._streams[stream_id]
                self._send(("added", stream_id, _portable(_prefixed(exc, f"prompt {prompt_index}: ")
                                                          if len(prompts) > 1 else exc)))
                return
            request_ids.append(request_id)
            self._origin[request_id] = (stream_id, prompt_index, num_completions(request_params))
        if not report_prompts:
            self._send(("added", stream_id, None))
            return
        queued = [self.engine.requests[request_id].seqs[0] for request_id in request_ids]
        self._send(("added", stream_id, None, [(seq.prompt, seq.token_ids[:seq.num_prompt_tokens]) for seq in queued]))

    def _abort(self, request_ids: list[str]):
        """The engine ends them at once, freeing their blocks; their last deltas come with the next take."""
        for request_id in request_ids:
            self.engine.abort_request(request_id)

    def _route(self, deltas) -> list[tuple]:
        """Each delta with the stream and prompt it belongs to; an API request is forgotten once its last
        completion has ended."""
        routed = []
        for delta in deltas:
            origin = self._origin.get(delta.request_id)
            if origin is None:
                continue
            stream_id, prompt_index, num_open = origin
            routed.append((stream_id, prompt_index, delta))
            if delta.finished:
                if num_open == 1:
                    del self._origin[delta.request_id]
                    request_ids = self._streams[stream_id]
                    request_ids.remove(delta.request_id)
                    if not request_ids:
                        del self._streams[stream_id]
                else:
                    self._origin[delta.request_id] = (stream_id, prompt_index, num_open - 1)
        return routed

    def _send(self, message: tuple):
        self._outbox.put(message)

    def _write(self):
        while (message := self._outbox.get()) is not None:
            try:
                _send(self.outputs, message)
            except Exception as exc:  # a message that cannot be sent: the frontend must not wait for it
                _send(self.outputs, ("dead", RuntimeError(f"the engine could not send its {message[0]!r} message: "
                                                          f"{type(exc).__name__}: {exc}")))


def _send(outputs: Connection, message: tuple):
    try:
        outputs.send(message)
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass  # the frontend is gone; the reader sees the pipe closed and stops the loop


def widen_pipe(end: Connection):
    """A pipe of 1 MiB rather than 64 KiB, so that a writer gets ahead of a busy reader by many messages (a burst of
    adds, many steps' deltas) before it waits."""
    try:
        fcntl.fcntl(end.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
    except OSError:
        pass  # the system's limit is lower: the default size works, with the writer waiting more often


def _prefixed(exc: Exception, prefix: str) -> Exception:
    """The same kind of error with its message prefixed (a ValueError where the kind takes other arguments)."""
    try:
        return type(exc)(prefix + str(exc))
    except Exception:
        return ValueError(prefix + str(exc))


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
