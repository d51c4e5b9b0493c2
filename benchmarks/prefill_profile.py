"""Where a prefill step's time goes: batches of fresh random prompts (no prefix-cache hits), each taken by the engine
in one step, under torch.profiler (CUPTI sees the kernels of the core's stream too), the kernels' time summed by kind
over the layers beside the step's wall time.

    python benchmarks/prefill_profile.py MODEL [--shapes 29x558,8x2048,128x128] [--max-model-len 4096]

A shape NxL is N prompts of L tokens; N x L must fit one step (max_num_batched_tokens, default 16,384).
"""
import argparse
import time

import numpy as np
import torch

from nanograph import LLM, SamplingParams

# Kernel kinds by a piece of their name, first match wins; cuBLASLt's Hopper kernels are named nvjet_*.
KINDS = [("prefill attention", "prefill_attention"), ("QK-norm, RoPE, KV store", "rope"), ("SiLU x up", "silu"),
         ("norms", "rmsnorm"), ("GEMMs", "nvjet"), ("GEMMs", "gemm"), ("GEMMs", "gemv")]


def kind(kernel_name: str) -> str:
    return next((label for label, piece in KINDS if piece in kernel_name), "other")


def by_kind(times: dict[str, float]) -> dict[str, float]:
    """Kernel times (name -> seconds) summed by kind, in KINDS' order, then "other"."""
    totals = {label: 0.0 for label, _ in KINDS} | {"other": 0.0}
    for name, seconds in times.items():
        totals[kind(name)] += seconds
    return totals


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        count, _, length = item.strip().lower().partition("x")
        if not (count.isdigit() and length.isdigit() and int(count) > 0 and int(length) > 0):
            raise argparse.ArgumentTypeError(f"a shape is PROMPTSxTOKENS, e.g. 29x558; got {item!r}")
        shapes.append((int(count), int(length)))
    return shapes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("29x558,8x2048,128x128"))
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per shape, for the wall time")
    args = parser.parse_args()
    llm = LLM(args.model, device="cuda", max_model_len=args.max_model_len, max_num_seqs=256)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    for count, length in args.shapes:
        def fresh():  # new tokens every time: nothing comes from the prefix cache
            return [{"prompt_token_ids": rng.integers(0, vocab, length).tolist()} for _ in range(count)]

        llm.generate(fresh(), params, use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.repeats):
            llm.generate(fresh(), params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.repeats
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(fresh(), params, use_tqdm=False)
            torch.cuda.synchronize()
        times = {e.key: e.device_time_total / 1e6 for e in prof.key_averages() if e.device_time_total > 0}
        totals = by_kind(times)
        print(f"{count} x {length} tokens: wall {wall * 1e3:.2f} ms a step, kernels {sum(times.values()) * 1e3:.2f} ms",
              flush=True)
        for label, seconds in totals.items():
            if seconds:
                print(f"  {label:<26} {seconds * 1e3:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
