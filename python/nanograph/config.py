"""Engine configuration: one dataclass, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass
from os import PathLike


@dataclass
class Config:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # or a torch.dtype, kept as its name
    # Capped at the model's positions (ModelConfig.max_context) when the engine loads it, with a warning when a
    # larger value was asked for.
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: the runner sizes the KV cache
    seed: int = 0
    max_logprobs: int = 20  # the most top logprobs a request may ask for (vLLM's default); -1: no limit

    def __post_init__(self):
        if self.model is not None and (not isinstance(self.model, (str, PathLike)) or not str(self.model)):
            raise ValueError(f"model must be a Hugging Face model folder, or None for the default model; "
                             f"got {self.model!r}")
        if isinstance(self.model, PathLike):
            self.model = str(self.model)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "seed", "max_logprobs",
                     *(("num_kv_blocks",) if self.num_kv_blocks is not None else ())):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)):
            raise ValueError(f"gpu_memory_utilization must be a number, got {self.gpu_memory_utilization!r}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or at least 0, got {self.max_logprobs}.")
        if not isinstance(self.dtype, str):  # a torch.dtype (as vLLM takes): its name
            name = str(self.dtype).removeprefix("torch.")
            if name not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"unsupported dtype {self.dtype}; use 'auto', 'bfloat16', 'float16' or 'float32'")
            self.dtype = name
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1 or None, got {self.num_kv_blocks}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
