"""Where the throughput benchmark's time goes: nano-vllm's workload (`nanograph bench throughput`) run once with CUDA
events around every step's forward and its sampler, summed by step kind and decode batch size, each group against
its roofline (weights once per step plus the K and V of every context token, at the copy bandwidth measured in the
same run). The wall time left over is the device idle while the host works, plus the events' own cost.

    python benchmarks/throughput_steps.py MODEL [NUM_SEQS] [--kv-cache-dtype fp8] [--top-k K] [--top-p P]

--top-k and --top-p truncate every request's draw (the workload's temperature stays 0.6): `--top-k 20 --top-p 0.95`
is how a Qwen3 folder's requests sample unless they say otherwise (its generation_config.json).
"""
import argparse
import time
from collections import defaultdict
from dataclasses import replace

import torch

from nanograph import LLM, SamplingParams
from nanograph.backends.base import Runner
from nanograph.bench import copy_bandwidth_gbs, kv_cache_bytes_per_token, nano_vllm_workload, weight_bytes

BANDS = [(1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 30)]


def group(num_seqs: int, num_tokens: int) -> str:
    if num_tokens != num_seqs:
        return "prefill/mixed"
    low, high = next(band for band in BANDS if band[0] <= num_seqs <= band[1])
    return f"decode {low}-{high}"


class TimedRunner(Runner):
    """A runner's steps with CUDA events on torch's stream (which the runner orders after its forward, for the
    sampler): before the forward, after it, and after the sampling."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.device, self.block_size, self.num_kv_blocks = runner.device, runner.block_size, runner.num_kv_blocks
        self.steps = []  # (group, tokens, context tokens, start, after forward, after sampler)

    def forward(self, batch, seqs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.runner.forward(batch, seqs)
        end.record()
        self.steps.append([group(batch.num_seqs, batch.num_tokens), batch.num_tokens, int(batch.context_lens.sum()),
                           start, end, end])

    def sample(self, rows, seqs):
        pending = self.runner.sample(rows, seqs)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        self.steps[-1][5] = done
        return pending


def main(model: str, num_seqs: int = 256, kv_cache_dtype: str = "auto", top_k: int = 0, top_p: float = 1.0):
    llm = LLM(model, max_model_len=2048, device="cuda", kv_cache_dtype=kv_cache_dtype)
    prompts, params = nano_vllm_workload(num_seqs, 1024, 1024, llm.engine.vocab_size)
    params = [replace(p, top_k=top_k, top_p=top_p) for p in params]
    llm.generate([prompts[0][:16]], SamplingParams(), use_tqdm=False)
    engine = llm.engine
    weights, kv_per_token = weight_bytes(llm), kv_cache_bytes_per_token(llm)
    runner = engine.runner = TimedRunner(engine.runner)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = runner.steps

    bandwidth = copy_bandwidth_gbs(runner.device) * 1e9
    totals = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])  # steps, tokens, forward s, sampler s, roofline s
    for name, tokens, context, s0, s1, s2 in steps:
        t = totals[name]
        t[0] += 1
        t[1] += tokens
        t[2] += s0.elapsed_time(s1) / 1e3
        t[3] += s1.elapsed_time(s2) / 1e3 if s2 is not None else 0.0
        t[4] += (weights + context * kv_per_token) / bandwidth
    output_tokens = sum(p.max_tokens for p in params)
    print(f"{num_seqs} requests, {output_tokens} output tokens in {wall:.3f} s ({output_tokens / wall:.0f} output "
          f"tok/s, events included); copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'group':<16}{'steps':>7}{'tokens':>9}{'forward s':>11}{'ms/step':>9}{'bytes/BW s':>12}"
          f"{'of forward':>13}{'sampler s':>11}")
    forward = sampled = 0.0
    for name in sorted(totals, key=lambda n: (n[0] != "p", int(n.split()[1].split("-")[0]) if n[0] == "d" else 0)):
        n, tokens, f, s, roof = totals[name]
        forward, sampled = forward + f, sampled + s
        print(f"{name:<16}{n:>7}{tokens:>9}{f:>11.3f}{1e3 * f / n:>9.3f}{roof:>12.3f}{100 * roof / f:>12.0f}%"
              f"{s:>11.3f}")
    print(f"forward {forward:.3f} s + sampler {sampled:.3f} s = {forward + sampled:.3f} s of device work; the other "
          f"{wall - forward - sampled:.3f} s of the wall time the device waited for the host")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("num_seqs", nargs="?", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    parser.add_argument("--top-k", type=int, default=0, help="every request's top_k (default: none)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default: none)")
    args = parser.parse_args()
    main(args.model, args.num_seqs, args.kv_cache_dtype, args.top_k, args.top_p)
