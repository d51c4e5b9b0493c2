"""The host side of the GPU sampler (CPU): the per-row arrays a SamplingPlan hands the sampling kernels, checked
row by row against the parameters and token histories that produced them, and the logprobs read back from them."""
import random

import numpy as np
import torch

from nanograph import SamplingParams
from nanograph.engine.sequence import Sequence
from nanograph.sampler import PendingSample, TokenLogprobs, _Logprobs
from nanograph.sampling_plan import SamplingPlan, SeenTokens

VOCAB = 1000
EOS = 7


def seq(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Sequence:
    s = Sequence("0", None, list(prompt) + list(output), params)
    s.num_prompt_tokens = len(prompt)
    if params.seed is not None:
        s.generator = random.Random(params.seed)
    return s


ROWS = [  # (params, prompt, output)
    (SamplingParams(temperature=0), [1, 2], [3]),
    (SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.2), [5, 6], [9, 9, 4]),
    (SamplingParams(temperature=0.9, top_k=20, min_tokens=4, stop_token_ids=[11, 12]), [3], [8]),
    (SamplingParams(temperature=0.8, top_p=0.9, seed=42, logprobs=3), [4, 4], []),
    (SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=2, logprobs=0), [2, 3, 2], [3]),
    (SamplingParams(temperature=1.0, min_p=0.1, min_tokens=1), [6], [1]),  # min_tokens reached: no mask
]


def plan_for(rows=ROWS) -> tuple[SamplingPlan, list[Sequence]]:
    seqs = [seq(*row) for row in rows]
    return SamplingPlan(seqs, VOCAB, [EOS], SeenTokens(), np.random.default_rng(0)), seqs


def test_each_row_gets_its_own_parameters():
    plan, _ = plan_for()
    a = plan.arrays
    assert a["kernel_temperatures"].tolist() == np.float32([0, 0.7, 0.9, 0.8, 0, 1.0]).tolist()
    assert a["top_ks"].tolist() == [0, 0, 20, 0, 0, 0]  # 0: none (and none for greedy rows)
    assert a["top_ps"].tolist() == np.float32([1, 1, 1, 0.9, 1, 1]).tolist()
    assert a["min_ps"].tolist() == np.float32([0, 0, 0, 0, 0, 0.1]).tolist()
    assert a["num_logprobs"].tolist() == [-1, -1, -1, 3, 0, -1]


def test_keys_come_from_the_row_stream_when_seeded_and_greedy_rows_draw_none():
    plan, _ = plan_for()
    keys = plan.arrays["keys"].view(np.uint64).tolist()
    assert keys[0] == keys[4] == 0  # greedy
    assert keys[3] == random.Random(42).getrandbits(64)  # the request's own stream
    assert len({keys[1], keys[2], keys[5], keys[3]}) == 4
    again, _ = plan_for()  # the sampler's stream is seeded too
    assert again.arrays["keys"].tolist() == plan.arrays["keys"].tolist()


def test_penalised_and_masked_rows_read_overrides_with_their_seen_and_masked_tokens():
    plan, _ = plan_for()
    a = plan.arrays
    # Row 1: penalties; row 2: min_tokens not reached; row 4: both; row 5 reached its min_tokens.
    assert a["override_source"].tolist() == [1, 2, 4]
    assert a["override_rows"].tolist() == [-1, 0, 1, -1, 2, -1]
    seen = {i: sorted(zip(tokens.tolist(), counts.tolist()))
            for i, tokens, counts in zip(range(3), a["seen_tokens"], a["output_counts"])}
    assert [(t, c) for t, c in seen[0] if t >= 0] == [(4, 1), (9, 2)]  # output only: no repetition penalty
    assert [t for t, _ in seen[1]] == [-1] * a["seen_tokens"].shape[1]  # masked, not penalised
    assert [(t, c) for t, c in seen[2] if t >= 0] == [(2, 0), (3, 1)]  # prompt too: repetition penalty
    assert a["penalties"][:, 0].tolist() == np.float32([0.5, 0.2, 1]).tolist()
    assert a["penalties"][:, 1].tolist() == [0, 0, 1]  # no penalty on a masked-only row
    assert a["penalties"][:, 2].tolist() == np.float32([0, 0, 1.3]).tolist()
    masked = [sorted(t for t in row.tolist() if t >= 0) for row in a["masked_tokens"]]
    assert masked == [[], [EOS, 11, 12], [EOS]]


def test_a_batch_without_penalties_or_masks_has_no_overrides():
    plan, _ = plan_for([(SamplingParams(temperature=0), [1], []), (SamplingParams(top_k=3), [2], [5])])
    assert len(plan.override_source) == 0 and "override_rows" not in plan.arrays


def test_seen_tokens_grow_with_the_sequence_between_calls():
    seen = SeenTokens()
    s = seq(SamplingParams(frequency_penalty=1.0), [1, 2], [5])
    first = SamplingPlan([s], VOCAB, [EOS], seen, np.random.default_rng(0))
    assert first.arrays["seen_tokens"].tolist() == [[5]]
    s.token_ids += [5, 6]
    second = SamplingPlan([s], VOCAB, [EOS], seen, np.random.default_rng(0))
    assert second.arrays["seen_tokens"].tolist() == [[5, 6]]
    assert second.arrays["output_counts"].tolist() == [[2, 1]]


def test_pending_logprobs_are_read_from_the_rows_that_asked():
    """The kernels' layout: a row per batch row, the sampled token's logprob then the top ones; ids: the rank, then
    the top ids. Only the rows that asked get TokenLogprobs, with the sampled token first and ranks from 1."""
    token_ids = torch.tensor([5, 8, 2])
    values = torch.tensor([[-9.0, -9.0, -9.0], [-1.5, -0.5, -1.0], [-0.25, -0.25, -3.0]])
    ids = torch.tensor([[0, 0, 0], [2, 3, 4], [0, 2, 9]])
    pending = PendingSample(token_ids, _Logprobs(rows=[1, 2], num_top=[2, 1], at=[1, 2], values=values, ids=ids))
    out = pending.result()
    assert out.token_ids == [5, 8, 2]
    assert out.logprobs[0] is None
    assert out.logprobs[1] == TokenLogprobs([8, 3, 4], [-1.5, -0.5, -1.0], [3, 1, 2])
    assert out.logprobs[2] == TokenLogprobs([2, 2], [-0.25, -0.25], [1, 1])
