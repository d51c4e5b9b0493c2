"""The sampler on the GPU, where the sampling kernel draws, from float32 logits and from the engine's bfloat16 ones:
what the CPU tests check (greedy and top-k 1, each row's own parameters, the exact softmax, seeds whatever the batch
and run, min_tokens, penalties as the reference formula has them, logprobs), a batch mixing every parameter, and
the packed call (ops.sample_packed) against the kernels called with separate tensors."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from nanograph import SamplingParams, ops
from nanograph._core import require_core
from nanograph.engine.sequence import Sequence
from nanograph.sampling import Sampler, SamplerOutput
from nanograph.sampling.kernel_plan import KernelPlan
from nanograph.sampling.packed_layout import PackedFormat
from nanograph.sampling.seen import SeenTokens

from .test_api_sampler import CHI2_CRITICAL_0_001, EOS, LOGITS, NUM_DRAWS, chi_square, reference_penalties, seq

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]


def sampler(seed=0) -> Sampler:
    return Sampler(DEVICE, [EOS], seed)


def sample(logits: torch.Tensor, seqs: list[Sequence], seed=0) -> SamplerOutput:
    """One call of a fresh sampler, read back."""
    return sampler(seed).sample(logits, seqs).result()


def on_device(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return logits.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_and_top_k_1_are_the_argmax(dtype):
    generator = torch.Generator().manual_seed(0)
    rows, vocab = 64, 151936
    logits = (torch.randn(rows, vocab, generator=generator) * 2).to(dtype)
    argmax = logits.float().argmax(dim=-1)
    assert sample(logits.to(DEVICE), [seq(SamplingParams(temperature=0))] * rows).token_ids == argmax.tolist()
    greedy = torch.arange(rows) % 2 == 0
    seqs = [seq(SamplingParams(temperature=0) if greedy[i] else SamplingParams(temperature=0.5 + i / rows, top_k=1))
            for i in range(rows)]
    token_ids = torch.tensor(sample(logits.to(DEVICE), seqs).token_ids)
    assert torch.equal(token_ids[greedy], argmax[greedy])
    maxima = logits.float().amax(dim=-1)
    assert torch.equal(logits.float().gather(1, token_ids[:, None]).squeeze(1), maxima)  # tied maxima: any of them
    unique = (logits.float() == maxima[:, None]).sum(dim=-1) == 1
    assert unique.float().mean() > 0.5
    assert torch.equal(token_ids[unique], argmax[unique])


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_uses_its_own_parameters(dtype):
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    row_params = [SamplingParams(temperature=0), SamplingParams(top_k=2), SamplingParams(top_p=0.6),
                  SamplingParams(top_k=3, top_p=0.95), SamplingParams(), SamplingParams(min_p=0.6)]
    allowed = [{0}, {0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1}]
    seqs = [seq(p) for p in row_params] * 2000
    draws = sample(on_device(row.repeat(len(seqs), 1), dtype), seqs).token_ids
    for i, expected in enumerate(allowed):
        assert set(draws[i::len(row_params)]) == expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.3, 1.0), (1.0, 0.8)])
def test_draws_follow_the_exact_renormalised_softmax(temperature, top_p, dtype):
    probs = (LOGITS / temperature).softmax(-1).double()  # LOGITS: exact in bfloat16 too
    nucleus = int(((probs.cumsum(-1) - probs) < top_p).sum())
    probs[nucleus:] = 0
    probs /= probs.sum()
    seqs = [seq(SamplingParams(temperature=temperature, top_p=top_p))] * NUM_DRAWS
    draws = torch.tensor(sample(on_device(LOGITS.repeat(NUM_DRAWS, 1), dtype), seqs).token_ids)
    assert int(draws.max()) < nucleus
    assert chi_square(draws, probs) < CHI2_CRITICAL_0_001[nucleus - 1]
    wrong = LOGITS[:nucleus].softmax(-1) if temperature != 1.0 else (LOGITS[:nucleus] / 1.3).softmax(-1)
    assert chi_square(draws, wrong) > CHI2_CRITICAL_0_001[nucleus - 1]  # the test can tell them apart


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=7), SamplingParams(top_p=0.9, seed=7),
                                    SamplingParams(top_k=30, min_p=0.01, seed=7),
                                    SamplingParams(temperature=0.8, presence_penalty=0.5, repetition_penalty=1.2,
                                                   seed=7)])
def test_a_seeded_request_draws_the_same_whatever_the_batch_and_run(params):
    generator = torch.Generator().manual_seed(2)
    # Values a bfloat16 holds exactly, so that both dtypes carry the same logits. Row 0 is the seeded request's.
    logits = torch.randn(9, 5000, generator=generator).to(torch.bfloat16).float()
    others = [SamplingParams(temperature=0), SamplingParams(top_k=3), SamplingParams(top_p=0.5),
              SamplingParams(min_p=0.1, seed=3), SamplingParams(frequency_penalty=0.5),
              SamplingParams(min_tokens=4, stop_token_ids=[9]), SamplingParams(logprobs=2), SamplingParams()]

    def draws(num_others: int, sampler_seed: int, dtype=torch.float32, seed=params.seed) -> list[int]:
        """Four steps of the seeded request, after num_others other rows; each step's token is appended to it, as
        the engine does. A new sampler and new sequences each time."""
        s = sampler(sampler_seed)
        target = seq(dataclasses.replace(params, seed=seed))
        tokens = []
        for _ in range(4):
            seqs = [seq(p) for p in others[:num_others]] + [target]
            batch = on_device(torch.cat([logits[1:num_others + 1], logits[:1]]), dtype)
            tokens.append(s.sample(batch, seqs).result().token_ids[-1])
            target.token_ids.append(tokens[-1])
        return tokens

    alone = draws(0, sampler_seed=0)
    assert len(set(alone)) > 1  # the row really is random
    assert draws(0, sampler_seed=0) == alone
    assert draws(len(others), sampler_seed=5) == alone
    assert draws(3, sampler_seed=1, dtype=torch.bfloat16) == alone
    assert draws(0, sampler_seed=0, seed=99) != alone


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    seqs = [seq(SamplingParams())] * 64
    assert sample(logits, seqs, seed=3).token_ids == sample(logits, seqs, seed=3).token_ids
    assert sample(logits, seqs, seed=3).token_ids != sample(logits, seqs, seed=4).token_ids


@pytest.mark.parametrize("dtype", DTYPES)
def test_min_tokens_masks_eos_and_stop_token_ids_until_reached(dtype):
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    short, done = seq(params, output=[1]), seq(params, output=[1, 2])
    logits = torch.tensor([[4.0, 1.0, 0.5, 0.0]]).repeat(4000, 1)  # EOS (0) is by far the likeliest
    token_ids = sample(on_device(logits, dtype), [short, done] * 2000).token_ids
    assert set(token_ids[0::2]) == {1, 2}
    assert set(token_ids[1::2]) == {0, 1, 2, 3}
    greedy = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]]).repeat(3, 1)
    seqs = [seq(greedy, output=[]), seq(greedy, output=[3]), seq(greedy, output=[3, 3])]
    assert sample(on_device(logits, dtype), seqs).token_ids == [2, 2, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_penalties_move_the_argmax_as_the_reference_formula_says(dtype):
    """Rows whose argmax token was generated 0 to 3 times, under random penalties; greedy rows and top-k 1 ones."""
    generator = torch.Generator().manual_seed(1)
    rows, vocab = 256, 1000
    logits = (torch.randn(rows, vocab, generator=generator) * 2).to(dtype)
    top = logits.float().argmax(dim=-1)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=generator))]

    seqs, expected, gaps = [], [], []
    for row in range(rows):
        params = SamplingParams(temperature=pick([0.5, 1.5]) if row % 2 else 0.0, top_k=row % 2,
                                presence_penalty=pick([0.0, 0.5, 1.5]), frequency_penalty=pick([0.0, 0.3, 1.0]),
                                repetition_penalty=pick([1.0, 1.2, 2.0]))
        prompt = torch.randint(vocab, (4,), generator=generator).tolist()
        output = [int(top[row])] * pick([0, 1, 3]) + torch.randint(vocab, (3,), generator=generator).tolist()
        seqs.append(seq(params, prompt, output))
        penalised = reference_penalties(logits[row].float(), prompt, output, params.presence_penalty,
                                        params.frequency_penalty, params.repetition_penalty)
        first, second = penalised.topk(2).values.tolist()
        expected.append(int(penalised.argmax()))
        gaps.append(first - second)
    token_ids = torch.tensor(sample(logits.to(DEVICE), seqs).token_ids)
    # Where the top two are this close (or tied, as bfloat16 logits often are), float rounding may decide.
    expected, clear = torch.tensor(expected), torch.tensor(gaps) > 1e-4
    assert clear.float().mean() > 0.9
    assert torch.equal(token_ids[clear], expected[clear])
    moved = int((expected[clear] != top[clear]).sum())
    assert 20 <= moved <= int(clear.sum()) - 20  # the penalties decided both ways


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_top", [5, 40])  # 40: more than the kernel gives, taken by torch
def test_logprobs_are_the_raw_log_softmax_with_the_sampled_token_first(num_top, dtype):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    params = [SamplingParams(temperature=0.7, logprobs=3, presence_penalty=1.0), SamplingParams(),
              SamplingParams(temperature=0, logprobs=0), SamplingParams(top_p=0.9, logprobs=num_top, seed=1)]
    s = sampler()
    out = s.sample(logits.to(DEVICE), [seq(p, output=[5]) for p in params]).result()
    assert out.logprobs[1] is None
    for row in (0, 2, 3):
        raw = logits[row].float().log_softmax(-1)
        entry = out.logprobs[row]
        token = out.token_ids[row]
        assert entry.token_ids[0] == token
        assert math.isclose(entry.logprobs[0], float(raw[token]), rel_tol=1e-4, abs_tol=1e-5)
        assert entry.ranks[0] == int((logits[row] > logits[row, token]).sum()) + 1
        top = raw.topk(params[row].logprobs).values
        assert torch.equal(raw[entry.token_ids[1:]], top)  # equal logprobs may come in any order
        torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), top, rtol=1e-4, atol=1e-5)
        assert entry.ranks[1:] == list(range(1, len(top) + 1))
    assert out.logprobs[2].ranks == [1]  # greedy: the sampled token is the most likely


MIXED = [  # as benchmarks/bench_sampler.py, and a row held short of min_tokens
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.8, top_k=50),
    SamplingParams(temperature=0.9, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.1),
    SamplingParams(temperature=0.8, top_p=0.95, seed=1234),
    SamplingParams(temperature=0.6, top_k=20, logprobs=5),
    SamplingParams(temperature=0.9, min_tokens=32, max_tokens=64, stop_token_ids=[7]),
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_mixing_every_parameter_draws_a_valid_token_per_row(dtype):
    generator = torch.Generator().manual_seed(8)
    rows, vocab = 256, 151936
    kinds = torch.arange(rows) % len(MIXED)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    held = kinds == len(MIXED) - 1
    logits[held, EOS] = logits[held, 7] = 30.0  # the likeliest, were they not masked
    logits = logits.to(dtype)
    histories = torch.randint(vocab, (rows, 80), generator=generator).tolist()  # 64 prompt tokens, 16 generated

    def run(sampler_seed: int):
        s = sampler(sampler_seed)
        return s.sample(logits.to(DEVICE), [seq(MIXED[kind], history[:64], history[64:])
                                            for kind, history in zip(kinds.tolist(), histories)]).result()

    out = run(0)
    token_ids = torch.tensor(out.token_ids)
    x = logits.float() / torch.tensor([MIXED[kind].temperature or 1.0 for kind in kinds.tolist()])[:, None]
    drawn = x.gather(1, token_ids[:, None]).squeeze(1)
    assert drawn.isfinite().all()
    assert torch.equal(token_ids[kinds == 0], x[kinds == 0].argmax(dim=-1))
    for kind, k in [(2, 50), (7, 20)]:  # top-k without penalties
        assert (drawn[kinds == kind] >= x[kinds == kind].topk(k).values[:, -1]).all()
    min_p_rows = kinds == 4
    assert (drawn[min_p_rows] >= x[min_p_rows].amax(dim=-1) + math.log(0.05) - 1e-5).all()  # a float32 floor
    assert not set(token_ids[held].tolist()) & {EOS, 7}
    assert all(out.logprobs[row].token_ids[0] == out.token_ids[row] for row in (kinds == 7).nonzero().flatten().tolist())
    assert all(out.logprobs[row] is None for row in (kinds != 7).nonzero().flatten().tolist())
    again = torch.tensor(run(5).token_ids)
    seeded = kinds == 6
    assert torch.equal(again[seeded], token_ids[seeded])
    assert not torch.equal(again[kinds == 1], token_ids[kinds == 1])  # the others follow the sampler's seed


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_packed_call_draws_exactly_what_separate_tensors_draw(dtype):
    """The sampler's packed call (one parameters blob, one results blob) against ops.prepare_overrides then
    ops.sample_rows on the same plan's arrays, each its own tensor, with the same keys: the same overrides, tokens,
    logprobs and ranks, bit for bit."""
    generator = torch.Generator().manual_seed(3)
    rows, vocab = 256, 151936
    kinds = torch.arange(rows) % len(MIXED)
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype).to(DEVICE)
    histories = torch.randint(vocab, (rows, 80), generator=generator).tolist()

    def batch(s: Sampler):
        return [seq(MIXED[kind], history[:64], history[64:])
                for kind, history in zip(kinds.tolist(), histories)]

    s = sampler(0)
    packed = s.sample(logits, batch(s)).result()
    # The sampler's key stream with seed 0 is numpy's default_rng(0); fresh sequences restart the seeded streams.
    plan = KernelPlan(batch(sampler(0)), vocab, [EOS], SeenTokens(), np.random.default_rng(0),
                      PackedFormat.of(require_core()))
    layout = plan.layout
    num_overrides, logprob_columns = layout.counts["num_overrides"], layout.counts["logprob_columns"]
    assert num_overrides > 0 and logprob_columns > 1

    def tensor(name: str, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(plan.arrays[name]).astype(dtype)).to(DEVICE)

    overrides = torch.empty(num_overrides, vocab, device=DEVICE)
    ops.prepare_overrides(logits, tensor("override_source", np.int32), overrides, tensor("seen_tokens", np.int32),
                          tensor("output_counts", np.int32), tensor("presence", np.float32),
                          tensor("frequency", np.float32), tensor("repetition", np.float32),
                          tensor("masked_tokens", np.int32))
    token_ids = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    values = torch.empty(rows, logprob_columns, device=DEVICE)
    ids = torch.empty(rows, logprob_columns, dtype=torch.int64, device=DEVICE)
    ops.sample_rows(logits, tensor("temperatures", np.float32), tensor("top_ks", np.int32),
                    tensor("top_ps", np.float32), tensor("min_ps", np.float32), tensor("keys", np.int64), token_ids,
                    None, overrides, tensor("override_rows", np.int32), tensor("num_logprobs", np.int32), values, ids)
    assert packed.token_ids == token_ids.tolist()
    values, ids = values.cpu(), ids.cpu()
    for row, k in zip(plan.batch.logprob_rows, plan.batch.num_top_logprobs):
        entry = packed.logprobs[row]
        assert entry.logprobs == values[row, :k + 1].tolist()
        assert entry.token_ids[1:] == ids[row, 1:k + 1].tolist() and entry.ranks[0] == int(ids[row, 0]) + 1
    assert [row for row, entry in enumerate(packed.logprobs) if entry is not None] == plan.batch.logprob_rows

    blob = np.zeros(layout.params_nbytes, np.uint8)
    layout.pack(plan.arrays, blob)
    results = torch.empty(layout.results_nbytes, dtype=torch.uint8, device=DEVICE)
    packed_overrides = torch.empty_like(overrides)
    ops.sample_packed(logits, torch.from_numpy(blob).to(DEVICE), layout.layout, results, packed_overrides)
    assert torch.equal(packed_overrides, overrides)
    assert torch.equal(results[:rows * 8].view(torch.int64), token_ids)



def test_results_read_after_their_staging_slot_is_reused_are_their_own():
    """The kernel path stages each call's results in one of two host slots, in turn: four calls queued before any is
    read (the third and fourth reuse the first's and second's slots) read what four calls read one by one do."""
    generator = torch.Generator().manual_seed(4)
    rows, vocab = 64, 32000
    logits = [(torch.randn(rows, vocab, generator=generator) * 4).to(DEVICE) for _ in range(4)]
    histories = torch.randint(vocab, (rows, 80), generator=generator).tolist()

    def outputs(read_each_call: bool) -> list[SamplerOutput]:
        """Four calls of a fresh sampler on fresh sequences, each read as it is made or all at the end."""
        s = sampler(0)
        seqs = [seq(MIXED[row % len(MIXED)], history[:64], history[64:])
                for row, history in enumerate(histories)]
        pending = []
        for step_logits in logits:
            pending.append(s.sample(step_logits, seqs))
            if read_each_call:
                pending[-1].result()
        return [p.result() for p in pending]

    assert outputs(read_each_call=False) == outputs(read_each_call=True)
