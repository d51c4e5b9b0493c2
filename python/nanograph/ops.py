"""Thin Python entry points to the core's kernels, for tests, benchmarks and eager use.

Looking up a kernel (`ops.rmsnorm`) checks that the core and a GPU are present and returns the binding,
which validates shapes, dtypes and devices and runs on torch's current stream.
"""
from ._core import require_core


def __getattr__(name):
    core = require_core()
    try:
        return getattr(core, name)
    except AttributeError:
        raise AttributeError(f"nanograph.ops has no kernel named {name!r}") from None
