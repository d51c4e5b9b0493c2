"""Runner: what the engine asks of a backend. A step is two calls, because a penalised or masked row may only be
sampled once the host knows the tokens before it: forward() queues the step's forward pass as soon as the batch is
scheduled; the engine then applies the previous step's tokens; sample() queues the sampling of the rows that reach
their sequence's end. The tokens stay where the runner keeps them, where the next step's forward reads them
(ForwardBatch.input_src points at PendingTokens.rows), and come to the host when the engine asks for them.
Prompt logprobs are a third call, after forward(): prompt_logprobs() applies the head to the final hidden states of
the forward's prompt tokens; pooled_hidden() gives them normed, for pooling."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import numpy as np
import torch

from ..sampling import SamplerOutput
from ..models.head import rms_norm
from .prompt_logprobs import prompt_logprobs


class Pending(Protocol):
    def result(self) -> SamplerOutput: ...


class PendingTokens:
    """One step's sampled tokens, on their way from the device: sampled row j's token lies at rows[j] of the
    runner's token buffer."""

    def __init__(self, pending: Pending, rows: list[int] | range):
        self._pending = pending
        self.rows = rows

    def result(self) -> SamplerOutput:
        """Waits for the device (the first time); the token ids and logprobs as host lists."""
        return self._pending.result()


def copy_weights(weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The weights copied to device (pinned host memory for the CPU, where a GPU is there to copy from), a tensor
    that several names share copied once (a tied lm_head); returns once the copies are done."""
    pinned = device.type == "cpu" and torch.cuda.is_available()
    copies: dict[int, torch.Tensor] = {}
    for tensor in weights.values():
        if id(tensor) not in copies:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pinned)
            copies[id(tensor)] = copy.copy_(tensor, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {name: copies[id(tensor)] for name, tensor in weights.items()}


def weight_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights' shapes and dtypes as meta tensors (no memory), names that share a tensor sharing one."""
    metas: dict[int, torch.Tensor] = {}
    for tensor in weights.values():
        if id(tensor) not in metas:
            metas[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return {name: metas[id(tensor)] for name, tensor in weights.items()}


def allocate_weights(layout: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of weight_layout's shapes and dtypes on device (a tied lm_head once)."""
    made: dict[int, torch.Tensor] = {}
    for meta in layout.values():
        if id(meta) not in made:
            made[id(meta)] = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    return {name: made[id(meta)] for name, meta in layout.items()}


class Runner(ABC):
    device: torch.device
    block_size: int
    num_kv_blocks: int
    kv_cache_dtype: torch.dtype  # the KV cache's element type (float8_e4m3fn for kv_cache_dtype "fp8")
    model_config: object  # a ModelConfig
    weights: dict[str, torch.Tensor]  # the packed weights (models/weights.py)

    @abstractmethod
    def forward(self, batch, seqs: list) -> None:
        """Queue the forward pass of batch (a ForwardBatch; seqs: its sequences, in its order). A runner that can
        take every row's token inside the step (an all-greedy batch) decides so here, from their parameters."""

    @abstractmethod
    def sample(self, rows: list[int], seqs: list) -> PendingTokens:
        """Queue the sampling of the last forward's rows `rows` (ascending), whose sequences are seqs."""

    # How a user gets a larger KV cache from this runner, for the engine's messages.
    more_kv_cache = "raise gpu_memory_utilization (or num_kv_blocks)"

    def kv_cache_summary(self) -> str:
        """What the KV cache holds, for the engine's messages."""
        name = str(self.kv_cache_dtype).removeprefix("torch.")
        tokens = self.num_kv_blocks * self.block_size
        return (f"{self.num_kv_blocks} blocks x {self.block_size} = {tokens} tokens in {name} "
                f"({self.kv_cache_dtype.itemsize} byte{'s' if self.kv_cache_dtype.itemsize > 1 else ''} per value)")

    def final_hidden(self) -> torch.Tensor:
        """[num_tokens, hidden_size]: the final norm's input (the last layer's output plus residual) at every token
        the last forward fed, valid until the next forward is queued, ordered after that forward."""
        raise NotImplementedError(f"{type(self).__name__} keeps no hidden states, so it gives no prompt logprobs")

    def shutdown(self):
        """Release what the runner holds outside this process (a tensor-parallel runner's worker processes)."""

    # Whether sleep() and wake_up() free and restore the device memory (Config.enable_sleep_mode).
    supports_sleep = False
    # Whether the weights hold memory but no values yet: woken without a copy (after sleep(level=2)), until
    # reload_weights() reads them.
    weights_unread = False
    _host_weights: dict[str, torch.Tensor] | None = None  # sleep(level=1)'s copy in host memory
    _weight_layout: dict[str, torch.Tensor] | None = None  # the freed weights' shapes, for wake_up

    def tags_freed(self, tags: set[str]) -> set[str]:
        """What sleep(tags) frees: tags, and what this runner cannot keep without them."""
        return set(tags)

    def sleep(self, tags: set[str], keep_weights: bool):
        """Free what tags name (tags_freed's): the KV cache (its contents are forgotten), the weights (with
        keep_weights a copy waits in host memory; else wake_up reads them from the checkpoint again). Only between
        steps, with nothing in flight."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def wake_up(self, tags: set[str]):
        """Restore what sleep() freed of tags ("weights", "kv_cache"; the weights before the KV cache): the weights
        as they were (or, slept without a copy, their memory alone: weights_unread), a KV cache of the same size
        (empty)."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def _free_weights(self):
        """sleep's part for the weights (a copy, if kept, is made before): their layout is kept for wake_up."""
        if self.weights is not None:
            self._weight_layout = weight_layout(self.weights)
        self.weights = None

    def _restore_weights(self):
        """wake_up's part for the weights: the host copy back on the device, or without one the weights' memory
        alone, their values left for reload_weights() (the engine reads them once, when nothing sleeps any more,
        unless reload_weights() has come first, as in vLLM's level-2 order)."""
        if self._host_weights is not None:
            self.weights = copy_weights(self._host_weights, self.device)
        else:
            self.weights, self.weights_unread = allocate_weights(self._weight_layout, self.device), True
        self._host_weights = None

    def reload_weights(self):
        """Read the checkpoint's weights again into the tensors that hold them (in place: what refers to them, the
        CUDA core's captured graphs too, reads the new values), once the device is done with the old ones."""
        raise NotImplementedError(f"{type(self).__name__} does not reload its weights")

    def _reload_into(self, weights: dict[str, torch.Tensor]):
        """reload_weights for a runner whose packed weights _load_weights(device) makes again: read into host
        memory, then copied tensor by tensor (the device never holds two copies)."""
        if weights is None:
            raise RuntimeError("reload_weights: the weights are asleep; wake them first (wake_up(tags=['weights']))")
        fresh = self._load_weights(torch.device("cpu"))
        done = set()
        for name, tensor in weights.items():
            if id(tensor) not in done:
                done.add(id(tensor))
                tensor.copy_(fresh[name])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.weights_unread = False

    def pooled_hidden(self, token_rows: np.ndarray) -> torch.Tensor:
        """float32 [len(token_rows), hidden_size]: the final norm's output (the model's last hidden state, which
        pooling reads) at the last forward's tokens token_rows."""
        hidden = self.final_hidden()[torch.from_numpy(token_rows).to(self.device)]
        return rms_norm(hidden, self.weights["norm"], self.model_config.rms_norm_eps).float()

    def prompt_logprobs(self, token_rows: np.ndarray, target_ids: list[int], num_top: list[int]) -> Pending:
        """Queue the logprobs of target_ids[j] at the last forward's token token_rows[j] (the token just before it),
        with the num_top[j] most likely tokens; result() brings them to the host (one TokenLogprobs per token)."""
        hidden = self.final_hidden()[torch.from_numpy(token_rows).to(self.device)]
        return prompt_logprobs(hidden, self.weights, self.model_config.rms_norm_eps, target_ids, num_top)
