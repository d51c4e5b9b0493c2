"""The two blobs through which the core's sampling kernels take one call (ops.sample_packed), so that the call makes
one copy each way: the per-row parameters, packed on the host into one buffer, and the results (token ids and
logprobs) the kernels write into one buffer; every field at an aligned byte offset.

The core declares the blobs (pyext/bind_sampling.cpp, exported by sample_packed_layout()): the fields' alignment,
the counts that size a call, then each field's blob, name, dtype and shape (in counts), in the order of their
offsets in the layout tuple that tells ops.sample_packed where they lie. PackedFormat holds that declaration;
PackedLayout places its fields for one call's counts. What each field holds: SampleRowsArgs and OverrideArgs in
csrc/sampling.h."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np


class DeclaredField(NamedTuple):
    blob: str  # "params" or "results"
    name: str
    dtype: np.dtype
    dims: tuple[str, ...]  # its shape, as names of counts


class PackedFormat:
    """The core's declaration of the blobs. max_top_logprobs: the most top logprobs the kernel gives a row."""

    def __init__(self, declaration: dict, max_top_logprobs: int):
        self.alignment: int = declaration["alignment"]  # of every field's offset, in bytes; the binding checks it
        self.counts: tuple[str, ...] = tuple(declaration["counts"])
        self.fields = [DeclaredField(blob, name, np.dtype(dtype), tuple(dims))
                       for blob, name, dtype, dims in declaration["fields"]]
        self.max_top_logprobs = max_top_logprobs

    @classmethod
    def of(cls, core) -> PackedFormat:
        """The format the core (nanograph._C) declares."""
        return cls(core.sample_packed_layout(), core.MAX_TOP_LOGPROBS)

    def layout(self, **counts: int) -> PackedLayout:
        """The layout of a call of these counts (each of self.counts, by name)."""
        if counts.keys() != set(self.counts):
            raise ValueError(f"a packed layout takes the counts {', '.join(self.counts)}; got {', '.join(counts)}")
        return _layout(self, tuple(counts[name] for name in self.counts))


@functools.lru_cache(maxsize=64)
def _layout(format: PackedFormat, shape: tuple[int, ...]) -> PackedLayout:
    """PackedLayout, made once per format and counts (layouts are not modified)."""
    return PackedLayout(format, dict(zip(format.counts, shape)))


class Field(NamedTuple):
    offset: int  # in bytes, from the blob's start
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def of(self, blob: np.ndarray) -> np.ndarray:
        """The field's view of blob (uint8)."""
        return blob[self.offset:self.offset + self.nbytes].view(self.dtype).reshape(self.shape)


class PackedLayout:
    """Where each field of one call lies in the two blobs (params, results: by name), and the tuple that tells
    ops.sample_packed: the counts, then each field's offset, in the format's order. logprob_columns: 1 + the most
    top logprobs a row asks the kernel for; 0 when it computes none."""

    def __init__(self, format: PackedFormat, counts: dict[str, int]):
        self.counts = counts
        self.params, self.params_nbytes = _placed(format, "params", counts)
        self.results, self.results_nbytes = _placed(format, "results", counts)
        offsets = {name: field.offset for name, field in (*self.params.items(), *self.results.items())}
        self.layout = (*(counts[name] for name in format.counts), *(offsets[field.name] for field in format.fields))

    def pack(self, arrays: dict[str, np.ndarray], blob: np.ndarray):
        """Writes each parameter field, arrays[name] (cast to the field's dtype), into blob (uint8, at least
        params_nbytes long)."""
        for name, field in self.params.items():
            field.of(blob)[...] = arrays[name]


def _placed(format: PackedFormat, blob: str, counts: dict[str, int]) -> tuple[dict[str, Field], int]:
    """The fields of blob one after another, each at the next aligned offset, their shapes from counts; and the bytes
    they span."""
    placed, end = {}, 0
    for field in format.fields:
        if field.blob == blob:
            shape = tuple(counts[dim] for dim in field.dims)
            offset = -(-end // format.alignment) * format.alignment
            placed[field.name] = Field(offset, math.prod(shape) * field.dtype.itemsize, field.dtype, shape)
            end = offset + placed[field.name].nbytes
    return placed, end
