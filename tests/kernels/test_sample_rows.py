"""The sampling kernel (ops.sample_rows) against the float64 full-sort reference of the sampler's truncations:
thresholds and drawn tokens on random batches mixing greedy rows, temperatures, top-k, top-p and min_p, from flat
rows to peaked ones; greedy rows in torch.argmax's order (NaN first), as the all-greedy paths choose; draws that
follow the exact renormalised distribution (chi-square); keys that fix a row's draw whatever its batch; rows read
from overrides; ties at the k-th logit; strided and misaligned rows; argument checks, of ops.sample_packed's blobs
and layout too.
Inputs are made on the host from a seeded generator, and references computed there."""
import math
from typing import NamedTuple

import numpy as np
import pytest
import torch

from nanograph import ops
from nanograph._core import require_core
from nanograph.sampling.packed_layout import PackedFormat

from ..engine.test_sampler_truncation import AMBIGUOUS, reference_thresholds

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16
NUM_DRAWS = 20000
# Chi-square critical values at significance 0.001, by degrees of freedom (statistical tables).
CHI2_CRITICAL_0_001 = {2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877,
                       10: 29.588, 11: 31.264, 12: 32.909}
REJECTED = (ValueError, TypeError, RuntimeError)


class RowParams(NamedTuple):
    """Per-row sampling parameters, [rows] on the host, in ops.sample_rows' order."""
    temperatures: torch.Tensor  # float32; 0: greedy
    top_ks: torch.Tensor  # int32; <= 0 or >= vocab: none
    top_ps: torch.Tensor  # float32; 1: none
    min_ps: torch.Tensor  # float32; 0: none
    keys: torch.Tensor  # int64

    def select(self, rows) -> "RowParams":
        return RowParams(*(t[rows] for t in self))


def same_params(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, first_key=0) -> RowParams:
    """Every row alike, with consecutive keys first_key, first_key + 1, ... (their draws must still be independent)."""
    return RowParams(torch.full((rows,), temperature), torch.full((rows,), top_k, dtype=torch.int32),
                     torch.full((rows,), top_p), torch.full((rows,), min_p), torch.arange(first_key, first_key + rows))


def random_keys(rows, generator) -> torch.Tensor:
    return torch.randint(-2**63, 2**63 - 1, (rows,), dtype=torch.int64, generator=generator)


def random_params(rows, vocab, generator) -> RowParams:
    """Rows mixing greedy ones, no truncation, top-k, top-p, min_p and their combinations, with random keys."""
    def pick(options, dtype):
        return torch.tensor(options, dtype=dtype)[torch.randint(len(options), (rows,), generator=generator)]
    return RowParams(pick([0.0, 0.05, 0.7, 1.0, 1.0, 1.5], torch.float32),
                     pick([0, 0, 0, -1, vocab, 1, 5, 50, 1000, vocab - 1], torch.int32),  # 0, -1, vocab: none
                     pick([1.0, 1.0, 1.0, 0.1, 0.5, 0.9, 0.99], torch.float32),
                     pick([0.0, 0.0, 0.0, 0.01, 0.2], torch.float32),
                     random_keys(rows, generator))


def sample(logits, params: RowParams, overrides=None, override_rows=None, want_thresholds=True):
    """ops.sample_rows into poisoned outputs; (tokens int64, thresholds float32 or None) [rows] on the host, each row
    checked to be written."""
    rows, vocab = logits.shape
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    thresholds = torch.full((rows,), math.nan, device=DEVICE) if want_thresholds else None
    ops.sample_rows(logits, *(t.to(DEVICE) for t in params), out, thresholds, overrides, override_rows)
    tokens = out.cpu()
    read = logits.float()
    if override_rows is not None:
        overridden = override_rows.long().to(DEVICE)
        read = torch.where((overridden >= 0)[:, None], overrides[overridden.clamp(min=0), :vocab].float(), read)
    nothing = ~(read > -math.inf).any(dim=-1).cpu()  # every logit -inf or NaN: the id vocab may come back
    unwritten = ((tokens < 0) | (tokens > vocab) | ((tokens == vocab) & ~nothing)).nonzero().flatten()
    assert len(unwritten) == 0, f"rows {unwritten[:10].tolist()} have tokens {tokens[unwritten[:10]].tolist()}"
    if not want_thresholds:
        return tokens, None
    thresholds = thresholds.cpu()
    assert not thresholds.isnan().any(), f"rows {thresholds.isnan().nonzero().flatten()[:10].tolist()} unwritten"
    return tokens, thresholds


def scaled(logits, temperatures) -> torch.Tensor:
    """x = logit / temperature, a float32 division (greedy rows: the logits), on the host."""
    return logits.float().cpu() / torch.where(temperatures == 0, 1.0, temperatures)[:, None]


def reference(x, params: RowParams, slack=0.0):
    """reference_thresholds on x (float32 [rows, vocab], already scaled): float32 thresholds [rows] (greedy rows: the
    max) and float64 margins (inf for greedy rows). slack > 0 raises top_p (where < 1) and lowers log(min_p) by that
    much, keeping more tokens; slack < 0 keeps fewer. -inf logits go in as the lowest float32 (weight 0 all the same),
    as x - floor would be NaN there."""
    lowest = torch.finfo(torch.float32).min
    vocab = x.shape[-1]
    top_ks = torch.where((params.top_ks <= 0) | (params.top_ks >= vocab), vocab, params.top_ks).long()
    top_ps = params.top_ps.double()
    top_ps = torch.where(top_ps < 1, top_ps + slack, top_ps)
    min_ps = params.min_ps.double() * math.exp(-slack)
    thresholds, margin = reference_thresholds(x.clamp(min=lowest), top_ks[:, None], top_ps[:, None], min_ps[:, None])
    thresholds = thresholds.squeeze(1).masked_fill(thresholds.squeeze(1) == lowest, -math.inf)
    greedy = params.temperatures == 0
    return torch.where(greedy, x.amax(dim=-1), thresholds), torch.where(greedy, math.inf, margin)


def assert_follows_reference(logits, params: RowParams, tokens, thresholds, min_clear=0.6):
    """logits: the rows as the kernel read them (after overrides). Every row: its token is finite and kept by its
    threshold, and greedy rows take the first maximum. Rows not ambiguous (at least min_clear of them; in flat rows
    over 150k tokens each holds about 1e-5 of the mass, so most top-p rows are ambiguous): the threshold equals the
    float64 reference, exactly where that is -inf or one of the row's x (greedy, top-k, top-p), else (a min_p floor,
    found in float32) up to keeping the same tokens. Ambiguous rows: the threshold lies between the reference's with
    top_p and min_p moved by AMBIGUOUS either way."""
    x = scaled(logits, params.temperatures)
    drawn = x.gather(1, tokens[:, None]).squeeze(1)
    assert drawn.isfinite().all(), f"rows {(~drawn.isfinite()).nonzero().flatten()[:10].tolist()} drew -inf"
    below = (drawn < thresholds).nonzero().flatten()
    assert len(below) == 0, f"rows {below[:10].tolist()} drew tokens under their thresholds"
    greedy = params.temperatures == 0
    assert torch.equal(tokens[greedy], x[greedy].argmax(dim=-1))

    expected, margin = reference(x, params)
    clear = margin > AMBIGUOUS
    assert clear.float().mean() >= min_clear, f"only {clear.float().mean():.2f} of rows are clear"
    in_row = (x == expected[:, None]).any(dim=-1) | (expected == -math.inf)
    exact = clear & in_row
    wrong = (exact & (thresholds != expected)).nonzero().flatten()
    assert len(wrong) == 0, f"rows {wrong[:10].tolist()}: {thresholds[wrong[:10]].tolist()}, " \
                            f"expected {expected[wrong[:10]].tolist()}"
    floors = clear & ~in_row
    assert torch.equal(x[floors] >= thresholds[floors, None], x[floors] >= expected[floors, None])

    ambiguous = ~clear
    if ambiguous.any():
        looser = reference(x[ambiguous], params.select(ambiguous), AMBIGUOUS)[0]
        tighter = reference(x[ambiguous], params.select(ambiguous), -AMBIGUOUS)[0]
        assert ((looser <= thresholds[ambiguous]) & (thresholds[ambiguous] <= tighter)).all()


# ---- thresholds and draws against the reference --------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("scale", [0.5, 4.0, 20.0])  # flat rows to peaked ones
@pytest.mark.parametrize("vocab, rows", [(151936, 64), (50257, 128), (32000, 192), (1000, 256)])
def test_thresholds_and_draws_follow_the_float64_reference(vocab, rows, scale, dtype):
    generator = torch.Generator().manual_seed(vocab + int(scale * 10))
    logits = (torch.randn(rows, vocab, generator=generator) * scale).to(dtype)
    params = random_params(rows, vocab, generator)
    tokens, thresholds = sample(logits.to(DEVICE), params)
    assert_follows_reference(logits, params, tokens, thresholds)


@pytest.mark.parametrize("rows", [1, 3, 256, 300])
def test_any_number_of_rows(rows):
    generator = torch.Generator().manual_seed(rows)
    vocab = 32000
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(BF16)
    params = random_params(rows, vocab, generator)
    tokens, thresholds = sample(logits.to(DEVICE), params)
    assert_follows_reference(logits, params, tokens, thresholds, min_clear=0.9)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_greedy_rows_take_the_first_maximum(dtype):
    generator = torch.Generator().manual_seed(3)
    rows, vocab = 6, 151936
    logits = torch.randn(rows, vocab, generator=generator).to(dtype)
    a, b = sorted(torch.randperm(vocab, generator=generator)[:2].tolist())
    logits[0, [a, b]] = 30.0  # two equal maxima: the lower index
    logits[1, 0] = 30.0
    logits[2, vocab - 1] = 30.0
    logits[3, 3::8] = 30.0  # thousands of equal maxima
    logits[4] = 0.0
    logits[5, [vocab - 1, 70000]] = 30.0
    params = random_params(rows, vocab, generator)._replace(temperatures=torch.zeros(rows))  # the rest is ignored
    tokens, thresholds = sample(logits.to(DEVICE), params)
    assert tokens.tolist() == [a, 0, vocab - 1, 3, 0, 70000]
    assert thresholds.tolist() == [30.0, 30.0, 30.0, 30.0, 0.0, 30.0]


# ---- greedy rows: torch.argmax's order, shared with the all-greedy paths ----------------------------

def argmax_order_rows(vocab, generator) -> tuple[torch.Tensor, list[int]]:
    """bf16 rows [9, vocab] that only torch.argmax's order decides (a NaN before every number, equal values to the
    lowest index, -0 equal to +0), and their tokens by hand. The special positions spread over the row's threads."""
    rows = (torch.randn(9, vocab, generator=generator) * 4).to(BF16)  # every value far below 30
    a, b, c, d = (int(f * vocab) for f in (0.1, 0.35, 0.6, 0.85))
    rows[0, [a, c, vocab - 2]] = 30.0  # ties at the largest number, below, between and after NaNs at b and d
    rows[0, [b, d]] = math.nan
    rows[1, 0] = math.inf
    rows[1, vocab - 1] = math.nan  # a NaN at the last index beats +inf at the first
    rows[2, [d, b, c, a]] = math.nan  # several NaNs: the lowest index
    rows[3] = -math.inf  # all -inf: index 0 (the sampler's greedy rows: vocab, below)
    for r, signs in ((4, [-0.0, 0.0]), (5, [0.0, -0.0])):  # negative but for a zero of each sign: the lower index
        rows[r] = -rows[r].abs() - 1
        rows[r, [a, b]] = torch.tensor(signs, dtype=BF16)
    rows[6] = -math.inf
    rows[6, c] = math.nan  # a NaN among -inf
    rows[7, a::7] = 30.0  # many ties, no NaN
    # Row 8 stays random: bf16 values over a whole row tie at their maximum now and then.
    return rows, [b, vocab - 1, a, 0, a, a, c, a, int(rows[8].float().argmax())]


def all_greedy_tokens(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that an all-greedy batch of the bf16 rows gets from the core's argmax, and from gemv_argmax with
    each row as lm_head's bias over zero weights (logits = +0 + bias: -0 becomes +0, equal to it), into poisoned
    outputs; int64 on the host."""
    num_rows, vocab = rows.shape
    by_argmax = torch.full((num_rows,), -7, dtype=torch.int32, device=DEVICE)
    ops.argmax(rows.to(DEVICE), by_argmax)
    x, weight = torch.zeros(1, 8, dtype=BF16, device=DEVICE), torch.zeros(vocab, 8, dtype=BF16, device=DEVICE)
    keys = torch.zeros(ops.GEMV_MAX_M, dtype=torch.int64, device=DEVICE)
    by_gemv = []
    for row in rows:
        token = torch.full((1,), -7, dtype=torch.int32, device=DEVICE)
        logits = torch.full((1, vocab), math.nan, dtype=BF16, device=DEVICE)
        ops.gemv_argmax(x, weight, row.to(DEVICE), logits, token, keys)
        by_gemv.append(token)
    return by_argmax.long().cpu(), torch.cat(by_gemv).long().cpu()


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 1001])  # rows read by 16-byte vectors; element by element
def test_greedy_rows_follow_torch_argmax_in_a_mixed_batch(vocab, dtype):
    """Greedy rows that only torch.argmax's order decides, interleaved with sampled rows (half of them holding NaNs
    too): each greedy row takes torch.argmax of its float32 logits, and the same token in an all-greedy batch, from
    sample_rows, the core's argmax and gemv_argmax alike, but for a row of -inf: the sampler's rows can be masked
    whole, and it gives such a row the id past the vocabulary (nothing to draw), on which the engine fails that
    request; an all-greedy batch has no masks. The sampled rows treat NaN logits as absent: they draw finite
    logits."""
    generator = torch.Generator().manual_seed(vocab)
    greedy_rows, want = argmax_order_rows(vocab, generator)
    want = torch.tensor(want)
    assert torch.equal(torch.argmax(greedy_rows.float(), dim=-1), want)  # the hand-made tokens are torch's
    sampler_want = torch.where(greedy_rows.float().amax(dim=-1) == -math.inf, vocab, want)
    assert sampler_want.tolist().count(vocab) == 1
    num_greedy = len(want)
    sampled_rows = (torch.randn(24, vocab, generator=generator) * 4).to(BF16)
    sampled_rows[::2, torch.randint(vocab, (8,), generator=generator)] = math.nan
    logits = torch.cat([greedy_rows, sampled_rows])
    params = random_params(len(logits), vocab, generator)
    sampled_temperatures = torch.where(params.temperatures > 0, params.temperatures, 1.0)
    params = params._replace(temperatures=torch.where(torch.arange(len(logits)) < num_greedy, 0.0,
                                                      sampled_temperatures))
    order = torch.randperm(len(logits), generator=generator)
    mixed, _ = sample(logits[order].to(dtype).to(DEVICE), params.select(order), want_thresholds=False)
    mixed = mixed[order.argsort()]
    assert torch.equal(mixed[:num_greedy], sampler_want)
    drawn = logits[num_greedy:].float().gather(1, mixed[num_greedy:, None])
    assert drawn.isfinite().all(), f"sampled rows {(~drawn.isfinite()).nonzero()[:, 0].tolist()} drew NaN or -inf"

    alone, _ = sample(greedy_rows.to(dtype).to(DEVICE), params.select(slice(0, num_greedy)), want_thresholds=False)
    assert torch.equal(alone, sampler_want)
    by_argmax, by_gemv = all_greedy_tokens(greedy_rows)
    assert torch.equal(by_argmax, want)
    assert torch.equal(by_gemv, want)


# ---- distributions --------------------------------------------------------------------------------

def peaked_row(vocab=64) -> torch.Tensor:
    """Ten tokens carrying most of the mass, at scattered positions, the others far below."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=generator) - 4
    logits[torch.randperm(vocab, generator=generator)[:10]] = torch.linspace(2.5, 0.0, 10)
    return logits


def exact_probs(row, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """float64: exp(x - x_max) renormalised over the tokens the reference keeps."""
    params = same_params(1, temperature, top_k, top_p, min_p)
    x = scaled(row[None], params.temperatures)
    threshold, margin = reference(x, params)
    assert margin > AMBIGUOUS  # the case itself is clear
    weights = (x[0].double() - x.max()).exp() * (x[0] >= threshold)
    return weights / weights.sum()


def chi_square(tokens, probs) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, over a bin for each of the ten most likely tokens and one for
    the other tokens of non-zero probability, if any. Draws of tokens of probability 0 fail here."""
    assert (probs[tokens] > 0).all()
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    likeliest = probs.argsort(descending=True)[:10]
    likeliest = likeliest[probs[likeliest] > 0]
    rest = probs > 0
    rest[likeliest] = False
    observed = torch.cat([counts[likeliest], counts[rest].sum()[None]])
    expected = torch.cat([probs[likeliest], probs[rest].sum()[None]]) * len(tokens)
    if not rest.any():
        observed, expected = observed[:-1], expected[:-1]
    assert (expected >= 5).all()  # the statistic's distribution is then near enough chi-square's
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


@pytest.mark.parametrize("temperature, top_k, top_p, min_p, wrong_temperature", [
    (0.7, 0, 1.0, 0.0, 1.0), (1.3, 0, 1.0, 0.0, 1.0), (1.0, 5, 1.0, 0.0, None), (1.0, 0, 0.8, 0.0, None),
    (1.0, 0, 1.0, 0.1, None), (0.8, 6, 0.9, 0.0, None)])
def test_draws_follow_the_exact_renormalised_distribution(temperature, top_k, top_p, min_p, wrong_temperature):
    row = peaked_row()
    params = same_params(NUM_DRAWS, temperature, top_k, top_p, min_p)
    tokens, _ = sample(row.to(DEVICE).repeat(NUM_DRAWS, 1), params)
    statistic, dof = chi_square(tokens, exact_probs(row, temperature, top_k, top_p, min_p))
    assert dof >= 2
    assert statistic < CHI2_CRITICAL_0_001[dof]
    if wrong_temperature is not None:  # the test can tell distributions apart
        statistic, dof = chi_square(tokens, exact_probs(row, wrong_temperature, top_k, top_p, min_p))
        assert statistic > CHI2_CRITICAL_0_001[dof]


def philox_words(key: int, num_counters: int) -> np.ndarray:
    """The kernel's Philox-4x32-10 for counters 0 .. num_counters - 1 under a 64-bit key: uint32 [num_counters, 4]
    (word e of counter c is token 4c + e's)."""
    mask = np.uint64(0xFFFFFFFF)
    c0 = np.arange(num_counters, dtype=np.uint64)
    c1, c2, c3 = (np.zeros(num_counters, dtype=np.uint64) for _ in range(3))
    key &= 0xFFFFFFFFFFFFFFFF
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # < 2^64: exact
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


def test_philox_reference_gives_the_published_answers():
    """The reference Philox above against Random123's published answer for key 0 and counter 0 (its kat_vectors),
    so that the race test's words are the kernel's Philox-4x32-10."""
    assert [hex(w) for w in philox_words(0, 1)[0]] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]


def race_reference(row: torch.Tensor, temperature: float, key: int, kept=None) -> tuple[int, float]:
    """float64 winner of the exponential race over a row's tokens (those of the bool mask `kept`, or all), from the
    kernel's own random words: argmax of x - T log(E), E = -log1p(-v), v = word 2^-32 + 2^-33; and the gap to the
    runner-up (inf if none)."""
    vocab = row.numel()
    words = philox_words(key, -(-vocab // 4)).reshape(-1)[:vocab].astype(np.float64)
    v = words * 2.0**-32 + 2.0**-33
    scores = row.double().numpy() - temperature * np.log(-np.log1p(-v))
    if kept is not None:
        scores[~kept.numpy()] = -np.inf
    top2 = np.argpartition(-scores, 1)[:2]
    first, second = sorted(top2, key=lambda i: -scores[i])
    return int(first), float(scores[first] - scores[second])


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("vocab, scale, temperature, one_thread", [
    (151936, 0.5, 1.0, False), (151936, 4.0, 0.7, False), (32000, 1.0, 1.5, False), (1000, 20.0, 1.0, False),
    (1001, 1.0, 1.0, False), (151936, 0.5, 1.0, True), (151936, 4.0, 0.7, True)])
def test_race_winner_is_the_float64_race_argmax(vocab, scale, temperature, one_thread, dtype):
    """The drawn token is the race's winner computed in float64 from the same random words, in every row whose
    winner leads by more than float32's rounding could change: flat rows, where almost every token's score is
    skipped as unable to win, as well as peaked ones. one_thread: only tokens 4096k .. 4096k + 3 are finite, all
    read by the kernel's first thread (whether it loads 8 bf16 or 4 float32 at a time), so that its running best
    is the whole race and a skip that is too bold shows."""
    rows = 48
    generator = torch.Generator().manual_seed(vocab + int(scale * 10))
    logits = torch.randn(rows, vocab, generator=generator) * scale
    if one_thread:
        kept = (torch.arange(vocab) % 4096) < 4
        logits = logits.masked_fill(~kept, -math.inf)
    logits = logits.to(dtype)
    params = same_params(rows, temperature)
    params = params._replace(keys=random_keys(rows, generator))
    tokens, _ = sample(logits.to(DEVICE), params, want_thresholds=False)
    clear = 0
    for r in range(rows):
        winner, lead = race_reference(logits[r].float(), temperature, int(params.keys[r]))
        if lead > 1e-3 * temperature:
            clear += 1
            assert tokens[r] == winner, f"row {r}: drew {int(tokens[r])}, the race's winner is {winner}"
    assert clear >= 0.9 * rows, f"only {clear} of {rows} rows are clear"


# ---- top-k rows that gather their candidates --------------------------------------------------------

def assert_race_over_kept_tokens(logits, params: RowParams, tokens, thresholds, min_clear=0.9):
    """Every row's token is the float64 race's winner among the tokens its threshold keeps, where it leads by more
    than float32's rounding could change (at least min_clear of the rows)."""
    x = scaled(logits, params.temperatures)
    clear = 0
    for r in range(len(tokens)):
        temperature = float(params.temperatures[r])
        kept = x[r] >= thresholds[r]
        winner, lead = race_reference(logits[r].float(), temperature, int(params.keys[r]), kept)
        if lead > 1e-3 * temperature:
            clear += 1
            assert tokens[r] == winner, f"row {r}: drew {int(tokens[r])}, the race's winner is {winner}"
    assert clear >= min_clear * len(tokens), f"only {clear} of {len(tokens)} rows are clear"


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("vocab, scale, top_k, top_p, min_p", [
    (151936, 0.5, 20, 0.95, 0.0),  # Qwen3's generation defaults, on flat rows
    (151936, 4.0, 50, 1.0, 0.0), (151936, 1.0, 256, 0.9, 0.05), (151936, 2.0, 257, 0.9, 0.0),  # 257: select
    (32000, 2.0, 1, 1.0, 0.0),
    (32000, 4.0, 256, 0.9, 0.2),  # fewer than k tokens above the min_p floor
    (1000, 1.0, 200, 1.0, 0.0),  # fewer than k threads hold tokens (bf16: 125)
    (1001, 1.0, 100, 0.9, 0.0),  # read element by element
    (151936, 8.0, 0, 0.9, 0.0), (151936, 8.0, 0, 0.5, 0.01),  # top-p alone: a narrowed select
    (50257, 20.0, 600, 0.95, 0.0)])  # k past 256: a narrowed select
def test_truncated_rows_keep_the_reference_tokens_and_draw_the_race_winner(vocab, scale, top_k, top_p, min_p, dtype):
    """Top-k rows up to k = 256 take their candidates from the elements at or above the k-th largest of the
    threads' maxima, and other truncated rows those of a select's first level where they are few: the thresholds
    are the float64 reference's, and the token is the race's winner among the kept tokens, as on the select way
    (k = 257 on flat rows)."""
    rows = 48
    generator = torch.Generator().manual_seed(vocab + top_k)
    logits = (torch.randn(rows, vocab, generator=generator) * scale).to(dtype)
    params = same_params(rows, 0.7, top_k, top_p, min_p)._replace(keys=random_keys(rows, generator))
    tokens, thresholds = sample(logits.to(DEVICE), params)
    assert_follows_reference(logits, params, tokens, thresholds)
    assert_race_over_kept_tokens(logits, params, tokens, thresholds)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("ties", [1024, 1025])  # the candidates' capacity, and one more: the select way
def test_ties_at_the_top_fill_the_candidates_or_go_the_select_way(ties, dtype):
    """Tokens tied at the largest logit, spread over the row, reach every thread's maximum: the candidates are
    exactly the ties. Either way every row keeps all the ties and draws the race's winner among them."""
    rows, vocab = 64, 32000
    generator = torch.Generator().manual_seed(ties)
    row = torch.randn(vocab, generator=generator) - 10.0
    tied = torch.randperm(vocab, generator=generator)[:ties]
    row[tied] = 3.0
    logits = row.to(dtype).repeat(rows, 1)
    params = same_params(rows, 1.0, top_k=5)._replace(keys=random_keys(rows, generator))
    tokens, thresholds = sample(logits.to(DEVICE), params)
    assert (thresholds == 3.0).all()
    assert set(tokens.tolist()) <= set(tied.tolist())
    assert len(set(tokens.tolist())) > rows // 2
    assert_race_over_kept_tokens(logits, params, tokens, thresholds)


@pytest.mark.parametrize("top_k, min_p", [(5, 0.0), (0, 1.0), (300, 0.0), (5, 1.0)])
def test_signed_zeros_at_the_top_are_one_logit(top_k, min_p):
    """A row whose largest logit is 0, -0.0 at its first index and +0.0 elsewhere: every zero is kept (top-k ties,
    min_p 1 keeps the maximum's ties) and drawn, none left out as above or below the row's maximum."""
    rows, vocab = 256, 4096
    row = torch.full((vocab,), -4.0)
    zeros = torch.arange(0, vocab, 7)
    row[zeros] = 0.0
    row[0] = -0.0
    params = same_params(rows, 1.0, top_k=top_k, min_p=min_p)._replace(
        keys=random_keys(rows, torch.Generator().manual_seed(9)))
    tokens, thresholds = sample(row.to(DEVICE).repeat(rows, 1), params)
    assert (thresholds == 0.0).all()
    assert set(tokens.tolist()) <= set(zeros.tolist())
    assert len(set(tokens.tolist())) > 100
    assert_race_over_kept_tokens(row.repeat(rows, 1), params, tokens, thresholds)


# ---- keys ------------------------------------------------------------------------------------------

def test_a_key_gives_the_same_token_whatever_the_batch():
    generator = torch.Generator().manual_seed(4)
    rows, others, vocab = 200, 300, 32000
    logits = (torch.randn(rows + others, vocab, generator=generator) * 0.5).to(BF16)  # flat: draws spread
    params = random_params(rows + others, vocab, generator)
    row_logits, row_params = logits[:rows], params.select(slice(0, rows))
    tokens, thresholds = sample(row_logits.to(DEVICE), row_params)
    again, _ = sample(row_logits.to(DEVICE), row_params, want_thresholds=False)
    assert torch.equal(again, tokens)
    # Permuted among other rows, in a bigger batch.
    order = torch.randperm(rows + others, generator=generator)
    batch, _ = sample(logits[order].to(DEVICE), params.select(order))
    assert torch.equal(batch[order.argsort()[:rows]], tokens)
    # The draw depends on the logits' values, not their dtype.
    as_float, _ = sample(row_logits.float().to(DEVICE), row_params)
    assert torch.equal(as_float, tokens)
    # Other keys, other draws: on the rows that keep thousands of tokens, nearly all change.
    rekeyed, _ = sample(row_logits.to(DEVICE), row_params._replace(keys=random_keys(rows, generator)))
    wide = (scaled(row_logits, row_params.temperatures) >= thresholds[:, None]).sum(dim=-1) >= 1000
    assert wide.sum() >= 50
    assert (rekeyed[wide] != tokens[wide]).float().mean() > 0.9


@pytest.mark.parametrize("keys", [torch.arange(4096), torch.arange(4096) + (-2**63), torch.arange(4096) << 32],
                         ids=["consecutive", "most_negative", "high_bits_only"])
def test_distinct_keys_draw_independently(keys):
    generator = torch.Generator().manual_seed(5)
    vocab = 8192
    row = torch.randn(vocab, generator=generator) * 0.5
    tokens, _ = sample(row.to(DEVICE).repeat(len(keys), 1), same_params(len(keys))._replace(keys=keys))
    probs = (row.double() - row.max()).exp()
    probs /= probs.sum()
    expected_distinct = float((1 - (1 - probs) ** len(keys)).sum())  # about 3,100 of 4,096
    assert len(set(tokens.tolist())) > 0.95 * expected_distinct


# ---- overrides -------------------------------------------------------------------------------------

def test_overridden_rows_are_read_from_the_overrides():
    generator = torch.Generator().manual_seed(6)
    rows, vocab, num_overrides = 256, 32000, 100
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(BF16)
    params = random_params(rows, vocab, generator)
    # Half penalised rows (finite, with a few tokens at -inf as min_tokens masks), half a few finite tokens.
    overrides = torch.randn(num_overrides, vocab, generator=generator) * 4
    overrides.scatter_(1, torch.randint(vocab, (num_overrides, 3), generator=generator), -math.inf)
    sparse = torch.full((num_overrides // 2, vocab), -math.inf)
    sparse.scatter_(1, torch.randint(vocab, (num_overrides // 2, 4), generator=generator),
                    torch.randn(num_overrides // 2, 4, generator=generator))
    overrides[num_overrides // 2:] = sparse
    override_rows = torch.full((rows,), -1, dtype=torch.int32)
    overridden = torch.randperm(rows, generator=generator)[:num_overrides]
    override_rows[overridden] = torch.randperm(num_overrides, generator=generator).int()
    logits[overridden, 0] = 1e4  # where a row read its own logits, it would take token 0
    effective = logits.float()
    effective[overridden] = overrides[override_rows[overridden].long()]
    tokens, thresholds = sample(logits.to(DEVICE), params, overrides.to(DEVICE), override_rows.to(DEVICE))
    assert_follows_reference(effective, params, tokens, thresholds)
    # A row's draw depends on its logits after overrides only: given directly, the same keys draw the same tokens.
    direct, _ = sample(effective.to(DEVICE), params)
    assert torch.equal(direct, tokens)


def test_an_override_with_a_few_finite_tokens_draws_only_those():
    rows, vocab = 2000, 32000
    allowed = torch.tensor([5, 999, 20000, 31999])
    overrides = torch.full((2, vocab), -math.inf)
    overrides[0, allowed] = torch.tensor([0.0, 0.0, -0.5, 0.3])
    overrides[1, allowed] = torch.tensor([1.0, 3.0, 3.0, 2.0])  # greedy: the first of two maxima, 999
    logits = torch.zeros(rows, vocab, dtype=BF16, device=DEVICE)
    logits[:, 0] = 1e4  # where a row read its own logits, it would take token 0
    greedy = torch.arange(rows) % 4 == 0
    params = same_params(rows)._replace(temperatures=torch.where(greedy, 0.0, 1.0))
    override_rows = greedy.int()  # sampled rows: override 0; greedy rows: override 1
    tokens, thresholds = sample(logits, params, overrides.to(DEVICE), override_rows.to(DEVICE))
    assert set(tokens[~greedy].tolist()) == set(allowed.tolist())
    assert (tokens[greedy] == 999).all()
    assert (thresholds[~greedy] == -math.inf).all() and (thresholds[greedy] == 3.0).all()


# ---- ties at the k-th logit ------------------------------------------------------------------------

def test_ties_with_the_kth_logit_are_kept_past_rank_k():
    rows, vocab = 2000, 32000
    row = torch.full((vocab,), -5.0)
    row[7::7] = 0.0  # 4,571 ties with the 5th largest logit, across the whole row
    row[torch.tensor([10, 20001, 30001, 31999])] = torch.tensor([1.0, 0.9, 0.8, 0.7])
    tokens, thresholds = sample(row.to(BF16).to(DEVICE).repeat(rows, 1), same_params(rows, top_k=5))
    assert (thresholds == 0.0).all()
    assert (row[tokens] >= 0.0).all()
    ties = tokens[row[tokens] == 0.0]
    assert len(set(ties.tolist())) > 1000  # the ties hold nearly all the mass: about 1,600 distinct are drawn
    assert ties.max() > vocab - 1000


def test_top_p_after_top_k_counts_the_first_k_by_rank_not_their_ties():
    rows, vocab = 4000, 1000
    row = torch.full((vocab,), -10.0)
    row[:6] = torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # By rank, top-k 2 leaves probabilities .73 and .27: a top_p of .7 keeps the first token alone. Counting the
    # four ties too would keep all six. Without top-p, all six are kept.
    with_top_p = torch.arange(rows) % 2 == 0
    params = same_params(rows, top_k=2)._replace(top_ps=torch.where(with_top_p, 0.7, 1.0))
    tokens, thresholds = sample(row.to(DEVICE).repeat(rows, 1), params)
    assert set(tokens[with_top_p].tolist()) == {0} and (thresholds[with_top_p] == 2.0).all()
    assert set(tokens[~with_top_p].tolist()) == set(range(6)) and (thresholds[~with_top_p] == 1.0).all()


# ---- layouts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("vocab, padded, offset", [(32000, 32003, 0), (151936, 151937, 1), (50257, 50257, 1),
                                                   (1000, 1000, 1), (13, 16, 3), (7, 7, 1)])
def test_strided_and_misaligned_rows(vocab, padded, offset, dtype):
    """Rows of a wider buffer (an odd stride starts each row at a different alignment), from an element offset.
    Everything around the rows holds huge logits, which a kernel reading past them would take."""
    generator = torch.Generator().manual_seed(vocab + offset)
    rows = 48
    buffer = torch.full((offset + rows * padded + 8,), 1e4)
    full = buffer[offset:offset + rows * padded].view(rows, padded)
    full[:, :vocab] = torch.randn(rows, vocab, generator=generator) * 4
    buffer = buffer.to(dtype)
    logits = buffer[offset:offset + rows * padded].view(rows, padded)[:, :vocab]
    params = random_params(rows, vocab, generator)
    on_device = buffer.to(DEVICE)[offset:offset + rows * padded].view(rows, padded)[:, :vocab]
    tokens, thresholds = sample(on_device, params)
    assert_follows_reference(logits, params, tokens, thresholds)


# ---- argument checks -------------------------------------------------------------------------------

def test_bad_arguments_are_rejected_with_the_argument_named():
    rows, vocab = 4, 100
    f32 = dict(dtype=torch.float32, device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    i64 = dict(dtype=torch.int64, device=DEVICE)
    good = dict(logits=torch.randn(rows, vocab).to(BF16).to(DEVICE), temperatures=torch.ones(rows, **f32),
                top_ks=torch.zeros(rows, **i32), top_ps=torch.ones(rows, **f32), min_ps=torch.zeros(rows, **f32),
                keys=torch.arange(rows, device=DEVICE), out=torch.empty(rows, **i64),
                thresholds=torch.empty(rows, **f32), overrides=torch.zeros(2, vocab, **f32),
                override_rows=torch.tensor([-1, 0, -1, 1], **i32))
    bad = [("logits", dict(logits=good["logits"].half())), ("logits", dict(logits=good["logits"].cpu())),
           ("temperatures", dict(temperatures=torch.ones(rows + 1, **f32))),
           ("top_ks", dict(top_ks=torch.zeros(rows, **i64))), ("top_ps", dict(top_ps=torch.ones(rows - 1, **f32))),
           ("min_ps", dict(min_ps=torch.zeros(rows, dtype=torch.float64, device=DEVICE))),
           ("keys", dict(keys=torch.arange(rows, **i32))), ("out", dict(out=torch.empty(rows + 1, **i64))),
           ("out", dict(out=torch.empty(rows, **i32))), ("thresholds", dict(thresholds=torch.empty(rows + 2, **f32))),
           ("overrides", dict(overrides=torch.zeros(2, vocab + 1, **f32))),
           ("overrides", dict(overrides=torch.zeros(2, vocab, device=DEVICE).to(BF16))),
           ("override_rows", dict(override_rows=torch.zeros(rows - 1, **i32))),
           ("override", dict(overrides=None)), ("override", dict(override_rows=None))]
    for name, change in bad:
        with pytest.raises(REJECTED, match=name):
            ops.sample_rows(*{**good, **change}.values())
    ops.sample_rows(*good.values())
    torch.cuda.synchronize()  # the rejected calls launched nothing that fails later
    assert ((good["out"] >= 0) & (good["out"] < vocab)).all()


def test_bad_packed_arguments_are_rejected_with_the_field_named():
    """ops.sample_packed: the layout, each blob and each field is checked (in its blob, aligned, apart from the
    others) before anything runs."""
    rows, vocab, n = 4, 100, 2
    layout = PackedFormat.of(require_core()).layout(rows=rows, logprob_columns=3, num_overrides=n, seen_width=2,
                                                    masked_width=1, bias_width=0)
    blob = np.zeros(layout.params_nbytes, np.uint8)
    layout.pack(dict(temperatures=[1, 0, 0.5, 1], top_ks=[0, 0, 5, 0], top_ps=[1, 1, 1, 0.9], min_ps=[0] * 4,
                     keys=[1, 2, 3, 4], num_logprobs=[-1, 2, -1, 0], override_rows=[-1, 0, -1, 1],
                     override_source=[1, 3], seen_tokens=[[5, -1], [6, 7]], output_counts=[[1, 0], [2, 1]],
                     presence=[0.5, 0], frequency=[0, 0.3], repetition=[1, 1.2], masked_tokens=[[9], [-1]],
                     biased_tokens=np.zeros((n, 0)), biases=np.zeros((n, 0)), mask_others=[0, 0]), blob)
    params = torch.from_numpy(blob).to(DEVICE)
    offsets = list(layout.layout)
    at = {name: len(layout.counts) + i for i, name in enumerate([*layout.params, *layout.results])}
    good = dict(logits=torch.randn(rows, vocab).to(BF16).to(DEVICE), params=params, layout=tuple(offsets),
                results=torch.empty(layout.results_nbytes, dtype=torch.uint8, device=DEVICE),
                overrides=torch.empty(n, vocab, device=DEVICE))

    def moved(name, offset):
        return tuple(offset if i == at[name] else value for i, value in enumerate(offsets))

    bad = [("layout", dict(layout=tuple(offsets[:-1]))), ("rows", dict(logits=good["logits"][:3])),
           ("logprob columns", dict(layout=(rows, 40, *offsets[2:]))),
           ("negative", dict(layout=(rows, 3, -1, *offsets[3:]))),
           ("params", dict(params=params.view(torch.int32))), ("params", dict(params=params[1:])),
           ("params", dict(params=params.cpu())), ("results", dict(results=good["results"][:-8])),
           ("top_ks", dict(layout=moved("top_ks", offsets[at["top_ks"]] + 4))),
           ("masked_tokens", dict(params=params[:offsets[at["masked_tokens"]]])),
           ("overlap", dict(layout=moved("top_ps", offsets[at["top_ks"]]))),
           ("logprob_ids", dict(layout=moved("logprob_ids", layout.results_nbytes))),
           ("overrides", dict(overrides=None)), ("overrides", dict(overrides=torch.empty(n, vocab + 1, device=DEVICE)))]
    for name, change in bad:
        with pytest.raises(REJECTED, match=name):
            ops.sample_packed(*{**good, **change}.values())
    ops.sample_packed(*good.values())
    tokens = good["results"][:rows * 8].view(torch.int64).cpu()
    assert ((tokens >= 0) & (tokens < vocab)).all()
    greedy = good["logits"][1].float().cpu()  # row 1 reads override 0: presence 0.5 at token 5, token 9 masked
    greedy[5] -= 0.5
    greedy[9] = float("-inf")
    assert tokens[1] == greedy.argmax()


# ---- prepare_overrides ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_overrides_are_the_source_rows_with_every_penalty_and_mask_applied(dtype):
    """Thousands of seen tokens per row, so that penalty writes and the row copy overlap in time: every element of
    every override row must be the source logit, penalised where seen, -inf where masked."""
    g = torch.Generator().manual_seed(11)
    rows, vocab, num_seen, num_masked = 6, 151936, 6000, 3
    logits = (torch.randn(10, vocab, generator=g) * 3).to(dtype)
    source_rows = torch.tensor([7, 0, 3, 3, 9, 1], dtype=torch.int32)
    seen = torch.stack([torch.randperm(vocab, generator=g)[:num_seen] for _ in range(rows)]).to(torch.int32)
    seen[1, num_seen // 2:] = -1  # padding
    counts = torch.randint(0, 4, (rows, num_seen), generator=g, dtype=torch.int32)
    presence, frequency = torch.rand(rows, generator=g) * 2 - 0.5, torch.rand(rows, generator=g)
    repetition = 1 + torch.rand(rows, generator=g)
    masked = torch.randint(0, vocab, (rows, num_masked), generator=g, dtype=torch.int32)
    masked[2, 1:] = -1
    out = torch.full((rows, vocab), float("nan"), device=DEVICE)
    ops.prepare_overrides(logits.to(DEVICE), source_rows.to(DEVICE), out, seen.to(DEVICE), counts.to(DEVICE),
                          presence.to(DEVICE), frequency.to(DEVICE), repetition.to(DEVICE), masked.to(DEVICE))
    want = logits.float()[source_rows.long()].clone()
    for r in range(rows):
        tokens, c = seen[r][seen[r] >= 0].long(), counts[r][seen[r] >= 0].float()
        x = want[r, tokens]
        x = torch.where(x > 0, x / repetition[r], x * repetition[r])
        want[r, tokens] = x - (frequency[r] * c + presence[r] * (c > 0).float())
        want[r, masked[r][masked[r] >= 0].long()] = float("-inf")
    torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)
