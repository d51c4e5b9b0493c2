"""Where a decode step's time goes, kernel by kernel, as the step really runs: its CUDA graph replayed under
torch.profiler, whose CUPTI trace holds every kernel of a graph launch with its start and end.

    python benchmarks/decode_timeline.py MODEL [--batch 1] [--context 131] [--max-model-len 400] \\
        [--quantization fp8] [--kv-cache-dtype fp8] [--enforce-eager] [--json timeline.json]
    python benchmarks/decode_timeline.py --summarize timeline.json

Under programmatic dependent launch a kernel starts while the one before it still runs (its CTAs load weights and
wait), so a kernel's own duration says little about the step. The table gives each kernel's exposed time instead:
how far it moves the step's end, its end minus the latest end of the kernels that started before it. The exposed
times of a step add up to its span. Kernels of one name that appear a multiple of the layer count per step are told
apart by their place in the layer (qkv and o of the same GEMV kernel: "#1/2", "#2/2"); others are summed. Steps run
one at a time (a synchronize after each), which leaves the kernels' overlap inside a step as it is; the step time
without the profiler, back to back, is printed beside it. CUDA only.
"""
import argparse
import json
import statistics
import sys
from collections import defaultdict


def kernel_name(signature: str) -> str:
    """A kernel's name with its template arguments, without return type, namespaces or parameters:
    "void nanograph::(anonymous namespace)::gemv_kernel<8, 8, true>(bf16 const*, ...)" -> "gemv_kernel<8, 8, true>"."""
    name = signature.replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[len("void "):]
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the parameter list: the first "(" outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    base, _, args = name.partition("<")
    return base.split("::")[-1] + ("<" + args if args else "")


def split_steps(kernels: list, min_gap_us: float = 5.0) -> list:
    """[(name, start_us, end_us)] of several steps run one at a time -> one list per step: a new step starts where a
    kernel starts min_gap_us or more after every kernel before it has ended."""
    steps, latest_end = [], None
    for k in sorted(kernels, key=lambda k: k[1]):
        if latest_end is None or k[1] - latest_end >= min_gap_us:
            steps.append([])
        steps[-1].append(k)
        latest_end = k[2] if latest_end is None else max(latest_end, k[2])
    return steps


def exposed_times(step: list) -> list:
    """Each kernel's exposed time in a step (sorted by start): its end minus the latest end before it (0 if it ends
    earlier). They add up to the step's span, from the first start to the last end."""
    exposed, latest_end = [], step[0][1]
    for _, start, end in step:
        exposed.append(max(0.0, end - latest_end))
        latest_end = max(latest_end, end)
    return exposed


def summarize(timeline: dict, out=sys.stdout):
    """Prints the table of timeline (as written by profile): per kernel role, calls per step, exposed us per call and
    per step, and its own duration per call, medians over the steps."""
    steps, layers = timeline["steps"], timeline["num_layers"]
    per_role = defaultdict(lambda: {"exposed": [], "duration": [], "calls": []})
    order = []
    for step in steps:
        counts = defaultdict(int)
        for name, *_ in step:
            counts[name] += 1
        seen, role_sums = defaultdict(int), defaultdict(lambda: [0.0, 0.0, 0])
        for (name, start, end), exposed in zip(step, exposed_times(step)):
            per_layer = counts[name] // layers if counts[name] % layers == 0 else 0
            role = name
            if per_layer > 1:
                role = f"{name} #{seen[name] % per_layer + 1}/{per_layer}"
            seen[name] += 1
            sums = role_sums[role]
            sums[0] += exposed
            sums[1] += end - start
            sums[2] += 1
        for role, (exposed, duration, calls) in role_sums.items():
            if role not in per_role:
                order.append(role)
            per_role[role]["exposed"].append(exposed)
            per_role[role]["duration"].append(duration / calls)
            per_role[role]["calls"].append(calls)
    spans = [max(end for _, _, end in step) - step[0][1] for step in steps]
    span = statistics.median(spans)
    print(f"{timeline.get('label', '')}: {len(steps)} steps profiled, span {span:.1f} us (median); "
          f"{statistics.median(len(s) for s in steps):.0f} kernels a step", file=out)
    if timeline.get("step_us"):
        print(f"  without the profiler, steps back to back: {timeline['step_us']:.1f} us a step", file=out)
    print(f"  {'kernel':<64} {'calls':>5} {'exposed/call':>12} {'exposed/step':>12} {'share':>6} {'own/call':>9}",
          file=out)
    for role in sorted(order, key=lambda r: -statistics.median(per_role[r]["exposed"])):
        r = per_role[role]
        calls = statistics.median(r["calls"])
        exposed = statistics.median(r["exposed"])
        print(f"  {role[:64]:<64} {calls:5.0f} {exposed / calls:10.2f}us {exposed:10.1f}us {100 * exposed / span:5.1f}% "
              f"{statistics.median(r['duration']):7.2f}us", file=out)


def profile(model: str, batch: int, context: int, max_model_len: int | None, steps: int, **llm_kwargs) -> dict:
    import torch

    from nanograph import LLM
    from nanograph.bench import decode_step_seconds, storeless_decode_batch

    max_model_len = max_model_len or max(400, context + 1)
    llm = LLM(model, device="cuda", max_num_seqs=batch, max_model_len=max_model_len, **llm_kwargs)
    runner = llm.engine.runner
    step_us = decode_step_seconds(runner, context, batch, 200) * 1e6
    decode = storeless_decode_batch(runner, context, batch)

    def one_step():
        runner.queue_step(decode, greedy=True)
        runner.model.synchronize()

    for _ in range(5):
        one_step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
    kernels = [(kernel_name(e.name), e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    label = f"{model} batch {batch}, context {context}, max_model_len {max_model_len}" + "".join(
        f", {k} {v}" for k, v in llm_kwargs.items() if v not in (None, False, "auto"))
    kernels.sort(key=lambda k: k[1])
    step_kernels = split_steps(kernels)
    if len(step_kernels) != steps and len(kernels) % steps == 0:  # steps closer than the gap: every step ran
        per_step = len(kernels) // steps                          # the same kernels, so cut them by count
        step_kernels = [kernels[i:i + per_step] for i in range(0, len(kernels), per_step)]
    names = [[k[0] for k in step] for step in step_kernels]
    if len(step_kernels) != steps or any(n != names[0] for n in names):
        raise RuntimeError(f"{steps} steps were profiled, but their kernels do not split into {steps} equal steps "
                           f"({len(kernels)} kernels): another process's kernels on this GPU?")
    return {"label": label, "num_layers": runner.model_config.num_layers, "step_us": step_us,
            "steps": step_kernels}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--summarize", metavar="JSON", help="print the table of a timeline written by --json")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=131, help="cached tokens of each sequence")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quantization")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", help="write the timeline here")
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            summarize(json.load(f))
        sys.exit(0)
    if not args.model:
        parser.error("give a model (a folder or a hub name), or --summarize JSON")
    timeline = profile(args.model, args.batch, args.context, args.max_model_len, args.steps,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                       enforce_eager=args.enforce_eager)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(timeline, f)
    summarize(timeline)
