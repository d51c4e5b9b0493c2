"""`nanograph bench sweep`: decode step time over batch sizes and context lengths, beside the roofline of the bytes
each step must move at the copy bandwidth measured in the same run, as JSON (`bench_plot` draws it).

A point (batch B, context C) times B sequences of C tokens each whose step stores no KV (bench.decode_step_seconds);
each sequence reads blocks of its own, so the point needs B * ceil(C / block_size) blocks of the one engine's KV
cache, which is sized for the largest batch and context. A point that the engine cannot hold is skipped, with why.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from .bench import copy_bandwidth_gbs, decode_step_seconds, step_bytes
from .llm import LLM

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_CONTEXT_LENS = (128, 512, 2048, 8192, 32768)


def sweep(model: str | None, batch_sizes=DEFAULT_BATCH_SIZES, context_lens=DEFAULT_CONTEXT_LENS,
          output: str | None = None, steps: int = 100, **llm_kwargs) -> dict:
    """Measures every (batch, context) point and writes the result as JSON to output (if given); llm_kwargs are
    Config fields (device "cuda", max_num_seqs the largest batch and max_model_len the longest context unless
    given)."""
    batch_sizes, context_lens = sizes("batch_sizes", batch_sizes), sizes("context_lens", context_lens)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (the decode steps timed per point), got {steps!r}")
    if llm_kwargs.get("tensor_parallel_size", 1) != 1:
        raise ValueError(f"bench sweep times one process's decode step; tensor_parallel_size="
                         f"{llm_kwargs['tensor_parallel_size']} is not supported there: leave it at 1")
    llm = LLM(model, **{"max_num_seqs": batch_sizes[-1], "max_model_len": context_lens[-1], "device": "cuda",
                        **llm_kwargs})
    runner, config = llm.engine.runner, llm.engine.config
    bandwidth = copy_bandwidth_gbs(runner.device)
    result = {"model": runner.model_config.path, "device": device_name(runner.device),
              "runner": type(runner).__name__,
              "dtype": str(runner.weights["embed_tokens"].dtype).removeprefix("torch."),
              "copy_gbs": bandwidth, "max_num_seqs": config.max_num_seqs, "max_model_len": config.max_model_len,
              "block_size": runner.block_size, "num_kv_blocks": runner.num_kv_blocks, "steps_per_point": steps,
              "points": []}
    print(f"nanograph bench sweep: {Path(result['model']).name} on {result['device']} ({result['dtype']}), copy "
          f"bandwidth {bandwidth:.1f} GB/s, KV cache {runner.kv_cache_summary()}",
          flush=True)
    try:
        measure_all(llm, result["points"], batch_sizes, context_lens, bandwidth, steps)
    finally:
        llm.shutdown()
    if output is not None:
        Path(output).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {output}", flush=True)
    return result


def measure_all(llm: LLM, points: list, batch_sizes, context_lens, bandwidth: float, steps: int):
    """Appends each (batch, context) point to points: measured, or skipped with the reason."""
    runner, config = llm.engine.runner, llm.engine.config
    for context in context_lens:
        for batch in batch_sizes:
            point = {"batch": batch, "context": context}
            reason = unfit_reason(batch, context, config.max_num_seqs, config.max_model_len, runner.num_kv_blocks,
                                  runner.block_size)
            if reason is None:
                point.update(measure(llm, batch, context, bandwidth, steps))
                print(f"  batch {batch:>4}, context {context:>6}: {point['ms_per_step']:9.3f} ms/step "
                      f"{point['tokens_per_s']:9.0f} tok/s, roofline {point['roofline_ms']:9.3f} ms "
                      f"({100 * point['fraction_of_roofline']:.0f}%)", flush=True)
            else:
                point["skipped"] = reason
                print(f"  batch {batch:>4}, context {context:>6}: skipped: {reason}", flush=True)
            points.append(point)


def measure(llm: LLM, batch: int, context: int, bandwidth_gbs: float, steps: int) -> dict:
    seconds = decode_step_seconds(llm.engine.runner, context, batch, steps)
    moved = step_bytes(llm, context, batch)
    roofline = moved / (bandwidth_gbs * 1e9)
    return {"ms_per_step": seconds * 1e3, "ms_per_token": seconds * 1e3, "tokens_per_s": batch / seconds,
            "roofline_bytes": moved, "roofline_ms": roofline * 1e3, "fraction_of_roofline": roofline / seconds}


def unfit_reason(batch: int, context: int, max_num_seqs: int, max_model_len: int, num_kv_blocks: int,
                 block_size: int) -> str | None:
    """Why the engine cannot run batch sequences at context tokens each, or None when it can."""
    if batch > max_num_seqs:
        return f"batch {batch} is more than max_num_seqs={max_num_seqs}"
    if context > max_model_len:
        return f"context {context} is more than max_model_len={max_model_len}"
    blocks = batch * -(-context // block_size)
    if blocks > num_kv_blocks:
        return f"needs {blocks} KV blocks of {block_size} tokens; the KV cache holds {num_kv_blocks}"
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.machine()}, {torch.get_num_threads()} threads)"


def sizes(name: str, values) -> list[int]:
    """values as a sorted list of distinct positive ints, or a ValueError naming them."""
    values = list(values)
    if not values:
        raise ValueError(f"{name} is empty; give at least one size")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be positive integers; got {value!r} in {values}")
    return sorted(set(values))
