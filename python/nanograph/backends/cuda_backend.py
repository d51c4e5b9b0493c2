"""CudaRunner: the model forward on the C++/CUDA core, with decode steps replayed from CUDA graphs.

The core owns the KV cache, the activations, the step metadata buffers and the graphs; this
runner loads the weights into torch tensors (kept alive here), sizes the KV cache from the memory
left after a warm-up pass, fills the pinned metadata with numpy, and hands torch a zero-copy view
of the logits, ordered after the core's stream by run() (run_greedy leaves torch's stream alone:
its tokens come back through pinned memory).
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from .._core import require_core
from ..models.rope import rope_cos_sin
from ..models.weights import load_weights
from ..sampling import PendingSample, SamplerOutput


def warm_up_lengths(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> np.ndarray:
    """The prompt lengths of the warm-up's prefill: the largest step the scheduler can make, as sequences of at most
    max_model_len tokens (the RoPE table and the block tables hold no more), at most max_num_seqs of them."""
    seq_len = min(max_model_len, max_num_batched_tokens)
    num_seqs = min(max_num_seqs, math.ceil(max_num_batched_tokens / seq_len))
    num_tokens = min(max_num_batched_tokens, num_seqs * seq_len)
    lens = np.full(num_seqs, seq_len, dtype=np.int32)
    lens[-1] = num_tokens - seq_len * (num_seqs - 1)
    return lens


class _DeviceArray:
    """Exposes a core-owned device buffer to torch.as_tensor through __cuda_array_interface__."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": None, "version": 3}


class CudaRunner:
    def __init__(self, config, model_config):
        core = require_core()
        if config.dtype not in ("auto", "bfloat16", "bf16"):
            raise ValueError(f"the cuda backend runs bfloat16 models; got dtype={config.dtype!r}. "
                             "Use dtype='bfloat16' (or 'auto'), or device='cpu' for other dtypes")
        self.config = config
        self.model_config = mc = model_config
        self.block_size = config.block_size
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.weights = load_weights(mc.path, mc, torch.bfloat16, self.device)
        self.cos_sin = rope_cos_sin(mc, config.max_model_len, self.device).contiguous()
        core_config = {"vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
                       "num_layers": mc.num_layers, "num_heads": mc.num_heads,
                       "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
                       "intermediate_size": mc.intermediate_size, "rms_norm_eps": mc.rms_norm_eps}
        limits = {"max_num_tokens": config.max_num_batched_tokens,
                  "max_num_seqs": config.max_num_seqs, "max_model_len": config.max_model_len,
                  "block_size": config.block_size}
        torch.cuda.synchronize()
        self.model = core.Model(core_config, self.weights, limits, self.cos_sin)
        self.stream = torch.cuda.ExternalStream(self.model.stream, device=self.device)
        self.logits = torch.as_tensor(
            _DeviceArray(self.model.logits_ptr, (config.max_num_seqs, mc.vocab_size), "<i2"),
            device=self.device).view(torch.bfloat16)
        self.sampled_tokens = torch.as_tensor(
            _DeviceArray(self.model.sampled_tokens_ptr, (config.max_num_seqs,), "<i4"), device=self.device)
        self.num_kv_blocks = self._size_kv_cache()
        self._torch_stream_used = True  # since the last step: whether torch's stream may have written its inputs
        self.use_graphs = not config.enforce_eager
        if self.use_graphs:
            self._capture_graphs()

    def _size_kv_cache(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the device after weights, activations and
        a warm-up pass at the largest step (which also warms cuBLASLt and torch's sampler memory)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            self.model.allocate_kv_cache(cfg.num_kv_blocks)
            return cfg.num_kv_blocks
        warm_blocks = 1  # the warm-up stores nothing and reads block 0 only
        self.model.allocate_kv_cache(warm_blocks)
        self._warm_up()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free - warm_blocks * self.model.kv_bytes_per_block
        budget = total * cfg.gpu_memory_utilization - used
        blocks = int(budget // self.model.kv_bytes_per_block)
        needed = math.ceil(cfg.max_model_len / self.block_size)
        if blocks < needed:
            raise RuntimeError(
                f"the KV cache fits {max(blocks, 0) * self.block_size} tokens, fewer than one sequence of "
                f"max_model_len={cfg.max_model_len}; raise gpu_memory_utilization (now "
                f"{cfg.gpu_memory_utilization}) or lower max_model_len")
        self.model.allocate_kv_cache(blocks)
        return blocks

    def _warm_up(self):
        cfg = self.config
        lens = warm_up_lengths(cfg.max_model_len, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        num_tokens, num_seqs = int(lens.sum()), len(lens)
        v = self.model.step_views(num_tokens, num_seqs)
        v["input_ids"][:] = np.random.default_rng(0).integers(0, self.model_config.vocab_size, num_tokens)
        v["input_src"][:] = -1
        v["positions"][:] = np.concatenate([np.arange(n) for n in lens])
        v["slot_mapping"][:] = -1  # nothing is stored: the warm-up must not need cache blocks
        v["cu_seqlens_q"][:] = np.concatenate([[0], np.cumsum(lens)])
        v["context_lens"][:] = lens
        v["block_tables"][:] = 0
        self.model.step(num_tokens, num_seqs, int(lens.max()), False)
        with torch.cuda.stream(self.stream):
            logits = torch.randn(cfg.max_num_seqs, self.model_config.vocab_size, device=self.device)
            torch.sort(torch.softmax(logits, -1), dim=-1, descending=True)
        torch.cuda.synchronize()

    def _capture_graphs(self):
        buckets = list(require_core().default_decode_buckets(self.config.max_num_seqs))
        start = time.perf_counter()
        graph_bytes = self.model.capture_decode_graphs(buckets)
        print(f"nanograph: captured {len(buckets)} decode graphs (batch {buckets[0]}..{buckets[-1]}) in "
              f"{time.perf_counter() - start:.2f} s, using {graph_bytes / 2**20:.1f} MiB", flush=True)

    def publish_sampled(self, token_ids: torch.Tensor):
        """The tokens just sampled, one per sampling row, copied on torch's stream into the core's buffer, where a
        later batch's input_src points (StepLayout in csrc/model.h); nothing to copy when the sampler wrote them
        there itself."""
        if token_ids.data_ptr() != self.sampled_tokens.data_ptr():
            self.sampled_tokens[:len(token_ids)].copy_(token_ids)

    def run(self, batch) -> torch.Tensor:
        """The batch's logits [num_seqs, vocab], bf16: a view of the core's logits buffer, valid until the next step
        is queued (the sampler reads it first, on torch's stream)."""
        self._step(batch, greedy=False)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._torch_stream_used = True  # the caller samples there; the next step waits for it
        return self.logits[:batch.num_seqs]

    def run_greedy(self, batch) -> GreedyTokens:
        """run() for an all-greedy batch: the core takes the argmax of every sequence's logits within the step (inside
        the decode graph). The ids land where the next step reads them (sampled_tokens[i] for sequence i of the
        batch) and in pinned host memory, which the returned pending tokens read once the step has run. Nothing is
        left for torch's stream, so it is not ordered after the step (the logits stay in self.logits, on the core's
        stream)."""
        return GreedyTokens(self.model, self._step(batch, greedy=True), batch.num_seqs)

    def _step(self, batch, greedy: bool) -> int:
        """Queues the batch's step on the core's stream; the host token slot of a greedy step, else -1."""
        num_seqs, num_tokens = batch.num_seqs, batch.num_tokens
        rows, tokens = num_seqs, num_tokens
        use_graph = False
        if batch.is_decode and self.use_graphs:
            bucket = self.model.decode_bucket(num_seqs)
            if bucket > 0:
                rows = tokens = bucket
                use_graph = True
        v = self.model.step_views(tokens, rows)
        v["input_ids"][:num_tokens] = batch.input_ids
        v["input_src"][:num_tokens] = batch.input_src
        v["positions"][:num_tokens] = batch.positions
        v["slot_mapping"][:num_tokens] = batch.slot_mapping
        v["cu_seqlens_q"][:num_seqs + 1] = batch.cu_seqlens_q
        v["context_lens"][:num_seqs] = batch.context_lens
        width = batch.block_tables.shape[1]
        v["block_tables"][:num_seqs, :width] = batch.block_tables
        if rows > num_seqs:  # inert padding rows of a graph bucket
            v["input_ids"][num_tokens:] = 0
            v["input_src"][num_tokens:] = -1
            v["positions"][num_tokens:] = 0
            v["slot_mapping"][num_tokens:] = -1
            v["cu_seqlens_q"][num_seqs + 1:] = np.arange(num_tokens + 1, tokens + 1)
            v["context_lens"][num_seqs:] = 0
        q_lens = np.diff(batch.cu_seqlens_q)
        if self._torch_stream_used:
            # The previous step's sampler (on torch's stream) wrote the tokens this step may read.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._torch_stream_used = False
        return self.model.step(tokens, rows, int(q_lens.max()), use_graph, greedy)


class GreedyTokens:
    """The pending result of CudaRunner.run_greedy: the argmax of each of the batch's rows, read from the core's
    pinned host slot once the step has run. rows(...) gives the PendingSample of a subset of the rows."""

    def __init__(self, model, slot: int, num_rows: int):
        self._model, self._slot, self._num_rows = model, slot, num_rows

    def rows(self, rows: list[int]) -> PendingSample:
        """The pending sample of the batch rows `rows` (their tokens, in that order)."""
        return _GreedyRows(self, rows)

    def read(self) -> list[int]:
        return self._model.greedy_tokens(self._slot, self._num_rows)


class _GreedyRows(PendingSample):
    def __init__(self, tokens: GreedyTokens, rows: list[int]):  # not PendingSample.__init__: nothing to copy
        self._tokens, self._rows = tokens, rows
        self._output: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._output is None:
            ids = self._tokens.read()
            self._output = SamplerOutput([ids[row] for row in self._rows], [None] * len(self._rows))
        return self._output
