"""The throughput workload (nano-vllm's 256 requests, as `nanograph bench throughput` runs them) through
AsyncLLMEngine, each request a generate() of its own read as it streams, beside LLM.generate on the same requests in
the same run: what the asynchronous interface (an engine process, two pipes, an event loop) costs.

    python benchmarks/async_engine_throughput.py MODEL [--num-seqs N] [--output-kind delta|cumulative|final_only]

The async engine runs first, in its own process, and is shut down before LLM loads in this one.
"""
import argparse
import asyncio
import time

from nanograph import LLM, AsyncLLMEngine, RequestOutputKind, SamplingParams
from nanograph.bench import nano_vllm_workload

MAX_LEN = 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--output-kind", default="delta", choices=[kind.name.lower() for kind in RequestOutputKind])
    args = parser.parse_args()
    engine_args = dict(max_model_len=2 * MAX_LEN, device="cuda")
    kind = RequestOutputKind[args.output_kind.upper()]

    engine = AsyncLLMEngine(args.model, **engine_args)
    prompts, params = nano_vllm_workload(args.num_seqs, MAX_LEN, MAX_LEN, engine.info.vocab_size)
    output_tokens = sum(p.max_tokens for p in params)

    async def run_async() -> tuple[float, int, int]:
        async def one(i: int) -> tuple[int, int]:
            generated = outputs = 0
            async for output in engine.generate(prompts[i], _with_kind(params[i], kind), f"r{i}"):
                outputs += 1
                generated = len(output.outputs[0].token_ids) if kind is not RequestOutputKind.DELTA else \
                    generated + len(output.outputs[0].token_ids)
            return generated, outputs

        async for _ in engine.generate(prompts[0][:16], SamplingParams(), "warm-up"):
            pass
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return time.perf_counter() - start, sum(r[0] for r in results), sum(r[1] for r in results)

    async_seconds, generated, num_outputs = asyncio.run(run_async())
    engine.shutdown()
    assert generated == output_tokens, (generated, output_tokens)
    print(f"AsyncLLMEngine ({args.output_kind}): {args.num_seqs} requests, {output_tokens} output tokens in "
          f"{async_seconds:.2f} s: {output_tokens / async_seconds:.0f} output tok/s ({num_outputs} outputs read)",
          flush=True)

    llm = LLM(args.model, **engine_args)
    llm.generate([prompts[0][:16]], SamplingParams(), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    llm_seconds = time.perf_counter() - start
    print(f"LLM.generate: {output_tokens} output tokens in {llm_seconds:.2f} s: {output_tokens / llm_seconds:.0f} "
          f"output tok/s; AsyncLLMEngine / LLM.generate = {llm_seconds / async_seconds:.3f}", flush=True)


def _with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    params = params.clone()
    params.output_kind = kind
    return params


if __name__ == "__main__":
    main()
