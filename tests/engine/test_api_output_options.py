"""SamplingParams' output options from vLLM (CPU, a tiny random model with SmolLM2's real tokenizer):
truncate_prompt_tokens, detokenize=False, spaces_between_special_tokens, output_kind on LLM.stream, extra_args, and
the refused best_of > n and use_beam_search."""
import pytest

from nanograph import LLM, RequestOutputKind, SamplingParams

from .tiny_models import make_tiny_chat_model

MAX_MODEL_LEN = 64
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_chat_model(folder)
    return LLM(str(folder), device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=32, block_size=16)


def greedy(**fields):
    return SamplingParams(temperature=0, max_tokens=6, **fields)


def test_truncate_prompt_tokens_keeps_the_last_ones(llm):
    token_ids = llm.get_tokenizer().encode(PROMPT)
    [out] = llm.generate(PROMPT, greedy(truncate_prompt_tokens=4), use_tqdm=False)
    assert out.prompt_token_ids == token_ids[-4:]
    assert out.outputs[0].token_ids == llm.generate([token_ids[-4:]], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    # A prompt shorter than k is kept whole; -1 keeps the last max_model_len tokens.
    assert llm.generate([token_ids], greedy(truncate_prompt_tokens=50), use_tqdm=False)[0].prompt_token_ids == \
        token_ids
    long_prompt = (token_ids * 8)[:MAX_MODEL_LEN + 10]
    [out] = llm.generate([long_prompt], greedy(truncate_prompt_tokens=-1), use_tqdm=False)
    assert out.prompt_token_ids == long_prompt[-MAX_MODEL_LEN:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens=65 is more than max_model_len={MAX_MODEL_LEN}"):
        llm.generate(PROMPT, greedy(truncate_prompt_tokens=65), use_tqdm=False)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"truncate_prompt_tokens must be an integer >= 1 or -1, got {bad}"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_detokenize_false_gives_token_ids_only(llm):
    [with_text] = llm.generate(PROMPT, greedy(logprobs=1), use_tqdm=False)
    [ids_only] = llm.generate(PROMPT, greedy(logprobs=1, detokenize=False), use_tqdm=False)
    assert with_text.outputs[0].text and ids_only.outputs[0].text == ""
    assert ids_only.outputs[0].token_ids == with_text.outputs[0].token_ids
    assert all(lp.decoded_token is None for step in ids_only.outputs[0].logprobs for lp in step.values())
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(stop=["."], detokenize=False)


def test_spaces_between_special_tokens_reach_the_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    for spaces in (True, False):
        [out] = llm.generate(PROMPT, greedy(skip_special_tokens=False, spaces_between_special_tokens=spaces,
                                            ignore_eos=True), use_tqdm=False)
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=False,
                                                       spaces_between_special_tokens=spaces)


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kind_shapes_the_stream(llm, kind):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, logprobs=0, output_kind=kind)
    [final] = llm.generate(PROMPT, params, use_tqdm=False)
    deltas = list(llm.stream(PROMPT, params))
    for completion in final.outputs:
        mine = [delta for delta in deltas if delta.index == completion.index]
        assert mine[-1].finished and not any(delta.finished for delta in mine[:-1])
        if kind is RequestOutputKind.DELTA:
            assert "".join(delta.text for delta in mine) == completion.text
            assert [t for delta in mine for t in delta.token_ids] == completion.token_ids
            assert len(mine) > 1
        else:
            for delta in mine:  # each holds everything so far
                assert completion.text.startswith(delta.text)
                assert delta.token_ids == completion.token_ids[:len(delta.token_ids)]
                assert delta.logprobs == completion.logprobs[:len(delta.token_ids)]
            assert (mine[-1].text, mine[-1].token_ids) == (completion.text, completion.token_ids)
            assert len(mine) == 1 if kind is RequestOutputKind.FINAL_ONLY else len(mine) > 1


def test_extra_args_are_kept(llm):
    params = greedy(extra_args={"trace_id": "abc", "weights": [1, 2]})
    assert params.extra_args == {"trace_id": "abc", "weights": [1, 2]}
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="extra_args must be a dict or None, got list"):
        SamplingParams(extra_args=["trace"])
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_best_of_and_use_beam_search(llm):
    assert SamplingParams(n=3, best_of=3).best_of == 3 and SamplingParams(best_of=None).best_of is None
    [out] = llm.generate(PROMPT, SamplingParams(n=2, best_of=2, seed=1, max_tokens=4), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    with pytest.raises(ValueError, match=r"best_of=4 is not supported: nanograph does not sample extra completions"):
        SamplingParams(n=2, best_of=4)
    with pytest.raises(ValueError, match="best_of must be greater than or equal to n, got n=3 and best_of=2."):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match=r"use_beam_search is not a sampling option: beam search is "
                                         r"LLM.beam_search\(prompts, BeamSearchParams\("):
        SamplingParams(use_beam_search=True)
