"""The sampler's truncations found among candidates (torch.topk) against the whole sorted rows: thresholds equal to
a float64 full-sort reference on random logits, from peaked rows to rows whose nucleus spills past the candidates;
spilled rows drawn from the exact renormalised distribution; ties at the k-th logit kept; seeded draws that do not
depend on the batch; penalties that follow a sequence's tokens as they change."""
import math

import pytest
import torch

from nanograph import SamplingParams
from nanograph.engine.sequence import Sequence
from nanograph.sampling import Sampler, SamplerOutput, seeded_generator
from nanograph.sampling.torch_plan import CANDIDATES
from nanograph.sampling.transforms import TruncationParams, sorted_top_p_thresholds, truncation_thresholds

CHI2_CRITICAL_0_001_DOF_9 = 27.877
AMBIGUOUS = 1e-5  # float32 rounding may decide a row where a cumulative probability or logit is this close to its bound


def sampler(seed=0) -> Sampler:
    return Sampler(torch.device("cpu"), [0], seed)


def sample(logits: torch.Tensor, seqs: list[Sequence], seed=0) -> SamplerOutput:
    """One call of a fresh sampler, read back."""
    return sampler(seed).sample(logits, seqs).result()


def seq(params: SamplingParams, prompt=(1, 2, 3)) -> Sequence:
    s = Sequence("0", None, list(prompt), params)
    if params.seed is not None:
        s.generator = seeded_generator(params.seed)
    return s


def reference_thresholds(logits, top_ks, top_ps, min_ps):
    """vLLM's order on whole sorted rows in float64, as the sampler computed it before candidates: top-k (by rank)
    and min_p, then top-p; the threshold is the smallest kept logit. Also each row's distance to ambiguity."""
    vocab = logits.shape[-1]
    sorted_logits = logits.double().sort(dim=-1, descending=True).values
    ranks = torch.arange(vocab)
    kth = torch.where(top_ks < vocab, sorted_logits.gather(1, top_ks - 1), -math.inf)
    min_p_floors = sorted_logits[:, :1] + min_ps.double().log()
    floors = torch.maximum(min_p_floors, kth)
    masked = sorted_logits.masked_fill((ranks >= top_ks) | (sorted_logits < floors), -math.inf)
    probs = masked.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    num_kept = ((before < top_ps) & (masked > -math.inf)).sum(dim=-1, keepdim=True)
    thresholds = torch.where(top_ps < 1, sorted_logits.gather(1, num_kept - 1), floors)
    # The kept count flips if top_p sits this close to the cumulative probability before the last kept token or the
    # first dropped one, or if a logit sits this close to the min_p floor.
    beside = torch.cat([before.gather(1, num_kept - 1), before.gather(1, num_kept.clamp(max=vocab - 1))], 1)
    top_p_margin = torch.where(top_ps < 1, (beside - top_ps).abs(), math.inf).amin(dim=-1)
    margin = torch.minimum(top_p_margin, (sorted_logits - min_p_floors).abs().amin(dim=-1))
    return thresholds.float(), margin


def random_truncations(rows: int, vocab: int, generator: torch.Generator):
    pick = lambda options: torch.tensor(options)[torch.randint(len(options), (rows, 1), generator=generator)]
    top_ks = pick([vocab, vocab, 1, 20, 300])  # vocab: none
    top_ps = pick([1.0, 0.3, 0.9, 0.99]).float()
    min_ps = pick([0.0, 0.0, 0.01, 0.2]).float()
    return top_ks, top_ps, min_ps


@pytest.mark.parametrize("scale, spills", [(0.3, True), (2.0, True), (8.0, False)])  # flat rows to peaked ones
def test_thresholds_among_candidates_equal_the_full_sort_reference(scale, spills):
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 400, 6000
    logits = torch.randn(rows, vocab, generator=generator) * scale
    top_ks, top_ps, min_ps = random_truncations(rows, vocab, generator)
    num_candidates = min(vocab, int(top_ks[top_ks < vocab].max()) + CANDIDATES)  # as the sampler chooses
    candidates = logits.topk(num_candidates, dim=-1).values
    no_top_k = top_ks == vocab
    params = TruncationParams(top_ks.clamp(max=num_candidates), no_top_k, min_ps.log(), top_ps,
                              ((top_ps < 1) & no_top_k).squeeze(1).nonzero().squeeze(1))
    floors, thresholds = truncation_thresholds(logits, candidates, (candidates - candidates[:, :1]).exp(), params,
                                               open_min_p=True)
    spilled = (candidates[:, -1:] >= thresholds).squeeze(1)  # the sampler takes these from the sorted row
    thresholds[spilled] = torch.where(top_ps < 1, sorted_top_p_thresholds(logits, top_ps, top_ks, floors),
                                      floors)[spilled]
    expected, margin = reference_thresholds(logits, top_ks, top_ps, min_ps)
    clear = margin > AMBIGUOUS
    assert clear.float().mean() > 0.9
    kept = logits >= thresholds
    assert torch.equal(kept[clear], (logits >= expected)[clear])
    truncated = ((top_ks < vocab) | (top_ps < 1) | (min_ps > 0)).squeeze(1)  # the rows the sampler truncates
    assert bool(spilled[truncated].any()) == spills  # whether the sorted fallback is exercised
    assert not spilled[truncated].all()


def test_draws_keep_to_the_reference_thresholds_through_candidates_and_spills():
    generator = torch.Generator().manual_seed(1)
    rows, vocab = 600, 3000
    logits = torch.randn(rows, vocab, generator=generator) * torch.tensor([0.3, 2.0, 6.0]).repeat(rows // 3)[:, None]
    top_ks, top_ps, min_ps = random_truncations(rows, vocab, generator)
    params = [SamplingParams(top_k=0 if k == vocab else int(k), top_p=float(p), min_p=float(m))
              for k, p, m in zip(top_ks.squeeze(1).tolist(), top_ps.squeeze(1).tolist(), min_ps.squeeze(1).tolist())]
    expected, margin = reference_thresholds(logits, top_ks, top_ps, min_ps)
    token_ids = torch.tensor(sample(logits, [seq(p) for p in params]).token_ids)
    drawn = logits.gather(1, token_ids[:, None])
    clear = margin > AMBIGUOUS
    assert (drawn[clear] >= expected[clear]).all()
    truncated = ((top_ks < vocab) | (top_ps < 1) | (min_ps > 0)).squeeze(1)
    ranks = (logits > drawn).sum(dim=-1)
    assert (ranks[truncated] >= CANDIDATES + 300).any()  # some spilled rows drew past every row's candidates


def test_a_spilled_nucleus_is_drawn_from_the_exact_renormalised_distribution():
    vocab, top_p, num_draws = 4000, 0.9, 20000
    logits = -torch.arange(vocab) * 5e-4  # nearly flat: the nucleus holds thousands of tokens
    probs = logits.double().softmax(dim=-1)
    nucleus = int(((probs.cumsum(dim=-1) - probs) < top_p).sum())
    assert nucleus > CANDIDATES
    token_ids = torch.tensor(sample(logits.repeat(num_draws, 1),
                                    [seq(SamplingParams(top_p=top_p))] * num_draws).token_ids)
    assert int(token_ids.max()) < nucleus
    bins = torch.linspace(0, nucleus, 11).long()  # ten bins of tokens
    expected = torch.stack([probs[a:b].sum() for a, b in zip(bins[:-1], bins[1:])]) / probs[:nucleus].sum()
    observed = torch.bucketize(token_ids, bins[1:], right=True).bincount(minlength=10).double()
    chi_square = float(((observed - expected * num_draws) ** 2 / (expected * num_draws)).sum())
    assert chi_square < CHI2_CRITICAL_0_001_DOF_9


def test_ties_at_the_kth_logit_are_kept_even_past_the_candidates():
    vocab = 4000
    logits = torch.full((vocab,), -5.0)
    logits[:4] = torch.tensor([3.0, 2.5, 2.0, 1.5])
    logits[1000:3000] = 0.0  # 2000 ties with the 5th largest logit
    token_ids = sample(logits.repeat(3000, 1), [seq(SamplingParams(temperature=0.2, top_k=5))] * 3000).token_ids
    assert set(token_ids) <= set(range(4)) | set(range(1000, 3000))
    assert max(token_ids) >= 1000 + CANDIDATES  # beyond the 1029 candidates


def test_top_p_after_top_k_counts_the_first_k_by_rank_not_their_ties():
    logits = torch.full((50,), -10.0)
    logits[:6] = torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # By rank, top-k 2 leaves probabilities .73 and .27: a top_p of .7 keeps the first token alone. Counting the
    # four ties too would keep all six.
    token_ids = sample(logits.repeat(2000, 1), [seq(SamplingParams(top_k=2, top_p=0.7))] * 2000).token_ids
    assert set(token_ids) == {0}


def test_min_tokens_masked_tokens_are_never_drawn():
    logits = torch.tensor([[4.0, 1.0, 0.5, 0.0]]).repeat(4000, 1)  # EOS (0) is by far the likeliest
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    token_ids = sample(logits, [seq(params)] * 4000).token_ids
    assert set(token_ids) == {1, 2}


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=7),
                                    SamplingParams(top_p=0.9, seed=7), SamplingParams(top_k=30, min_p=0.01, seed=7),
                                    SamplingParams(temperature=1.5, top_p=0.95, seed=7)])  # the last one spills
def test_a_seeded_row_draws_the_same_whatever_the_batch(params):
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 3000, generator=generator) * torch.tensor([4.0] * 8 + [0.3])[:, None]
    target = logits[-1:] if params.temperature == 1.5 else logits[:1]

    def draws(others: list[SamplingParams], sampler_seed: int) -> list[int]:
        s = sampler(sampler_seed)
        seeded = seq(params)
        seqs = [seq(p) for p in others] + [seeded]
        return [s.sample(torch.cat([logits[1:len(others) + 1], target]), seqs).result().token_ids[-1] for _ in range(6)]

    alone = draws([], 0)
    assert len(set(alone)) > 1
    assert draws([SamplingParams(temperature=0), SamplingParams(top_k=3), SamplingParams(top_p=0.5),
                  SamplingParams(min_p=0.1, seed=3), SamplingParams()], 5) == alone


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.95, seed=1234),
                                    SamplingParams(temperature=1.0, top_k=1400, seed=99),
                                    SamplingParams(temperature=1.0, min_p=0.5, seed=5)])
def test_a_seeded_row_draws_the_same_beside_a_large_top_k(params):
    """Whether a row's kept tokens spill past the candidates depends on the batch (its largest top-k sets how many
    there are): a seeded row is drawn from its whole row either way, so its tokens are the same alone, beside a
    top_k=1000 request (its ~1,400 kept tokens then fit the 2,024 candidates), and beside one whose candidates are
    the whole row."""
    generator = torch.Generator().manual_seed(0)
    vocab = 3000
    row = torch.full((vocab,), -30.0)
    row[torch.randperm(vocab, generator=generator)[:1500]] = torch.randn(1500, generator=generator) * 0.1

    def draws(neighbour: SamplingParams | None) -> list[int]:
        s = sampler(1)
        seqs = [seq(params)] + ([seq(neighbour)] if neighbour else [])
        logits = row.repeat(len(seqs), 1)
        return [s.sample(logits, seqs).result().token_ids[0] for _ in range(8)]

    alone = draws(None)
    assert len(set(alone)) > 1
    assert draws(SamplingParams(temperature=1.0, top_k=1000)) == alone
    assert draws(SamplingParams(temperature=1.0, top_k=2500)) == alone


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # torch path, kernels
def test_penalties_follow_the_sequence_tokens_as_they_change(device):
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0, 0.0]], device=device)
    s = Sampler(torch.device(device), [0], 0)
    sequence = seq(SamplingParams(temperature=0, presence_penalty=1.0), prompt=[5])
    assert s.sample(logits, [sequence]).result().token_ids == [1]
    sequence.token_ids.append(1)  # generated: now penalised
    assert s.sample(logits, [sequence]).result().token_ids == [2]
    sequence.token_ids[-1] = 3  # a placeholder replaced in place, as the engine does with a pending token
    assert s.sample(logits, [sequence]).result().token_ids == [1]
