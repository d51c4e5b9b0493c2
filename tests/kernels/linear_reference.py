"""Shared by the linear-layer kernel tests: the float32 reference and a NaN-poisoned output."""
import torch


def reference(x, w, b):
    ref = x.float() @ w.float().T
    return ref + b.float() if b is not None else ref


def poisoned_out(M, N):
    return torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
