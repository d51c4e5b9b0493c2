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
    ([1] * 65, "prompt has 65 tokens; max_model_len is 64"),
])
def test_bad_prompt_raises_and_the_engine_keeps_serving(prompt, message):
    engine = fake_engine(max_model_len=64)
    engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, GREEDY)
    assert len(engine.scheduler.waiting) == 1
    [output] = generate(engine, [[8, 9]])
    assert output.outputs[0].token_ids == reference_completion([8, 9], 6)


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
