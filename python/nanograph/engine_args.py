"""vLLM's engine keyword arguments, as LLM(model, **kwargs) takes them: one table of those that are not Config fields,
with the values nanograph implements; everything else is a ValueError that names the argument.

Config's own fields (max_model_len, dtype, quantization, kv_cache_dtype, gpu_memory_utilization, enforce_eager,
tokenizer, revision, generation_config, ...) carry vLLM's names and meanings and pass straight through; None for any
of them means its default, as in vLLM."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from .config import POOLING_TASKS, Config

ANY = None  # an argument accepted at any value: nothing in nanograph depends on it


@dataclass(frozen=True)
class EngineArg:
    values: tuple | None  # the values nanograph implements (ANY: all of them)
    meaning: str  # what nanograph does instead, or why other values are not supported
    field: str | None = None  # the Config field it sets, where it is another name for one


VLLM_ARGS = {
    "pipeline_parallel_size": EngineArg((1,), "nanograph runs a model on one GPU"),
    "data_parallel_size": EngineArg((1,), "nanograph runs a model on one GPU"),
    "distributed_executor_backend": EngineArg((None, "uni"), "nanograph runs in the calling process"),
    "cpu_offload_gb": EngineArg((0,), "weights stay on the device"),
    "tokenizer_mode": EngineArg(("auto", "hf"), "the tokenizer is transformers' AutoTokenizer"),
    "load_format": EngineArg(("auto", "safetensors"), "weights are read from *.safetensors"),
    "task": EngineArg(("auto", "generate", "embed", "classify"), "vLLM's older name of runner: 'embed' and "
                                                                 "'classify' are runner='pooling'"),
    "convert": EngineArg(("auto", "none", "embed", "classify"), "a pooling runner runs a causal LM as an embedding "
                                                                "model, and a *ForSequenceClassification folder as "
                                                                "its classifier; generate runs it as it is"),
    "enable_lora": EngineArg((False,), "LoRA adapters are not implemented"),
    "speculative_config": EngineArg((None,), "speculative decoding is not implemented"),
    "hf_token": EngineArg((None,), "a Hub token comes from HF_TOKEN (or `hf auth login`)"),
    "limit_mm_per_prompt": EngineArg((None,), "nanograph's models take text only"),
    "num_gpu_blocks_override": EngineArg(ANY, "the KV cache's size in blocks", field="num_kv_blocks"),
    "calculate_kv_scales": EngineArg((False,), "an FP8 KV cache's scales come from the checkpoint, else they are 1.0"),
    "guided_decoding_backend": EngineArg(("auto", "guidance"), "structured outputs run on llguidance (vLLM's "
                                                               "guidance backend)"),
    # Accepted and ignored: nanograph behaves as vLLM does with any of their values.
    "swap_space": EngineArg(ANY, "nanograph never swaps KV blocks to host memory: a preempted sequence recomputes "
                                 "its KV (as vLLM's V1 engine does), so no swap space is reserved"),
    "disable_log_stats": EngineArg(ANY, "LLM logs no periodic stats (the server logs its own)"),
    "max_seq_len_to_capture": EngineArg(ANY, "decode CUDA graphs are captured per batch size and serve every "
                                             "context length up to max_model_len"),
    "enable_chunked_prefill": EngineArg(ANY, "prompts longer than the step's token budget (max_num_batched_tokens) "
                                             "are always prefilled in chunks; outputs do not change"),
    "disable_custom_all_reduce": EngineArg(ANY, "one GPU: no all-reduce"),
    "disable_async_output_proc": EngineArg(ANY, "the step loop always reads step N's tokens while step N + 1 runs"),
    "async_scheduling": EngineArg(ANY, "the step loop always schedules step N + 1 while step N runs"),
    "compilation_config": EngineArg(ANY, "nanograph compiles nothing with torch.compile, and captures its decode "
                                         "CUDA graphs itself, one per batch size (enforce_eager=True: none)"),
    "cuda_graph_sizes": EngineArg(ANY, "decode CUDA graphs are captured for every batch size up to max_num_seqs"),
    "disable_cascade_attn": EngineArg(ANY, "nanograph has no cascade attention"),
}
_CONFIG_FIELDS = {field.name for field in fields(Config)}
_CONFIG_DEFAULTS = {field.name: field.default for field in fields(Config) if field.default is not MISSING}


def engine_config(model: str | None, **kwargs) -> Config:
    """The Config for LLM(model, **kwargs): Config fields and the arguments of VLLM_ARGS at supported values."""
    config_kwargs = {}
    for name, value in kwargs.items():
        if name in _CONFIG_FIELDS:
            if value is not None:
                config_kwargs[name] = value
            continue
        arg = VLLM_ARGS.get(name)
        if arg is None:
            raise ValueError(f"engine argument {name!r} is not supported yet by nanograph; it takes the Config "
                             f"fields ({', '.join(sorted(_CONFIG_FIELDS))}) and these of vLLM's: "
                             f"{', '.join(sorted(VLLM_ARGS))}")
        if arg.values is not ANY and not any(
                value == v and isinstance(value, bool) == isinstance(v, bool) for v in arg.values):
            supported = " or ".join(repr(v) for v in arg.values)
            raise ValueError(f"{name}={value!r} is not supported yet: {arg.meaning}; use {name}={supported}, or leave "
                             f"it out")
        if arg.field is not None and value is not None:
            config_kwargs[arg.field] = value
    task, convert = kwargs.get("task"), kwargs.get("convert")
    if task in POOLING_TASKS and convert in POOLING_TASKS and task != convert:
        raise ValueError(f"task={task!r} and convert={convert!r} ask for two kinds of pooling model; pass one")
    if task in POOLING_TASKS or convert in POOLING_TASKS:
        name = "task" if task in POOLING_TASKS else "convert"
        if config_kwargs.setdefault("runner", "pooling") not in ("auto", "pooling"):
            raise ValueError(f"{name}={kwargs[name]!r} makes a pooling model, which runner="
                             f"{config_kwargs['runner']!r} contradicts; pass runner='pooling' or leave it out")
        config_kwargs["runner"] = "pooling"
        config_kwargs["pooling_task"] = kwargs[name]
    elif task == "generate" and config_kwargs.get("runner") == "pooling":
        raise ValueError("task='generate' contradicts runner='pooling'; pass one of them")
    return Config(model=model, **config_kwargs)


class EngineArgs:
    """vLLM's engine arguments as one object, for LLMEngine.from_engine_args: EngineArgs(model=..., max_model_len=...)
    takes what LLM(model, **kwargs) takes, and checks them here (an argument nanograph does not take raises at once).
    Each argument given is an attribute, and may be changed before the engine is built."""

    _NOT_ENGINE: tuple[str, ...] = ()  # arguments of the frontend, not the engine's

    def __init__(self, model: str | None = None, **kwargs):
        self.model = model
        vars(self).update(kwargs)
        self.create_engine_config()

    def __getattr__(self, name: str):
        """An argument not given reads as its default (a Config field's, else the first value nanograph takes of
        vLLM's other arguments, None for those it takes at any value)."""
        if name in _CONFIG_DEFAULTS:
            return _CONFIG_DEFAULTS[name]
        if name in VLLM_ARGS:
            values = VLLM_ARGS[name].values
            return None if values is ANY else values[0]
        raise AttributeError(f"{type(self).__name__} has no argument {name!r}")

    def create_engine_config(self) -> Config:
        arguments = {name: value for name, value in vars(self).items() if name not in self._NOT_ENGINE}
        return engine_config(arguments.pop("model"), **arguments)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in vars(self).items())})"


class AsyncEngineArgs(EngineArgs):
    """EngineArgs for AsyncLLMEngine.from_engine_args; vLLM's request logging switches (enable_log_requests,
    disable_log_requests) are taken at any value: the engine logs no request."""

    _NOT_ENGINE = ("enable_log_requests", "disable_log_requests")

    def __init__(self, model: str | None = None, *, enable_log_requests: bool = False,
                 disable_log_requests: bool = True, **kwargs):
        super().__init__(model, enable_log_requests=enable_log_requests, disable_log_requests=disable_log_requests,
                         **kwargs)
