import torch

from nanograph import SamplingParams
from nanograph.sampler import Sampler, mask_top_k_top_p

NUM_DRAWS = 4000


def sampler(seed=0):
    return Sampler(torch.device("cpu"), seed)


def drawn_tokens(logits_row, params, seed=0) -> set[int]:
    """Every token drawn from NUM_DRAWS copies of one row, sampled in one batch."""
    return set(sampler(seed)(logits_row.repeat(NUM_DRAWS, 1), [params] * NUM_DRAWS))


def test_greedy_is_argmax():
    logits = torch.randn(8, 1000)
    assert sampler()(logits, [SamplingParams(temperature=0)] * 8) == logits.argmax(dim=-1).tolist()


def test_top_k_1_is_greedy():
    logits = torch.randn(8, 1000)
    assert sampler()(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8) == logits.argmax(dim=-1).tolist()


def test_top_k_draws_only_the_k_largest():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0, 3.0]])
    assert drawn_tokens(logits, SamplingParams(top_k=3)) == {1, 3, 5}


def test_top_p_draws_only_the_nucleus():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert drawn_tokens(logits, SamplingParams(top_p=0.7)) == {0, 1}  # 0.5 < 0.7, then 0.8 reaches it
    assert drawn_tokens(logits, SamplingParams(top_p=0.85)) == {0, 1, 2}
    assert drawn_tokens(logits, SamplingParams(top_p=0.3)) == {0}
    assert drawn_tokens(logits, SamplingParams()) == {0, 1, 2, 3}


def test_draws_follow_the_temperature_scaled_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    for temperature in (1.0, 2.0):
        draws = sampler()(probs.log().repeat(20000, 1), [SamplingParams(temperature=temperature)] * 20000)
        expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
        observed = torch.bincount(torch.tensor(draws), minlength=4) / 20000
        assert torch.allclose(observed, expected, atol=0.015), (temperature, observed, expected)


def test_each_row_uses_its_own_parameters():
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    row_params = [SamplingParams(temperature=0), SamplingParams(top_k=2), SamplingParams(top_p=0.6),
                  SamplingParams(top_k=3, top_p=0.95), SamplingParams()]
    allowed = [{0}, {0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]
    draws = sampler()(row.repeat(NUM_DRAWS * len(row_params), 1), row_params * NUM_DRAWS)
    for i, expected in enumerate(allowed):
        assert set(draws[i::len(row_params)]) == expected


def test_mask_keeps_the_allowed_tokens_of_each_row_in_vocab_order():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    masked = mask_top_k_top_p(logits, torch.tensor([2, -1]), torch.tensor([1.0, 0.7]))  # p = .64, .24, .09, .03
    assert torch.isfinite(masked).tolist() == [[True, False, True, False], [False, False, True, True]]
    assert torch.equal(masked[torch.isfinite(masked)], logits[torch.isfinite(masked)])


def test_same_seed_same_draws():
    logits = torch.randn(64, 100)
    params = [SamplingParams(temperature=1.0)] * 64
    assert sampler(seed=3)(logits, params) == sampler(seed=3)(logits, params)
    assert sampler(seed=3)(logits, params) != sampler(seed=4)(logits, params)
