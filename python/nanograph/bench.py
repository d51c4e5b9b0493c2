"""`nanograph bench latency`: batch-1 decode speed against the weight+KV roofline and HF transformers.

Workload: a 128-token prompt, 256 output tokens, greedy, EOS ignored. Decode time per token is
(time for 256 tokens - time for 1 token) / 255, so the prefill stays out of it. HF transformers runs
the same workload in the same process, with a static cache and torch.compile(mode="reduce-overhead").
"""
from __future__ import annotations

import statistics
import time

import torch

from .llm import LLM
from .sampling_params import SamplingParams


def copy_bandwidth_gbs(device) -> float:
    src = torch.randn(1 << 29, dtype=torch.float32, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * (1 << 31) / min(times) / 1e9


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


def step_bytes(llm: LLM, context_len: float) -> float:
    """Bytes one decode step must read: every weight once (the embedding table only through the
    lm_head when tied, one row otherwise) plus K and V of every cached token in every layer."""
    runner = llm.engine.runner
    mc = runner.model_config
    seen, weight_bytes = set(), 0
    for name, t in runner.weights.items():
        if t.data_ptr() in seen or (name == "embed_tokens" and not mc.tie_word_embeddings):
            continue
        seen.add(t.data_ptr())
        weight_bytes += t.numel() * t.element_size()
    kv_bytes = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2 * context_len
    return weight_bytes + kv_bytes


def hf_decode_seconds_per_token(model_path: str, prompt: list[int], output_len: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor([prompt], device="cuda")

    def generate(n):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()

    generate(output_len)  # compiles
    seconds = decode_seconds_per_token(generate, output_len)
    del model
    torch.cuda.empty_cache()
    return seconds


def latency(model: str | None, prompt_len: int = 128, output_len: int = 256, compare_hf: bool = True,
            **llm_kwargs) -> dict:
    llm = LLM(model, max_num_seqs=1, max_model_len=prompt_len + output_len + 16, device="cuda", **llm_kwargs)
    vocab = llm.engine.vocab_size
    prompt = torch.randint(0, min(vocab, 10000), (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    def generate(n):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    seconds = decode_seconds_per_token(generate, output_len)
    bandwidth = copy_bandwidth_gbs(llm.engine.runner.device)
    gbs = step_bytes(llm, prompt_len + output_len / 2) / seconds / 1e9
    result = {"ms_per_token": seconds * 1e3, "tok_s": 1 / seconds, "achieved_gbs": gbs,
              "copy_gbs": bandwidth, "pct_bandwidth": 100 * gbs / bandwidth}
    print(f"nanograph  batch 1, prompt {prompt_len}, {output_len} tokens: {seconds * 1e3:.3f} ms/token, "
          f"{1 / seconds:.0f} tok/s, {gbs:.0f} GB/s = {100 * gbs / bandwidth:.0f}% of the {bandwidth:.0f} GB/s "
          "copy bandwidth measured now", flush=True)
    if compare_hf:
        path = llm.engine.runner.model_config.path
        del llm
        torch.cuda.empty_cache()
        hf = hf_decode_seconds_per_token(path, prompt, output_len)
        result.update(hf_ms_per_token=hf * 1e3, hf_tok_s=1 / hf, speedup=hf / seconds)
        print(f"HF transformers (static cache + torch.compile reduce-overhead): {hf * 1e3:.3f} ms/token, "
              f"{1 / hf:.0f} tok/s; nanograph is {hf / seconds:.2f}x", flush=True)
    return result
