"""Small-M GEMV against a float32 torch reference: every M up to GEMV_MAX_M on decode shapes, bias,
K/N tails, determinism, graph replay, the Gemm.linear route and the sizes it rejects."""
import functools

import pytest
import torch

from nanograph import ops

from .linear_reference import assert_close, make_inputs, poisoned_out, reference

pytestmark = pytest.mark.gpu

MAX_M = 32  # kGemvMaxM; test_max_m_matches_core keeps the two in step
# Above 16 rows a second MMA tile takes x rows 16..31 against the same weight fragments.

# (N, K): Qwen3-0.6B qkv, o, gate_up, down, lm_head; Qwen3-8B gate_up-sized, o, gate_up, down;
# a small model's MLP; one 8-row group.
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (6144, 4096),
          (4096, 4096), (24576, 4096), (4096, 12288), (4608, 576), (576, 1536), (8, 64)]
# Tails: N not a multiple of 8, K not a multiple of 32 (partial warp steps), the smallest K; both
# tails in a matrix large enough to stream through several waves with split K (4 splits); one row
# group whose 16 splits of 79 steps each (the last 65), a one-wave grid, request their batches by
# halves up to 8 rows of x (gemv_reloads_by_halves), ending inside a half.
EDGE_SHAPES = [(1001, 200), (3, 8), (20, 4104), (9001, 2056), (8, 40000)]
# Shape-major, so that the weight cache below holds one matrix at a time.
CASES = [(N, K, M, with_bias) for N, K in SHAPES + EDGE_SHAPES for M in range(1, MAX_M + 1)
         for with_bias in (False, True)]


@functools.lru_cache(maxsize=1)
def weight(N, K):
    """One bf16 weight per shape (the lm_head one is 311 MB), shared by that shape's cases."""
    g = torch.Generator(device="cuda").manual_seed(N * 7919 + K)
    return (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)


def misaligned_out(M, N):
    """A NaN-filled [M, N] view 2 bytes into its buffer: cuBLASLt's path rejects it, the GEMV not."""
    return torch.full((M * N + 1,), float("nan"), device="cuda", dtype=torch.bfloat16)[1:].view(M, N)


@pytest.mark.parametrize("N,K,M,with_bias", CASES)
def test_gemv_matches_torch(N, K, M, with_bias):
    w = weight(N, K)
    x, b = make_inputs(M, N, K, with_bias)
    out = poisoned_out(M, N)
    ops.gemv(x, w, b, out)
    assert_close(out, reference(x, w, b))


def test_max_m_matches_core():
    assert ops.GEMV_MAX_M == MAX_M


@pytest.mark.parametrize("M", [1, 8, 16, 17, MAX_M])
@pytest.mark.parametrize("N,K", [(1024, 2048), (4096, 1024), (1001, 200)])
def test_deterministic(N, K, M):
    """Split-K partials are summed in a fixed order: two runs are bit-equal."""
    w = weight(N, K)
    x, b = make_inputs(M, N, K, True)
    first, second = poisoned_out(M, N), poisoned_out(M, N)
    ops.gemv(x, w, b, first)
    ops.gemv(x, w, b, second)
    assert torch.equal(first, second)


def test_offset_views():
    """x and weight need 16-byte alignment, not 256; bias and out only their 2-byte elements."""
    M, N, K = 5, 1024, 2048
    w = weight(N, K)
    x, b = make_inputs(M, N, K, True)
    xs = torch.empty(M * K + 8, device="cuda", dtype=torch.bfloat16)[8:].view(M, K).copy_(x)
    ws = torch.empty(N * K + 8, device="cuda", dtype=torch.bfloat16)[8:].view(N, K).copy_(w)
    bs = torch.empty(N + 1, device="cuda", dtype=torch.bfloat16)[1:].copy_(b)
    outs = misaligned_out(M, N)
    ops.gemv(xs, ws, bs, outs)
    assert_close(outs, reference(x, w, b))


# Gemm.linear's choice between the GEMV and cuBLASLt (gemv_preferred), on the decode shapes it was measured on
# (Qwen3-0.6B and Qwen3-8B on an H200): 0.6B's projections keep the GEMV up to 16 rows, its o and down up to 32;
# 8B's projections and both lm_heads leave it above 8 rows, where cuBLASLt streams them faster.
ROUTES = [((4096, 1024), 16), ((1024, 2048), 32), ((6144, 1024), 16), ((1024, 3072), 32), ((151936, 1024), 8),
          ((6144, 4096), 8), ((4096, 4096), 8), ((24576, 4096), 8), ((4096, 12288), 8), ((151936, 4096), 8)]


@pytest.mark.parametrize("shape,last_gemv_m", ROUTES)
def test_gemv_preferred_follows_the_weight_size(shape, last_gemv_m):
    N, K = shape
    assert [M for M in range(1, 2 * MAX_M) if ops.gemv_preferred(M, N, K)] == list(range(1, last_gemv_m + 1))
    assert not ops.gemv_preferred(4, N, K + 4)  # a K the GEMV does not take


@pytest.mark.parametrize("M", [1, 8, 9, 16, 17, 24, MAX_M, MAX_M + 1])
@pytest.mark.parametrize("N,K", [(4096, 1024), (1024, 3072), (6144, 4096)])
def test_gemm_linear_takes_the_gemv_where_preferred(N, K, M):
    """Where gemv_preferred, Gemm.linear is gemv bit for bit (and takes a 2-byte aligned out, which cuBLASLt's path
    refuses); elsewhere it is cuBLASLt's, within the reference's tolerance."""
    w = weight(N, K)
    x, b = make_inputs(M, N, K, True)
    gemm = ops.Gemm()
    if ops.gemv_preferred(M, N, K):
        via_linear, via_gemv = misaligned_out(M, N), poisoned_out(M, N)
        gemm.linear(x, w, b, via_linear)
        ops.gemv(x, w, b, via_gemv)
        assert torch.equal(via_linear, via_gemv)
    else:
        with pytest.raises(ValueError, match="out must be 16-byte aligned"):
            gemm.linear(x, w, b, misaligned_out(M, N))
        out = poisoned_out(M, N)
        gemm.linear(x, w, b, out)
        assert_close(out, reference(x, w, b))


def test_gemm_linear_uses_cublas_above_max_m():
    M, N, K = MAX_M + 1, 4096, 1024
    x, b = make_inputs(M, N, K, True)
    with pytest.raises(ValueError, match="out must be 16-byte aligned"):
        ops.Gemm().linear(x, weight(N, K), b, misaligned_out(M, N))


@pytest.mark.parametrize("M", [1, 12, 29])
def test_graph_replay_with_new_inputs(M):
    N, K = 1024, 3072
    w = weight(N, K).clone()
    x, b = make_inputs(M, N, K, True)
    out = poisoned_out(M, N)
    ops.gemv(x, w, b, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gemv(x, w, b, out)

    for seed in (11, 12):
        x_new, b_new = make_inputs(M, N, K, True, seed=seed)
        w_new = torch.randn(N, K, device="cuda").mul(K**-0.5).to(torch.bfloat16)
        x.copy_(x_new)
        w.copy_(w_new)
        b.copy_(b_new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(x_new, w_new, b_new))


@pytest.mark.parametrize("M", [0, MAX_M + 1, 64])
def test_unsupported_row_counts_are_rejected(M):
    N, K = 1024, 1024
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match=rf"M={M}.*1 <= M <= {MAX_M}"):
        ops.gemv(x, w, None, poisoned_out(M, N))


@pytest.mark.parametrize("K", [4, 12, 1030])
def test_k_not_multiple_of_8_is_rejected(K):
    x = torch.randn(2, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(64, K, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match=rf"K={K}.*multiple of 8"):
        ops.gemv(x, w, None, poisoned_out(2, 64))


@pytest.mark.parametrize("misaligned", ["x", "weight"])
def test_misaligned_input_is_rejected(misaligned):
    M, N, K = 4, 1024, 1024
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda").to(torch.bfloat16)
    shifted = torch.empty(M * K + 1 if misaligned == "x" else N * K + 1, device="cuda",
                          dtype=torch.bfloat16)[1:]
    if misaligned == "x":
        x = shifted.view(M, K).copy_(x)
    else:
        w = shifted.view(N, K).copy_(w)
    with pytest.raises(ValueError, match=f"{misaligned} must be 16-byte aligned"):
        ops.gemv(x, w, None, poisoned_out(M, N))


def test_bad_arguments_are_rejected():
    M, N, K = 4, 1024, 2048
    w = weight(N, K)
    x, b = make_inputs(M, N, K, True)
    with pytest.raises(ValueError, match="weight"):
        ops.gemv(x, w[:, :1024].contiguous(), b, poisoned_out(M, N))
    with pytest.raises(ValueError, match="bias"):
        ops.gemv(x, w, b[:512].contiguous(), poisoned_out(M, N))
    with pytest.raises(ValueError, match="out"):
        ops.gemv(x, w, b, poisoned_out(M, 1000))
    with pytest.raises(ValueError, match="contiguous"):
        ops.gemv(x, w.T.contiguous().T, b, poisoned_out(M, N))
    with pytest.raises(TypeError, match="x"):
        ops.gemv(x.float(), w, b, poisoned_out(M, N))
    with pytest.raises(TypeError, match="weight"):
        ops.gemv(x, w.half(), b, poisoned_out(M, N))


# ---- gemv_silu_mul: the gated MLP's gate_up projection and SiLU * up in one kernel ---------------
# (inter, K): Qwen3-0.6B and -8B, SmolLM2-135M, 16 splits in 16-warp CTAs, an inter not a
# multiple of 4 with a K tail.
SILU_SHAPES = [(3072, 1024), (12288, 4096), (1536, 576), (64, 1024), (1001, 200)]


def silu_reference(x, w):
    """fp32 silu(gate) * up over gate and up rounded to bf16, as the unfused gemv stores them."""
    gate, up = (x.float() @ w.float().T).to(torch.bfloat16).float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("M", [1, 2, 8, 9, 16, 17, 24, 25, MAX_M])
@pytest.mark.parametrize("inter,K", SILU_SHAPES)
def test_gemv_silu_mul_matches_reference(inter, K, M):
    w = weight(2 * inter, K)
    x, _ = make_inputs(M, 2 * inter, K, False)
    out = poisoned_out(M, inter)
    ops.gemv_silu_mul(x, w, out)
    assert_close(out, silu_reference(x, w))


@pytest.mark.parametrize("M", [1, 16, 23, MAX_M])
@pytest.mark.parametrize("inter,K", [(i, k) for i, k in SILU_SHAPES if i % 8 == 0])  # silu_mul's limit
def test_gemv_silu_mul_equals_gemv_then_silu_mul(inter, K, M):
    """The same splits and summation order as gemv over 2 * inter rows, the same rounding of gate and up,
    then silu_mul's formula: bit-equal to the two kernels it replaces."""
    w = weight(2 * inter, K)
    x, _ = make_inputs(M, 2 * inter, K, False, seed=3)
    gate_up = poisoned_out(M, 2 * inter)
    unfused, fused = poisoned_out(M, inter), poisoned_out(M, inter)
    ops.gemv(x, w, None, gate_up)
    ops.silu_mul(gate_up, unfused)
    ops.gemv_silu_mul(x, w, fused)
    assert torch.equal(fused, unfused)


def test_gemv_silu_mul_rejects_bad_shapes():
    inter, K = 64, 128
    x, _ = make_inputs(2, 2 * inter, K, False)
    w = torch.randn(2 * inter, K, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="2 \\* inter rows"):
        ops.gemv_silu_mul(x, w[:-1], poisoned_out(2, inter))
    with pytest.raises(ValueError, match="out"):
        ops.gemv_silu_mul(x, w, poisoned_out(2, 2 * inter))
    with pytest.raises(ValueError, match=f"M <= {MAX_M}"):
        big = torch.randn(MAX_M + 1, K, device="cuda").to(torch.bfloat16)
        ops.gemv_silu_mul(big, w, poisoned_out(MAX_M + 1, inter))


# ---- gemv_argmax: lm_head with the greedy choice in its epilogue ------------------------------

def run_gemv_argmax(x, w, b=None, host_out=None, keys=None):
    M, N = x.shape[0], w.shape[0]
    keys = torch.zeros(MAX_M, dtype=torch.int64, device="cuda") if keys is None else keys
    logits = poisoned_out(M, N)
    tokens = torch.full((M,), -7, dtype=torch.int32, device="cuda")
    ops.gemv_argmax(x, w, b, logits, tokens, keys, host_out)
    return logits, tokens, keys


# lm_head (streaming, 2 splits), ragged tails (streaming with 4 splits; one wave), 16-warp CTAs
# (16 splits), a single row group.
ARGMAX_SHAPES = [(151936, 1024), (9001, 2056), (1001, 200), (256, 8192), (3, 8)]


@pytest.mark.parametrize("M", [1, 2, 9, 16, 17, 26, MAX_M])
@pytest.mark.parametrize("N,K", ARGMAX_SHAPES)
def test_gemv_argmax_matches_gemv_and_torch_argmax(N, K, M):
    """The logits are gemv's bits, and each row's token is torch.argmax over them as stored; the keys
    are left zeroed for the next call."""
    w = weight(N, K)
    x, b = make_inputs(M, N, K, with_bias=N < 100_000, seed=5)
    want = poisoned_out(M, N)
    ops.gemv(x, w, b, want)
    logits, tokens, keys = run_gemv_argmax(x, w, b)
    assert torch.equal(logits, want)
    assert torch.equal(tokens.long(), torch.argmax(want, dim=-1))
    assert not keys.any()


def test_gemv_argmax_ties_go_to_the_lowest_index_and_nan_wins():
    """Equal maxima in different CTAs give the lower index, as torch.argmax does; a NaN logit beats
    every number, and of two NaNs the lower index wins."""
    N, K = 151936, 1024
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(2, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    strong = (x[0].float() / x[0].float().norm() * 8).to(torch.bfloat16)  # far above any random row
    for row in (140_000, 77_777, 90_001):
        w[row] = strong
    w[120_000, 5] = float("nan")
    w[150_000, 9] = float("nan")
    logits, tokens, _ = run_gemv_argmax(x, w)
    assert logits[0, 77_777].item() == logits[0, 140_000].item()
    # Both rows have NaN logits at 120,000 and 150,000.
    assert tokens.tolist() == [120_000, 120_000] == torch.argmax(logits, dim=-1).tolist()
    w[120_000, 5] = w[150_000, 9] = 0.5
    logits, tokens, _ = run_gemv_argmax(x, w)
    assert tokens[0].item() == 77_777 == torch.argmax(logits[0]).item()
    assert tokens[1].item() == torch.argmax(logits[1]).item()


def test_gemv_argmax_negative_infinite_and_in_warp_ties():
    """Through the bias: all-negative rows, all -inf rows (torch answers 0), two +inf columns (the lower
    wins); and equal maxima in one row group (one warp) and in one CTA."""
    N, K, M = 9001, 2056, 3
    x, _ = make_inputs(M, N, K, False, seed=9)
    w = weight(N, K).clone()
    strong = (x[0].float() / x[0].float().norm() * 8).to(torch.bfloat16)
    for row in (4003, 4001, 4009):  # 4001 and 4003 share a row group; 4009 is the next group
        w[row] = strong
    for bias_fill, special, want0 in ((-64.0, {}, 4001), (float("-inf"), {}, 0),
                                      (float("-inf"), {7000: float("inf"), 20: float("inf")}, 20)):
        b = torch.full((N,), bias_fill, device="cuda", dtype=torch.bfloat16)
        for col, value in special.items():
            b[col] = value
        logits, tokens, keys = run_gemv_argmax(x, w, b)
        assert tokens[0].item() == want0
        assert torch.equal(tokens.long(), torch.argmax(logits, dim=-1))
        assert not keys.any()
        if bias_fill == -64.0:
            assert (logits[0, [4003, 4009]] == logits[0, 4001]).all()  # the ties are real
            assert (logits[1:] < 0).all()  # rows 1 and 2: negative maxima


def test_gemv_argmax_writes_host_out():
    w = weight(151936, 1024)
    x, _ = make_inputs(4, 151936, 1024, False, seed=8)
    host = torch.full((4,), -1, dtype=torch.int32, pin_memory=True)
    logits, tokens, _ = run_gemv_argmax(x, w, host_out=host)
    torch.cuda.synchronize()
    assert torch.equal(host, tokens.cpu())
    assert torch.equal(host.long(), torch.argmax(logits, dim=-1).cpu())


def test_gemv_argmax_replays_in_a_graph():
    """Captured once, replayed on new inputs: the keys are cleared inside the graph every time."""
    N, K, M = 9001, 2056, 3
    w = weight(N, K)
    x = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    logits = poisoned_out(M, N)
    tokens = torch.empty(M, dtype=torch.int32, device="cuda")
    keys = torch.zeros(MAX_M, dtype=torch.int64, device="cuda")
    x.copy_(make_inputs(M, N, K, False, seed=0)[0])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.gemv_argmax(x, w, None, logits, tokens, keys)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ops.gemv_argmax(x, w, None, logits, tokens, keys)
    for seed in (1, 2, 3):
        x.copy_(make_inputs(M, N, K, False, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        want = poisoned_out(M, N)
        ops.gemv(x, w, None, want)
        assert torch.equal(tokens.long(), torch.argmax(want, dim=-1))
    assert not keys.any()


def test_gemv_argmax_rejects_bad_arguments():
    N, K = 1001, 200
    w = weight(N, K)
    x, _ = make_inputs(2, N, K, False)
    logits, tokens = poisoned_out(2, N), torch.empty(2, dtype=torch.int32, device="cuda")
    keys = torch.zeros(MAX_M, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="keys"):
        ops.gemv_argmax(x, w, None, logits, tokens, keys[:4])
    with pytest.raises(TypeError, match="keys"):
        ops.gemv_argmax(x, w, None, logits, tokens, keys.int())
    with pytest.raises(ValueError, match="tokens"):
        ops.gemv_argmax(x, w, None, logits, tokens[:1], keys)
    with pytest.raises(ValueError, match="host_out"):
        ops.gemv_argmax(x, w, None, logits, tokens, keys, torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=f"M <= {MAX_M}"):
        big = torch.randn(MAX_M + 1, K, device="cuda").to(torch.bfloat16)
        ops.gemv_argmax(big, w, None, poisoned_out(MAX_M + 1, N),
                        torch.empty(MAX_M + 1, dtype=torch.int32, device="cuda"), keys)
