"""The sampler against reference formulas: greedy, temperature and top-p (chi-square against the exact softmax),
top-k, min_p, the three penalties, min_tokens, seeds and logprobs."""
import math

import pytest
import torch

from nanograph import SamplingParams
from nanograph.engine.sequence import PENDING_TOKEN, Sequence
from nanograph.sampling import Sampler, SamplerOutput, seeded_generator
from nanograph.sampling.seen import SeenTokens
from nanograph.sampling.transforms import apply_penalties

EOS = 0
NUM_DRAWS = 20000
# Chi-square critical values at significance 0.001, by degrees of freedom (statistical tables).
CHI2_CRITICAL_0_001 = {3: 16.266, 4: 18.467, 5: 20.515, 7: 24.322}


def sampler(seed=0) -> Sampler:
    return Sampler(torch.device("cpu"), [EOS], seed)


def sample(logits: torch.Tensor, seqs: list[Sequence], seed=0) -> SamplerOutput:
    """One call of a fresh sampler, read back."""
    return sampler(seed).sample(logits, seqs).result()


def seq(params: SamplingParams, prompt=(1, 2, 3), output=()) -> Sequence:
    s = Sequence("0", None, list(prompt) + list(output), params)
    s.num_prompt_tokens = len(prompt)
    if params.seed is not None:
        s.generator = seeded_generator(params.seed)
    return s


def draw(logits_row, params, n=NUM_DRAWS, seed=0) -> torch.Tensor:
    """n draws from one row, sampled as n rows of one batch."""
    return torch.tensor(sample(logits_row.repeat(n, 1), [seq(params) for _ in range(n)], seed=seed).token_ids)


def chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens of non-zero probability (draws elsewhere fail the caller's check)."""
    observed = torch.bincount(draws, minlength=len(probs)).double()
    expected = probs.double() * len(draws)
    support = probs > 0
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_draws_follow_the_exact_softmax(temperature):
    draws = draw(LOGITS, SamplingParams(temperature=temperature))
    exact = (LOGITS / temperature).softmax(-1)
    assert chi_square(draws, exact) < CHI2_CRITICAL_0_001[7]
    wrong = LOGITS.softmax(-1) if temperature != 1.0 else (LOGITS / 1.3).softmax(-1)
    assert chi_square(draws, wrong) > CHI2_CRITICAL_0_001[7]  # the test can tell distributions apart


@pytest.mark.parametrize("top_p, nucleus", [(0.5, 2), (0.8, 4), (0.95, 6)])
def test_top_p_draws_follow_the_renormalised_nucleus(top_p, nucleus):
    probs = LOGITS.softmax(-1)  # .35 .21 .13 .08 .05 .03 .02 .01 (rounded)
    assert (probs.cumsum(-1)[nucleus - 1] >= top_p) and (probs.cumsum(-1)[nucleus - 2] < top_p)
    draws = draw(LOGITS, SamplingParams(top_p=top_p))
    exact = torch.zeros_like(probs)
    exact[:nucleus] = probs[:nucleus] / probs[:nucleus].sum()
    assert int(draws.max()) < nucleus
    if nucleus > 2:
        assert chi_square(draws, exact) < CHI2_CRITICAL_0_001[nucleus - 1]
    else:
        assert abs(float((draws == 0).double().mean()) - float(exact[0])) < 0.015


def test_greedy_and_top_k_1_are_the_argmax():
    logits = torch.randn(8, 1000)
    assert sample(logits, [seq(SamplingParams(temperature=0))] * 8).token_ids == logits.argmax(-1).tolist()
    assert sample(logits, [seq(SamplingParams(temperature=1.5, top_k=1))] * 8).token_ids == \
        logits.argmax(-1).tolist()


def test_top_k_draws_only_the_k_largest():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0, 2.0, 3.0])
    assert set(draw(logits, SamplingParams(top_k=3), n=2000).tolist()) == {1, 3, 5}


def test_min_p_keeps_exactly_the_tokens_above_min_p_times_the_top_probability():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    for min_p, temperature in [(0.1, 1.0), (0.3, 1.0), (0.1, 0.5)]:
        probs = (logits / temperature).softmax(-1)
        allowed = {i for i in range(6) if probs[i] >= min_p * probs.max()}
        drawn = set(draw(logits, SamplingParams(min_p=min_p, temperature=temperature), n=4000).tolist())
        assert drawn == allowed, (min_p, temperature)


def test_each_row_uses_its_own_parameters():
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    row_params = [SamplingParams(temperature=0), SamplingParams(top_k=2), SamplingParams(top_p=0.6),
                  SamplingParams(top_k=3, top_p=0.95), SamplingParams(), SamplingParams(min_p=0.6)]
    allowed = [{0}, {0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1}]
    seqs = [seq(p) for p in row_params] * 2000
    draws = sample(row.repeat(len(seqs), 1), seqs).token_ids
    for i, expected in enumerate(allowed):
        assert set(draws[i::len(row_params)]) == expected


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's penalties, one token at a time."""
    logits = logits.clone()
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    for token in set(output):
        logits[token] -= frequency * output.count(token) + presence
    return logits


def test_penalties_match_the_reference_formula():
    """The sampler's pieces: SeenTokens' distinct tokens and output counts, then apply_penalties at them."""
    torch.manual_seed(0)
    vocab = 40
    cases = [([1, 2, 3], [3, 3, 4, 9], 0.5, 0.0, 1.0), ([5, 6], [6, 7, 7, 7], 0.0, 0.7, 1.0),
             ([8, 9, 10], [10, 11, 11], 0.0, 0.0, 1.3), ([2, 2, 12], [12, 13, 13, 2], -0.4, 1.1, 0.8),
             ([1], [], 1.0, 1.0, 2.0)]
    logits = torch.randn(len(cases), vocab) * 3
    seen = SeenTokens()
    for row, (prompt, output, p, f, r) in enumerate(cases):
        token_ids, counts = seen(seq(SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r),
                                     prompt, output))
        assert len(set(token_ids.tolist())) == len(token_ids)  # distinct
        token_ids = torch.from_numpy(token_ids.astype("int64"))
        penalised = logits[row].clone()
        penalised[token_ids] = apply_penalties(logits[row, token_ids][None], torch.from_numpy(counts).float()[None],
                                               torch.tensor([[p]]), torch.tensor([[f]]), torch.tensor([[r]]))[0]
        assert torch.allclose(penalised, reference_penalties(logits[row], prompt, output, p, f, r))


def test_seen_tokens_follow_a_growing_sequence_and_skip_pending_tokens():
    seen = SeenTokens()
    s = seq(SamplingParams(frequency_penalty=1.0), [4, 5], [6])
    assert [x.tolist() for x in seen(s)] == [[6], [1]]  # no repetition penalty: the output only
    s.token_ids += [6, 7, PENDING_TOKEN]
    assert [x.tolist() for x in seen(s)] == [[6, 7], [2, 1]]
    s.token_ids[-1] = 4
    assert [x.tolist() for x in seen(s)] == [[6, 7, 4], [2, 1, 1]]
    r = seq(SamplingParams(repetition_penalty=1.2), [4, 5, 4], [5, 9])
    assert [x.tolist() for x in seen(r)] == [[4, 5, 9], [0, 1, 1]]  # the prompt too, counted as unseen in output


def test_the_sampler_applies_penalties_before_the_greedy_choice():
    logits = torch.tensor([[3.0, 4.0, 3.8, 3.3, -1.0]]).repeat(4, 1)
    prompt, output = [3], [1, 1, 2]
    params = [SamplingParams(temperature=0, **penalty) for penalty in
              [{}, {"presence_penalty": 0.8}, {"frequency_penalty": 0.3}, {"repetition_penalty": 1.5}]]
    chosen = sample(logits, [seq(p, prompt, output) for p in params]).token_ids
    expected = [int(reference_penalties(logits[0], prompt, output, p.presence_penalty, p.frequency_penalty,
                                        p.repetition_penalty).argmax()) for p in params]
    assert chosen == expected == [1, 3, 2, 0]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]]).repeat(3, 1)
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    seqs = [seq(params, output=[]), seq(params, output=[3]), seq(params, output=[3, 3])]
    assert sample(logits, seqs).token_ids == [2, 2, 0]


def test_a_seed_gives_the_same_draws_whatever_the_batch_and_run():
    torch.manual_seed(0)
    logits = torch.randn(16, 5000)

    def draws(rows_before: int, sampler_seed: int, seed: int = 1234) -> list[int]:
        """Four steps of one seeded sequence, at row rows_before of a batch of otherwise unseeded rows."""
        s = sampler(sampler_seed)
        target = seq(SamplingParams(temperature=1.0, seed=seed))
        tokens = []
        for _ in range(4):
            seqs = [seq(SamplingParams()) for _ in range(rows_before)] + [target] + [seq(SamplingParams())] * 3
            batch = torch.cat([logits[1:rows_before + 1], logits[:1], logits[-3:]])
            tokens.append(s.sample(batch, seqs).result().token_ids[rows_before])
        return tokens

    alone = draws(0, sampler_seed=0)
    assert len(set(alone)) > 1  # the row really is random
    assert draws(0, sampler_seed=0) == alone
    assert draws(7, sampler_seed=5) == alone
    assert draws(0, sampler_seed=0, seed=99) != alone


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.randn(64, 100)
    seqs = [seq(SamplingParams())] * 64
    assert sample(logits, seqs, seed=3).token_ids == sample(logits, seqs, seed=3).token_ids
    assert sample(logits, seqs, seed=3).token_ids != sample(logits, seqs, seed=4).token_ids


def test_logprobs_are_the_raw_log_softmax_with_the_sampled_token_first():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.7, logprobs=3, presence_penalty=1.0), SamplingParams(),
              SamplingParams(temperature=0, logprobs=0)]
    out = sample(logits, [seq(p, output=[5]) for p in params])
    assert out.logprobs[1] is None
    for row in (0, 2):
        raw = logits[row].log_softmax(-1)
        entry = out.logprobs[row]
        token = out.token_ids[row]
        assert entry.token_ids[0] == token
        assert math.isclose(entry.logprobs[0], float(raw[token]), rel_tol=1e-5)
        assert entry.ranks[0] == int((raw > raw[token]).sum()) + 1
        k = params[row].logprobs
        assert entry.token_ids[1:] == raw.topk(k).indices.tolist() and entry.ranks[1:] == list(range(1, k + 1))
    assert out.logprobs[2].ranks == [1]  # greedy: the sampled token is the most likely
