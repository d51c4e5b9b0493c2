"""The engine's own host work per step: nano-vllm's throughput workload (`nanograph bench throughput`) through the
scheduler, batch building and token application, with a runner that does no device work and samples at once. Runs on
any machine; what it prints is the part of a step's host time that is the engine's, not the runner's or the
sampler's.

    python benchmarks/engine_host.py [--rounds 3] [--num-seqs 256] [--profile]
"""
import argparse
import cProfile
import pstats
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from nanograph.backends.base import PendingTokens, Runner
from nanograph.bench import nano_vllm_workload
from nanograph.config import Config
from nanograph.engine.llm_engine import LLMEngine
from nanograph.sampling import SamplerOutput

VOCAB_SIZE = 151936


class _Sampled:
    def __init__(self, token_ids: list[int]):
        self._output = SamplerOutput(token_ids, [None] * len(token_ids))

    def result(self) -> SamplerOutput:
        return self._output


class NullRunner(Runner):
    """Forward passes that do nothing and tokens drawn in advance: only the engine's host work is left."""
    device = torch.device("cpu")
    kv_cache_dtype = torch.bfloat16

    def __init__(self, num_kv_blocks: int, block_size: int):
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self._tokens = np.random.default_rng(0).integers(1, VOCAB_SIZE, 1 << 16).tolist()

    def forward(self, batch, seqs):
        pass

    def sample(self, rows, seqs) -> PendingTokens:
        return PendingTokens(_Sampled(self._tokens[:len(rows)]), range(len(rows)))


def run_once(num_seqs: int, profile: cProfile.Profile | None = None) -> tuple[float, int]:
    """Seconds of one generate call of the workload, and its steps."""
    model_config = SimpleNamespace(vocab_size=VOCAB_SIZE, eos_token_ids=[0], max_context=4096)
    engine = LLMEngine(Config(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384), model_config,
                       NullRunner(num_kv_blocks=65536, block_size=16), tokenizer=None)
    prompts, params = nano_vllm_workload(num_seqs, 1024, 1024, VOCAB_SIZE)
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if profile is not None:
        profile.disable()
    return time.perf_counter() - start, engine.stats.steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--profile", action="store_true", help="also print the costliest functions of one round")
    args = parser.parse_args()
    seconds, steps = zip(*(run_once(args.num_seqs) for _ in range(args.rounds)))
    median = statistics.median(seconds)
    print(f"{args.num_seqs} requests, {steps[0]} steps: engine host {median:.3f} s (median of {args.rounds}; "
          f"{min(seconds):.3f}-{max(seconds):.3f}), {1e3 * median / steps[0]:.3f} ms per step")
    if args.profile:
        profile = cProfile.Profile()
        run_once(args.num_seqs, profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
