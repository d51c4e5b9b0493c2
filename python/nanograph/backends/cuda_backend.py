"""CudaRunner: the model forward on the C++/CUDA core, with decode steps replayed from CUDA graphs, and its sampling.

The core owns the KV cache (bf16, or e4m3 with a K and a V scale per layer for kv_cache_dtype "fp8":
models/kv_cache.py), the activations, the step metadata buffers and the graphs; this
runner loads the weights into torch tensors (kept alive here), sizes the KV cache from the memory
left after a warm-up pass, fills the pinned metadata with numpy, and either lets the core take an
all-greedy step's argmax inside the step (its tokens come back through pinned memory) or hands the
sampler a zero-copy view of the logits, with torch's stream ordered after the core's.
"""
from __future__ import annotations

import gc
import math
import time

import numpy as np
import torch

from .._core import require_core
from ..engine.batch import storeless_batch
from ..models.fp8 import check_core_shapes
from ..models.kv_cache import kv_cache_torch_dtype, load_kv_scales
from ..models.rope import rope_cos_sin
from ..models.weights import block_scales, load_weights
from ..sampling import Sampler, SamplerOutput
from .base import PendingTokens, Runner, copy_weights


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


class CudaRunner(Runner):
    def __init__(self, config, model_config):
        require_core()
        if config.dtype not in ("auto", "bfloat16", "bf16"):
            raise ValueError(f"the cuda backend runs bfloat16 models; got dtype={config.dtype!r}. "
                             "Use dtype='bfloat16' (or 'auto'), or device='cpu' for other dtypes")
        self.config = config
        self.model_config = mc = model_config
        self.block_size = config.block_size
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, torch.bfloat16)
        # FP8: each layer's [K scale, V scale] (models/kv_cache.py); None: the cache holds bf16
        self.kv_scales = None if config.kv_cache_dtype == "auto" else load_kv_scales(mc.path, mc).tolist()
        self.device = torch.device("cuda", torch.cuda.current_device())
        if "fp8" in (config.quantization, mc.quantization):
            check_core_shapes(mc)
        self.weights = self._load_weights()
        self.cos_sin = rope_cos_sin(mc, config.max_model_len, self.device).contiguous()
        self._core_config = {"vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
                             "num_layers": mc.num_layers, "num_heads": mc.num_heads,
                             "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
                             "intermediate_size": mc.intermediate_size, "rms_norm_eps": mc.rms_norm_eps,
                             "kv_cache_dtype": "auto" if self.kv_scales is None else "fp8"}
        if self.kv_scales is not None:
            self._core_config["kv_scales"] = self.kv_scales
        self._build_model()
        self.sampler = Sampler(self.device, model_config.eos_token_ids, config.seed)
        self.in_step_argmax = True
        self._greedy, self._num_seqs, self._slot = False, 0, -1  # the last forward's
        self._num_tokens, self._is_decode = 0, False  # the last forward's
        self._torch_stream_used = True  # since the last step: whether torch's stream may have written its inputs
        self.use_graphs = False  # until they are captured
        self.num_kv_blocks = self._size_kv_cache()
        self._kv_bytes_per_block = self.model.kv_bytes_per_block
        self.use_graphs = not config.enforce_eager
        if self.use_graphs:
            self._capture_graphs()

    def _load_weights(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        weights = load_weights(self.model_config.path, self.model_config, torch.bfloat16, device or self.device,
                               quantization=self.config.quantization)
        weights.update(block_scales(weights))  # the FP8 linears' scales for the core's FP8 GEMM
        return weights

    def _build_model(self):
        """The core's model over self.weights (its activations, workspaces and stream; no KV cache yet), and the
        views of its buffers that this runner reads."""
        cfg, mc = self.config, self.model_config
        limits = {"max_num_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
                  "max_model_len": cfg.max_model_len, "block_size": cfg.block_size}
        torch.cuda.synchronize()
        self.model = require_core().Model(self._core_config, self.weights, limits, self.cos_sin)
        self.stream = torch.cuda.ExternalStream(self.model.stream, device=self.device)
        self.logits = torch.as_tensor(
            _DeviceArray(self.model.logits_ptr, (cfg.max_num_seqs, mc.vocab_size), "<i2"),
            device=self.device).view(torch.bfloat16)
        self.sampled_tokens = torch.as_tensor(
            _DeviceArray(self.model.sampled_tokens_ptr, (cfg.max_num_seqs,), "<i4"), device=self.device)
        self.hidden, self.residual = (torch.as_tensor(
            _DeviceArray(ptr, (cfg.max_num_batched_tokens, mc.hidden_size), "<i2"), device=self.device
        ).view(torch.bfloat16) for ptr in (self.model.hidden_ptr, self.model.residual_ptr))

    supports_sleep = True

    def tags_freed(self, tags: set[str]) -> set[str]:
        """The core's model (the KV cache with it) is built over the weights: it goes with them."""
        return tags | {"kv_cache"} if "weights" in tags else set(tags)

    def sleep(self, tags: set[str], keep_weights: bool):
        """Kept weights are copied to pinned host memory first; then the core's model goes (its KV cache,
        activations, workspaces and graphs), and the weights, and torch's cached blocks go back to the driver.
        A sleep that fails partway leaves each part whole or freed, for wake_up to restore."""
        with torch.cuda.device(self.device):
            if self.model is not None:
                self.model.synchronize()
            if "weights" in tags:
                if keep_weights and self.weights is not None and self._host_weights is None:
                    self._host_weights = copy_weights(self.weights, torch.device("cpu"))
                if not keep_weights:
                    self._host_weights = None
            self._drop_model()
            if "weights" in tags:
                self._free_weights()
            gc.collect()  # whatever still refers to the core's model or a weight, in a cycle
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def wake_up(self, tags: set[str]):
        """The weights back (from host memory; after level 2 their memory alone, which reload_weights fills in
        place); then a model of the core over them, with a KV cache of as many blocks as before, warmed up and its
        decode graphs captured again."""
        with torch.cuda.device(self.device):
            if "weights" in tags and self.weights is None:
                self._restore_weights()
            if "kv_cache" in tags and self.model is None:
                try:
                    self._build_model()
                    self.model.allocate_kv_cache(self.num_kv_blocks)
                    self._warm_up()
                    if self.use_graphs:
                        self._capture_graphs()
                except Exception as exc:
                    self._drop_model()
                    torch.cuda.empty_cache()
                    needed = self.num_kv_blocks * self._kv_bytes_per_block
                    free = torch.cuda.mem_get_info()[0]
                    raise RuntimeError(
                        f"wake_up: the KV cache ({self.num_kv_blocks} blocks, {needed / 2**30:.2f} GiB) and the "
                        f"model's buffers did not fit the device's free memory ({free / 2**30:.2f} GiB): "
                        f"{type(exc).__name__}: {exc}. The weights are awake, the KV cache still asleep: free "
                        f"device memory and call wake_up() again") from exc

    def reload_weights(self):
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()  # the steps queued so far, on the core's stream too, read the old values
            self._reload_into(self.weights)

    def _drop_model(self):
        self.model = self.stream = self.logits = self.sampled_tokens = self.hidden = self.residual = None

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
        # Fewer blocks than one sequence of max_model_len needs are the engine's to judge (it caps a default length).
        if blocks < 1:
            raise RuntimeError(
                f"no room for a KV cache: the weights and activations use {used / 2**30:.1f} GiB of the "
                f"{total * cfg.gpu_memory_utilization / 2**30:.1f} GiB that gpu_memory_utilization="
                f"{cfg.gpu_memory_utilization} allows; raise gpu_memory_utilization or lower max_num_seqs / "
                f"max_num_batched_tokens")
        self.model.allocate_kv_cache(blocks)
        return blocks

    def _warm_up(self):
        cfg = self.config
        lens = warm_up_lengths(cfg.max_model_len, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        input_ids = np.random.default_rng(0).integers(0, self.model_config.vocab_size, int(lens.sum()))
        # Nothing is stored: the warm-up must not need cache blocks (it reads block 0 only).
        block_tables = np.zeros((len(lens), -(-int(lens.max()) // self.block_size)), np.int32)
        batch = storeless_batch(input_ids, lens, lens, block_tables)
        self.queue_step(batch, greedy=False)
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

    def forward(self, batch, seqs: list):
        """Queues the step on the core's stream. An all-greedy batch without penalties, masks or logprobs takes its
        argmax inside the step (inside the decode graph; in_step_argmax=False sends it to the sampler): the ids
        land where the next step reads them (sampled_tokens[i] for sequence i of the batch) and in pinned host
        memory, and torch's stream is left alone. Otherwise the sampler reads the logits on torch's stream."""
        self._greedy = self.in_step_argmax and self.sampler.plain_greedy(seqs, self.model_config.vocab_size)
        self._num_seqs = batch.num_seqs
        self._num_tokens, self._is_decode = batch.num_tokens, batch.is_decode
        if self._greedy:
            self._slot = self.queue_step(batch, greedy=True)
        else:
            self.run(batch)

    def sample(self, rows: list[int], seqs: list) -> PendingTokens:
        if self._greedy:  # taken within the step: sequence i's token is at sampled_tokens[i]
            return PendingTokens(_InStepArgmax(self.model, self._slot, self._num_seqs, rows), rows)
        logits = self.logits[:self._num_seqs]
        pending = self.sampler.sample(logits if len(rows) == self._num_seqs else logits[rows], seqs)
        self.sampled_tokens[:len(rows)].copy_(pending.token_ids)  # where the next step's input_src points
        return PendingTokens(pending, range(len(rows)))

    def final_hidden(self) -> torch.Tensor:
        """The final norm's input at the last step's tokens, where the core left it (Model::hidden, residual), read
        on torch's stream after the step; the next step waits for torch's stream before it overwrites them."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._torch_stream_used = True
        residual = self.residual[:self._num_tokens]
        return residual if self._is_decode else self.hidden[:self._num_tokens] + residual

    def run(self, batch) -> torch.Tensor:
        """Queues the batch's step; its logits [num_seqs, vocab], bf16: a view of the core's logits buffer, valid
        until the next step is queued, with torch's stream ordered after the step."""
        self.queue_step(batch, greedy=False)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._torch_stream_used = True  # whoever reads the logits works there; the next step waits for it
        return self.logits[:batch.num_seqs]

    def queue_step(self, batch, greedy: bool) -> int:
        """Queues the batch's step on the core's stream (a decode graph when one is captured for it); the host
        token slot of a greedy step, else -1. The logits stay in self.logits, on the core's stream."""
        use_graph = batch.is_decode and self.use_graphs
        write_step_metadata(self.model.step_views(batch.num_tokens, batch.num_seqs, use_graph), batch)
        if self._torch_stream_used:
            # The previous step's sampler (on torch's stream) wrote the tokens this step may read.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._torch_stream_used = False
        max_q_len = int(np.diff(batch.cu_seqlens_q).max())
        return self.model.step(batch.num_tokens, batch.num_seqs, max_q_len, use_graph, greedy)


def write_step_metadata(views: dict[str, np.ndarray], batch):
    """The one writer of a step's metadata: batch's fields into the core's pinned buffer (views from
    Model.step_views, as StepLayout in csrc/model.h lays them out). A graph bucket's other rows are the core's."""
    for name in ("input_ids", "input_src", "positions", "slot_mapping", "cu_seqlens_q", "context_lens"):
        views[name][:] = getattr(batch, name)
    views["block_tables"][:, :batch.block_tables.shape[1]] = batch.block_tables


class _InStepArgmax:
    """The tokens of a step that took the argmax itself: read from the core's pinned host slot once it has run."""

    def __init__(self, model, slot: int, num_rows: int, rows: list[int]):
        self._model, self._slot, self._num_rows, self._rows = model, slot, num_rows, rows
        self._output: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._output is None:
            ids = self._model.greedy_tokens(self._slot, self._num_rows)
            self._output = SamplerOutput([ids[row] for row in self._rows], [None] * len(self._rows))
        return self._output
