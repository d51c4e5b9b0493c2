"""The command line's shared options: the model and the engine's Config fields (chat, generate, serve, bench) and
the sampling options (chat, generate), each declared once, with what each becomes."""
from __future__ import annotations

import argparse
import json
import re

from .config import Config
from .engine_args import VLLM_ARGS
from .sampling_params import SamplingParams

MODEL_HELP = "Hugging Face model folder (default: the bundled SmolLM2-135M-Instruct)"


def human_readable_int(text: str) -> int:
    """A token count as vLLM's command line reads it: 4096, 32k (32,000), 25.6k (25,600), 32K (32,768), 1m, 1M."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (such as 4096, 32k or 32K)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return round(float(number) * 1000 ** ("kmg".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMG".index(suffix) + 1)


def json_object(text: str) -> dict:
    """A JSON object given on the command line (vLLM's --hf-overrides '{"rope_scaling": {...}}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc}); give an object, such as "
                                         "'{\"max_position_embeddings\": 65536}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; give one, such as "
                                         "'{\"max_position_embeddings\": 65536}'")
    return value


# Config field -> (type, help). An option left out is absent from the parsed arguments, so that the Config default
# (or a benchmark's own) applies.
ENGINE_OPTIONS = {
    "device": (str, "auto, cuda, cpu, or torch:<torch device>"),
    "dtype": (str, "auto, bfloat16, float16 or float32 (the cuda device runs bfloat16)"),
    "max_model_len": (human_readable_int, "the longest prompt plus output, in tokens (32k: 32,000; 32K: 32,768)"),
    "max_num_seqs": (int, "sequences in one step at most"),
    "gpu_memory_utilization": (float, "share of the GPU's memory the engine may use, KV cache included"),
    "seed": (int, "the engine's sampling seed"),
    "quantization": (str, "fp8: quantize the weights' linear layers to FP8 at load (an FP8 checkpoint runs as such "
                          "without it)"),
    "kv_cache_dtype": (str, "the KV cache's dtype; auto: the model's; fp8 (or fp8_e4m3): e4m3 with a K and a V "
                            "scale per layer, twice the tokens of bf16"),
    "tensor_parallel_size": (int, "processes that each hold a shard of the model (the torch backend: device cpu "
                                  "or torch:<torch device>)"),
    "max_num_batched_tokens": (human_readable_int,
                               "tokens in one step at most (a longer prompt is prefilled in chunks)"),
    "scheduling_policy": (str, "fcfs: requests in arrival order; priority: by each request's priority (lower "
                               "first), then arrival"),
    "max_logprobs": (int, "the most top logprobs a request may ask for; -1: no limit"),
    "tokenizer": (str, "a tokenizer folder or Hub id (default: the model's)"),
    "revision": (str, "the Hub revision (branch, tag or commit) of a Hub model id"),
    "download_dir": (str, "the Hub cache to download into (default: $HF_HUB_CACHE)"),
    "override_generation_config": (json_object, "a JSON object of generation_config.json values over the ones "
                                                "--generation-config gives, e.g. '{\"temperature\": 0.5}'"),
    "hf_overrides": (json_object, "a JSON object of config.json values to use instead of the model folder's (e.g. "
                                  "Qwen3's YaRN: '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                  "\"original_max_position_embeddings\": 32768}}'); a rope_scaling replaces the rope "
                                  "parameters but rope_theta"),
    "runner": (str, "generate: the model samples text; pooling: it is an embedding model (embed(), the server's "
                    "/v1/embeddings)"),
    "pooler_config": (json_object, "with --runner pooling, a JSON object over the model folder's pooling, e.g. "
                                   "'{\"pooling_type\": \"MEAN\", \"normalize\": false}'"),
    "profiler_config": (json_object, "a JSON object configuring the profiler that LLM.start_profile() and the server's "
                                     "POST /start_profile run, e.g. '{\"profiler\": \"torch\", "
                                     "\"torch_profiler_dir\": \"./traces\"}'"),
    "block_size": (int, "tokens per KV cache block"),
    "tokenizer_revision": (str, "the Hub revision of a --tokenizer Hub id"),
    "generation_config": (str, "auto: default sampling parameters from the model's generation_config.json; vllm: "
                               "none; or a folder holding a generation_config.json"),
}


_FLAG = "flag"
# vLLM's engine options that are not Config fields (engine_args.VLLM_ARGS): taken on the command line too, so that a
# vLLM command line runs as it is where nanograph does what it asks, and is an error naming the option elsewhere.
VLLM_OPTIONS = {"pipeline_parallel_size": int, "data_parallel_size": int, "distributed_executor_backend": str,
                "cpu_offload_gb": float, "tokenizer_mode": str, "load_format": str, "task": str, "convert": str,
                "enable_lora": _FLAG, "speculative_config": json_object, "hf_token": str,
                "limit_mm_per_prompt": json_object, "num_gpu_blocks_override": int,
                "calculate_kv_scales": _FLAG, "swap_space": float, "max_seq_len_to_capture": int,
                "enable_chunked_prefill": argparse.BooleanOptionalAction, "disable_custom_all_reduce": _FLAG,
                "disable_async_output_proc": _FLAG, "guided_decoding_backend": str, "async_scheduling": _FLAG,
                "compilation_config": str, "cuda_graph_sizes": str, "disable_cascade_attn": _FLAG}


def add_engine_arguments(parser: argparse.ArgumentParser, model_positional: bool = False,
                         model_help: str = MODEL_HELP, defaults: dict[str, str] | None = None):
    """The model (`MODEL` when model_positional, else `--model`) and the engine options; defaults: what a command
    uses in place of a Config default, in words, by field."""
    if model_positional:
        parser.add_argument("model", nargs="?", help=model_help)
    else:
        parser.add_argument("--model", help=model_help)
    for field, (kind, help_text) in ENGINE_OPTIONS.items():
        default = (defaults or {}).get(field, getattr(Config, field))
        parser.add_argument("--" + field.replace("_", "-"), type=kind, default=argparse.SUPPRESS,
                            help=f"{help_text} (default: {default})")
    parser.add_argument("--enforce-eager", action="store_true", default=argparse.SUPPRESS,
                        help="run decode without CUDA graphs")
    parser.add_argument("--trust-remote-code", action="store_true", default=argparse.SUPPRESS,
                        help="let the tokenizer run code from its folder")
    parser.add_argument("--enable-sleep-mode", action="store_true", default=argparse.SUPPRESS,
                        help="let the engine sleep, freeing the device memory of its weights and KV cache (the "
                             "server's POST /sleep and /wake_up, with NANOGRAPH_SERVER_DEV_MODE=1)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                        help=f"reuse the KV blocks of shared prompt prefixes (default: {Config.enable_prefix_caching})")
    vllm = parser.add_argument_group("vLLM's engine options", "taken as vLLM takes them where nanograph does the same, "
                                                              "else an error naming the values it runs")
    for field, kind in VLLM_OPTIONS.items():
        arg = VLLM_ARGS[field]
        help_text = arg.meaning if arg.values is None else \
            f"{' or '.join(map(str, arg.values)).replace('None', 'unset')} only: {arg.meaning}"
        if kind is _FLAG:
            vllm.add_argument("--" + field.replace("_", "-"), action="store_true", default=argparse.SUPPRESS,
                              help=help_text)
        elif kind is argparse.BooleanOptionalAction:
            vllm.add_argument("--" + field.replace("_", "-"), action=kind, default=argparse.SUPPRESS, help=help_text)
        else:
            vllm.add_argument("--" + field.replace("_", "-"), type=kind, default=argparse.SUPPRESS, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The Config fields given on the command line."""
    return {field: getattr(args, field) for field in (*ENGINE_OPTIONS, "enforce_eager", "enable_prefix_caching",
                                                      "trust_remote_code", "enable_sleep_mode", *VLLM_OPTIONS)
            if hasattr(args, field)}


# The command line's sampling where neither an option nor the model's generation_config.json says otherwise: greedy,
# 256 tokens. A folder's generation_config.json (--generation-config auto, the default) comes first, as vLLM takes it.
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 256}
_FROM_MODEL = "the model's generation_config.json, else"


def add_sampling_arguments(parser: argparse.ArgumentParser):
    """The sampling options; one left out is None, so that the model's generation_config.json or
    CLI_SAMPLING_DEFAULTS applies (sampling_params)."""
    d = CLI_SAMPLING_DEFAULTS
    parser.add_argument("--temperature", type=float, help=f"0: greedy (default: {_FROM_MODEL} {d['temperature']})")
    parser.add_argument("--top-p", type=float, help="sample from the smallest set of tokens whose probabilities add "
                        f"up to this (default: {_FROM_MODEL} {d['top_p']})")
    parser.add_argument("--top-k", type=int, help="sample from this many most likely tokens; 0: all "
                        f"(default: {_FROM_MODEL} {d['top_k']})")
    parser.add_argument("--max-tokens", type=int, help="output tokens at most, per answer "
                        f"(default: {_FROM_MODEL} {d['max_tokens']})")


def sampling_params(args: argparse.Namespace, model_defaults: dict | None = None) -> SamplingParams:
    """The sampling options given, over model_defaults (the SamplingParams fields of the model's
    generation_config.json: LLMEngine.sampling_defaults), over CLI_SAMPLING_DEFAULTS."""
    given = {field: getattr(args, field) for field in CLI_SAMPLING_DEFAULTS if getattr(args, field, None) is not None}
    return SamplingParams(**{**CLI_SAMPLING_DEFAULTS, **(model_defaults or {}), **given})
