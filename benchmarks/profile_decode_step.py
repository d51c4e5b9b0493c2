"""Per-kernel time of one eager decode step, for `ncu` (each kernel timed alone):

    ncu --clock-control none --nvtx --nvtx-include "decode_step/" --metrics gpu__time_duration.sum \
        --csv python benchmarks/profile_decode_step.py MODEL [BATCH [CONTEXT [MAX_MODEL_LEN]]] > profile.csv
    python benchmarks/profile_decode_step.py --summarize profile.csv

BATCH sequences (default 1) each attend CONTEXT cached tokens (default 131: the middle of the latency
benchmark's batch-1 run); the cache holds unwritten memory, which costs the same time to read. A fourth argument,
MAX_MODEL_LEN (default max(512, CONTEXT + 1)), sizes the engine, and with it the attention grid.
`--kv-cache-dtype fp8` profiles the FP8 KV cache, `--quantization fp8` FP8 weights.
"""
import csv
import sys
from collections import defaultdict


def run(model, batch=1, context=131, max_model_len=None, kv_cache_dtype="auto", quantization=None):
    import numpy as np
    import torch

    from nanograph import LLM, SamplingParams
    from nanograph.engine.batch import storeless_batch

    max_model_len = max_model_len or max(512, context + 1)
    block_size = 16
    width = -(-max_model_len // block_size) + 1  # the core's block-table width
    llm = LLM(model, device="cuda", enforce_eager=True, max_num_seqs=batch, max_model_len=max_model_len,
              max_num_batched_tokens=max(4096, batch), block_size=block_size, num_kv_blocks=batch * width,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    llm.generate([list(range(100, 228))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warms cuBLASLt
    runner = llm.engine.runner
    blocks = -(-context // block_size)  # sequence s in its own blocks s * width, s * width + 1, ...
    block_tables = np.arange(batch)[:, None] * width + np.arange(blocks)[None]
    step = storeless_batch(np.zeros(batch), np.ones(batch), np.full(batch, context), block_tables)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("decode_step")
    runner.queue_step(step, greedy=False)
    runner.model.synchronize()
    torch.cuda.nvtx.range_pop()


def kernel_name(signature: str) -> str:
    """A kernel's name without return type, namespaces, template arguments or parameters:
    "void nanograph::(anonymous namespace)::split_kernel<128>(DecodeAttentionArgs, int)" -> "split_kernel"."""
    name = signature.replace("(anonymous namespace)", "").replace("void ", "")
    return name.split("(")[0].split("<")[0].split("::")[-1] or signature


def summarize(path):
    with open(path) as f:
        rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
    header, rows = rows[0], rows[1:]
    name_col, value_col = header.index("Kernel Name"), header.index("Metric Value")
    total, per_name, count = 0.0, defaultdict(float), defaultdict(int)
    for r in rows:
        us = float(r[value_col].replace(",", "")) / 1e3  # ns -> us
        name = kernel_name(r[name_col])
        per_name[name] += us
        count[name] += 1
        total += us
    print(f"{len(rows)} kernels, {total:.1f} us of kernel time in one decode step")
    for name, us in sorted(per_name.items(), key=lambda kv: -kv[1]):
        print(f"{us:9.1f} us {100 * us / total:5.1f}%  x{count[name]:<4d} {name[:90]}")


if __name__ == "__main__":
    if sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    else:
        args = sys.argv[1:]
        options = {"--kv-cache-dtype": "auto", "--quantization": None}
        for flag in options:
            if flag in args:
                i = args.index(flag)
                options[flag] = args[i + 1]
                del args[i:i + 2]
        run(args[0], *map(int, args[1:4]), kv_cache_dtype=options["--kv-cache-dtype"],
            quantization=options["--quantization"])
