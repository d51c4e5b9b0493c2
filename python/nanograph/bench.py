"""`nanograph bench latency` and `nanograph bench throughput`: decode speed against the weight+KV roofline and
HF transformers.

latency: a 128-token prompt, 256 output tokens, greedy, EOS ignored. Decode time per token is
(time for 256 tokens - time for 1 token) / 255, so the prefill stays out of it. HF transformers runs
the same workload in the same process, with a static cache and torch.compile(mode="reduce-overhead").

throughput: nano-vllm's bench.py workload (256 requests of random token ids, 100-1024 prompt and
100-1024 output tokens, temperature 0.6, EOS ignored), timed as one generate call after a warm-up.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, replace
from random import randint, seed

import numpy as np
import torch

from .backends.cuda_backend import CudaRunner
from .engine.batch import storeless_batch
from .llm import LLM
from .models.kv_cache import kv_bytes_per_token
from .sampling_params import SamplingParams


def copy_bandwidth_gbs(device) -> float:
    """GB/s read plus written by the fastest of five copies between two buffers: 2 GiB on a GPU, 256 MiB in host
    memory (far past the CPU's caches, and quick)."""
    device = torch.device(device)
    nbytes = 1 << 31 if device.type == "cuda" else 1 << 28
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    synchronize = _synchronizer(device)
    dst.copy_(src)
    synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize()
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / min(times) / 1e9


def _synchronizer(device: torch.device):
    """Waits for the work queued on device: a no-op on the host."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_seconds_per_token(generate, output_len: int, repeats: int = 3) -> float:
    """generate(n) produces n tokens for the fixed prompt; prefill cost cancels in the difference."""
    full = _median_seconds(lambda: generate(output_len), repeats)
    first = _median_seconds(lambda: generate(1), repeats)
    return (full - first) / (output_len - 1)


def graph_step_seconds(runner, context_len: int, steps: int = 200) -> float | None:
    """GPU time of one batch-1 decode step at context_len: its graph replayed back to back (no KV is stored), the
    greedy variant that generate runs (the argmax into pinned host memory ends the step); None without graphs."""
    if not getattr(runner, "use_graphs", False):
        return None
    return decode_step_seconds(runner, context_len, 1, steps)


def decode_step_seconds(runner, context_len: int, batch_size: int, steps: int = 200) -> float:
    """Seconds of one decode step of batch_size sequences at context_len tokens each, timed over steps of them queued
    back to back (no KV is stored): on the core, the step that generate queues for an all-greedy batch (its decode
    graph, unless enforce_eager); on the torch backend, the forward pass."""
    batch = storeless_decode_batch(runner, context_len, batch_size)
    if isinstance(runner, CudaRunner):
        step, synchronize = (lambda: runner.queue_step(batch, greedy=True)), runner.model.synchronize
    else:
        step, synchronize = (lambda: runner.run(batch)), _synchronizer(runner.device)
    step()
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize()
    return (time.perf_counter() - start) / steps


def storeless_decode_batch(runner, context_len: int, batch_size: int):
    """batch_size sequences feeding token 0 at the end of context_len tokens each, every one over blocks of its own
    (taken in order, wrapping around the KV cache when it holds fewer)."""
    blocks = -(-context_len // runner.block_size)
    block_tables = np.arange(batch_size * blocks, dtype=np.int32).reshape(batch_size, blocks) % runner.num_kv_blocks
    return storeless_batch(np.zeros(batch_size, np.int32), np.ones(batch_size, np.int32),
                           np.full(batch_size, context_len, np.int32), block_tables)


def step_bytes(llm: LLM, context_len: float, batch_size: int = 1) -> float:
    """Bytes one decode step of batch_size sequences must move: every weight once (the embedding table only through
    the lm_head when tied), the batch's embedding rows, K and V of every cached token in every layer, and the
    batch's logits written (K and V in the KV cache's dtype, the rest in the model's)."""
    mc = llm.engine.runner.model_config
    rows = batch_size * (mc.hidden_size + mc.vocab_size) * llm.engine.runner.weights["embed_tokens"].element_size()
    return weight_bytes(llm) + rows + kv_cache_bytes_per_token(llm) * context_len * batch_size


def weight_bytes(llm: LLM) -> int:
    runner = llm.engine.runner
    seen, total = set(), 0
    for name, t in runner.weights.items():
        if t.data_ptr() in seen or (name == "embed_tokens" and not runner.model_config.tie_word_embeddings):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def kv_cache_bytes_per_token(llm: LLM) -> int:
    runner = llm.engine.runner
    return kv_bytes_per_token(runner.model_config, runner.model_config.num_kv_heads, runner.kv_cache_dtype)


def hf_decode_seconds_per_token(model_path: str, prompt: list[int], output_len: int) -> float:
    from transformers import AutoModelForCausalLM, CompileConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
    # A static cache makes generate() compile the decode forward itself (wrapping forward by hand
    # trips over its CUDA-graph output buffers).
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor([prompt], device="cuda")

    def generate(n):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()

    generate(output_len)  # compiles
    seconds = decode_seconds_per_token(generate, output_len)
    model = None  # the weights go (the closure above reads the name, and is not called again)
    torch.cuda.empty_cache()
    return seconds


def latency(model: str | None, prompt_len: int = 128, output_len: int = 256, compare_hf: bool = True,
            max_model_len: int | None = None, **llm_kwargs) -> dict:
    """max_model_len sizes the KV cache and the decode graphs (the attention grid grows with it); by default just
    enough for the workload. llm_kwargs are Config fields (device "cuda" unless given); the copy bandwidth and the
    HF comparison are measured on CUDA only."""
    if max_model_len is None:
        max_model_len = prompt_len + output_len + 16
    elif max_model_len < prompt_len + output_len:
        raise ValueError(f"max_model_len {max_model_len} cannot hold the {prompt_len}-token prompt and "
                         f"{output_len} output tokens; give at least {prompt_len + output_len}")
    llm = LLM(model, max_model_len=max_model_len, **{"max_num_seqs": 1, "device": "cuda", **llm_kwargs})
    device = llm.engine.runner.device
    if compare_hf and device.type != "cuda":
        raise ValueError(f"bench latency compares with HF transformers on CUDA only, and the engine runs on {device}; "
                         "pass --no-hf (compare_hf=False)")
    vocab = llm.engine.vocab_size
    prompt = torch.randint(0, min(vocab, 10000), (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    def generate(n):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    seconds = decode_seconds_per_token(generate, output_len)
    gpu_seconds = graph_step_seconds(llm.engine.runner, prompt_len + output_len // 2)
    result = {"ms_per_token": seconds * 1e3, "tok_s": 1 / seconds}
    report = f"nanograph  batch 1, prompt {prompt_len}, {output_len} tokens: {seconds * 1e3:.3f} ms/token, " \
             f"{1 / seconds:.0f} tok/s"
    if device.type == "cuda":
        bandwidth = copy_bandwidth_gbs(device)
        gbs = step_bytes(llm, prompt_len + output_len / 2) / seconds / 1e9
        result.update(achieved_gbs=gbs, copy_gbs=bandwidth, pct_bandwidth=100 * gbs / bandwidth)
        report += f", {gbs:.0f} GB/s = {100 * gbs / bandwidth:.0f}% of the {bandwidth:.0f} GB/s copy bandwidth " \
                  "measured now"
    print(report, flush=True)
    if gpu_seconds is not None:
        result["gpu_ms_per_step"] = gpu_seconds * 1e3
        print(f"  of which GPU: {gpu_seconds * 1e3:.3f} ms per step (the batch-1 decode graph replayed alone); "
              f"the rest, {(seconds - gpu_seconds) * 1e3:.3f} ms, is host work between steps", flush=True)
    if compare_hf:
        path = llm.engine.runner.model_config.path
        del llm
        gc.collect()  # frees the core's KV cache before HF loads
        torch.cuda.empty_cache()
        hf = hf_decode_seconds_per_token(path, prompt, output_len)
        result.update(hf_ms_per_token=hf * 1e3, hf_tok_s=1 / hf, speedup=hf / seconds)
        print(f"HF transformers (static cache + torch.compile reduce-overhead): {hf * 1e3:.3f} ms/token, "
              f"{1 / hf:.0f} tok/s; nanograph is {hf / seconds:.2f}x", flush=True)
    return result


def nano_vllm_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                       vocab_size: int = 10001) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py requests: the same random draws in the same order from seed(0). Token ids past a toy
    model's vocabulary wrap around, and maxima below 100 lower the minimum lengths, without changing the draws."""
    seed(0)
    prompts = [[randint(0, 10000) % vocab_size for _ in range(randint(min(100, max_input_len), max_input_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=randint(min(100, max_output_len), max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


@dataclass
class StepStats:
    """What the engine's steps did during one generate call."""
    steps: int
    context_tokens: int  # summed over steps: the tokens each scheduled sequence attends, whose K and V it reads
    device_wait_seconds: float  # the host waiting for sampled tokens: the device was the bottleneck
    preemptions: int


def _timed_generate(llm: LLM, prompts, params) -> tuple[float, StepStats]:
    engine = llm.engine
    before, preemptions = replace(engine.stats), engine.scheduler.num_preemptions
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = engine.stats
    return seconds, StepStats(after.steps - before.steps, after.context_tokens - before.context_tokens,
                              after.device_wait_seconds - before.device_wait_seconds,
                              engine.scheduler.num_preemptions - preemptions)


def hf_batched_generate_seconds(model_path: str, prompts: list[list[int]], params: list[SamplingParams],
                                device: torch.device) -> float:
    """HF transformers generate on one left-padded batch (dynamic cache, eager), every row running to the longest
    max_tokens, with the same temperature and no top-k/top-p truncation."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    max_new = max(p.max_tokens for p in params)

    def generate(new_tokens):
        with torch.no_grad():
            model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=True, temperature=params[0].temperature, top_k=0,
                           top_p=1.0, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    generate(2)  # warm-up
    start = time.perf_counter()
    generate(max_new)
    seconds = time.perf_counter() - start
    model = None  # the weights go (the closure above reads the name, and is not called again)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def throughput(model: str | None, num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
               compare_hf: bool = False, hf_subset: int = 16, **llm_kwargs) -> dict:
    """Output tokens per second of one generate call over nano-vllm's workload; llm_kwargs are Config fields
    (device "cuda" and max_model_len max_input_len + max_output_len unless given)."""
    llm = LLM(model, **{"max_model_len": max_input_len + max_output_len, "device": "cuda", **llm_kwargs})
    prompts, params = nano_vllm_workload(num_seqs, max_input_len, max_output_len, llm.engine.vocab_size)
    llm.generate([prompts[0][:16]], SamplingParams(), use_tqdm=False)  # warm-up, as nano-vllm's bench does
    seconds, stats = _timed_generate(llm, prompts, params)
    output_tokens = sum(p.max_tokens for p in params)
    prompt_tokens = sum(map(len, prompts))
    runner = llm.engine.runner
    result = {"seconds": seconds, "output_tok_s": output_tokens / seconds,
              "total_tok_s": (prompt_tokens + output_tokens) / seconds, "steps": stats.steps,
              "preemptions": stats.preemptions, "kv_blocks": runner.num_kv_blocks, "block_size": runner.block_size,
              "host_share": 1 - stats.device_wait_seconds / seconds}
    print(f"nanograph  {num_seqs} requests, {prompt_tokens} prompt + {output_tokens} output tokens in "
          f"{seconds:.2f} s: {result['output_tok_s']:.0f} output tok/s, {result['total_tok_s']:.0f} total tok/s",
          flush=True)
    print(f"  {stats.steps} steps, {stats.preemptions} preemptions, KV cache {runner.kv_cache_summary()}; the host "
          f"was busy (scheduling, batch building, queueing the sampler, applying tokens) "
          f"{100 * result['host_share']:.1f}% of the wall time and waited for the device the rest; "
          "its work overlaps the device's", flush=True)
    if runner.device.type == "cuda":
        moved = stats.steps * weight_bytes(llm) + stats.context_tokens * kv_cache_bytes_per_token(llm)
        bandwidth = copy_bandwidth_gbs(runner.device)
        gbs = moved / seconds / 1e9
        result.update(achieved_gbs=gbs, copy_gbs=bandwidth, pct_bandwidth=100 * gbs / bandwidth)
        print(f"  weights once per step + KV of every context token: {gbs:.0f} GB/s = {100 * gbs / bandwidth:.0f}% "
              f"of the {bandwidth:.0f} GB/s copy bandwidth measured now", flush=True)
    if compare_hf:
        prompts, params = prompts[:hf_subset], params[:hf_subset]
        subset_tokens = sum(p.max_tokens for p in params)
        ours, _ = _timed_generate(llm, prompts, params)
        path, device = runner.model_config.path, runner.device
        del llm, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = hf_batched_generate_seconds(path, prompts, params, device)
        hf_generated = len(prompts) * max(p.max_tokens for p in params)
        result.update(subset_tok_s=subset_tokens / ours, hf_subset_tok_s=subset_tokens / hf, speedup=hf / ours)
        print(f"first {len(prompts)} requests ({subset_tokens} output tokens): nanograph {subset_tokens / ours:.0f} "
              f"tok/s; HF transformers batched generate (left-padded, every row to the longest, {hf_generated} "
              f"tokens generated) {subset_tokens / hf:.0f} tok/s of requested tokens; nanograph is {hf / ours:.2f}x",
              flush=True)
    return result
