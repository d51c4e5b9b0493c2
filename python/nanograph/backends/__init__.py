"""make_runner: picks the backend that runs the model's forward pass for a Config's device."""
from __future__ import annotations

import torch

from .._core import gpu_available
from ..model_config import ModelConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def make_runner(config, model_config: ModelConfig):
    """device "cuda": the C++/CUDA core; "cpu" or "torch:<torch device>" (e.g. "torch:cuda", also spelt
    "torch-cuda"): the plain-PyTorch reference, over tensor_parallel_size processes when that is above 1; "auto":
    cuda when the core sees a GPU, else cpu."""
    device = config.device
    if device == "auto":
        device = "cuda" if gpu_available() else "cpu"
    if device == "cuda":
        if config.tensor_parallel_size > 1:
            raise NotImplementedError(f"tensor_parallel_size={config.tensor_parallel_size} is not implemented on the "
                                      "CUDA core yet: tensor parallelism runs on the torch backend for now; use "
                                      "device='cpu' or device='torch:<torch device>', or tensor_parallel_size=1")
        from .cuda_backend import CudaRunner
        return CudaRunner(config, model_config)
    torch_device = _torch_device(device)
    runner_kwargs = dict(device=torch_device, dtype=resolve_dtype(config.dtype, model_config, torch_device),
                         block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
                         max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs, seed=config.seed,
                         quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype)
    if config.tensor_parallel_size > 1:
        if "fp8" in (config.quantization, model_config.quantization):
            raise ValueError("FP8 weights (quantization='fp8' or an FP8 checkpoint) do not run with "
                             f"tensor_parallel_size={config.tensor_parallel_size} yet; use tensor_parallel_size=1")
        if torch_device.type == "cuda" and torch.cuda.device_count() < config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} puts rank r on cuda:r, but "
                             f"{torch.cuda.device_count()} GPU(s) are visible; use a tensor_parallel_size of at most "
                             f"{torch.cuda.device_count()}")
        from .tensor_parallel import TensorParallelRunner
        return TensorParallelRunner(model_config, config.tensor_parallel_size, config.tensor_parallel_step_timeout,
                                    **runner_kwargs)
    from .torch_backend import TorchRunner
    return TorchRunner(model_config, **runner_kwargs)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU (fast and exact there); on a GPU the checkpoint's 16-bit type, else bfloat16."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return model_config.dtype if model_config.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _torch_device(device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    for prefix in ("torch:", "torch-"):
        if device.startswith(prefix):
            return torch.device(device[len(prefix):])
    raise ValueError(f"unknown device {device!r}; use auto, cuda, cpu, or torch:<torch device> such as torch:cuda")
