"""GPU tests of the FP8 (e4m3) KV cache in the CUDA kernels: the RoPE/KV store, decode and prefill attention.

They hold the kernels to the torch backend's quantize_kv / dequantize_kv: a value x is stored as
e4m3(clamp(x / scale, -448, 448)), one K scale and one V scale per tensor, and read back as float(e4m3) * scale. The
store must write, bit for bit, quantize_kv of what the bf16 store writes; attention over an FP8 cache must match a
float32 reference over the dequantised cache with the bf16 tests' tolerance. Caches hold, beside ordinary values,
values that saturate (|x / scale| > 448) and values in e4m3's subnormal range (|x / scale| < 2^-6); slots outside
any sequence hold e4m3's NaN byte."""
import math

import pytest
import torch

from nanograph.models.fp8 import FP8_DTYPE, FP8_MAX
from nanograph.models.kv_cache import dequantize_kv, quantize_kv

from .test_decode_attention import TOL, bits, captured, make_inputs, plan, random_lens
from .test_decode_attention import reference as decode_reference
from .test_prefill_attention import make_batch
from .test_prefill_attention import reference as prefill_reference
from .test_rope_kv import EPS, cos_sin_table
from .test_rope_kv import make_inputs as rope_inputs

FP8_NAN = 0x7F  # e4m3fn's NaN byte (it has no infinities)
SUBNORMAL_BOUND = 2.0**-6  # e4m3's smallest normal magnitude
SCALES = [(0.05, 3.0), (3.0, 0.05), (1.0, 1.0)]  # (k_scale, v_scale)
SATURATING, SUBNORMAL = 0.01, 0.03  # fractions of a cache's values moved to e4m3's ends


def fp8_bytes(t):
    return t.view(torch.uint8)


def is_fp8_nan(t):
    """Where an FP8 tensor holds NaN (0x7f or 0xff)."""
    return fp8_bytes(t) & 0x7F == FP8_NAN


def fp8_cache(cache, scale, largest=30.0):
    """A bf16 cache from make_inputs / make_batch (NaN in slots outside any sequence) as the FP8 cache holds it:
    (e4m3 cache, its float32 dequantisation). 1% of the values become 5/6 * largest to largest in magnitude (by
    default 25 to 30, which saturate under scale 0.05: 448 * 0.05 = 22.4) and 3% fall in the subnormal range of the
    scale; the rest stay O(1), so that outputs keep the magnitudes the bf16 tolerance is made for. NaN slots get the
    NaN byte."""
    x = cache.float()
    pick = torch.rand_like(x)
    x = torch.where(pick < SATURATING, x.sign() * largest * (5 + torch.rand_like(x)) / 6, x)
    tiny = scale * SUBNORMAL_BOUND * (2 * torch.rand_like(x) - 1)
    x = torch.where((pick >= SATURATING) & (pick < SATURATING + SUBNORMAL), tiny, x)
    stored = quantize_kv(x, scale)
    fp8_bytes(stored)[cache.isnan()] = FP8_NAN
    return stored, dequantize_kv(stored, scale, torch.float32)


def random_fp8(shape):
    """An FP8 cache of random bytes (NaN ones included): a poison whose every byte a test can check."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(FP8_DTYPE)


def log_spread(shape, low, high):
    """float32 values of random sign whose magnitudes are 2^U(low, high)."""
    sign = torch.randint(0, 2, shape, device="cuda") * 2 - 1
    return sign * torch.exp2(low + (high - low) * torch.rand(shape, device="cuda"))


def newest_slots(block_tables, context_lens, block_size):
    """Each sequence's newest key's slot (-1 for length 0) and position, as a decode step stores them."""
    newest = (context_lens.long() - 1).clamp(min=0)
    slots = (block_tables.long().gather(1, (newest // block_size)[:, None])[:, 0] * block_size
             + newest % block_size).to(torch.int32)
    slots[context_lens == 0] = -1
    return slots, newest.to(torch.int32)


# ---------------------------------------------------------------------------------------------- the RoPE/KV store


@pytest.mark.gpu
@pytest.mark.parametrize("k_scale,v_scale", SCALES, ids=[f"k{k}_v{v}" for k, v in SCALES])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_quantizes_what_the_bf16_store_writes(head_dim, qk_norm, k_scale, v_scale):
    """Run on clones of the same inputs, the FP8 store rotates qkv as the bf16 store does and writes
    quantize_kv(the bf16 store's key and value) bit for bit; slot -1 writes nothing and every other slot keeps its
    bytes. Keys and values span 2^-16 to 2^12 in magnitude (and the norm weights 2^-10 to 2^12), so that each scale
    meets saturated and subnormal values."""
    from nanograph import ops

    nq, nkv, bs = 6, 2, 16
    torch.manual_seed(head_dim + qk_norm + int(100 * k_scale))
    qkv, _, cos_sin, positions, slots, k_bf16, v_bf16 = rope_inputs(129, nq, nkv, head_dim, bs, qk_norm=False)
    kv_columns = qkv[:, nq * head_dim :]
    kv_columns.copy_(log_spread(kv_columns.shape, -16, 12))
    qw, kw = [log_spread((head_dim,), -10, 12).abs().bfloat16() if qk_norm else None for _ in range(2)]
    k_fp8, v_fp8 = random_fp8(k_bf16.shape), random_fp8(v_bf16.shape)
    k_before, v_before = k_fp8.clone(), v_fp8.clone()
    qkv_fp8 = qkv.clone()

    ops.qk_norm_rope_kv_store(qkv, qw, kw, cos_sin, positions, slots, k_bf16, v_bf16, nq, nkv, EPS)
    ops.qk_norm_rope_kv_store(qkv_fp8, qw, kw, cos_sin, positions, slots, k_fp8, v_fp8, nq, nkv, EPS,
                              k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()

    assert torch.equal(bits(qkv_fp8), bits(qkv)), "qkv is rotated differently with an FP8 cache"
    written = slots[slots >= 0].long()
    untouched = torch.ones(k_bf16.shape[0] * bs, dtype=torch.bool, device="cuda")
    untouched[written] = False
    for name, fp8, bf16, scale, before in [("k", k_fp8, k_bf16, k_scale, k_before),
                                           ("v", v_fp8, v_bf16, v_scale, v_before)]:
        stored = bf16.view(-1, nkv, head_dim)[written]
        y = stored.float().abs() / scale
        assert (y > FP8_MAX).any() and ((y > 0) & (y < SUBNORMAL_BOUND)).any(), \
            f"the {name} values must reach saturation and subnormals"
        got = fp8_bytes(fp8).view(-1, nkv, head_dim)
        assert torch.equal(got[written], fp8_bytes(quantize_kv(stored, scale))), \
            f"{name}_cache differs from quantize_kv of the bf16 store"
        assert torch.equal(got[untouched], fp8_bytes(before).view(-1, nkv, head_dim)[untouched]), \
            f"{name}_cache written outside slot_mapping"


# ------------------------------------------------------------------------------------------------ decode attention


def decode(q, k_cache, v_cache, block_tables, context_lens, nq, max_len, k_scale, v_scale, **kwargs):
    """paged_decode_attention into a fresh output poisoned with NaN."""
    from nanograph import ops

    hd = k_cache.shape[-1]
    out = torch.full((q.shape[0], nq * hd), float("nan"), device="cuda").bfloat16()
    ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, nq, hd**-0.5, max_len,
                               k_scale=k_scale, v_scale=v_scale, **kwargs)
    return out


# (id, context lengths, nq, nkv, head_dim, block_size, max_context_len, (k_scale, v_scale)): batch 1 from 1 to
# 33,000 keys, 4 x 16,384 and 64 sequences of mixed lengths with zeros; groups of 1, 2, 4 and 8 q heads; bounds tight
# and large. Small grids (every CTA resident; a chunk's splits merged in a cluster where the GPU keeps all of the
# grid's clusters resident) and large ones (longest first, merged through the workspace) both run:
# test_cases_cover_small_and_large_grids.
DECODE_CASES = [
    ("b1_len1_group1", [1], 8, 8, 128, 16, 1, SCALES[0]),
    ("b1_len100_group2_hd64", [100], 16, 8, 64, 32, 100, SCALES[1]),
    ("b1_4096_group4", [4096], 32, 8, 128, 16, 4096, SCALES[2]),
    ("b1_33000_group8", [33000], 16, 2, 128, 32, 33000, SCALES[0]),
    ("b4_16384", [16384] * 4, 32, 8, 128, 16, 16384, SCALES[1]),
    ("b64_mixed_hd64", random_lens(64, 4096, 20, zeros=(0, 9)), 16, 4, 64, 16, 4096, SCALES[0]),
    ("b1_128_under_40960", [128], 16, 8, 128, 16, 40960, SCALES[1]),
    ("b64_group1_bs32", random_lens(64, 1024, 21, zeros=(5,)), 8, 8, 128, 32, 1024, SCALES[2]),
    ("b3_group8_hd64_under_40960", [0, 777, 2049], 8, 1, 64, 32, 40960, SCALES[1]),
    ("b16_large_grid_under_40960", [128] + random_lens(15, 2000, 22), 16, 8, 128, 16, 40960, SCALES[0]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nq,nkv,hd,bs,max_len,scales", [c[1:] for c in DECODE_CASES],
                         ids=[c[0] for c in DECODE_CASES])
def test_decode_matches_the_dequantised_reference(lens, nq, nkv, hd, bs, max_len, scales):
    """The output over FP8 caches matches the float32 reference over the dequantised caches; a length-0 row gives
    zeros, and merging a chunk's splits in a cluster or through the workspace gives the same bits."""
    k_scale, v_scale = scales
    torch.manual_seed(sum(lens) + nq + hd + bs)
    q, k_cache, v_cache, block_tables, context_lens, _ = make_inputs(lens, nq, nkv, hd, bs, max_len)
    (k_fp8, k_deq), (v_fp8, v_deq) = fp8_cache(k_cache, k_scale), fp8_cache(v_cache, v_scale)
    args = (q, k_fp8, v_fp8, block_tables, context_lens, nq, max_len, k_scale, v_scale)
    out = decode(*args)
    workspace_merged = decode(*args, cluster_merge=False)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), decode_reference(q, k_deq, v_deq, block_tables, context_lens, nq), **TOL)
    assert (out[context_lens == 0] == 0).all(), "rows of context length 0 must be exactly zero"
    assert torch.equal(bits(out), bits(workspace_merged)), "the cluster merge differs from the workspace merge"


@pytest.mark.gpu
def test_cases_cover_small_and_large_grids():
    plans = [plan(len(lens), nq, nkv, hd, max_len) for _, lens, nq, nkv, hd, _, max_len, _ in DECODE_CASES]
    assert {p["early_kv"] for p in plans} == {True, False}
    if torch.cuda.get_device_capability()[0] >= 9:
        assert any(p["cluster_merge"] for p in plans)


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs,max_len", [(64, 4096), (256, 1024), (1, 32768)])
def test_large_grids_of_an_e4m3_cache_prefetch_the_next_step(num_seqs, max_len):
    """An e4m3 tile is half a bf16 tile's bytes in flight: large grids of an e4m3 cache ask for each warp's next step
    in L2; those of a bf16 cache, and small grids (which always prefetch, in the kernel), leave the flag off."""
    from nanograph import ops

    e4m3 = ops.decode_attention_plan(num_seqs, 32, 8, 128, max_len, True)
    bf16 = ops.decode_attention_plan(num_seqs, 32, 8, 128, max_len, False)
    assert e4m3["early_kv"] == bf16["early_kv"]
    assert e4m3["prefetch_next_step"] == (not e4m3["early_kv"])
    assert not bf16["prefetch_next_step"]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nq,nkv,hd,max_len", [([300], 16, 8, 128, 300),
                                                    (random_lens(64, 512, 23), 16, 8, 64, 512)],
                         ids=["small_grid", "large_grid_hd64"])
def test_decode_saturates_q_past_fp16(lens, nq, nkv, hd, max_len):
    """Over an FP8 cache q meets the keys as fp16, so q values past fp16's range (bf16 reaches 3.4e38, and infinity)
    count as +-65504. Two dims of every q head hold such values and the keys hold 0 or e4m3's smallest subnormal
    (2^-9) there, so the saturated values move a score by up to 2 * 65504 * 2^-9 / sqrt(head_dim): the output
    matches the float32 reference over q clamped to +-65504."""
    torch.manual_seed(len(lens) + nq + hd)
    q, k_cache, v_cache, block_tables, context_lens, _ = make_inputs(lens, nq, nkv, hd, 16, max_len)
    dims = [3, hd // 2 + 5]
    past_fp16 = torch.tensor([float("inf"), -float("inf"), 1e5, -1e5, 3e38, -7e4], device="cuda")
    heads = q[:, : nq * hd].view(len(lens), nq, hd)
    heads[:, :, dims] = past_fp16[torch.randint(len(past_fp16), (len(lens), nq, len(dims)), device="cuda")].bfloat16()
    (k_fp8, _), (v_fp8, v_deq) = fp8_cache(k_cache, 1.0), fp8_cache(v_cache, 1.0)
    tiny = torch.randint(0, 2, (*k_fp8.shape[:-1], len(dims)), dtype=torch.uint8, device="cuda")  # 0 or 2^-9
    fp8_bytes(k_fp8)[..., dims] = torch.where(is_fp8_nan(k_fp8)[..., dims], fp8_bytes(k_fp8)[..., dims], tiny)
    k_deq = dequantize_kv(k_fp8, 1.0, torch.float32)
    out = decode(q, k_fp8, v_fp8, block_tables, context_lens, nq, max_len, 1.0, 1.0)
    torch.cuda.synchronize()
    q_fp16_range = q.float().clamp(-65504, 65504)
    ref = decode_reference(q_fp16_range, k_deq, v_deq, block_tables, context_lens, nq)
    torch.testing.assert_close(out.float(), ref, **TOL)


def e4m3_error_variance(x, scale):
    """The variance of quantize_kv's rounding error at each value x (float64, no saturation): spacing^2 / 12, where
    the spacing of e4m3's values around |x| / scale is 2^(floor(log2 |x / scale|) - 3), and 2^-9 in the subnormal
    range, times the scale."""
    _, exponent = torch.frexp(x.abs() / scale)  # |x / scale| = m * 2^exponent, m in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(x), (exponent - 4).clamp(min=-9)) * scale
    return spacing**2 / 12


def predicted_error_variance(q, k, v, k_scale, v_scale, nq):
    """Per output element of one sequence ([nq * hd], float64): the variance of the change that quantising its keys
    and values makes, to first order, with each rounding error independent and uniform. With p = softmax(c q K^T)
    and out = p V, an error dK moves the logits by ds_l = c q . dK_l and out by sum_l p_l ds_l (V_l - out); an error
    dV moves out by sum_l p_l dV_l."""
    length, nkv, hd = k.shape
    c = hd**-0.5
    qs = q.view(nkv, nq // nkv, hd)
    p = (c * torch.einsum("kgd,lkd->kgl", qs, k)).softmax(-1)
    out = torch.einsum("kgl,lkd->kgd", p, v)
    logit_variance = c**2 * torch.einsum("kgd,lkd->kgl", qs**2, e4m3_error_variance(k, k_scale))
    w = p**2 * logit_variance
    from_keys = (torch.einsum("kgl,lkd->kgd", w, v**2) - 2 * out * torch.einsum("kgl,lkd->kgd", w, v)
                 + out**2 * w.sum(-1, keepdim=True))
    from_values = torch.einsum("kgl,lkd->kgd", p**2, e4m3_error_variance(v, v_scale))
    return (from_keys + from_values).reshape(-1)


def bf16_rounding_variance(x):
    """The variance of rounding x to bf16 (8 significant bits)."""
    _, exponent = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), exponent - 8) ** 2 / 12


@pytest.mark.gpu
@pytest.mark.parametrize("calibrated", [True, False], ids=["amax_over_448", "scale_1"])
def test_quantising_a_bf16_cache_costs_what_e4m3_rounding_predicts(calibrated):
    """FP8 decode over a bf16 cache quantised with quantize_kv, against bf16 decode over the original cache. e4m3
    keeps 3 mantissa bits: rounding moves a value by at most half its spacing (a relative error of at most 2^-4),
    uniformly, so by spacing^2 / 12 in variance. Propagated to first order through the softmax
    (predicted_error_variance) this gives each output's expected error sigma, plus both outputs' bf16 rounding.
    The test asks that the mean squared difference is that predicted (ratio within [0.5, 2]: e5m2's 2 mantissa
    bits, or truncating instead of rounding, make it about 4), and that no output moves by more than 6 sigma plus
    2^-7 of its magnitude and 1e-2 (the kernels' own rounding: of the outputs to bf16, of the probabilities to bf16
    or fp16)."""
    lens, nq, nkv, hd, bs, max_len = [1, 64, 300, 1000, 4000, 0], 32, 8, 128, 16, 4096
    torch.manual_seed(int(calibrated))
    q, k_cache, v_cache, block_tables, context_lens, _ = make_inputs(lens, nq, nkv, hd, bs, max_len)
    if calibrated:  # vLLM's calibration: the largest magnitude maps to e4m3's largest value
        k_scale, v_scale = [c.nan_to_num(0).abs().max().item() / FP8_MAX for c in (k_cache, v_cache)]
    else:
        k_scale = v_scale = 1.0
    k_fp8, v_fp8 = quantize_kv(k_cache, k_scale), quantize_kv(v_cache, v_scale)
    for fp8, cache in ((k_fp8, k_cache), (v_fp8, v_cache)):
        fp8_bytes(fp8)[cache.isnan()] = FP8_NAN
    args = (block_tables, context_lens, nq, max_len)
    out_bf16 = decode(q, k_cache, v_cache, *args, 1.0, 1.0).double()
    out_fp8 = decode(q, k_fp8, v_fp8, *args, k_scale, v_scale).double()
    torch.cuda.synchronize()

    variance = torch.zeros_like(out_bf16)
    for s, length in enumerate(lens):
        if length:
            blocks = block_tables[s, : math.ceil(length / bs)].long()
            k, v = [c[blocks].reshape(-1, nkv, hd)[:length].double() for c in (k_cache, v_cache)]
            variance[s] = predicted_error_variance(q[s, : nq * hd].double(), k, v, k_scale, v_scale, nq)
    variance += 2 * bf16_rounding_variance(out_bf16)
    difference = out_fp8 - out_bf16
    ratio = (difference**2).sum() / variance.sum()
    assert 0.5 < ratio < 2, f"mean squared difference {ratio:.2f} x the predicted quantisation error"
    bound = 6 * variance.sqrt() + 2**-7 * out_bf16.abs() + 1e-2
    worst = (difference.abs() / bound).max()
    assert worst <= 1, f"an output moved by {worst:.2f} x its bound"


# (id, context lengths, nq, nkv, head_dim, block_size, max_context_len, QK-norm, a row whose slot is -1): a small
# grid (the engine runs the RoPE kernel and attention separately there) and large ones (which it fuses; they prefetch
# each warp's next step), each with a length-0 row.
FUSED_CASES = [
    ("small_grid", [383, 0, 17], 16, 8, 128, 16, 400, True, 2),
    ("large_grid_hd64", random_lens(64, 1024, 23, zeros=(3,)), 32, 8, 64, 32, 1024, False, 0),
    ("large_grid_hd128", random_lens(48, 2048, 29, zeros=(5,)), 32, 8, 128, 16, 2048, True, 7),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nq,nkv,hd,bs,max_len,qk_norm,unstored", [c[1:] for c in FUSED_CASES],
                         ids=[c[0] for c in FUSED_CASES])
def test_fused_rope_store_equals_the_rope_kernel(lens, nq, nkv, hd, bs, max_len, qk_norm, unstored):
    """With cos_sin, attention stores each sequence's newest key and value into the FP8 cache bit for bit as
    qk_norm_rope_kv_store does with the same scales (the rest of the cache untouched, qkv left as it was), and its
    output matches the reference over the cache after that store. A row whose slot is -1 stores nothing."""
    from nanograph import ops

    k_scale, v_scale = (0.05, 3.0) if qk_norm else (3.0, 0.05)
    torch.manual_seed(len(lens) + hd)
    qkv, k_cache, v_cache, block_tables, context_lens, _ = make_inputs(lens, nq, nkv, hd, bs, max_len)
    (k_fp8, _), (v_fp8, _) = fp8_cache(k_cache, k_scale), fp8_cache(v_cache, v_scale)
    qw, kw = [(torch.rand(hd, device="cuda") * 1.5 + 0.25).bfloat16() if qk_norm else None for _ in range(2)]
    cos_sin = cos_sin_table(max_len + 8, hd).cuda()
    slots, positions = newest_slots(block_tables, context_lens, bs)
    slots[unstored] = -1
    stored = slots[slots >= 0].long()
    for cache in (k_fp8, v_fp8):
        fp8_bytes(cache).view(-1, nkv, hd)[stored] = FP8_NAN

    qkv_rotated, k_ref, v_ref = qkv.clone(), k_fp8.clone(), v_fp8.clone()
    ops.qk_norm_rope_kv_store(qkv_rotated, qw, kw, cos_sin, positions, slots, k_ref, v_ref, nq, nkv, EPS,
                              k_scale=k_scale, v_scale=v_scale)
    order = torch.empty_like(context_lens)
    ops.order_by_length(context_lens, order)
    qkv_before = qkv.clone()
    out = decode(qkv, k_fp8, v_fp8, block_tables, context_lens, nq, max_len, k_scale, v_scale,
                 q_norm_weight=qw, k_norm_weight=kw, cos_sin=cos_sin, positions=positions, slot_mapping=slots,
                 eps=EPS, seq_order=order)
    torch.cuda.synchronize()

    for cache in (k_ref, v_ref):
        assert not is_fp8_nan(cache).view(-1, nkv, hd)[stored].any(), "the newest keys and values were not stored"
    assert torch.equal(fp8_bytes(k_fp8), fp8_bytes(k_ref)), "k_cache differs from the RoPE/KV-store kernel's"
    assert torch.equal(fp8_bytes(v_fp8), fp8_bytes(v_ref)), "v_cache differs from the RoPE/KV-store kernel's"
    assert torch.equal(bits(qkv), bits(qkv_before)), "qkv changed"
    k_deq, v_deq = dequantize_kv(k_ref, k_scale, torch.float32), dequantize_kv(v_ref, v_scale, torch.float32)
    torch.testing.assert_close(out.float(), decode_reference(qkv_rotated, k_deq, v_deq, block_tables, context_lens,
                                                             nq), **TOL)
    assert (out[context_lens == 0] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("before,after,nq,nkv,max_len", [
    ([4096, 1, 0, 700], [17, 4000, 33, 0], 16, 8, 4096),
    (random_lens(64, 2048, 24, zeros=(2,)), random_lens(64, 2048, 25, zeros=(7,)), 16, 8, 2048)],
    ids=["small_grid", "large_grid"])
def test_graph_replay_gives_the_eager_bits(before, after, nq, nkv, max_len):
    """Decode attention over an FP8 cache, captured in a CUDA graph under some lengths and replayed with others,
    gives the bits of an eager call with those lengths."""
    from nanograph import ops

    hd, bs, k_scale, v_scale = 128, 16, 0.05, 3.0
    torch.manual_seed(len(before))
    q, k_cache, v_cache, block_tables, context_lens, out = make_inputs(after, nq, nkv, hd, bs, max_len,
                                                                       full_tables=True)
    (k_fp8, k_deq), (v_fp8, v_deq) = fp8_cache(k_cache, k_scale), fp8_cache(v_cache, v_scale)
    workspace = torch.zeros(ops.decode_attention_workspace_bytes(len(after), nq, hd, max_len) // 4, device="cuda")

    def call(into):
        ops.paged_decode_attention(q, k_fp8, v_fp8, block_tables, context_lens, into, nq, hd**-0.5, max_len,
                                   workspace, k_scale=k_scale, v_scale=v_scale)

    context_lens.copy_(torch.tensor(before, dtype=torch.int32))
    graph = captured(lambda: call(out))
    context_lens.copy_(torch.tensor(after, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    eager = torch.full_like(out, float("nan"))
    call(eager)
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(eager)), "the replayed graph differs from the eager call"
    torch.testing.assert_close(out.float(), decode_reference(q, k_deq, v_deq, block_tables, context_lens, nq), **TOL)


# ----------------------------------------------------------------------------------------------- prefill attention


# (k_scale, v_scale): values are at most about 4 in magnitude (the prefill kernel's probabilities are bf16, whose
# rounding error grows with the values), so they saturate under v_scale 0.005 (448 * 0.005 = 2.24); keys saturate
# under 0.05.
PREFILL_SCALES = [(0.05, 3.0), (3.0, 0.005)]


@pytest.mark.gpu
@pytest.mark.parametrize("k_scale,v_scale", PREFILL_SCALES, ids=[f"k{k}_v{v}" for k, v in PREFILL_SCALES])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 4, 16), (128, 2, 32)])
def test_prefill_matches_the_dequantised_reference(head_dim, group, block_size, k_scale, v_scale):
    """Causal prefill over FP8 caches, sequences continuing a cached prefix (context_len > q_len) beside ones
    without, a decode-like row and a chunk ending mid-block, against the float32 reference over the dequantised
    caches."""
    from nanograph import ops

    q_lens, context_lens = [1, 17, 200, 65, 300], [1500, 17, 1000, 193, 300]
    nkv = 2
    nq = group * nkv
    b = make_batch(q_lens, context_lens, nq, nkv, head_dim, block_size, seed=head_dim + group)
    (k_fp8, k_deq), (v_fp8, v_deq) = fp8_cache(b["k_cache"], k_scale), fp8_cache(b["v_cache"], v_scale, largest=4.0)
    scale = head_dim**-0.5
    out = torch.full((sum(q_lens), nq * head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops.paged_prefill_attention(b["q"], k_fp8, v_fp8, b["block_tables"], b["cu_seqlens_q"], b["context_lens"], out,
                                nq, scale, max(q_lens), k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    ref = prefill_reference(dict(b, k_cache=k_deq, v_cache=v_deq), q_lens, context_lens, nq, scale)
    torch.testing.assert_close(out.float(), ref, **TOL)


# ---------------------------------------------------------------------------------------------------------- errors


def cache_as(cache, dtype):
    """A cache of cache's shape in dtype (zeros for the 1-byte float8 dtypes)."""
    if dtype.itemsize == 1:
        return torch.zeros(cache.shape, dtype=torch.uint8, device=cache.device).view(dtype)
    return cache.to(dtype)


def bad_cache_arguments(k_cache, v_cache):
    """(keyword overrides, the argument the error must name) for an op taking bf16 caches k_cache, v_cache."""
    k_fp8, v_fp8 = cache_as(k_cache, FP8_DTYPE), cache_as(v_cache, FP8_DTYPE)
    cases = [(dict(k_cache=k_fp8), "v_cache|k_cache"), (dict(v_cache=v_fp8), "v_cache|k_cache")]
    for dtype in (torch.float8_e5m2, torch.float16):
        cases.append((dict(k_cache=cache_as(k_cache, dtype), v_cache=cache_as(v_cache, dtype)), "k_cache"))
    for name in ("k_scale", "v_scale"):
        for value in (0.0, -1.0, math.inf, math.nan):
            cases.append((dict(k_cache=k_fp8, v_cache=v_fp8, **{name: value}), name))
        cases.append(({name: 2.0}, name))  # a scale other than 1 with bf16 caches
    return cases


def check_rejects(call, k_cache, v_cache):
    call(k_scale=1.0, v_scale=1.0)  # bf16 caches take the default scales
    for overrides, named in bad_cache_arguments(k_cache, v_cache):
        with pytest.raises((ValueError, TypeError), match=named):
            call(**overrides)


@pytest.mark.gpu
def test_store_rejects_bad_caches_and_scales():
    from nanograph import ops

    nq, nkv, hd = 8, 2, 128
    qkv, (qw, kw), cos_sin, positions, slots, k_cache, v_cache = rope_inputs(5, nq, nkv, hd, 16, True)

    def call(**overrides):
        args = dict(qkv=qkv, q_norm_weight=qw, k_norm_weight=kw, cos_sin=cos_sin, positions=positions,
                    slot_mapping=slots, k_cache=k_cache, v_cache=v_cache, num_q_heads=nq, num_kv_heads=nkv, eps=EPS)
        ops.qk_norm_rope_kv_store(**(args | overrides))

    check_rejects(call, k_cache, v_cache)


@pytest.mark.gpu
def test_decode_rejects_bad_caches_and_scales():
    from nanograph import ops

    nq, nkv, hd, max_len = 8, 2, 128, 1024
    q, k_cache, v_cache, block_tables, context_lens, out = make_inputs([5, 900], nq, nkv, hd, 16, max_len)

    def call(**overrides):
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens,
                    out=out, num_q_heads=nq, scale=0.1, max_context_len=max_len)
        ops.paged_decode_attention(**(args | overrides))

    check_rejects(call, k_cache, v_cache)


@pytest.mark.gpu
def test_prefill_rejects_bad_caches_and_scales():
    from nanograph import ops

    b = make_batch([4], [4], 4, 2, 128, 16)
    out = torch.empty(4, 4 * 128, device="cuda", dtype=torch.bfloat16)

    def call(**overrides):
        args = dict(q=b["q"], k_cache=b["k_cache"], v_cache=b["v_cache"], block_tables=b["block_tables"],
                    cu_seqlens_q=b["cu_seqlens_q"], context_lens=b["context_lens"], out=out, num_q_heads=4,
                    scale=0.1, max_q_len=4)
        ops.paged_prefill_attention(**(args | overrides))

    check_rejects(call, b["k_cache"], b["v_cache"])
