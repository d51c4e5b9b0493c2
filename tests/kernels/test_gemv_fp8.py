"""FP8-weight linear layers (e4m3 with one float32 scale per 8 rows x 128 columns) against a float32
reference of the dequantised weight: the GEMV at every decode shape and M, its SiLU epilogue, the
dequantiser, Gemm.linear_fp8 on both sides of GEMV_FP8_MAX_M, and the arguments they refuse."""
import functools

import pytest
import torch

from nanograph import ops
from nanograph.models.fp8 import PACKED_SCALE_COLS, PACKED_SCALE_ROWS, dequantize_fp8

from .linear_reference import assert_close, make_inputs, poisoned_out, reference

pytestmark = pytest.mark.gpu

# Products are exact and summed in fp32, then rounded once: a tighter norm than the bf16 GEMV's.
REL_NORM = 5e-3

# (N, K): Qwen3-8B qkv, o, gate_up, down; Qwen3-0.6B qkv, o, gate_up, down; SmolLM2-135M qkv
# (576 = 4.5 blocks of K), down; tails: N not a multiple of 8 or 16, K a multiple of 16 but not of
# 64 or 128 (the last 64-column step holding 1, 2 or 3 lanes' columns), the smallest K, and a long
# K split over several waves. At M <= 8 the grids of more than one wave (8B qkv and gate_up, 9001 x
# 2064) take the 3-CTAs-per-SM kernel, the others the 2-CTA one that loads x a step ahead; 8B
# gate_up (here and as the gated 12288 x 4096), several waves even at 3 per SM, takes 2 K splits.
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (4096, 1024), (1024, 2048),
          (6144, 1024), (1024, 3072), (960, 576), (576, 1536), (1001, 208), (3, 16), (20, 4112),
          (9001, 2064), (40, 96), (1000, 176), (24, 1120)]
MS = list(range(1, 17))  # lane (g, c) holds rows m = 2c, 2c + 1 (and + 8): every M ends the rows differently


@functools.lru_cache(maxsize=1)
def fp8_weight(N, K, spread=2.0):
    """Random e4m3 values over their whole range (subnormals included) and block scales spread over
    orders of magnitude (exp(spread * normal)), so that a scale applied to the wrong block shows."""
    g = torch.Generator(device="cuda").manual_seed(N * 7919 + K)
    q = (torch.randn(N, K, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows, cols = -(-N // PACKED_SCALE_ROWS), -(-K // PACKED_SCALE_COLS)
    scale = torch.exp(torch.randn(rows, cols, device="cuda", generator=g) * spread) * (K ** -0.5 / 100)
    return q, scale, dequantize_fp8(q, scale)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", MS)
def test_gemv_fp8_matches_the_dequantised_reference(N, K, M):
    q, scale, w = fp8_weight(N, K)
    for with_bias in (False, True):
        x, b = make_inputs(M, N, K, with_bias)
        out = poisoned_out(M, N)
        ops.gemv_fp8(x, q, scale, b, out)
        assert_close(out, reference(x, w, b), REL_NORM)


def silu_reference(x, w):
    gate, up = (x.float() @ w.float().T).to(torch.bfloat16).float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("inter,K", [(3072, 1024), (12288, 4096), (1536, 576), (8, 16), (1000, 208),
                                     (64, 4096), (24, 96)])
@pytest.mark.parametrize("M", [1, 5, 9, 12, 16])
def test_gemv_silu_mul_fp8_matches_the_reference(inter, K, M):
    """Gate and up rows sit in different scale blocks: each column's pair takes its own two."""
    q, scale, w = fp8_weight(2 * inter, K)
    x, _ = make_inputs(M, 2 * inter, K, False)
    out = poisoned_out(M, inter)
    ops.gemv_silu_mul_fp8(x, q, scale, out)
    assert_close(out, silu_reference(x, w), REL_NORM)


@pytest.mark.parametrize("N,K", [(4096, 1024), (1001, 208), (960, 576), (3, 16)])
def test_dequantize_fp8_is_the_reference_rounded_once(N, K):
    q, scale, w = fp8_weight(N, K)
    out = torch.full((N, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops.dequantize_fp8(q, scale, out)
    assert torch.equal(out, w.to(torch.bfloat16))


@pytest.mark.parametrize("M", [1, 16, 17, 64, 300])
@pytest.mark.parametrize("N,K", [(6144, 1024), (960, 576), (1001, 208)])
def test_gemm_linear_fp8_on_both_sides_of_the_gemv_limit(N, K, M):
    """Up to GEMV_FP8_MAX_M rows Gemm takes the FP8 GEMV (bit-equal to it); above, the dequantised
    weight (rounded to bf16, exactly as test_dequantize checks) through cuBLASLt. Scales of one
    order of magnitude here: cuBLASLt's bf16 GEMM, not the scales, is what this path adds."""
    gemm = ops.Gemm()
    q, scale, w = fp8_weight(N, K, spread=0.5)
    x, b = make_inputs(M, N, K, True, seed=3)
    out = poisoned_out(M, N)
    gemm.linear_fp8(x, q, scale, b, out)
    assert_close(out, reference(x, w if M <= ops.GEMV_FP8_MAX_M else w.to(torch.bfloat16), b), REL_NORM)
    if M <= ops.GEMV_FP8_MAX_M:
        direct = poisoned_out(M, N)
        ops.gemv_fp8(x, q, scale, b, direct)
        assert torch.equal(out, direct)


@pytest.mark.parametrize("M", [1, 16])
def test_gemv_fp8_is_deterministic_and_replays_in_a_graph(M):
    N, K = 4096, 12288
    q, scale, w = fp8_weight(N, K)
    x, b = make_inputs(M, N, K, False, seed=5)
    first = poisoned_out(M, N)
    ops.gemv_fp8(x, q, scale, b, first)
    graph_out = poisoned_out(M, N)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.gemv_fp8(x, q, scale, b, graph_out)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gemv_fp8(x, q, scale, b, graph_out)
    graph_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(first, graph_out)
    x2, _ = make_inputs(M, N, K, False, seed=6)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(graph_out, reference(x2, w, b), REL_NORM)


def test_bad_arguments_name_the_argument_and_the_limit():
    q, scale, _ = fp8_weight(64, 128)
    x = torch.randn(1, 128, device="cuda").to(torch.bfloat16)
    out = poisoned_out(1, 64)
    with pytest.raises(ValueError, match="scale"):
        ops.gemv_fp8(x, q, scale[:, :0], None, out)
    with pytest.raises(TypeError, match="scale must have dtype torch.float32"):
        ops.gemv_fp8(x, q, scale.to(torch.bfloat16), None, out)
    with pytest.raises(TypeError, match="weight must have dtype torch.float8_e4m3fn"):
        ops.gemv_fp8(x, q.to(torch.bfloat16), scale, None, out)
    q24 = torch.zeros(64, 24, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.gemv_fp8(x[:, :24].contiguous(), q24, scale[:, :1].contiguous(), None, out)
    rows = ops.GEMV_FP8_MAX_M + 1  # the bf16 GEMV takes more rows; the FP8 one stops here
    assert ops.GEMV_FP8_MAX_M == 16 < ops.GEMV_MAX_M
    with pytest.raises(ValueError, match=f"M={rows} .*1 <= M <= 16"):
        ops.gemv_fp8(torch.randn(rows, 128, device="cuda").to(torch.bfloat16), q, scale, None,
                     poisoned_out(rows, 64))
    with pytest.raises(ValueError, match="inter must be a multiple of 8"):
        q_odd = torch.zeros(2 * 12, 128, device="cuda").to(torch.float8_e4m3fn)
        ops.gemv_silu_mul_fp8(x, q_odd, torch.ones(3, 1, device="cuda"), poisoned_out(1, 12))


E4M3_FINITE_CODES = [c for c in range(256) if c & 0x7F != 0x7F]  # 0x7F and 0xFF are NaN


@pytest.mark.parametrize("M", [1, 8, 9, 16])
def test_gemv_fp8_reads_every_e4m3_code_exactly(M):
    """Row n of the weight holds, at column k, the (n + k)-th finite e4m3 code (subnormals, zeros of
    both signs, +-448), under unit scales; x row m is one-hot at a column of its own. Each output is
    then one weight value times one plus zeros, which bf16 holds exactly: any code read wrongly, or a weight
    paired with the wrong x column, changes the bits."""
    N, K = len(E4M3_FINITE_CODES), 256
    codes = torch.tensor(E4M3_FINITE_CODES, dtype=torch.int64)
    index = (torch.arange(N)[:, None] + torch.arange(K)[None, :]) % N
    q = codes[index].to(torch.uint8).view(torch.float8_e4m3fn).cuda()
    scale = torch.ones(-(-N // PACKED_SCALE_ROWS), -(-K // PACKED_SCALE_COLS), device="cuda")
    columns = torch.randperm(K, generator=torch.Generator().manual_seed(M))[:M]
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    x[torch.arange(M), columns] = 1
    x = x.cuda()
    out = poisoned_out(M, N)
    ops.gemv_fp8(x, q, scale, None, out)
    expected = q.float()[:, columns.cuda()].T.to(torch.bfloat16)
    assert torch.equal(out.float(), expected.float())  # equal values; the sum may give +0 for -0
