"""TensorParallelRunner: the torch backend over tensor_parallel_size processes, each holding one shard of the model
(models/sharding.py), joined by torch.distributed's gloo backend over localhost.

Rank 0 is this process: it runs the scheduler, the sampler and the API, and drives a TorchRunner on its shard. Ranks
1..N-1 are worker processes (backends/tensor_parallel_worker.py), started with subprocess rather than
multiprocessing so that a daemonic process (the server's engine process) may start them too. Each step, rank 0
resolves the sampled tokens the step reads (input_src) into its input ids and broadcasts the step's metadata
(backends/step_broadcast.py); then every rank runs the same layers on its shard, the partial sums all-reduced.

The head runs on rank 0 alone, over the whole lm_head: the sampler and the prompt logprobs need whole rows of
logits, and for a small vocabulary (SmolLM2's 49,152 x 576) a vocabulary-parallel head would save half of a small
product but gather [seqs, vocab] float32 logits to rank 0 every step.

Failure: rank 0's collectives time out after step_timeout seconds. A worker that dies closes its sockets, so the
collective fails at once; one that hangs lets it time out. Either way the runner raises a RuntimeError naming the
rank, ends the workers and refuses later steps. Workers wait for a step without a time limit and end with rank 0:
at shutdown() (also at interpreter exit or when the runner is collected), or when rank 0's process goes.

The ranks share the machine's cores: each takes an equal share of rank 0's torch threads (rank 0's own count is
lowered to its share until shutdown), as more threads than cores slow every rank down."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..model_config import ModelConfig
from ..models.sharding import Shard
from .base import PendingTokens, Runner
from .step_broadcast import send_step
from .torch_backend import TorchRunner

# For the workers to start and load their shards: the group's own timeout; each step's collectives pass theirs.
STARTUP_TIMEOUT = timedelta(minutes=10)


class TensorParallelRunner(Runner):
    more_kv_cache = TorchRunner.more_kv_cache

    def __init__(self, model_config: ModelConfig, world: int, step_timeout: float, **runner_kwargs):
        Shard.check(model_config, world)
        self.model_config = model_config
        self.step_timeout = timedelta(seconds=step_timeout)
        self._error: str | None = None
        # The rendezvous is a file, not a TCP store: no port is opened (a TCP store listens on every interface).
        store_path = Path(tempfile.mkdtemp(prefix="nanograph-tp-")) / "store"
        store = new_store(store_path, world)
        self._workers = _Workers([_start_worker(rank, world, store_path, model_config, step_timeout, runner_kwargs)
                                  for rank in range(1, world)], store_path.parent)
        self._stop = weakref.finalize(self, _shut_down, self._workers, self.step_timeout, torch.get_num_threads())
        torch.set_num_threads(max(1, torch.get_num_threads() // world))  # the ranks share the cores
        try:
            # The all-reduce closes over the workers, not self: the runner is collected (and its workers ended)
            # as soon as nothing holds it.
            self.rank0 = TorchRunner(model_config, **runner_kwargs, shard=Shard(0, world),
                                     all_reduce=partial(_all_reduce, self._workers, self.step_timeout))
        except Exception:  # rank 0's own error (such as an unreadable checkpoint), as it is
            self._stop()
            raise
        try:
            self._workers.wait_connected(store)
            self._workers.group = loopback_group(store, 0, world)
            self._workers.group.allreduce([torch.zeros(1)]).wait()  # every shard is loaded
        except Exception as exc:
            self._fail(exc, "starting")
        self.device, self.block_size = self.rank0.device, self.rank0.block_size
        self.num_kv_blocks, self.weights = self.rank0.num_kv_blocks, self.rank0.weights
        self.kv_cache_dtype = self.rank0.kv_cache_dtype

    def forward(self, batch, seqs: list):
        if self._error is not None:
            raise RuntimeError(self._error)
        try:
            input_ids = self.rank0.input_ids(batch).cpu().numpy().astype(np.int32)
            batch = replace(batch, input_ids=input_ids, input_src=np.full_like(input_ids, -1))
            send_step(self._workers.group, batch, self.step_timeout)
            self.rank0.forward(batch, seqs)
        except Exception as exc:
            self._fail(exc, "running a step")
        except BaseException:  # KeyboardInterrupt: the workers are inside the step's collectives, out of step
            self._error = "a step was interrupted, leaving the ranks out of step; build a new LLM"
            self._workers.kill()  # not told to stop: they would take the message for the step's collectives
            self._stop()
            raise

    def sample(self, rows: list[int], seqs: list) -> PendingTokens:
        return self.rank0.sample(rows, seqs)

    def final_hidden(self) -> torch.Tensor:
        return self.rank0.final_hidden()

    def shutdown(self):
        self._stop()
        self._error = self._error or "the engine was shut down (LLM.shutdown()); build a new LLM to run more requests"

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [process.pid for process in self._workers.processes]

    def _fail(self, exc: Exception, doing: str):
        """End the workers and raise the error that names the rank at fault, where one exited."""
        try:
            self._workers.check_alive(doing, grace_s=0.5)  # a worker that died has closed its sockets: wait for it
            self._error = (f"tensor parallelism failed while {doing}: {type(exc).__name__}: {exc}; no worker rank "
                           f"exited, so one may hang or be slower than tensor_parallel_step_timeout "
                           f"({self.step_timeout.total_seconds():g} s)")
        except RuntimeError as died:
            self._error = f"{died}; the engine cannot go on (the rank's own error, if any, is on stderr above)"
        self._workers.kill()
        self._stop()  # gives rank 0 its threads back
        raise RuntimeError(self._error) from exc


def _all_reduce(workers: _Workers, timeout: timedelta, tensor: torch.Tensor):
    workers.group.allreduce([tensor], timeout=timeout).wait()


def _shut_down(workers: _Workers, timeout: timedelta, num_threads: int):
    workers.stop(timeout)
    shutil.rmtree(workers.store_dir, ignore_errors=True)
    torch.set_num_threads(num_threads)


class _Workers:
    """Ranks 1..N-1: their processes and, once all have connected, the process group."""

    def __init__(self, processes: list[subprocess.Popen], store_dir: Path):
        self.processes = processes
        self.store_dir = store_dir  # the rendezvous file's folder, removed at shutdown
        self.group = None

    def check_alive(self, doing: str, grace_s: float = 0.0):
        """RuntimeError naming each rank that has exited (within grace_s each)."""
        for process in self.processes:
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        exited = [(rank, process) for rank, process in enumerate(self.processes, 1) if process.poll() is not None]
        if exited:
            raise RuntimeError("; ".join(f"tensor parallel rank {rank} (pid {process.pid}) exited with code "
                                         f"{process.returncode} while {doing}" for rank, process in exited))

    def wait_connected(self, store: dist.FileStore):
        """Wait for every worker to reach the store, checking meanwhile that none has exited (one that fails to
        start would otherwise leave rank 0 waiting for the whole STARTUP_TIMEOUT)."""
        keys = [connected_key(rank) for rank in range(1, len(self.processes) + 1)]
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while not store.check(keys):
            self.check_alive("starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallel workers did not start within {STARTUP_TIMEOUT}")
            time.sleep(0.05)

    def stop(self, timeout: timedelta):
        """Tell the workers to stop, then kill any that has not within a few seconds; at once when none was told
        (the group never formed, or a worker is gone)."""
        told = False
        if self.group is not None and all(process.poll() is None for process in self.processes):
            try:
                send_step(self.group, None, timeout)
                told = True
            except RuntimeError:
                pass  # a worker is gone or hangs: it is killed below
        self.kill(grace_s=5 if told else 0)

    def kill(self, grace_s: float = 0.0):
        for process in self.processes:
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def new_store(path: Path, world: int) -> dist.FileStore:
    store = dist.FileStore(str(path), world)
    store.set_timeout(STARTUP_TIMEOUT)
    return store


def loopback_group(store: dist.FileStore, rank: int, world: int) -> dist.ProcessGroupGloo:
    """The ranks' gloo group, its sockets on 127.0.0.1 (gloo's default device binds the host name's address)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = STARTUP_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world, options)


def connected_key(rank: int) -> str:
    """The store key a worker sets once it has reached the store."""
    return f"worker {rank} connected"


def _start_worker(rank: int, world: int, store_path: Path, model_config: ModelConfig, step_timeout: float,
                  runner_kwargs: dict) -> subprocess.Popen:
    """Rank `rank` in a new process running this very nanograph, its arguments pickled on its stdin."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "nanograph.backends.tensor_parallel_worker"],
                               stdin=subprocess.PIPE, env=env)
    try:
        pickle.dump(dict(rank=rank, world=world, store_path=store_path, parent_pid=os.getpid(), model_config=model_config,
                         step_timeout=step_timeout, runner_kwargs=runner_kwargs,
                         num_threads=max(1, torch.get_num_threads() // world)), process.stdin)
        process.stdin.close()
    except BrokenPipeError:  # it has exited already: waiting for it to connect reports its exit code
        pass
    return process
