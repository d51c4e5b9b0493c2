"""Shared by the linear-layer kernel tests: inputs, the float32 reference, a NaN-poisoned output and the check of
an output against the reference."""
import torch


def reference(x, w, b):
    ref = x.float() @ w.float().T
    return ref + b.float() if b is not None else ref


def poisoned_out(M, N):
    return torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)


def make_inputs(M, N, K, with_bias, seed=0):
    """x [M, K] and a bias [N] (or None), bf16, fresh for each M and seed."""
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + M)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16) if with_bias else None
    return x, b


def assert_close(out, ref, rel_norm=1e-2):
    """Every element written and finite, the relative error norm below rel_norm, and each element within 1% of its
    reference plus 1% of the reference's RMS (so that a few wrong columns cannot hide in the norm)."""
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or overflowed elements)"
    err = out.float() - ref
    rel = (err.norm() / ref.norm()).item()
    assert rel < rel_norm, f"relative error norm {rel:.3e}"
    bound = 1e-2 * ref.abs() + 1e-2 * ref.pow(2).mean().sqrt()
    bad = (err.abs() > bound).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} elements off, first at (m, n) = {bad[0].tolist()}"
