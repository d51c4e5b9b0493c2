"""Sampler benchmark: the time to sample one step of 256 rows x 151,936 vocabulary (Qwen3's), for an all-greedy
batch (the fast path), an all-temperature-0.6 batch (the throughput benchmark's), a batch of Qwen3's generation
defaults (temperature 0.6, top-k 20, top-p 0.95: what a Qwen3 folder's requests sample with unless they say
otherwise), one of top-p 0.9 alone (Llama 3's defaults, with temperature 0.6), a batch mixing every parameter:
greedy, temperature, top-k, top-p, min_p, the three penalties (512-token prompts, 128 generated tokens), per-request
seeds, logprobs; and that mixed batch with a quarter of its rows constrained by a JSON schema (structured outputs,
with the default model's tokenizer; each matcher inside a string value, where most tokens are allowed), with the time
of its grammar bitmask alone (filled on the host, copied, applied).

    python benchmarks/bench_sampler.py [--rows 256] [--vocab 151936] [--device cuda] [--dtype bfloat16]
                                       [--scale 4] [--host] [--profile]

A figure is the median wall time (with its 10th-90th percentile range, over 200 calls) of whole sampler calls, host
work and the final copy of the token ids included, as the engine pays it. Target on an H200: mixed <= 1 ms. --host then splits the host's part of each
batch on the core's path into stages, each a median: plan (the KernelPlan), upload (packing the parameters and
queueing their copy), launch (the kernels' binding and the results' copy back) and result (reading the results,
timed once the device is done, so without the wait). --profile runs the mixed batch under torch.profiler and prints
where the time goes, by operator."""
import argparse
import statistics
import time

import torch

from nanograph import SamplingParams, StructuredOutputsParams
from nanograph.engine.sequence import Sequence
from nanograph.sampling import Sampler, seeded_generator
from nanograph.sampling.grammar import GrammarCompiler
from nanograph.sampling.kernel_path import KernelPath

PROMPT_LEN = 512
OUTPUT_LEN = 128
MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.8, top_k=50),
    SamplingParams(temperature=0.9, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.1),
    SamplingParams(temperature=0.8, top_p=0.95, seed=1234),
    SamplingParams(temperature=0.6, top_k=20, logprobs=5),
]


def sequences(params: list[SamplingParams], rows: int, vocab: int, sampler: Sampler) -> list[Sequence]:
    generator = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(rows):
        row_params = params[i % len(params)]
        token_ids = torch.randint(0, vocab, (PROMPT_LEN + OUTPUT_LEN,), generator=generator).tolist()
        seq = Sequence(str(i), None, token_ids[:PROMPT_LEN], row_params)
        seq.token_ids = token_ids
        if row_params.seed is not None:
            seq.generator = seeded_generator(row_params.seed + i)
        seqs.append(seq)
    return seqs

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
IN_A_STRING = '{"name": "'  # where each constrained row's matcher stands


def constrain(seqs: list[Sequence], every: int, vocab: int) -> list[int]:
    """Gives every every-th sequence a matcher of PERSON, advanced past IN_A_STRING; their rows."""
    from transformers import AutoTokenizer

    from nanograph.default_model import default_model_path
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    grammar = compiler.compile(StructuredOutputsParams(json=PERSON))
    rows = list(range(0, len(seqs), every))
    for row in rows:
        seqs[row].grammar = compiler.matcher(grammar)
        assert all(seqs[row].grammar.advance(t) for t in tokenizer.encode(IN_A_STRING, add_special_tokens=False))
    return rows


def time_ms(fn, warmup: int = 10, repeats: int = 200) -> tuple[float, float, float]:
    """The median, 10th and 90th percentile of fn's wall time in ms."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # ends with the copy of the token ids to the host
        samples.append((time.perf_counter() - start) * 1e3)
    deciles = statistics.quantiles(samples, n=10)
    return statistics.median(samples), deciles[0], deciles[-1]


def host_stages_ms(path: KernelPath, logits: torch.Tensor, seqs: list[Sequence], warmup: int = 5,
                   repeats: int = 50) -> dict[str, float]:
    """The median host time of each stage of the core's path (the module's docstring), in the path's order."""
    samples = {stage: [] for stage in ("plan", "upload", "launch", "result")}
    for i in range(warmup + repeats):
        start = time.perf_counter()
        plan = path.plan(logits, seqs)
        planned = time.perf_counter()
        slot, params = path.upload(plan, logits.device)
        uploaded = time.perf_counter()
        pending = path.launch(logits, plan, slot, params)
        launched = time.perf_counter()
        torch.cuda.synchronize()
        read = time.perf_counter()
        pending.result()
        if i >= warmup:
            for stage, begin, end in [("plan", start, planned), ("upload", planned, uploaded),
                                      ("launch", uploaded, launched), ("result", read, time.perf_counter())]:
                samples[stage].append((end - begin) * 1e3)
    return {stage: statistics.median(times) for stage, times in samples.items()}


def profile(fn, device: torch.device, repeats: int = 20):
    """Print fn's operators (a device's kernels under them), totalled over repeats calls, costliest first."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"mixed batch under torch.profiler, {repeats} calls:")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=25))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the logits' dtype (the engine's are bfloat16)")
    parser.add_argument("--scale", type=float, default=4.0,
                        help="the random logits' standard deviation (small ones make flat rows, where every "
                             "token may win)")
    parser.add_argument("--host", action="store_true",
                        help="the host's time per stage of the core's path: plan, upload, launch, result")
    parser.add_argument("--profile", action="store_true", help="profile the mixed batch, by operator")
    args = parser.parse_args()
    device = torch.device(args.device)
    sampler = Sampler(device, eos_token_ids=[0], seed=0)
    logits = (torch.randn(args.rows, args.vocab, device=device) * args.scale).to(getattr(torch, args.dtype))
    print(f"sampler, {args.rows} rows x {args.vocab} vocabulary, {args.dtype} logits on {device}")
    for name, params in [("all greedy", [SamplingParams(temperature=0)]),
                         ("temperature", [SamplingParams(temperature=0.6)]),
                         ("qwen3", [SamplingParams(temperature=0.6, top_k=20, top_p=0.95)]),
                         ("top-p", [SamplingParams(temperature=0.6, top_p=0.9)]), ("mixed", MIXED)]:
        seqs = sequences(params, args.rows, args.vocab, sampler)
        median, p10, p90 = time_ms(lambda: sampler.sample(logits, seqs).result())
        print(f"  {name:<12} {median:8.3f} ms  (10th-90th percentile {p10:.3f}-{p90:.3f} ms)")
        if args.host and not isinstance(sampler.path, KernelPath):
            print("    (--host times the core's path, which needs a GPU and the core)")
        elif args.host and sampler.plain_greedy(seqs, args.vocab):
            print("    (an all-greedy batch takes the core's argmax, without the packed stages)")
        elif args.host:
            stages = host_stages_ms(sampler.path, logits, seqs)
            print("    host: " + ", ".join(f"{stage} {ms:.3f}" for stage, ms in stages.items())
                  + f" ms; total {sum(stages.values()):.3f} ms")
    seqs = sequences(MIXED, args.rows, args.vocab, sampler)
    rows = constrain(seqs, 4, args.vocab)
    median, p10, p90 = time_ms(lambda: sampler.sample(logits, seqs).result())
    print(f"  {'json 25%':<12} {median:8.3f} ms  (10th-90th percentile {p10:.3f}-{p90:.3f} ms)")

    def bitmask():
        sampler.bitmask.apply(logits, seqs, rows)
        if device.type == "cuda":
            torch.cuda.synchronize()
    median, p10, p90 = time_ms(bitmask)
    print(f"    of which the bitmask of {len(rows)} rows: {median:.3f} ms (10th-90th percentile {p10:.3f}-{p90:.3f})")
    if args.profile:
        seqs = sequences(MIXED, args.rows, args.vocab, sampler)
        profile(lambda: sampler.sample(logits, seqs).result(), device)


if __name__ == "__main__":
    main()
