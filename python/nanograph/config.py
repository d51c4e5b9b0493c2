"""Engine configuration: one dataclass, validated on construction."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from os import PathLike

from .reasoning import REASONING_PARSERS

# Weight quantizations nanograph runs: Config.quantization's values, a checkpoint's quantization_config.quant_method.
SUPPORTED_QUANTIZATION = ("fp8",)

SCHEDULING_POLICIES = ("fcfs", "priority")
RUNNERS = ("auto", "generate", "pooling")  # Config.runner's values
PROFILERS = ("torch", "cuda")  # ProfilerConfig.profiler's values
POOLING_TASKS = ("embed", "classify")  # what a pooling model's requests get: an embedding, or class probabilities
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # PoolerConfig.pooling_type's values

# vLLM's kv_cache_dtype values that nanograph runs: "auto", the model's dtype; "fp8" and "fp8_e4m3", both e4m3 with a
# K and a V scale per layer (models/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class Config:
    model: str | None = None  # a model folder or a Hugging Face Hub id; None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # or a torch.dtype, kept as its name
    # None: the checkpoint's weights as they are (FP8 for an FP8 checkpoint); "fp8": a 16- or 32-bit checkpoint's
    # linear layers quantized at load to e4m3 in 128 x 128 blocks (vLLM's flag).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # vLLM's name; "auto": the model's dtype; "fp8" (= "fp8_e4m3"): e4m3, scaled per layer
    # None: the model's own length (ModelConfig.max_context), capped by what the KV cache holds. A given length is
    # capped at the model's positions with a warning, and one the KV cache cannot hold is an error.
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    # vLLM's: "fcfs", requests served in arrival order; "priority", by each request's priority (lower first), then
    # arrival (engine/scheduler.py).
    scheduling_policy: str = "fcfs"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: the runner sizes the KV cache
    seed: int = 0
    tensor_parallel_size: int = 1  # processes that each hold a shard of the model (the torch backend for now)
    tensor_parallel_step_timeout: float = 60.0  # seconds a rank waits on another in a step before the engine fails
    max_logprobs: int = 20  # the most top logprobs a request may ask for (vLLM's default); -1: no limit
    # Where the model, its tokenizer and its sampling defaults come from.
    revision: str | None = None  # the Hub revision (branch, tag or commit) of a Hub id
    download_dir: str | None = None  # the Hub cache to use instead of HF_HUB_CACHE
    tokenizer: str | None = None  # a tokenizer folder or Hub id; None: the model's
    tokenizer_revision: str | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids and outputs have no text
    trust_remote_code: bool = False  # passed to the tokenizer's loading (the model architectures are built in)
    # "auto": default sampling parameters from the model folder's generation_config.json; "vllm": none (vLLM's own
    # defaults); or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # vLLM's: generation_config.json values over the ones generation_config gives (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens), e.g. {"temperature": 0.5}; with generation_config="vllm", these alone.
    override_generation_config: dict | None = None
    # vLLM's: with a reasoning parser (reasoning.REASONING_PARSERS), a request's structured-output grammar applies to
    # its reply's answer, from the token after </think>, and not to the thinking before it. None: from the first token.
    reasoning_parser: str | None = None
    # vLLM's: config.json values to use instead of the folder's ({"rope_scaling": {...}, "max_position_embeddings":
    # ...}), or a function that takes the loaded transformers config and returns it changed. A rope_scaling (or
    # rope_parameters) dict replaces the config's rope parameters but rope_theta, which stays unless given.
    hf_overrides: dict | Callable | None = None
    # vLLM's: "generate" samples text; "pooling" runs the model as an embedding model (pooling.py): embed() and
    # encode(), no generate(); "auto": "pooling" for a base model's folder (architectures Qwen3Model, LlamaModel,
    # ...), else "generate" (LLMEngine.from_config settles it).
    runner: str = "auto"
    # vLLM's task / convert with runner="pooling": "embed" or "classify", checked against the model folder (a
    # classifier's is *ForSequenceClassification); None: the folder's.
    pooling_task: str | None = None
    # vLLM's: overrides of the pooling the model folder gives (PoolerConfig below, or a dict of its fields).
    pooler_config: object | None = None
    # vLLM's: the profiler that LLM.start_profile() / stop_profile() run (ProfilerConfig below, or a dict of its
    # fields, such as {"profiler": "torch", "torch_profiler_dir": "./traces"}; profiler.py); None: none.
    profiler_config: object | None = None
    # vLLM's: LLMEngine.sleep() / wake_up() may free the device memory the weights and the KV cache hold, between
    # bursts of work (runners that have it: the CUDA core and the torch backend on one process).
    enable_sleep_mode: bool = False

    def __post_init__(self):
        if self.model is not None and (not isinstance(self.model, (str, PathLike)) or not str(self.model)):
            raise ValueError(f"model must be a Hugging Face model folder or Hub id, or None for the default model; "
                             f"got {self.model!r}")
        for name in ("model", "tokenizer", "download_dir", "generation_config"):
            if isinstance(getattr(self, name), PathLike):
                setattr(self, name, str(getattr(self, name)))
        for name in ("revision", "download_dir", "tokenizer", "tokenizer_revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}.")
        if self.override_generation_config is not None and not (
                isinstance(self.override_generation_config, dict)
                and all(isinstance(key, str) for key in self.override_generation_config)):
            raise ValueError(f"override_generation_config must be a dict of generation_config.json fields (such as "
                             f"{{\"temperature\": 0.5}}), got {self.override_generation_config!r}.")
        if self.override_generation_config:
            from .generation_defaults import check_overrides
            check_overrides(self.override_generation_config)
        if self.hf_overrides is not None and not callable(self.hf_overrides) and not (
                isinstance(self.hf_overrides, dict) and all(isinstance(key, str) for key in self.hf_overrides)):
            raise ValueError(f"hf_overrides must be a dict of config.json fields (such as "
                             f"{{\"rope_scaling\": {{...}}}}) or a function of the loaded config, got "
                             f"{self.hf_overrides!r}.")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                             f"got {self.generation_config!r}.")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "seed", "max_logprobs",
                     "tensor_parallel_size",
                     *(name for name in ("max_model_len", "num_kv_blocks") if getattr(self, name) is not None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64) (it seeds a 64-bit generator), got {self.seed}.")
        for name in ("enforce_eager", "enable_prefix_caching", "skip_tokenizer_init", "trust_remote_code",
                     "enable_sleep_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)):
            raise ValueError(f"gpu_memory_utilization must be a number, got {self.gpu_memory_utilization!r}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or at least 0, got {self.max_logprobs}.")
        if self.quantization not in (None, *SUPPORTED_QUANTIZATION):
            raise ValueError(f"quantization={self.quantization!r} is not supported yet: nanograph runs FP8 weights "
                             f"(an FP8 checkpoint's, or quantized at load); use quantization="
                             f"{' or '.join(map(repr, SUPPORTED_QUANTIZATION))}, or None for the checkpoint's format")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} is not one nanograph has; use 'fcfs' "
                             f"(first come, first served) or 'priority' (each request's priority, lower first)")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is not one nanograph has; use "
                             f"{' or '.join(map(repr, REASONING_PARSERS))}, or None")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner={self.runner!r} is not one nanograph has; use 'generate' (text), 'pooling' "
                             f"(embeddings) or 'auto'")
        if self.pooling_task not in (None, *POOLING_TASKS):
            raise ValueError(f"pooling_task={self.pooling_task!r} is not one nanograph has; use "
                             f"{' or '.join(map(repr, POOLING_TASKS))}, or None (the model folder's)")
        if self.pooling_task is not None and self.runner == "generate":
            raise ValueError(f"pooling_task={self.pooling_task!r} is for a pooling model, which runner='generate' "
                             f"contradicts; pass runner='pooling' (or 'auto') with it")
        if self.pooler_config is not None:
            if self.runner == "generate":
                raise ValueError("pooler_config is for a pooling model: pass runner='pooling' with it, or leave it "
                                 "out")
            self.pooler_config = PoolerConfig.of(self.pooler_config)
        if self.profiler_config is not None:
            self.profiler_config = ProfilerConfig.of(self.profiler_config)
        if self.enable_sleep_mode and self.tensor_parallel_size > 1:
            raise ValueError(f"enable_sleep_mode=True is not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size} yet: use tensor_parallel_size=1, or leave "
                             f"enable_sleep_mode out")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported yet: nanograph's KV cache "
                             f"holds the model's dtype or FP8 e4m3; use kv_cache_dtype='auto' (the model's dtype), "
                             f"'fp8' or 'fp8_e4m3' (both e4m3)")
        if not isinstance(self.dtype, str):  # a torch.dtype (as vLLM takes): its name
            name = str(self.dtype).removeprefix("torch.")
            if name not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"unsupported dtype {self.dtype}; use 'auto', 'bfloat16', 'float16' or 'float32'")
            self.dtype = name
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                     *(("max_model_len",) if self.max_model_len is not None else ())):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's rule
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): a step of max_num_seqs decoding sequences takes a token of each; "
                             f"raise max_num_batched_tokens or lower max_num_seqs.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1 or None, got {self.num_kv_blocks}.")
        timeout = self.tensor_parallel_step_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"tensor_parallel_step_timeout must be a number of seconds above 0, got {timeout!r}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")


@dataclass
class PoolerConfig:
    """vLLM's pooler_config: what overrides the model folder's pooling (None: the folder's, else the default)."""
    pooling_type: str | None = None  # "LAST" (the prompt's last token), "MEAN" (over its tokens) or "CLS" (its first)
    normalize: bool | None = None  # divide by the L2 norm (a request's PoolingParams.normalize overrides it)

    def __post_init__(self):
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type={self.pooling_type!r} is not one nanograph has; use "
                                 f"{', '.join(map(repr, POOLING_TYPES))}")
            self.pooling_type = self.pooling_type.upper()
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be a bool, got {self.normalize!r}")

    @classmethod
    def of(cls, given) -> PoolerConfig:
        """A PoolerConfig, a dict of its fields (as --pooler-config's JSON gives them), or None (no override)."""
        return _options_of(cls, given, "pooler_config", '{"pooling_type": "MEAN"}')


@dataclass
class ProfilerConfig:
    """vLLM's profiler_config. A torch_profiler_dir given without a profiler means profiler="torch"."""
    profiler: str | None = None  # "torch", "cuda", or None (no profiler: start_profile() is an error)
    torch_profiler_dir: str | None = None  # where profiler="torch" writes its traces (created if missing)
    torch_profiler_with_stack: bool = True  # the Python stack of each op
    torch_profiler_with_flops: bool = False  # estimated FLOPs of matrix products and convolutions
    torch_profiler_use_gzip: bool = True  # traces gzip-compressed (.json.gz)
    torch_profiler_dump_cuda_time_total: bool = True  # the table of ops by self time, beside the trace
    torch_profiler_record_shapes: bool = False  # the input shapes of each op
    torch_profiler_with_memory: bool = False  # tensor allocations and frees
    delay_iterations: int = 0
    max_iterations: int = 0
    ignore_frontend: bool = False  # vLLM's; the API server is never profiled here, only the engine's process

    def __post_init__(self):
        if isinstance(self.torch_profiler_dir, os.PathLike):
            self.torch_profiler_dir = os.fspath(self.torch_profiler_dir)
        if self.torch_profiler_dir is not None:
            if not isinstance(self.torch_profiler_dir, str) or not self.torch_profiler_dir:
                raise ValueError(f"profiler_config.torch_profiler_dir must be a folder's path, got "
                                 f"{self.torch_profiler_dir!r}")
            # As vLLM: ~ expanded, and absolute (the engine process's working folder is not the caller's to guess).
            self.torch_profiler_dir = os.path.abspath(os.path.expanduser(self.torch_profiler_dir))
        if self.profiler is None and self.torch_profiler_dir is not None:
            self.profiler = "torch"
        if self.profiler not in (None, *PROFILERS):
            raise ValueError(f"profiler_config.profiler={self.profiler!r} is not one nanograph has; use "
                             f"{' or '.join(map(repr, PROFILERS))}, or None (no profiler)")
        if self.profiler == "cuda" and self.torch_profiler_dir is not None:
            raise ValueError("profiler_config.torch_profiler_dir is for profiler='torch'; profiler='cuda' writes no "
                             "trace (Nsight Systems does): leave the folder out, or use profiler='torch'")
        if self.profiler == "torch" and self.torch_profiler_dir is None:
            raise ValueError("profiler_config.profiler='torch' writes its traces into torch_profiler_dir; give one, "
                             "e.g. {\"profiler\": \"torch\", \"torch_profiler_dir\": \"./traces\"}")
        for field in fields(self):
            value = getattr(self, field.name)
            if (field.name.startswith("torch_profiler_") and field.name != "torch_profiler_dir"
                    or field.name == "ignore_frontend") and not isinstance(value, bool):
                raise ValueError(f"profiler_config.{field.name} must be a bool, got {value!r}")
        for name in ("delay_iterations", "max_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"profiler_config.{name} must be a whole number of engine steps (0 or more), got "
                                 f"{value!r}")

    @classmethod
    def of(cls, given) -> ProfilerConfig:
        """A ProfilerConfig, a dict of its fields (as --profiler-config's JSON gives them), or None (no profiler)."""
        return _options_of(cls, given, "profiler_config", '{"profiler": "torch", "torch_profiler_dir": "./traces"}')


def _options_of(cls, given, option: str, example: str):
    """A copy of a cls (an options dataclass), a dict of its fields (as --option's JSON gives them), or None (its
    defaults); anything else, or an unknown field, is a ValueError naming `option` and its fields."""
    if given is None:
        return cls()
    if isinstance(given, cls):
        return replace(given)
    if not isinstance(given, dict):
        raise ValueError(f"{option} must be a {cls.__name__} or a dict such as {example}, got {given!r}")
    names = {field.name for field in fields(cls)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"{option} takes {', '.join(sorted(names))}; got unknown key(s) {unknown}")
    return cls(**given)
