"""Kernel benchmark: for each case in benchmarks/kernel_cases/*.py, time, achieved GB/s or TFLOP/s, and
that figure as a % of the device's copy bandwidth or bf16 matmul rate, both measured in this run.

    python benchmarks/bench_kernels.py [module ...] [-k TEXT ...]
        modules: basic rope gemm gemm_fp8 gemv gemv_fp8 decode_attention prefill_attention (default: all)
        -k TEXT: time only the cases whose label contains TEXT (any of several -k; case-sensitive)
"""
import argparse
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODULES = ["basic", "rope", "gemm", "gemm_fp8", "gemv", "gemv_fp8", "decode_attention", "prefill_attention"]


def time_ms(fn, launches=20, repeats=15, graph=True):
    """Median time of one launch. The launches are captured into a CUDA graph and replayed, so
    Python and launch overhead stay out of the figure (as inside the engine's decode graphs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(launches):
                fn()
        run = g.replay
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph:
            run()
        else:
            for _ in range(launches):
                run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / launches)
    return statistics.median(samples)


def copy_bandwidth_gbs():
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), launches=5, repeats=7, graph=False)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def matmul_tflops():
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, launches=5, repeats=7, graph=False)
    return 2 * 8192**3 / ms / 1e9


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Times the kernel cases of benchmarks/kernel_cases/*.py.")
    parser.add_argument("modules", nargs="*", metavar="module",
                        help=f"case modules to run (default: all of {' '.join(MODULES)})")
    parser.add_argument("-k", dest="filters", action="append", default=[], metavar="TEXT",
                        help="time only the cases whose label contains TEXT (repeatable: any of them)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.modules if name not in MODULES]
    if unknown:
        parser.error(f"unknown module {', '.join(unknown)}; the modules are {' '.join(MODULES)}")
    return args.modules or MODULES, args.filters


def selected(label, filters):
    """Whether a case runs: every case without filters, else one whose label contains any of them."""
    return not filters or any(text in label for text in filters)


def main(names, filters=()):
    bw, mm = copy_bandwidth_gbs(), matmul_tflops()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s  "
          f"bf16 matmul {mm:.0f} TFLOP/s (measured now)")
    print(f"{'kernel':58s} {'time':>10s} {'achieved':>16s} {'% of ceiling':>13s}")
    for name in names:
        module = importlib.import_module(f"benchmarks.kernel_cases.{name}")
        for label, fn, bytes_moved, flops in module.cases():
            if not selected(label, filters):
                continue
            ms = time_ms(fn)
            if flops:
                rate = flops / ms / 1e9
                achieved, pct = f"{rate:8.1f} TFLOP/s", 100 * rate / mm
            else:
                rate = bytes_moved / ms / 1e6
                achieved, pct = f"{rate:8.0f} GB/s", 100 * rate / bw
            print(f"{label:58s} {ms * 1e3:8.1f}us {achieved:>16s} {pct:12.1f}%", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*parse_args(sys.argv[1:]))
