"""Per-kernel time of one eager batch-1 decode step, for `ncu` (each kernel timed alone):

    ncu --clock-control none --nvtx --nvtx-include "decode_step/" --metrics gpu__time_duration.sum \
        --csv python benchmarks/profile_decode_step.py MODEL > profile.csv
    python benchmarks/profile_decode_step.py --summarize profile.csv
"""
import csv
import sys
from collections import defaultdict


def run(model):
    import torch

    from nanograph import LLM, SamplingParams
    from nanograph.bench import write_decode_metadata

    llm = LLM(model, device="cuda", enforce_eager=True, max_num_seqs=1, max_model_len=512, num_kv_blocks=64)
    llm.generate([list(range(100, 228))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warms cuBLASLt and fills the cache blocks the step reads
    model = llm.engine.runner.model
    write_decode_metadata(model, 131)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("decode_step")
    model.step(1, 1, 1, False)
    model.synchronize()
    torch.cuda.nvtx.range_pop()


def summarize(path):
    with open(path) as f:
        rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
    header, rows = rows[0], rows[1:]
    name_col, value_col = header.index("Kernel Name"), header.index("Metric Value")
    total, per_name, count = 0.0, defaultdict(float), defaultdict(int)
    for r in rows:
        us = float(r[value_col].replace(",", "")) / 1e3  # ns -> us
        name = r[name_col].split("(")[0].split("<")[0].replace("void ", "")
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
        run(sys.argv[1])
