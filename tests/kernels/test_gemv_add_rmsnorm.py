"""The GEMVs that end in the decoder's residual add and RMSNorm (gemv_add_rmsnorm, gemv_fp8_add_rmsnorm and
Gemm.linear_add_rmsnorm): bit-equal to the linear layer followed by add_rmsnorm, against a float32 reference as
well, at every row layout of the norm and grids of one CTA to several waves; the counter left zeroed between
calls and graph replays; the arguments they refuse."""
import functools

import pytest
import torch

from nanograph import ops
from nanograph.models.fp8 import PACKED_SCALE_COLS, PACKED_SCALE_ROWS, dequantize_fp8

from .linear_reference import make_inputs, poisoned_out

pytestmark = pytest.mark.gpu

EPS = 1e-6
# (N, K): Qwen3-0.6B o and down, Qwen3-8B o and down; rows the norm spreads over 1, 2, 3 and 4 vectors per
# thread (1024: 128 threads; 8192: 256 threads x 4), over one warp (512, 8) and 96 threads (576); a one-CTA
# grid (8 x 64) and grids of several waves (4096 x 12288, 6144 x 4096).
SHAPES = [(1024, 2048), (1024, 3072), (4096, 4096), (4096, 12288), (6144, 4096), (8192, 1024),
          (5120, 1024), (576, 1536), (512, 64), (8, 64)]


@functools.lru_cache(maxsize=1)
def bf16_weight(N, K):
    g = torch.Generator(device="cuda").manual_seed(N * 7919 + K)
    return (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)


@functools.lru_cache(maxsize=1)
def fp8_weight(N, K):
    g = torch.Generator(device="cuda").manual_seed(N * 7919 + K + 1)
    q = (torch.randn(N, K, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows, cols = -(-N // PACKED_SCALE_ROWS), -(-K // PACKED_SCALE_COLS)
    scale = torch.exp(torch.randn(rows, cols, device="cuda", generator=g)) * (K ** -0.5 / 100)
    return q, scale, dequantize_fp8(q, scale)


def norm_inputs(M, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 31 + M)
    residual = (torch.randn(M, N, device="cuda", generator=g) * 2).to(torch.bfloat16)
    norm_weight = (torch.rand(N, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    return residual, norm_weight


def zeroed_counter():
    return torch.zeros(1, device="cuda", dtype=torch.int32)


def float_reference(x, w, b, residual, norm_weight):
    """The layer in float32 with the bf16 roundings of the stored tensors: out, then h = out + residual, then
    the norm (rmsnorm in fp32, rounded, times the weight)."""
    out = x.float() @ w.float().T
    if b is not None:
        out = out + b.float()
    h = (out.to(torch.bfloat16).float() + residual.float()).to(torch.bfloat16).float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16).float()
    return normed * norm_weight.float(), h


def check(fused_out, fused_residual, unfused_out, unfused_residual, ref_out, ref_h):
    assert torch.equal(fused_residual, unfused_residual), "residual differs from gemv then add_rmsnorm"
    assert torch.equal(fused_out, unfused_out), "out differs from gemv then add_rmsnorm"
    for got, want in ((fused_out, ref_out), (fused_residual, ref_h)):
        assert torch.isfinite(got).all()
        err = (got.float() - want).norm() / want.norm()
        assert err < 2e-2, f"relative error norm {err:.3e} against the float32 reference"


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 16, 17, 32])
def test_gemv_add_rmsnorm_equals_gemv_then_add_rmsnorm(N, K, M):
    w = bf16_weight(N, K)
    for with_bias in (False, True):
        x, b = make_inputs(M, N, K, with_bias, seed=3)
        residual, norm_weight = norm_inputs(M, N, seed=with_bias)
        ref_out, ref_h = float_reference(x, w, b, residual, norm_weight)

        unfused, unfused_residual = poisoned_out(M, N), residual.clone()
        ops.gemv(x, w, b, unfused)
        ops.add_rmsnorm(unfused, unfused_residual, norm_weight, EPS)

        fused, fused_residual, counter = poisoned_out(M, N), residual.clone(), zeroed_counter()
        ops.gemv_add_rmsnorm(x, w, b, fused, fused_residual, norm_weight, EPS, counter)
        check(fused, fused_residual, unfused, unfused_residual, ref_out, ref_h)
        assert counter.item() == 0, "the counter is left zeroed for the next call"


@pytest.mark.parametrize("N,K", SHAPES[:7] + [(576, 1536), (8, 64)])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16])
def test_gemv_fp8_add_rmsnorm_equals_gemv_fp8_then_add_rmsnorm(N, K, M):
    q, scale, w = fp8_weight(N, K)
    for with_bias in (False, True):
        x, b = make_inputs(M, N, K, with_bias, seed=5)
        residual, norm_weight = norm_inputs(M, N, seed=2 + with_bias)
        ref_out, ref_h = float_reference(x, w, b, residual, norm_weight)

        unfused, unfused_residual = poisoned_out(M, N), residual.clone()
        ops.gemv_fp8(x, q, scale, b, unfused)
        ops.add_rmsnorm(unfused, unfused_residual, norm_weight, EPS)

        fused, fused_residual, counter = poisoned_out(M, N), residual.clone(), zeroed_counter()
        ops.gemv_fp8_add_rmsnorm(x, q, scale, b, fused, fused_residual, norm_weight, EPS, counter)
        check(fused, fused_residual, unfused, unfused_residual, ref_out, ref_h)
        assert counter.item() == 0


def test_back_to_back_calls_share_one_counter():
    """Calls queued on one stream with one counter, each on the previous one's output: every call's last CTA
    finds the counter as the previous call left it."""
    N, K, M = 1024, 1024, 4
    w = bf16_weight(N, K)
    x0, _ = make_inputs(M, N, K, False, seed=7)
    residual0, norm_weight = norm_inputs(M, N, seed=7)
    expected_x, expected_residual = x0.clone(), residual0.clone()
    for _ in range(6):
        out = poisoned_out(M, N)
        ops.gemv(expected_x, w, None, out)
        ops.add_rmsnorm(out, expected_residual, norm_weight, EPS)
        expected_x = out
    x, residual, counter = x0.clone(), residual0.clone(), zeroed_counter()
    for _ in range(6):
        out = poisoned_out(M, N)
        ops.gemv_add_rmsnorm(x, w, None, out, residual, norm_weight, EPS, counter)
        x = out
    assert torch.equal(x, expected_x) and torch.equal(residual, expected_residual)
    assert counter.item() == 0


@pytest.mark.parametrize("fp8", [False, True])
def test_graph_replays_with_new_inputs(fp8):
    N, K, M = 4096, 4096, 1
    q, scale, w_fp8 = fp8_weight(N, K)
    w = w_fp8 if fp8 else bf16_weight(N, K)
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    out = poisoned_out(M, N)
    residual = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    _, norm_weight = norm_inputs(M, N, seed=9)
    counter = zeroed_counter()

    def layer():
        if fp8:
            ops.gemv_fp8_add_rmsnorm(x, q, scale, None, out, residual, norm_weight, EPS, counter)
        else:
            ops.gemv_add_rmsnorm(x, w, None, out, residual, norm_weight, EPS, counter)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer()  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer()
    torch.cuda.synchronize()
    for seed in range(3):
        new_x, _ = make_inputs(M, N, K, False, seed=20 + seed)
        new_residual, _ = norm_inputs(M, N, seed=20 + seed)
        x.copy_(new_x)
        residual.copy_(new_residual)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected, expected_residual = poisoned_out(M, N), new_residual.clone()
        if fp8:
            ops.gemv_fp8(new_x, q, scale, None, expected)
        else:
            ops.gemv(new_x, w, None, expected)
        ops.add_rmsnorm(expected, expected_residual, norm_weight, EPS)
        assert torch.equal(out, expected) and torch.equal(residual, expected_residual)
        assert counter.item() == 0


@pytest.mark.parametrize("M", [1, 8, 64])
def test_gemm_linear_add_rmsnorm_on_both_routes(M):
    """Up to 8 rows take the fused GEMV; 64 rows cuBLASLt and add_rmsnorm's own kernel: both as the two ops."""
    N, K = 1024, 2048
    gemm = ops.Gemm()
    w = bf16_weight(N, K)
    x, b = make_inputs(M, N, K, True, seed=11)
    residual, norm_weight = norm_inputs(M, N, seed=11)
    expected, expected_residual = poisoned_out(M, N), residual.clone()
    gemm.linear(x, w, b, expected)
    ops.add_rmsnorm(expected, expected_residual, norm_weight, EPS)
    for _ in range(2):  # the second call finds the Gemm's counter zeroed again
        out, got_residual = poisoned_out(M, N), residual.clone()
        gemm.linear_add_rmsnorm(x, w, b, out, got_residual, norm_weight, EPS)
        assert torch.equal(out, expected) and torch.equal(got_residual, expected_residual)


def test_bad_arguments_are_rejected():
    K, M = 64, 2
    x, _ = make_inputs(M, 8, K, False)
    counter = zeroed_counter()
    for N in (1001, 8200):  # not a multiple of 8; wider than the norm's rows
        w = torch.randn(N, K, device="cuda").to(torch.bfloat16)
        residual, norm_weight = norm_inputs(M, N, seed=0)
        with pytest.raises(ValueError, match=f"N={N}.*multiple of 8.*8192"):
            ops.gemv_add_rmsnorm(x, w, None, poisoned_out(M, N), residual, norm_weight, EPS, counter)
    N = 64
    w = bf16_weight(N, K)
    residual, norm_weight = norm_inputs(M, N, seed=0)
    with pytest.raises(TypeError, match="arrivals"):
        ops.gemv_add_rmsnorm(x, w, None, poisoned_out(M, N), residual, norm_weight, EPS, None)
    with pytest.raises(ValueError, match="residual"):
        ops.gemv_add_rmsnorm(x, w, None, poisoned_out(M, N), residual[:1], norm_weight, EPS, counter)
    with pytest.raises(ValueError, match="norm_weight"):
        ops.gemv_add_rmsnorm(x, w, None, poisoned_out(M, N), residual, norm_weight[:8], EPS, counter)
    with pytest.raises((TypeError, ValueError), match="arrivals"):
        ops.gemv_add_rmsnorm(x, w, None, poisoned_out(M, N), residual, norm_weight, EPS, counter.float())
    assert counter.item() == 0
