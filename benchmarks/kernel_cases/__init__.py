"""Kernel benchmark cases; each module defines cases() for benchmarks/bench_kernels.py."""
