"""Embedding, RMSNorm, add-RMSNorm, SiLU-and-mul and argmax kernels against float32 torch references."""
import pytest
import torch
import torch.nn.functional as F

from nanograph import ops

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16


def poisoned(*shape, dtype=BF16):
    if dtype == BF16:
        return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    return torch.full(shape, -7, dtype=dtype, device=DEVICE)


def hf_rmsnorm(h, weight, eps):
    """LlamaRMSNorm: statistics in float32, cast to bf16, then times the bf16 weight."""
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(BF16)


def assert_matches_hf(out, ref):
    """Within bf16 tolerance everywhere, and bit-equal almost everywhere (same rounding steps)."""
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    exact = (out == ref).float().mean().item()
    assert exact > 0.99, f"only {exact:.4f} of elements match the HF rounding exactly"


# ---- embedding -------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab,hidden,tokens", [(1000, 64, 1), (32000, 4096, 37), (151936, 1024, 300),
                                                 (17, 8, 5), (5000, 2568, 129)])
def test_embedding_gathers_rows(vocab, hidden, tokens):
    table = torch.randn(vocab, hidden, device=DEVICE).to(BF16)
    ids = torch.randint(0, vocab, (tokens,), dtype=torch.int32, device=DEVICE)
    ids[0] = vocab - 1
    out = poisoned(tokens, hidden)
    ops.embedding(ids, table, out)
    assert torch.equal(out, table[ids.long()])


def test_embedding_out_of_range_ids_give_zero_rows():
    vocab, hidden = 100, 128
    table = torch.randn(vocab, hidden, device=DEVICE).to(BF16)
    ids = torch.tensor([3, -1, vocab, 99, 2**31 - 1, 0], dtype=torch.int32, device=DEVICE)
    out = poisoned(len(ids), hidden)
    ops.embedding(ids, table, out)
    valid = (ids >= 0) & (ids < vocab)
    assert torch.equal(out[valid], table[ids[valid].long()])
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))


def test_embedding_reads_sampled_ids_where_id_src_says():
    """A decode step's tokens sampled on the device by the step before: id_src[t] >= 0 picks sampled[id_src[t]]
    (ids[t] then holds a stale value), -1 keeps ids[t]."""
    vocab, hidden = 5000, 1024
    table = torch.randn(vocab, hidden, device=DEVICE).to(BF16)
    ids = torch.tensor([7, 4999, 123, 0, 42], dtype=torch.int32, device=DEVICE)
    id_src = torch.tensor([-1, 2, 0, -1, 3], dtype=torch.int32, device=DEVICE)
    sampled = torch.tensor([11, 2500, 4998, vocab + 5], dtype=torch.int32, device=DEVICE)
    out = poisoned(len(ids), hidden)
    ops.embedding(ids, table, out, id_src=id_src, sampled=sampled)
    want_ids = torch.tensor([7, 4998, 11, 0], device=DEVICE)
    assert torch.equal(out[:4], table[want_ids])
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # sampled[3] is outside the vocabulary
    with pytest.raises(ValueError, match="both"):
        ops.embedding(ids, table, out, id_src=id_src)


def test_embedding_no_tokens():
    ops.embedding(torch.empty(0, dtype=torch.int32, device=DEVICE),
                  torch.randn(10, 64, device=DEVICE).to(BF16),
                  torch.empty(0, 64, dtype=BF16, device=DEVICE))


# ---- embedding_rmsnorm: the first layer's input in one kernel --------------------------------

@pytest.mark.parametrize("hidden", [64, 576, 1024, 2056, 4096, 5120, 8192])
@pytest.mark.parametrize("tokens", [1, 5, 130])
def test_embedding_rmsnorm_equals_embedding_then_rmsnorm(tokens, hidden):
    """Bit-equal to the two kernels, on both row layouts (one warp per row up to 512 elements, one CTA
    above), with out-of-range ids (zero rows) and ids sampled on the device (id_src/sampled)."""
    vocab, eps = 3000, 1e-6
    table = (torch.randn(vocab, hidden, device=DEVICE) * 2 + 0.3).to(BF16)
    weight = torch.randn(hidden, device=DEVICE).to(BF16)
    ids = torch.randint(0, vocab, (tokens,), dtype=torch.int32, device=DEVICE)
    ids[0] = -1 if tokens > 1 else ids[0]
    id_src = torch.randint(-1, 4, (tokens,), dtype=torch.int32, device=DEVICE)
    sampled = torch.tensor([17, vocab - 1, vocab + 3, 5], dtype=torch.int32, device=DEVICE)
    for extra in ({}, {"id_src": id_src, "sampled": sampled}):
        want_residual, want_out = poisoned(tokens, hidden), poisoned(tokens, hidden)
        ops.embedding(ids, table, want_residual, **extra)
        ops.rmsnorm(want_residual, weight, want_out, eps)
        residual, out = poisoned(tokens, hidden), poisoned(tokens, hidden)
        ops.embedding_rmsnorm(ids, table, weight, residual, out, eps, **extra)
        assert torch.equal(residual, want_residual)
        assert torch.equal(out, want_out)
        assert_matches_hf(out, hf_rmsnorm(want_residual, weight, eps))


def test_embedding_rmsnorm_keeps_the_table_bits_of_nans():
    """The residual is the table row as embedding() copies it, NaN payloads included; out matches too."""
    vocab, hidden = 50, 1024
    table = torch.randn(vocab, hidden, device=DEVICE).to(BF16)
    bits = table.view(torch.int16)
    for k, payload in enumerate((0x7F81, -0x003F, 0x7FC0, -1)):  # 0x7f81, 0xffc1, 0x7fc0, 0xffff
        bits[7, 3 + 100 * k] = payload
    weight = torch.randn(hidden, device=DEVICE).to(BF16)
    ids = torch.tensor([7, 8, 7], dtype=torch.int32, device=DEVICE)
    want_residual, want_out = poisoned(3, hidden), poisoned(3, hidden)
    ops.embedding(ids, table, want_residual)
    ops.rmsnorm(want_residual, weight, want_out, 1e-6)
    residual, out = poisoned(3, hidden), poisoned(3, hidden)
    ops.embedding_rmsnorm(ids, table, weight, residual, out, 1e-6)
    assert torch.equal(residual.view(torch.int16), want_residual.view(torch.int16))
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


def test_embedding_rmsnorm_rejects_bad_arguments():
    table = torch.randn(100, 128, device=DEVICE).to(BF16)
    weight = torch.randn(128, device=DEVICE).to(BF16)
    ids = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    residual, out = poisoned(2, 128), poisoned(2, 128)
    with pytest.raises(ValueError, match="both"):
        ops.embedding_rmsnorm(ids, table, weight, residual, out, 1e-6, id_src=ids)
    with pytest.raises(ValueError, match="weight"):
        ops.embedding_rmsnorm(ids, table, weight[:64], residual, out, 1e-6)
    with pytest.raises(ValueError, match="out"):
        ops.embedding_rmsnorm(ids, table, weight, residual, poisoned(3, 128), 1e-6)
    with pytest.raises(TypeError, match="ids"):
        ops.embedding_rmsnorm(ids.long(), table, weight, residual, out, 1e-6)
    with pytest.raises(ValueError, match="different tensors"):
        ops.embedding_rmsnorm(ids, table, weight, residual, residual, 1e-6)


# ---- rmsnorm / add_rmsnorm -------------------------------------------------------------------

NORM_DIMS = [8, 64, 128, 200, 512, 520, 1024, 2048, 2056, 3584, 4096, 5120, 8192]
NORM_ROWS = [1, 3, 4, 5, 64, 257]


@pytest.mark.parametrize("dim", NORM_DIMS)
@pytest.mark.parametrize("rows", NORM_ROWS)
def test_rmsnorm(rows, dim):
    eps = 1e-6
    x = (torch.randn(rows, dim, device=DEVICE) * 3 + 0.5).to(BF16)
    weight = torch.randn(dim, device=DEVICE).to(BF16)
    out = poisoned(rows, dim)
    ops.rmsnorm(x, weight, out, eps)
    assert_matches_hf(out, hf_rmsnorm(x, weight, eps))


def test_rmsnorm_leading_dims_and_eps():
    x = torch.randn(2, 3, 256, device=DEVICE).mul(1e-3).to(BF16)  # eps dominates mean(x^2)
    weight = torch.randn(256, device=DEVICE).to(BF16)
    out = poisoned(2, 3, 256)
    ops.rmsnorm(x, weight, out, 1e-2)
    assert_matches_hf(out, hf_rmsnorm(x, weight, 1e-2))


@pytest.mark.parametrize("dim", NORM_DIMS)
@pytest.mark.parametrize("rows", [1, 5, 64, 257])
def test_add_rmsnorm(rows, dim):
    eps = 1e-5
    x = torch.randn(rows, dim, device=DEVICE).to(BF16)
    residual = (torch.randn(rows, dim, device=DEVICE) * 4).to(BF16)
    weight = torch.randn(dim, device=DEVICE).to(BF16)
    want_residual = x + residual  # bf16 add: float sum, rounded once
    want_x = hf_rmsnorm(want_residual, weight, eps)
    ops.add_rmsnorm(x, residual, weight, eps)
    assert torch.equal(residual, want_residual)
    assert_matches_hf(x, want_x)


def test_norm_rejects_bad_shapes():
    x = torch.randn(4, 100, device=DEVICE).to(BF16)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.rmsnorm(x, torch.ones(100, dtype=BF16, device=DEVICE), torch.empty_like(x), 1e-6)
    x = torch.randn(4, 128, device=DEVICE).to(BF16)
    with pytest.raises(ValueError, match="weight"):
        ops.rmsnorm(x, torch.ones(64, dtype=BF16, device=DEVICE), torch.empty_like(x), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rmsnorm(x, torch.empty(4, 64, dtype=BF16, device=DEVICE),
                        torch.ones(128, dtype=BF16, device=DEVICE), 1e-6)


# ---- silu_mul --------------------------------------------------------------------------------

@pytest.mark.parametrize("inter", [8, 64, 136, 1000, 3072, 11008, 12288])
@pytest.mark.parametrize("rows", [1, 2, 7, 256])
def test_silu_mul(rows, inter):
    gate_up = (torch.randn(rows, 2 * inter, device=DEVICE) * 3).to(BF16)
    out = poisoned(rows, inter)
    ops.silu_mul(gate_up, out)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, atol=2e-2, rtol=2e-2)


def test_silu_mul_leading_dims_and_shape_check():
    gate_up = torch.randn(2, 3, 2 * 96, device=DEVICE).to(BF16)
    out = poisoned(2, 3, 96)
    ops.silu_mul(gate_up, out)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="out"):
        ops.silu_mul(gate_up, torch.empty(2, 3, 192, dtype=BF16, device=DEVICE))


# ---- argmax ----------------------------------------------------------------------------------

def run_argmax(logits):
    out = poisoned(logits.shape[0], dtype=torch.int32)
    ops.argmax(logits, out)
    return out


def reference_argmax(logits):
    """torch's argmax on the CPU (its GPU reduction is what racecheck would then report on), on the device."""
    return torch.argmax(logits.float().cpu(), dim=-1).to(logits.device)


def planted_logits(rows, vocab, generator_seed=0):
    """Random logits with, per row, a planted maximum: a tie pair, the first column or the last."""
    torch.manual_seed(generator_seed)
    logits = torch.randn(rows, vocab, device=DEVICE).to(BF16)
    want = torch.empty(rows, dtype=torch.long)
    for r in range(rows):
        kind = r % 4
        if kind == 0:  # two equal maxima: the lower index wins
            a, b = sorted(torch.randperm(vocab)[:2].tolist()) if vocab > 1 else (0, 0)
            logits[r, a] = logits[r, b] = 30.0
            want[r] = a
        elif kind == 1:
            logits[r, 0] = 30.0
            want[r] = 0
        elif kind == 2:
            logits[r, vocab - 1] = 30.0
            want[r] = vocab - 1
        else:  # many ties: every eighth column holds the maximum
            logits[r, 3::8] = 30.0
            want[r] = min(3, vocab - 1) if vocab > 3 else logits[r].float().argmax().item()
    return logits, want.to(DEVICE)


@pytest.mark.parametrize("vocab", [1, 5, 7, 8, 9, 100, 1023, 8191, 32000, 151936, 151935, 256000])
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_argmax_planted_maxima(rows, vocab):
    logits, want = planted_logits(rows, vocab, vocab + rows)
    got = run_argmax(logits)
    assert torch.equal(got.long(), want)
    assert torch.equal(got.long(), reference_argmax(logits))


@pytest.mark.parametrize("vocab", [151936, 32000, 1000])
def test_argmax_random_rows_match_torch(vocab):
    # bf16 randn over a large vocabulary has natural ties at the maximum.
    logits = (torch.randn(256, vocab, device=DEVICE) * 2).to(BF16)
    assert torch.equal(run_argmax(logits).long(), reference_argmax(logits))


@pytest.mark.parametrize("padded,vocab", [(151937, 151936), (1001, 1000), (32003, 32000), (12, 11),
                                          (151936 + 64, 151936)])
def test_argmax_strided_rows(padded, vocab):
    """Row views of a wider buffer: with an odd row stride every row starts at a different
    alignment, which exercises the unaligned head and tail."""
    full = torch.randn(13, padded, device=DEVICE).to(BF16)
    full[:, vocab:] = 100.0  # outside the view: must never be chosen
    logits = full[:, :vocab]
    logits[1, 0] = 50.0
    logits[2, vocab - 1] = 50.0
    logits[3, 1] = logits[3, vocab - 2] = 50.0
    assert torch.equal(run_argmax(logits).long(), reference_argmax(logits))


def test_argmax_offset_start_and_special_values():
    base = torch.randn(5 * 1001 + 3, device=DEVICE).to(BF16)
    logits = base[3:].view(5, 1001)  # data pointer 6 bytes past an aligned address
    logits[0, :] = float("-inf")  # all -inf: index 0
    logits[1, 10] = float("nan")
    logits[1, 20] = float("nan")  # first NaN wins
    logits[2, :] = 0.0
    logits[2, 7] = -0.0  # +0 and -0 are equal: index 0
    logits[3, 500] = float("inf")
    want = torch.tensor([0, 10, 0, 500], device=DEVICE)
    got = run_argmax(logits)
    assert torch.equal(got[:4].long(), want)
    assert torch.equal(got[4].long(), reference_argmax(logits[4:5])[0])


@pytest.mark.parametrize("rows", [1, 2, 16, 17])
@pytest.mark.parametrize("vocab", [8192, 32000, 151936, 151943])
def test_argmax_across_cluster_slices(rows, vocab):
    """Few rows of a large vocabulary are scanned by eight CTAs each (on sm_90), one slice of the row's 16-byte
    vectors apiece: maxima and ties on either side of every slice boundary, in the last slice only, and rows of
    -inf and NaN, at the row counts on both sides of the cluster path's limit (16)."""
    torch.manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, device=DEVICE).to(BF16)
    per_slice = -(-(vocab // 8) // 8) * 8  # elements per slice (aligned rows: no head)
    boundaries = [k * per_slice for k in range(1, 8) if k * per_slice < vocab]
    want = torch.empty(rows, dtype=torch.long)
    for r in range(rows):
        kind = r % 5
        if kind == 0:  # a tie straddling a boundary: the lower index wins
            b = boundaries[r % len(boundaries)]
            logits[r, b - 1] = logits[r, b] = 40.0
            want[r] = b - 1
        elif kind == 1:  # every boundary holds the maximum: the first boundary wins
            logits[r, boundaries] = 40.0
            want[r] = boundaries[0]
        elif kind == 2:  # the maximum in the last slice's last element
            logits[r, vocab - 1] = 40.0
            want[r] = vocab - 1
        elif kind == 3:  # -inf everywhere but a NaN in the last slice
            logits[r, :] = float("-inf")
            logits[r, vocab - 3] = float("nan")
            want[r] = vocab - 3
        else:  # all -inf: index 0, like torch
            logits[r, :] = float("-inf")
            want[r] = 0
    got = run_argmax(logits)
    assert torch.equal(got.long().cpu(), want)
    assert torch.equal(got.long(), reference_argmax(logits))


@pytest.mark.parametrize("rows", [1, 16, 17, 40])
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_argmax_host_out_gets_the_same_ids(rows, vocab):
    """host_out: the kernel itself writes the ids into pinned host memory (no copy), on both the cluster path
    (<= 16 rows of a large vocabulary) and the one-CTA-per-row path."""
    logits, want = planted_logits(rows, vocab, rows + 3 * vocab)
    out = poisoned(rows, dtype=torch.int32)
    host = torch.full((rows,), -12345, dtype=torch.int32, pin_memory=True)
    ops.argmax(logits, out, host)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out.long(), want)
    assert torch.equal(host.long(), want.cpu())


def test_argmax_host_out_must_be_pinned_int32():
    logits = torch.randn(4, 64, device=DEVICE).to(BF16)
    out = torch.empty(4, dtype=torch.int32, device=DEVICE)
    for bad in (torch.empty(4, dtype=torch.int32),  # not pinned
                torch.empty(4, dtype=torch.int64, pin_memory=True),
                torch.empty(3, dtype=torch.int32, pin_memory=True),
                torch.empty(4, dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match="host_out must be a contiguous pinned CPU int32 tensor of 4"):
            ops.argmax(logits, out, bad)


def test_argmax_rejects_bad_layouts():
    logits = torch.randn(4, 64, device=DEVICE).to(BF16)
    with pytest.raises(ValueError, match="stride"):
        run_argmax(logits.t())
    with pytest.raises(ValueError, match="out"):
        ops.argmax(logits, torch.empty(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="int32"):
        ops.argmax(logits, torch.empty(4, dtype=torch.int64, device=DEVICE))
