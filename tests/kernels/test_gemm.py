"""Gemm (cuBLASLt linear) against a float32 torch reference: shapes, bias, plan cache, CUDA graphs."""
import pytest
import torch

from nanograph import ops

from .linear_reference import poisoned_out, reference

pytestmark = pytest.mark.gpu

# (N, K) of Qwen3-0.6B's projections (qkv, o, gate_up, down) and a small-model MLP shape.
WEIGHT_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4608, 576)]
LM_HEAD = (151936, 1024)
TOKEN_COUNTS = [1, 2, 7, 16, 64, 257, 2048]
SMALL_TOKEN_COUNTS = [1, 2, 7, 16]


@pytest.fixture(scope="module")
def gemm():
    """One Gemm for the whole module, so that many shapes go through one plan cache."""
    return ops.Gemm()


def make_inputs(M, N, K, with_bias, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    b = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16) if with_bias else None
    return x, w, b


def assert_close(out, ref):
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or overflowed elements)"
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"relative error norm {rel:.3e}"


def check_linear(gemm, M, N, K, with_bias, seed=0):
    x, w, b = make_inputs(M, N, K, with_bias, seed)
    out = poisoned_out(M, N)
    gemm.linear(x, w, b, out)
    assert_close(out, reference(x, w, b))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("N,K", WEIGHT_SHAPES)
@pytest.mark.parametrize("M", TOKEN_COUNTS)
def test_linear_matches_torch(gemm, M, N, K, with_bias):
    check_linear(gemm, M, N, K, with_bias)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("M", SMALL_TOKEN_COUNTS)
def test_lm_head(gemm, M, with_bias):
    check_linear(gemm, M, *LM_HEAD, with_bias)


def test_plan_cache_reuse_across_shapes_and_bias():
    gemm = ops.Gemm()
    shapes = [(3, 4096, 1024), (64, 1024, 2048), (3, 4096, 1024), (64, 1024, 2048)]
    for i, (M, N, K) in enumerate(shapes):
        for with_bias in (False, True, False):
            check_linear(gemm, M, N, K, with_bias, seed=i)


def test_cached_bias_plan_uses_each_calls_bias():
    gemm = ops.Gemm()
    assert not ops.gemv_preferred(64, 1024, 2048)  # cuBLASLt's cached plan, not the GEMV
    x, w, b1 = make_inputs(64, 1024, 2048, True, seed=1)
    b2 = torch.randn_like(b1, dtype=torch.float32).to(torch.bfloat16)
    out = poisoned_out(64, 1024)
    gemm.linear(x, w, b1, out)
    assert_close(out, reference(x, w, b1))
    out.fill_(float("nan"))
    gemm.linear(x, w, b2, out)
    assert_close(out, reference(x, w, b2))


def test_offset_views_with_16_byte_alignment():
    gemm = ops.Gemm()
    M, N, K = 7, 1024, 2048
    x, w, b = make_inputs(M, N, K, True)
    # Start 8 elements (16 bytes) into larger buffers: aligned for the plan, not to 256 bytes.
    xs = torch.empty(M * K + 8, device="cuda", dtype=torch.bfloat16)[8:].view(M, K).copy_(x)
    ws = torch.empty(N * K + 8, device="cuda", dtype=torch.bfloat16)[8:].view(N, K).copy_(w)
    bs = torch.empty(N + 8, device="cuda", dtype=torch.bfloat16)[8:].copy_(b)
    outs = torch.full((M * N + 8,), float("nan"), device="cuda", dtype=torch.bfloat16)[8:].view(M, N)
    gemm.linear(xs, ws, bs, outs)
    assert_close(outs, reference(x, w, b))


def test_misaligned_input_is_rejected():
    gemm = ops.Gemm()
    M, N, K = 64, 1024, 1024
    assert not ops.gemv_preferred(M, N, K)  # cuBLASLt's check, not the GEMV's
    x = torch.randn(M * K + 1, device="cuda").to(torch.bfloat16)[1:].view(M, K)
    w = torch.randn(N, K, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="aligned"):
        gemm.linear(x, w, None, poisoned_out(M, N))


def test_bad_arguments_are_rejected():
    gemm = ops.Gemm()
    x, w, b = make_inputs(4, 1024, 2048, True)
    with pytest.raises(ValueError, match="weight"):
        gemm.linear(x, w[:, :1024].contiguous(), b, poisoned_out(4, 1024))
    with pytest.raises(ValueError, match="bias"):
        gemm.linear(x, w, b[:512].contiguous(), poisoned_out(4, 1024))
    with pytest.raises(ValueError, match="out"):
        gemm.linear(x, w, b, poisoned_out(4, 1000))
    with pytest.raises(TypeError, match="x"):
        gemm.linear(x.float(), w, b, poisoned_out(4, 1024))


def capture(fn):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.parametrize("with_bias", [False, True])
def test_graph_replay_with_new_inputs(with_bias):
    gemm = ops.Gemm()
    M, N, K = 64, 6144, 1024
    x, w, b = make_inputs(M, N, K, with_bias)
    out = poisoned_out(M, N)
    gemm.linear(x, w, b, out)  # warm the shape: builds the plan outside the capture
    torch.cuda.synchronize()
    graph = capture(lambda: gemm.linear(x, w, b, out))

    for seed in (11, 12):
        x_new, w_new, b_new = make_inputs(M, N, K, with_bias, seed=seed)
        x.copy_(x_new)
        w.copy_(w_new)
        if with_bias:
            b.copy_(b_new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(x_new, w_new, b_new))


def test_plan_built_during_capture():
    """A shape first seen inside a capture still works: plan creation does no device allocation."""
    M, N, K = 64, 4608, 576
    assert not ops.gemv_preferred(M, N, K)  # a cuBLASLt plan, not the GEMV
    x, w, b = make_inputs(M, N, K, True)
    out = poisoned_out(M, N)
    ops.Gemm().linear(x, w, b, out)  # load cuBLASLt's kernels for this shape on another object
    torch.cuda.synchronize()

    gemm = ops.Gemm()
    graph = capture(lambda: gemm.linear(x, w, b, out))
    x_new, w_new, b_new = make_inputs(M, N, K, True, seed=21)
    x.copy_(x_new)
    w.copy_(w_new)
    b.copy_(b_new)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(x_new, w_new, b_new))
