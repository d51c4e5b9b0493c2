import random

import pytest

from nanograph import SamplingParams

from .fake_model import VOCAB_SIZE, fake_engine, reference_completion

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def generate(engine, prompts, params=GREEDY):
    return engine.generate(prompts, [params] * len(prompts), use_tqdm=False)


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt is empty"),
    ("", "prompt is empty"),
    ([1, VOCAB_SIZE, 2], f"prompt token id {VOCAB_SIZE} at position 1 is outside the vocabulary \\[0, {VOCAB_SIZE}\\)"),
    ([3, -1], "prompt token id -1 at position 1 is outside"),
    ([3, 2**64], f"prompt token id {2**64} at position 1 is outside"),  # beyond int64 too
    ([-2**70, 3], f"prompt token id {-2**70} at position 0 is outside"),
    ([1] * 65, "prompt has 65 tokens; max_model_len is 64: shorten the prompt \\(truncate_prompt_tokens=-1 keeps "
     "its last 64 tokens\\), or raise max_model_len \\(the model takes up to 256 positions\\)$"),
])
def test_bad_prompt_raises_and_the_engine_keeps_serving(prompt, message):
    engine = fake_engine(max_model_len=64)
    engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, GREEDY)
    assert len(engine.scheduler.waiting) == 1
    [output] = generate(engine, [[8, 9]])
    assert output.outputs[0].token_ids == reference_completion([8, 9], 6)


def test_a_prompt_too_long_at_the_models_whole_context_is_not_told_to_raise_max_model_len():
    engine = fake_engine(max_model_len=256)  # fake_engine's model takes 256 positions
    with pytest.raises(ValueError) as raised:
        engine.add_request([1] * 257, GREEDY)
    assert str(raised.value) == ("prompt has 257 tokens; max_model_len is 256: shorten the prompt "
                                 "(truncate_prompt_tokens=-1 keeps its last 256 tokens); max_model_len is already the "
                                 "model's whole context")
    assert not engine.scheduler.waiting


def test_bad_sampling_params_changed_after_construction_are_rejected():
    engine = fake_engine()
    params = SamplingParams()
    params.temperature = -0.5
    with pytest.raises(ValueError, match="temperature must be non-negative, got -0.5."):
        engine.add_request([1, 2], params)
    assert not engine.has_unfinished()


def test_generate_validates_every_request_before_queueing_any():
    engine = fake_engine(max_model_len=64)
    with pytest.raises(ValueError, match="request 2: prompt has 100 tokens; max_model_len is 64"):
        generate(engine, [[1, 2], [3], [4] * 100])
    assert not engine.has_unfinished()
    assert len(generate(engine, [[1, 2], [3]])) == 2


@pytest.mark.parametrize("token_id", [VOCAB_SIZE, 10**6, -1, -VOCAB_SIZE + 5])
def test_stop_token_ids_outside_the_vocabulary_are_rejected(token_id):
    """An id outside the vocabulary would mask another row's logit (min_tokens) or fail mid-step: it is refused
    with the request, and the others in the call are neither queued nor changed."""
    engine = fake_engine()
    bad = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[token_id])
    with pytest.raises(ValueError, match=rf"request 1: stop_token_ids holds {token_id}, outside the vocabulary"):
        engine.generate([[3, 1, 4], [2, 7]], [GREEDY, bad], use_tqdm=False)
    assert not engine.has_unfinished() and not engine.requests
    [output] = generate(engine, [[3, 1, 4]])
    assert output.outputs[0].token_ids == reference_completion([3, 1, 4], 6)


def test_min_tokens_that_cannot_fit_name_the_room_left():
    engine = fake_engine(max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=None, min_tokens=10)
    with pytest.raises(ValueError, match="min_tokens=10 does not fit: the 60-token prompt leaves 4 of "
                                         "max_model_len=64; lower min_tokens or raise max_model_len"):
        engine.add_request([1] * 60, params)
    assert not engine.has_unfinished()


def free_blocks(engine):
    return engine.scheduler.block_manager.num_free_blocks


def test_a_request_that_fails_while_queued_takes_back_the_ones_before_it():
    """Queueing is all or nothing: if a request fails after validation, the call's earlier requests are taken
    back, so that a later call neither runs them nor loses its own outputs among theirs."""
    engine = fake_engine()
    blocks = free_blocks(engine)

    make_request = engine.intake.request

    def failing_request(request_id, valid, owner=None):
        if valid.params.seed is not None:
            raise RuntimeError("no generator")
        return make_request(request_id, valid, owner)

    engine.intake.request = failing_request
    seeded = SamplingParams(max_tokens=4, seed=5)
    with pytest.raises(RuntimeError, match="no generator"):
        engine.generate([[1, 2], [3, 4], [5]], [GREEDY, GREEDY, seeded], use_tqdm=False)
    assert not engine.has_unfinished() and not engine.requests and free_blocks(engine) == blocks
    outputs = generate(engine, [[9, 9]])
    assert [out.outputs[0].token_ids for out in outputs] == [reference_completion([9, 9], 6)]


def test_an_error_during_generate_ends_that_calls_requests():
    """A step that raises (here the model) ends the call's requests: the engine frees their blocks and serves the
    next call."""
    engine = fake_engine()
    blocks = free_blocks(engine)
    run, calls = engine.runner.run, []

    def failing_run(batch):
        calls.append(batch)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return run(batch)

    engine.runner.run = failing_run
    with pytest.raises(RuntimeError, match="device lost"):
        generate(engine, [[1, 2, 3], [4, 5]])
    assert not engine.has_unfinished() and not engine.requests and free_blocks(engine) == blocks
    engine.runner.run = run
    [output] = generate(engine, [[7, 8]])
    assert output.outputs[0].token_ids == reference_completion([7, 8], 6)


def test_outputs_come_in_input_order_with_vllm_fields():
    engine = fake_engine()
    prompts = [[1, 2, 3] * 5, [4], "hi there", [9, 8]]
    outputs = generate(engine, prompts)
    assert [out.request_id for out in outputs] == ["0", "1", "2", "3"]
    tokenized = [prompts[0], prompts[1], engine.tokenizer.encode("hi there"), prompts[3]]
    for out, prompt, token_ids in zip(outputs, prompts, tokenized):
        completion = out.outputs[0]
        assert out.finished and out.prompt_token_ids == token_ids
        assert out.prompt == (prompt if isinstance(prompt, str) else None)
        assert completion.token_ids == reference_completion(token_ids, 6)
        assert completion.text == "".join(f" {t}" for t in completion.token_ids)
        assert completion.finish_reason == "length" and completion.index == 0


def test_eos_and_stop_tokens_finish_with_stop():
    prompt = [3, 1, 4, 1, 5]
    reference = reference_completion(prompt, 10)
    eos = fake_engine(eos_token_ids=[reference[2]])
    first = reference.index(reference[2]) + 1
    assert generate(eos, [prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].token_ids == \
        reference[:first]
    ignored = generate(eos, [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == reference and ignored.finish_reason == "length"
    stop = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[reference[4]])
    stopped = generate(fake_engine(), [prompt], stop)[0].outputs[0]
    assert stopped.token_ids == reference[:reference.index(reference[4]) + 1] and stopped.finish_reason == "stop"


def test_max_model_len_ends_a_request():
    engine = fake_engine(max_model_len=24)
    completion = generate(engine, [list(range(1, 21))], SamplingParams(temperature=0, max_tokens=100))[0].outputs[0]
    assert len(completion.token_ids) == 4 and completion.finish_reason == "length"


def test_kv_cache_smaller_than_max_model_len_is_refused():
    with pytest.raises(ValueError, match="KV cache holds 32 tokens, fewer than max_model_len=64"):
        fake_engine(num_kv_blocks=8, block_size=4, max_model_len=64)


def test_prefix_cache_hits_are_reported_and_reused_correctly():
    engine = fake_engine()
    shared = [(5 * i) % 40 + 1 for i in range(18)]
    generate(engine, [shared + [1, 2]])
    [output] = generate(engine, [shared + [3]])
    assert output.num_cached_tokens == 16
    assert output.outputs[0].token_ids == reference_completion(shared + [3], 6)


def test_reset_prefix_cache_forgets_cached_prefixes_but_not_while_a_request_holds_blocks():
    engine = fake_engine()
    shared = [(5 * i) % 40 + 1 for i in range(18)]
    generate(engine, [shared + [1, 2]])
    running = engine.add_request(shared + [4], SamplingParams(max_tokens=6), stream=True)
    engine.step()  # admitted: it holds blocks
    assert not engine.reset_prefix_cache()
    while engine.has_unfinished():
        engine.step()
    assert [d.request_id for d in engine.take_deltas() if d.finished] == [running]
    assert engine.reset_prefix_cache()
    [cold] = generate(engine, [shared + [3]])
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == reference_completion(shared + [3], 6)
    [warm] = generate(engine, [shared + [3]])  # the cache fills again
    assert warm.num_cached_tokens == 16
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids



@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_completions_of_n_keep_their_requests_place_in_the_queue(prefix_caching):
    """Six requests of n=2 with room for two sequences and a small KV cache: the second completion of each, held
    until the first has computed the prompt (with a prefix cache), goes ahead of the requests that came later, so
    every completion of a request starts before any of the request two places behind it, and each second
    completion takes the prompt's blocks from the cache before later prompts evict them; without a cache, it queues
    with the first at once. Their tokens are those of each request alone, and no block is lost."""
    prompts = [[(7 * r + i) % (VOCAB_SIZE - 1) + 1 for i in range(12)] for r in range(6)]
    params = [SamplingParams(temperature=0.8, seed=r, n=2, max_tokens=6, ignore_eos=True) for r in range(6)]
    engine = fake_engine(num_kv_blocks=12, max_model_len=24, max_num_seqs=2, enable_prefix_caching=prefix_caching)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    seqs = [engine.requests[request_id].seqs for request_id in ids]
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    for earlier, later in zip(seqs, seqs[2:]):
        assert max(seq.first_scheduled_time for seq in earlier) < min(seq.first_scheduled_time for seq in later)
    assert [outputs[request_id].num_cached_tokens for request_id in ids] == [8 if prefix_caching else 0] * 6
    for request_id, prompt, p in zip(ids, prompts, params):
        [alone] = generate(fake_engine(enable_prefix_caching=prefix_caching), [prompt], p)
        assert [c.token_ids for c in outputs[request_id].outputs] == [c.token_ids for c in alone.outputs]
    assert engine.scheduler.block_manager.num_free_blocks == 12

def test_chunking_preemption_and_prefix_caching_together_keep_outputs_exact():
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randrange(1, 12))]
               for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 16)) for _ in prompts]
    engine = fake_engine(num_kv_blocks=12, block_size=4, max_model_len=48, max_num_seqs=6,
                         max_num_batched_tokens=16)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for out, prompt, p in zip(outputs, prompts, params):
        assert out.outputs[0].token_ids == reference_completion(prompt, p.max_tokens)
    assert any(out.num_cached_tokens for out in outputs)
    assert engine.scheduler.block_manager.num_free_blocks == 12


def test_a_failure_in_sampling_ends_only_the_request_it_belongs_to():
    """The sampler raises whenever one request's rows are among those it samples: that request ends ("abort", its
    error on the output), and the requests sampled beside it, greedy and seeded, give exactly their tokens of a run
    without it; no block is lost."""
    def run(with_failure: bool):
        engine = fake_engine(peak=1.0)
        blocks = free_blocks(engine)
        greedy = engine.add_request([3, 1, 4], SamplingParams(temperature=0, max_tokens=10))
        seeded = engine.add_request([2, 7], SamplingParams(temperature=1.0, seed=11, max_tokens=10))
        engine.step()
        doomed = None
        if with_failure:
            doomed = engine.add_request([5, 5, 5], SamplingParams(temperature=1.0, max_tokens=10))
            sample = engine.runner.sample

            def failing_sample(rows, seqs):
                if any(seq.request_id == doomed for seq in seqs):
                    raise RuntimeError("sampler fault")
                return sample(rows, seqs)

            engine.runner.sample = failing_sample
        outputs = {}
        while engine.has_unfinished():
            outputs.update((out.request_id, out) for out in engine.step())
        assert free_blocks(engine) == blocks
        return outputs, greedy, seeded, doomed

    clean, greedy, seeded, _ = run(False)
    faulty, greedy_f, seeded_f, doomed = run(True)
    for ours, theirs in ((greedy, greedy_f), (seeded, seeded_f)):
        assert faulty[theirs].outputs[0].token_ids == clean[ours].outputs[0].token_ids
        assert faulty[theirs].error is None and faulty[theirs].outputs[0].finish_reason == "length"
    failed = faulty[doomed]
    assert failed.outputs[0].finish_reason == "abort" and failed.outputs[0].token_ids == []
    assert failed.error == "RuntimeError: sampler fault"


def test_a_request_finished_inside_generate_is_unfinished_until_step_returns_it():
    """vLLM's loop, `while has_unfinished_requests(): step()`, gets every request queued with add_request, also
    one that a generate() call in between ran to its end."""
    engine = fake_engine()
    queued = engine.add_request([3, 1, 4], SamplingParams(temperature=0, max_tokens=3))
    generate(engine, [[2, 7]])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [out.request_id for out in outputs] == [queued]
    assert outputs[0].outputs[0].token_ids == reference_completion([3, 1, 4], 3)


def test_every_completion_of_a_seeded_request_repeats_negative_seeds_included():
    """Completion i of n takes seed + i, also where that is -1 (which alone means no seed); -s and s are different
    streams (a 64-bit word, as torch reads a seed)."""
    def completions(seed, n=3):
        engine = fake_engine(peak=1.0)
        [out] = generate(engine, [[5, 9, 2]], SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=12))
        return [completion.token_ids for completion in out.outputs]

    assert completions(-2) == completions(-2)
    assert completions(-2)[0] == completions(-2, n=1)[0] and completions(-2)[2] == completions(0, n=1)[0]
    assert completions(-5, n=1) != completions(5, n=1)
    assert completions(7, n=1) == completions(7, n=2)[:1]
