"""The GEMVs with the decoder's add-RMSNorm fused into their input (norm=(residual, residual_out, weight, eps)):
bit-equal to add_rmsnorm followed by the same GEMV, residual_out equal to add_rmsnorm's residual, the inputs left
as they were, a float32 reference of the whole, and the shapes and arguments it refuses. The fusion takes up to 8
rows of up to 4,096 against weights that fit about one wave of CTAs (gemv_input_norm_supported)."""
import pytest
import torch

from nanograph import ops
from nanograph.models.fp8 import dequantize_fp8

from .linear_reference import assert_close, poisoned_out
from .test_gemv_fp8 import fp8_weight

pytestmark = pytest.mark.gpu

EPS = 1e-6
# K: a row of one warp in the norm kernel (256, 512), of 96 threads (SmolLM2's 576), 128 (Qwen3-0.6B), 256
# threads (2,048), two vectors per thread (Qwen3-8B's 4,096; 3,072 takes 192 threads).
KS = [256, 512, 576, 1024, 2048, 3072, 4096]
# N (out columns): a few row groups, several CTAs, a tail, Qwen3-0.6B's gate_up (6,144 rows at K = 1,024), and
# N = 256 at long K, whose row groups take 16 splits (16-warp CTAs).
NS = [24, 256, 1000, 3072]


def norm_threads(K):
    """rmsnorm_cut's threads per row (csrc/norm.h): one warp up to 64 vectors, else at most 256 threads."""
    vecs = K // 8
    if vecs <= 64:
        return 32
    per_thread = -(-vecs // 256)
    return -(-(-(-vecs // per_thread)) // 32) * 32


def cases():
    """M = 1, 2 and the most rows the fusion takes at K: 8 rows, or two rounds of 256 threads (checked against the
    core below)."""
    for K in KS:
        for M in sorted({1, 2, min(8, 2 * (256 // norm_threads(K)))}):
            yield M, K


def inputs(M, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    residual = (torch.randn(M, K, device="cuda", generator=g) * 4).to(torch.bfloat16)
    weight = (1 + 0.5 * torch.randn(K, device="cuda", generator=g)).to(torch.bfloat16)
    return x, residual, weight


def unfused(x, residual, weight):
    """add_rmsnorm's outputs: (normalised rows, new residual), on copies."""
    h, r = x.clone(), residual.clone()
    ops.add_rmsnorm(h, r, weight, EPS)
    return h, r


def run(kind, x, norm, N, K, out):
    """The kernel `kind` on x (norm None: unfused), into out."""
    if kind == "gemv":
        w = weight_bf16(N, K)
        ops.gemv(x, w, None, out, norm=norm)
    elif kind == "gemv_silu_mul":
        ops.gemv_silu_mul(x, weight_bf16(2 * N, K), out, norm=norm)
    elif kind == "gemv_fp8":
        q, scale, _ = fp8_weight(N, K)
        ops.gemv_fp8(x, q, scale, None, out, norm=norm)
    else:
        q, scale, _ = fp8_weight(2 * N, K)
        ops.gemv_silu_mul_fp8(x, q, scale, out, norm=norm)


_weights = {}


def weight_bf16(N, K):
    if (N, K) not in _weights:
        g = torch.Generator(device="cuda").manual_seed(N * 31 + K)
        _weights.clear()
        _weights[N, K] = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
    return _weights[N, K]


KINDS = ["gemv", "gemv_silu_mul", "gemv_fp8", "gemv_silu_mul_fp8"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("M,K", list(cases()))
def test_fused_input_norm_is_bit_equal_to_add_rmsnorm_then_the_gemv(kind, N, M, K):
    if kind.endswith("fp8") and K % 16:
        pytest.skip("FP8 weights take K a multiple of 16")
    rows = 2 * N if "silu" in kind else N
    supported = ops.gemv_fp8_input_norm_supported if kind.endswith("fp8") else ops.gemv_input_norm_supported
    if not supported(M, rows, K):
        pytest.skip(f"a weight of {rows} x {K} streams through several waves: no fused norm")
    x, residual, weight = inputs(M, K, seed=M * 100 + K)
    x_before, residual_before = x.clone(), residual.clone()
    normed, residual_ref = unfused(x, residual, weight)
    width = N
    expected = poisoned_out(M, width)
    run(kind, normed, None, N, K, expected)

    out = poisoned_out(M, width)
    residual_out = torch.full_like(residual, float("nan"))
    run(kind, x, (residual, residual_out, weight, EPS), N, K, out)
    torch.cuda.synchronize()
    assert torch.equal(out, expected), f"{kind}: {(out != expected).sum().item()} of {out.numel()} outputs differ"
    assert torch.equal(residual_out, residual_ref), "residual_out is not bf16(x + residual)"
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "the inputs were written"


@pytest.mark.parametrize("M,K", [(1, 1024), (4, 1024), (2, 4096)])
def test_fused_input_norm_matches_a_float32_reference(M, K):
    N = 1000
    x, residual, weight = inputs(M, K, seed=7)
    h = (x.float() + residual.float()).to(torch.bfloat16).float()
    # add_rmsnorm's two roundings (HF's RMSNorm: normalise in fp32, cast, multiply by the weight).
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16).float()
    normed = (normed * weight.float()).to(torch.bfloat16).float()
    for fp8 in (False, True):
        out = poisoned_out(M, N)
        residual_out = torch.full_like(residual, float("nan"))
        if fp8:
            q, scale, _ = fp8_weight(N, K)
            w = dequantize_fp8(q, scale)
            ops.gemv_fp8(x, q, scale, None, out, norm=(residual, residual_out, weight, EPS))
        else:
            w = weight_bf16(N, K)
            ops.gemv(x, w, None, out, norm=(residual, residual_out, weight, EPS))
        assert_close(out, normed @ w.float().T, 1e-2)
        assert torch.equal(residual_out.float(), h)


@pytest.mark.parametrize("K", KS)
def test_supported_rows_follow_the_norms_cut(K):
    """Two rounds of an 8-warp CTA cut into rmsnorm's thread groups: 128 threads per 1,024-wide row, 256 per
    4,096-wide row; at most 8 rows."""
    most = min(8, 2 * (256 // norm_threads(K)))
    for supported in (ops.gemv_input_norm_supported, ops.gemv_fp8_input_norm_supported):
        assert supported(most, 256, K) and not supported(most + 1, 256, K)


def test_supported_weights_fit_about_one_wave():
    """Qwen3-0.6B's qkv and gate_up take it; Qwen3-8B's, which stream through several waves, and rows of 8,192 do
    not."""
    for supported in (ops.gemv_input_norm_supported, ops.gemv_fp8_input_norm_supported):
        assert supported(1, 4096, 1024) and supported(1, 6144, 1024)
        assert not supported(1, 6144, 4096) and not supported(1, 24576, 4096)
        assert not supported(1, 256, 8192)


def test_fused_input_norm_refuses_what_it_cannot_do():
    M, K, N = 4, 4096, 64
    x, residual, weight = inputs(M, K, seed=1)
    w = weight_bf16(N, K)
    out = poisoned_out(M, N)
    with pytest.raises(ValueError, match="gemv_input_norm_supported"):  # 4 rows of 4,096
        ops.gemv(x, w, None, out, norm=(residual, torch.empty_like(residual), weight, EPS))
    x, residual, out = x[:2], residual[:2].contiguous(), out[:2]
    with pytest.raises(ValueError, match="another buffer"):
        ops.gemv(x, w, None, out, norm=(residual, residual, weight, EPS))
    with pytest.raises(TypeError, match="tuple"):
        ops.gemv(x, w, None, out, norm=(residual, weight))
    with pytest.raises(ValueError, match="norm weight"):
        ops.gemv(x, w, None, out, norm=(residual, torch.empty_like(residual), weight[:-8], EPS))
