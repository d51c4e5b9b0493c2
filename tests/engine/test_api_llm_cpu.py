"""The request API end to end with SmolLM2-135M-Instruct on the CPU: multi-byte text detokenised incrementally,
streaming, seeds, chat over several conversations."""
import pytest
from transformers import AutoTokenizer

from nanograph import LLM, SamplingParams
from nanograph.outputs import CompletionOutput
from nanograph.default_model import default_model_path
from nanograph.engine.detokenizer import IncrementalDetokenizer
from nanograph.engine.sequence import Sequence
from nanograph.engine.stop_checker import StopChecker

pytestmark = pytest.mark.slow

MULTI_BYTE = "Hello 😀 world 你好世界, 日本語 🎉 café!"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=256, max_num_seqs=8)


def feed(tokenizer, token_ids, params, prompt=(1, 2), stream=True, length_stop=False):
    """Deltas of each token, the stop string that ended the text (or None), and the final text. stream=False reads
    the text only at the end, as generate() does; length_stop: the last token ends the sequence by its length."""
    seq = Sequence("0", None, list(prompt), params,
                   max_num_tokens=len(prompt) + len(token_ids) if length_stop else 1 << 30)
    seq.detokenizer = detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), params)
    deltas, stop, checker = [], None, StopChecker(set())
    for token_id in token_ids:
        seq.token_ids.append(token_id)
        finished = checker.check(seq)
        deltas.append(detokenizer.take_new_text(finished=finished) if stream else "")
        if finished:
            stop = seq.stop_reason
            break
    return deltas, stop, detokenizer.text


def test_multi_byte_characters_are_released_whole(tokenizer):
    token_ids = tokenizer.encode(MULTI_BYTE)
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)  # some tokens are partial characters
    deltas, stop, text = feed(tokenizer, token_ids, SamplingParams())
    assert stop is None and text == "".join(deltas) == MULTI_BYTE
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # tokens ending inside a character release nothing yet


def test_the_text_keeps_the_spaces_a_tokenizer_cleanup_would_drop():
    """A tokenizer configured with clean_up_tokenization_spaces (Llama 3's is; transformers 4 applies it to BPE, and
    5 when forced) would turn " ." into "." and lose characters between incremental decodes: the text is the
    tokens', as vLLM's."""
    cleaning = AutoTokenizer.from_pretrained(
        default_model_path(), clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    text = "x != y . Then ? And , so 's it"
    token_ids = cleaning.encode(text)
    assert cleaning.decode(token_ids) != text  # the cleanup is on
    for stream in (True, False):
        deltas, stop, whole = feed(cleaning, token_ids, SamplingParams(), stream=stream)
        assert whole == text and (not stream or "".join(deltas) == text)
    deltas, stop, whole = feed(cleaning, token_ids, SamplingParams(stop=[" ?"]))
    assert stop == " ?" and whole == "".join(deltas) == "x != y . Then"
    # The logprobs' token texts too: they add up to the text.
    detokenizer = IncrementalDetokenizer(cleaning, [1, 2], SamplingParams())
    assert "".join(detokenizer.decode_each(token_ids, [1, 2])) == text


def test_a_multi_byte_stop_string_spanning_tokens(tokenizer):
    token_ids = tokenizer.encode(MULTI_BYTE)
    deltas, stop, text = feed(tokenizer, token_ids, SamplingParams(stop=["界, 日"]))
    assert stop == "界, 日" and text == "".join(deltas) == "Hello 😀 world 你好世"
    deltas, stop, text = feed(tokenizer, token_ids, SamplingParams(stop="😀", include_stop_str_in_output=True))
    assert text == "".join(deltas) == "Hello 😀"


def test_a_stop_string_in_the_text_of_the_first_min_tokens_does_not_count(tokenizer):
    """vLLM's rule, whether the text is read at every step (a stream) or only at the end (generate): a stop string
    that ends within the text of the first min_tokens tokens does not stop the output, a later one does."""
    token_ids = tokenizer.encode(" one two one two three")
    min_tokens = len(tokenizer.encode(" one two"))  # the first " two" is within them
    for stream in (True, False):
        _, stop, text = feed(tokenizer, token_ids, SamplingParams(stop=["two"], min_tokens=min_tokens), stream=stream)
        assert (stop, text) == ("two", " one two one "), stream
        # A match may start in that text, but must end after it.
        _, stop, text = feed(tokenizer, token_ids, SamplingParams(stop=["one two"], min_tokens=min_tokens + 1),
                             stream=stream)
        assert (stop, text) == ("one two", " one two "), stream
        _, stop, text = feed(tokenizer, token_ids, SamplingParams(stop=["one two"], min_tokens=2 * min_tokens),
                             stream=stream)
        assert (stop, text) == (None, " one two one two three"), stream


def test_a_character_split_between_prompt_and_completion_is_the_completions(tokenizer):
    """A prompt that ends inside a character: the completion's text starts with the whole character; a completion
    that ends inside one leaves it out (vLLM's rule: a partial character is never text)."""
    token_ids = tokenizer.encode("語")  # three byte tokens
    assert len(token_ids) > 1 and "\ufffd" in tokenizer.decode(token_ids[:-1])
    prompt = tokenizer.encode("Hi") + token_ids[:-1]
    for stream in (True, False):
        completion = token_ids[-1:] + tokenizer.encode("!")
        deltas, _, text = feed(tokenizer, completion, SamplingParams(), prompt, stream, length_stop=True)
        assert text == "語!" and (not stream or "".join(deltas) == text)
        completion = tokenizer.encode("ok") + token_ids[:-1]
        deltas, _, text = feed(tokenizer, completion, SamplingParams(), (1, 2), stream, length_stop=True)
        assert text == "ok" and (not stream or "".join(deltas) == text)


@pytest.mark.parametrize("end", ["length", "stop token"])
def test_a_stop_string_completed_by_the_text_released_at_the_end_is_cut(tokenizer, end):
    """ " 😀" is one token of its space and the emoji's first bytes and one of its last byte: without the last, the
    space is released only as the sequence ends, and it completes the stop string ": "."""
    token_ids = tokenizer.encode("Answer: 😀", add_special_tokens=False)[:-1]
    assert tokenizer.decode(token_ids).endswith(": \ufffd")
    stop_token = tokenizer.encode("!", add_special_tokens=False)
    params = SamplingParams(stop=[": "], stop_token_ids=stop_token if end == "stop token" else [])
    deltas, stop, text = feed(tokenizer, token_ids + (stop_token if end == "stop token" else []), params,
                              length_stop=end == "length")
    assert (text, stop) == ("Answer", ": ")
    assert "".join(deltas) == text


def test_logprob_texts_of_a_character_split_over_tokens_are_whole(tokenizer):
    """The tokens holding a character's first bytes read "", the token that completes it the whole character with
    the text of those tokens (vLLM's decoded_token), for the sampled token and the others alike."""
    prompt = [1, 2]
    token_ids = tokenizer.encode(" 😀 中", add_special_tokens=False)
    assert "\ufffd" in tokenizer.decode(token_ids[:1])  # the emoji is split over tokens
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    texts = [detokenizer.decode_each([t], prompt + token_ids[:i])[0] for i, t in enumerate(token_ids)]
    assert "".join(texts) == tokenizer.decode(token_ids) and "\ufffd" not in "".join(texts)
    assert texts[0] == "" and texts[1] == " 😀"
    grin = tokenizer.encode(" 😁", add_special_tokens=False)  # the same first bytes, another last one
    assert grin[0] == token_ids[0] and len(grin) == 2
    assert detokenizer.decode_each([token_ids[1], grin[1]], prompt + token_ids[:1]) == [" 😀", " 😁"]


def test_a_logprob_text_after_garbled_bytes_is_its_own_not_the_contexts(tokenizer):
    """Tokens of broken characters before a token that completes one of them (found by a random search over
    SmolLM2's partial-character tokens): its text holds none of the earlier, complete text."""
    context = tokenizer.encode("<|im_end|> Hello", add_special_tokens=False) + [21826, 11099, 177, 125]
    assert all("\ufffd" in tokenizer.decode([token_id]) for token_id in context[-4:] + [245])
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams())
    [text] = detokenizer.decode_each([245], context)
    assert "Hello" not in text and text.endswith("\u6c1b")  # 氛, completed by the token


def test_prompt_logprob_texts_of_a_character_split_over_tokens_are_whole(llm, tokenizer):
    token_ids = tokenizer.encode("Hi 😀 中", add_special_tokens=False)
    [output] = llm.generate({"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
    texts = [logprobs[t].decoded_token for logprobs, t in zip(output.prompt_logprobs[1:], token_ids[1:])]
    assert "".join(texts) == tokenizer.decode(token_ids[1:]) and "" in texts


def test_logprobs_true_asks_for_one_and_outputs_say_whether_they_finished(llm):
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    [out] = llm.generate(["Hi"], SamplingParams(max_tokens=2, logprobs=True, temperature=0), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finished() and all(len(top) == 1 for top in completion.logprobs)  # greedy: the top one
    assert not CompletionOutput(0, "", [], None, None).finished()


def test_stream_matches_generate(llm):
    prompts = ["The three primary colours are", "Une phrase en français :"]
    params = [SamplingParams(max_tokens=10, seed=5), SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=9,
                                                                   stop=[".", "!"])]
    texts = {}
    for delta in llm.stream(prompts, params):
        assert "\ufffd" not in delta.text
        texts[delta.request_id, delta.index] = texts.get((delta.request_id, delta.index), "") + delta.text
    outputs = llm.generate(prompts, params, use_tqdm=False)
    streamed = list(texts.values())
    final = [completion.text for out in outputs for completion in out.outputs]
    assert streamed == final and all(final)


def test_a_seed_reproduces_across_runs_and_batch_compositions(llm):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=1234)
    [alone] = llm.generate("Tell me about the sea.", params, use_tqdm=False)
    mixed = llm.generate(["Hi", "Tell me about the sea.", "List three fruits:"],
                         [SamplingParams(max_tokens=14), params, SamplingParams(temperature=0.5, max_tokens=6)],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    [other] = llm.generate("Tell me about the sea.", SamplingParams(temperature=1.0, max_tokens=10, seed=1),
                           use_tqdm=False)
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_chat_over_several_conversations_with_n(llm):
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "Name a colour."}]]
    outputs = llm.chat(conversations, SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=0), use_tqdm=False)
    assert len(outputs) == 2 and all(len(out.outputs) == 2 for out in outputs)
    assert outputs[0].num_cached_tokens > 0  # the second completion reused the first one's prompt blocks
