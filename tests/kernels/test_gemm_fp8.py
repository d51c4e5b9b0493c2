"""The block-scaled FP8 GEMM (GPU): the activation quantization bit for bit against its torch reference, and
Gemm.linear_fp8 with 128 x 128 block scales against a float32 reference of the dequantised weight times the
quantised-then-dequantised activations, on both sides of cuBLASLt's support (the dequantising path where it has no
algorithm or the scales do not come in whole blocks), with bias, in a CUDA graph, and with scale layouts scrambled
on purpose to show that the comparison sees them.

Scales differ by orders of magnitude from block to block in both operands, so that a scale read from the wrong
block, or a transposed scale tensor, moves the result far outside the tolerance."""
import pytest
import torch

from nanograph import ops
from nanograph.models.fp8 import (dequantize_activations, dequantize_fp8, expand_block_scales, gemm_block_scales,
                                  quantize_activations)

from .linear_reference import assert_close, poisoned_out, reference

pytestmark = pytest.mark.gpu

REL_NORM = 5e-3  # e4m3 products are exact and summed in fp32; the output is rounded once to bf16
# Quantizing the activations to e4m3 moves a result by a few percent of its norm, several times REL_NORM: a check
# against the unquantized reference must not pass within QUANTIZATION_REL (the test asserts the gap).
QUANTIZATION_REL = 2 * REL_NORM


def hopper():
    return torch.cuda.get_device_capability() == (9, 0)


def fp8_weight(N, K, seed=0):
    """(e4m3 [N, K] over e4m3's whole range, packed scales [ceil(N / 8), ceil(K / 128)] repeating one scale per
    128 x 128 block, those block scales for the GEMM, the dequantised weight in float32)."""
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + N + K)
    q = (torch.randn(N, K, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    hf = torch.exp(torch.randn(-(-N // 128), -(-K // 128), device="cuda", generator=g) * 2) * (K ** -0.5 / 100)
    packed = expand_block_scales(hf, (N, K))
    return q, packed, gemm_block_scales(packed), dequantize_fp8(q, packed)


def activations(M, K, seed=0):
    """bf16 [M, K]: each row's 128-column groups at magnitudes spread over orders of magnitude, a few outliers, one
    all-zero group and one row of tiny values."""
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + M + K)
    groups = -(-K // 128)
    magnitude = torch.exp(torch.randn(M, groups, device="cuda", generator=g) * 2).repeat_interleave(128, 1)[:, :K]
    x = torch.randn(M, K, device="cuda", generator=g) * magnitude
    rows = torch.randint(0, M, (3,), device="cuda", generator=g)
    cols = torch.randint(0, K, (3,), device="cuda", generator=g)
    x[rows, cols] *= 100
    x[M // 2, :min(K, 128)] = 0
    x[M - 1] *= 1e-30
    return x.to(torch.bfloat16)


def quantized_reference(x, w, b):
    """float32: the dequantised weight times the activations quantized as the GEMM's are, then dequantised."""
    return reference(dequantize_activations(*quantize_activations(x)), w, b)


def rel_error(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("M,K", [(1, 16), (5, 208), (17, 4096), (100, 1040), (33, 576), (1000, 12288)])
def test_activation_quantization_is_bit_for_bit_the_reference(M, K):
    x = activations(M, K)
    q = torch.full((M, K), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)  # e4m3 NaN
    scale = torch.full((-(-K // 128), M), float("nan"), device="cuda")
    ops.quantize_fp8_activations(x, q, scale)
    ref_q, ref_scale = quantize_activations(x)
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32)), "scales differ"
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), "e4m3 values differ"
    if M > 1:
        assert (scale[0, M // 2] == 1.0).item()  # the all-zero group


# (N, K): Qwen3-0.6B qkv and down, Qwen3-8B o; Qwen2.5-0.5B qkv (K = 896: 7 blocks of 128) and K = 640 (5 blocks), whose
# weight block scales have padded rows (rounded up to 8 blocks); then N and K not multiples of 128.
SHAPES = [(4096, 1024), (1024, 3072), (4096, 4096), (1152, 896), (1024, 640), (1000, 1040), (200, 208)]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [17, 100, 1000])
def test_linear_fp8_with_block_scales_matches_the_quantized_reference(M, N, K, with_bias):
    """Where cuBLASLt takes the shape (always, on Hopper, for N and K multiples of 128), every row -- the rows past
    the last multiple of 4 too -- is the quantized reference's; elsewhere the dequantised path's."""
    gemm = ops.Gemm()
    q, packed, blocks, w = fp8_weight(N, K)
    x = activations(M, K)
    g = torch.Generator(device="cuda").manual_seed(M)
    b = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16) if with_bias else None
    supported = gemm.fp8_gemm_supported(M, N, K, with_bias)
    if hopper() and N % 128 == 0 and K % 128 == 0:
        assert supported, f"cuBLASLt has no block-scaled FP8 algorithm for M={M} N={N} K={K} bias={with_bias}"
    out = poisoned_out(M, N)
    gemm.linear_fp8(x, q, packed, b, out, block_scale=blocks)
    quantized = quantized_reference(x, w, b)
    if supported:
        assert rel_error(reference(x, w, b), quantized) > QUANTIZATION_REL  # this comparison tells the paths apart
        assert_close(out, quantized, REL_NORM)
    else:
        assert_close(out, reference(x, w.to(torch.bfloat16), b), REL_NORM)


def test_scales_that_are_not_whole_blocks_take_the_dequantising_path():
    N, K, M = 1024, 1024, 64
    q, packed, _, _ = fp8_weight(N, K)
    packed[3] *= 4  # rows 24..31 now have their own scales inside the first 128-row block
    assert gemm_block_scales(packed) is None
    x = activations(M, K)
    out = poisoned_out(M, N)
    ops.Gemm().linear_fp8(x, q, packed, None, out)
    assert_close(out, reference(x, dequantize_fp8(q, packed).to(torch.bfloat16), None), REL_NORM)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="cuBLASLt's block-scaled FP8 GEMM runs on compute capability 9.0")
@pytest.mark.parametrize("K", [1024, 640])
def test_the_quantized_gemm_alone_and_scrambled_scale_layouts(K):
    """linear_fp8_quantized on quantize_fp8_activations' output equals linear_fp8's bits and the reference; the same
    call with the weight's block scales transposed, or the activation scales stored row-major instead of block-major,
    is far off (if one of those matched instead, cuBLASLt reads that layout: the message says which). At K = 640 the
    weight's 5 block columns are padded to 8, so a stride read as 5 is far off too."""
    M, N = 128, 1024  # square weight scale grids: [8, 8] (at K = 640, 5 columns and 3 of padding)
    gemm = ops.Gemm()
    q, packed, blocks, w = fp8_weight(N, K)
    x = activations(M, K)
    x_q = torch.empty(M, K, device="cuda", dtype=torch.float8_e4m3fn)
    x_scale = torch.empty(K // 128, M, device="cuda")
    ops.quantize_fp8_activations(x, x_q, x_scale)
    quantized = quantized_reference(x, w, None)
    errors = {}
    for layout, weight_scale, activation_scale in [
            ("as documented", blocks, x_scale),
            ("weight block scales N-major", blocks.t().contiguous(), x_scale),
            ("activation scales K-major", blocks, x_scale.t().contiguous().view(K // 128, M))]:
        out = poisoned_out(M, N)
        gemm.linear_fp8_quantized(x_q, activation_scale, q, weight_scale, None, out)
        errors[layout] = rel_error(out, quantized)
        if layout == "as documented":
            alone = out
    assert errors["as documented"] < REL_NORM, f"relative errors by scale layout: {errors}"
    assert min(errors["weight block scales N-major"], errors["activation scales K-major"]) > QUANTIZATION_REL, errors
    assert_close(alone, quantized, REL_NORM)
    full = poisoned_out(M, N)
    gemm.linear_fp8(x, q, packed, None, full, block_scale=blocks)
    assert torch.equal(alone.view(torch.int16), full.view(torch.int16))


def test_the_quantized_gemm_names_the_shape_it_needs():
    """linear_fp8_quantized rejects M not a multiple of 4, K not of 16, N not of 8 and block scales of the wrong shape
    with a ValueError that names the field and the fix (checked before whether the device has the GEMM)."""
    N, K = 1024, 1024
    gemm = ops.Gemm()
    q, _, blocks, _ = fp8_weight(N, K)

    def call(M, N, K, block_scale=blocks):
        x_q = torch.zeros(M, K, device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
        x_scale = torch.ones(-(-K // 128), M, device="cuda")
        gemm.linear_fp8_quantized(x_q, x_scale, q[:N, :K].contiguous(), block_scale, None, poisoned_out(M, N))

    with pytest.raises(ValueError, match=r"M \(x_q's rows\) a multiple of 4, got M=6; use Gemm.linear_fp8"):
        call(6, N, K)
    with pytest.raises(ValueError, match="K .* a multiple of 16, got K=1000; pad"):
        call(128, N, 1000)  # the same block scale grid as K = 1024
    with pytest.raises(ValueError, match="N .* a multiple of 8, got N=1020; pad"):
        call(128, 1020, K)
    with pytest.raises(ValueError, match="block_scale"):
        call(128, N, K, blocks[:, :2].contiguous())


@pytest.mark.parametrize("M", [1000, 1001])
def test_a_graph_replays_the_eager_bits(M):
    """Captured after a warm-up, linear_fp8 (quantization and GEMM; at M = 1001 also the last 4 rows' second GEMM)
    replays the eager call's bits, and follows new activations in place."""
    N, K = 4096, 4096
    gemm = ops.Gemm()
    q, packed, blocks, w = fp8_weight(N, K)
    x = activations(M, K)
    b = torch.randn(N, device="cuda").to(torch.bfloat16)
    eager = poisoned_out(M, N)
    gemm.linear_fp8(x, q, packed, b, eager, block_scale=blocks)
    graph_out = poisoned_out(M, N)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm.linear_fp8(x, q, packed, b, graph_out, block_scale=blocks)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.linear_fp8(x, q, packed, b, graph_out, block_scale=blocks)
    graph_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out.view(torch.int16), eager.view(torch.int16))
    x.copy_(activations(M, K, seed=1))
    graph.replay()
    torch.cuda.synchronize()
    expected = quantized_reference(x, w, b) if gemm.fp8_gemm_supported(M, N, K, True) else reference(
        x, w.to(torch.bfloat16), b)
    assert_close(graph_out, expected, REL_NORM)
