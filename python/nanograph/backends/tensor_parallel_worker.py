"""A tensor-parallel rank other than 0 (`python -m nanograph.backends.tensor_parallel_worker`, started by
backends/tensor_parallel.py with its arguments pickled on stdin): loads its shard, then runs each step's layers as
rank 0 broadcasts them, until rank 0 says stop or goes away."""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from datetime import timedelta

import torch

from ..models.sharding import Shard
from .step_broadcast import receive_step
from .tensor_parallel import connected_key, loopback_group, new_store
from .torch_backend import TorchRunner

IDLE_TIMEOUT = timedelta(days=365)  # between steps the engine may wait for requests as long as it likes


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: rank 0 decides what it ends
    args = pickle.load(sys.stdin.buffer)
    _exit_with(args["parent_pid"])
    rank, world = args["rank"], args["world"]
    torch.set_num_threads(args["num_threads"])
    store = new_store(args["store_path"], world)
    store.set(connected_key(rank), "1")
    step_timeout = timedelta(seconds=args["step_timeout"])
    group = loopback_group(store, rank, world)
    runner = TorchRunner(args["model_config"], **_rank_device(args["runner_kwargs"], rank), shard=Shard(rank, world),
                         all_reduce=lambda partial: group.allreduce([partial], timeout=step_timeout).wait())
    group.allreduce([torch.zeros(1)]).wait()  # this shard is loaded
    while (batch := receive_step(group, IDLE_TIMEOUT, step_timeout)) is not None:
        runner.run_layers(batch)


def _rank_device(runner_kwargs: dict, rank: int) -> dict:
    """A GPU device (torch:cuda) means one GPU per rank: this rank's."""
    device = torch.device(runner_kwargs["device"])
    if device.type == "cuda":
        return {**runner_kwargs, "device": torch.device("cuda", rank)}
    return runner_kwargs


def _exit_with(parent_pid: int):
    """End this process when rank 0's process is gone, whatever this one is waiting on."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    main()
