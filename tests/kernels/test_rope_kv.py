"""Fused QK-norm + RoPE + K/V cache store against a float32 torch reference that mirrors HF Qwen3."""
import pytest
import torch

SENTINEL = -123.0  # cache value no rotated k or random v can take: marks slots the kernel must not touch
EPS = 1e-6


def cos_sin_table(max_position, head_dim, base=1_000_000.0):
    """[max_position, head_dim] fp32: cos of each frequency, then sin (HF's default rope)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rms_norm_hf(x, weight):
    """Qwen3RMSNorm: fp32 statistics, bf16 cast of the normalised value, bf16 weight multiply."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * normed.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def reference(qkv, q_weight, k_weight, cos_sin, positions, nq, nkv, hd):
    """q, k rotated in fp32 (after HF's bf16 QK-norm when weights are given), each [T, heads, hd]."""
    q = qkv[:, : nq * hd].view(-1, nq, hd)
    k = qkv[:, nq * hd : (nq + nkv) * hd].view(-1, nkv, hd)
    if q_weight is not None:
        q, k = rms_norm_hf(q, q_weight), rms_norm_hf(k, k_weight)
    rows = cos_sin[positions.long()]
    cos = rows[:, : hd // 2].repeat(1, 2).unsqueeze(1)  # HF's cat((freqs, freqs)) layout
    sin = rows[:, hd // 2 :].repeat(1, 2).unsqueeze(1)
    q, k = q.float(), k.float()
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def make_inputs(num_tokens, nq, nkv, hd, block_size, qk_norm, skip_fraction=0.2, max_position=4096):
    dev = "cuda"
    num_blocks = max(2, (2 * num_tokens) // block_size + 2)
    qkv = (torch.randn(num_tokens, (nq + 2 * nkv) * hd, device=dev) * 2).bfloat16()
    weights = [None, None]
    if qk_norm:
        weights = [(torch.rand(hd, device=dev) * 1.5 + 0.25).bfloat16() for _ in range(2)]
    cos_sin = cos_sin_table(max_position, hd).to(dev)
    positions = torch.randint(0, max_position, (num_tokens,), device=dev, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:num_tokens].to(torch.int32)
    slots[torch.rand(num_tokens, device=dev) < skip_fraction] = -1
    k_cache = torch.full((num_blocks, block_size, nkv, hd), SENTINEL, device=dev, dtype=torch.bfloat16)
    v_cache = torch.full_like(k_cache, SENTINEL)
    return qkv, weights, cos_sin, positions, slots, k_cache, v_cache


def run_and_check(num_tokens, nq, nkv, hd, block_size, qk_norm):
    from nanograph import ops

    qkv, (qw, kw), cos_sin, positions, slots, k_cache, v_cache = make_inputs(
        num_tokens, nq, nkv, hd, block_size, qk_norm)
    original = qkv.clone()
    q_ref, k_ref = reference(original, qw, kw, cos_sin, positions, nq, nkv, hd)

    ops.qk_norm_rope_kv_store(qkv, qw, kw, cos_sin, positions, slots, k_cache, v_cache, nq, nkv, EPS)
    torch.cuda.synchronize()

    tol = dict(atol=2e-2, rtol=2e-2)
    q_out = qkv[:, : nq * hd].view(-1, nq, hd).float()
    k_out = qkv[:, nq * hd : (nq + nkv) * hd].view(-1, nkv, hd).float()
    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(k_out, k_ref, **tol)
    assert torch.equal(qkv[:, (nq + nkv) * hd :], original[:, (nq + nkv) * hd :]), "v changed in qkv"

    k_slots = k_cache.view(-1, nkv, hd)
    v_slots = v_cache.view(-1, nkv, hd)
    stored = slots >= 0
    written = slots[stored].long()
    torch.testing.assert_close(k_slots[written].float(), k_ref[stored], **tol)
    v = original[:, (nq + nkv) * hd :].view(-1, nkv, hd)
    assert torch.equal(v_slots[written], v[stored]), "v_cache differs from v"

    untouched = torch.ones(k_slots.shape[0], dtype=torch.bool, device=k_slots.device)
    untouched[written] = False
    assert (k_slots[untouched] == SENTINEL).all(), "k_cache written outside slot_mapping"
    assert (v_slots[untouched] == SENTINEL).all(), "v_cache written outside slot_mapping"


# (num_q_heads, num_kv_heads): GQA ratios 1 to 8, including head counts that make a warp's head
# groups straddle two tokens.
HEADS = [(4, 4), (8, 4), (6, 2), (16, 4), (5, 1), (12, 2), (7, 1), (64, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference(head_dim, qk_norm, heads, block_size):
    torch.manual_seed(hash((head_dim, qk_norm, heads, block_size)) % 2**31)
    run_and_check(129, *heads, head_dim, block_size, qk_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 4096])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_token_counts(num_tokens, head_dim):
    torch.manual_seed(num_tokens)
    run_and_check(num_tokens, 32, 8, head_dim, 16, qk_norm=True)


@pytest.mark.gpu
def test_no_tokens_is_a_no_op():
    from nanograph import ops

    qkv, (qw, kw), cos_sin, positions, slots, k_cache, v_cache = make_inputs(0, 8, 2, 128, 16, True)
    ops.qk_norm_rope_kv_store(qkv, qw, kw, cos_sin, positions, slots, k_cache, v_cache, 8, 2, EPS)
    assert (k_cache == SENTINEL).all() and (v_cache == SENTINEL).all()


@pytest.mark.gpu
def test_rejects_bad_arguments():
    from nanograph import ops

    nq, nkv, hd = 8, 2, 128
    qkv, (qw, kw), cos_sin, positions, slots, k_cache, v_cache = make_inputs(5, nq, nkv, hd, 16, True)

    def call(**overrides):
        args = dict(qkv=qkv, q_norm_weight=qw, k_norm_weight=kw, cos_sin=cos_sin, positions=positions,
                    slot_mapping=slots, k_cache=k_cache, v_cache=v_cache, num_q_heads=nq,
                    num_kv_heads=nkv, eps=EPS)
        args.update(overrides)
        ops.qk_norm_rope_kv_store(**args)

    with pytest.raises(ValueError, match="both"):
        call(k_norm_weight=None)
    with pytest.raises(ValueError, match="qkv"):
        call(num_q_heads=nq + 1)
    with pytest.raises(ValueError, match="head_dim 96"):
        call(k_cache=k_cache[..., :96].contiguous(), v_cache=v_cache[..., :96].contiguous())
    with pytest.raises(ValueError, match="v_cache"):
        call(v_cache=v_cache[:1].contiguous())
    with pytest.raises(ValueError, match="positions"):
        call(positions=positions[:4])
    with pytest.raises(ValueError, match="cos_sin"):
        call(cos_sin=cos_sin[:, :64].contiguous())
    with pytest.raises(TypeError, match="slot_mapping"):
        call(slot_mapping=slots.long())
    with pytest.raises(ValueError, match="q_norm_weight"):
        call(q_norm_weight=qw[:64].contiguous())


def test_reference_matches_hf():
    """The reference's QK-norm and rotation agree with transformers' own Qwen3 code."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    torch.manual_seed(0)
    hd, nq, nkv, T = 64, 4, 2, 11
    qkv = torch.randn(T, (nq + 2 * nkv) * hd).bfloat16()
    qw, kw = (torch.rand(hd) + 0.5).bfloat16(), (torch.rand(hd) + 0.5).bfloat16()
    cos_sin = cos_sin_table(512, hd)
    positions = torch.randint(0, 512, (T,), dtype=torch.int32)
    q_ref, k_ref = reference(qkv, qw, kw, cos_sin, positions, nq, nkv, hd)

    norms = []
    for w in (qw, kw):
        norm = qwen3.Qwen3RMSNorm(hd, eps=EPS).bfloat16()
        norm.weight.data.copy_(w)
        norms.append(norm)
    q = norms[0](qkv[:, : nq * hd].view(T, nq, hd))
    k = norms[1](qkv[:, nq * hd : (nq + nkv) * hd].view(T, nkv, hd))
    rows = cos_sin[positions.long()]
    cos, sin = rows[:, : hd // 2].repeat(1, 2), rows[:, hd // 2 :].repeat(1, 2)
    q_hf, k_hf = qwen3.apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(q_ref, q_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ref, k_hf, atol=1e-5, rtol=1e-5)
