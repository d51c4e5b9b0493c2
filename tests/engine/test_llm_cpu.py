"""End to end on the torch backend (CPU) with the bundled SmolLM2-135M-Instruct."""
import pytest

from nanograph import LLM, SamplingParams

pytestmark = pytest.mark.slow

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def small_uncached_llm():
    """A KV cache of 8 blocks (128 tokens), too small for several requests at once, and no prefix caching."""
    return LLM(device="cpu", max_model_len=128, block_size=16, num_kv_blocks=8, enable_prefix_caching=False)


def test_chat_answers_the_capital_of_france(llm):
    [output] = llm.chat(CAPITAL, greedy(16))
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop" and output.finished


def test_prompt_forms_and_output_order(llm):
    ids = llm.tokenizer.encode("The sky is")
    assert len(llm.generate("The sky is", greedy(2), use_tqdm=False)) == 1
    outputs = llm.generate([ids, "One, two,", ids], greedy(3), use_tqdm=False)
    assert [out.request_id for out in outputs] == sorted((out.request_id for out in outputs), key=int)
    assert outputs[0].prompt_token_ids == ids and outputs[1].prompt == "One, two,"
    assert outputs[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    assert llm.generate(ids, greedy(3), use_tqdm=False)[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="got 2 prompts but 1 sampling params"):
        llm.generate(["a", "b"], [greedy(1)])


def test_bad_inputs_raise_and_a_following_generate_still_works(llm):
    vocab_size = llm.engine.vocab_size
    for prompts, message in [
        (["fine", ""], "request 1: prompt is empty"),
        ([[1, vocab_size]], f"request 0: prompt token id {vocab_size} at position 1 is outside the vocabulary"),
        ([[1] * 300], "request 0: prompt has 300 tokens; max_model_len is 256"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p must be in"):
        llm.generate("fine", SamplingParams(top_p=0.0))
    assert not llm.engine.has_unfinished()
    [output] = llm.chat(CAPITAL, greedy(16), use_tqdm=False)
    assert "Paris" in output.outputs[0].text


def test_preempted_requests_match_an_unconstrained_run(llm, small_uncached_llm):
    prompts = ["Once upon a time", "The best way to learn", "In 1969, the first", "My favourite food is",
               "Water boils at"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    preempted = []
    scheduler = small_uncached_llm.engine.scheduler
    preempt = scheduler._preempt
    scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    constrained = small_uncached_llm.generate(prompts, params, use_tqdm=False)
    scheduler._preempt = preempt
    assert preempted
    unconstrained = llm.generate(prompts, params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in constrained] == [out.outputs[0].token_ids for out in unconstrained]


def test_prefix_cache_hit_gives_the_uncached_greedy_tokens(llm, small_uncached_llm):
    story = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
             "do: once or twice she had peeped into the book her sister was reading, but it had no pictures or "
             "conversations in it, and what is the use of a book, thought Alice, without pictures or conversations?")
    shared = llm.tokenizer.encode(story * 2)[:80]  # five full blocks of 16
    llm.generate([shared + llm.tokenizer.encode(" Alice then")], greedy(4), use_tqdm=False)
    second = shared + llm.tokenizer.encode(" The sister")
    [cached] = llm.generate([second], greedy(8), use_tqdm=False)
    [uncached] = small_uncached_llm.generate([second], greedy(8), use_tqdm=False)
    assert cached.num_cached_tokens >= 80 and uncached.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids
    # vLLM's reset_prefix_cache: the same prompt then computes every token, and gives the same ones.
    assert llm.reset_prefix_cache()
    [cold] = llm.generate([second], greedy(8), use_tqdm=False)
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == uncached.outputs[0].token_ids
