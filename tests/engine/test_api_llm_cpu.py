"""The request API end to end with SmolLM2-135M-Instruct on the CPU: multi-byte text detokenised incrementally,
streaming, seeds, chat over several conversations."""
import pytest
from transformers import AutoTokenizer

from nanograph import LLM, SamplingParams
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


def feed(tokenizer, token_ids, params, prompt=(1, 2)):
    """Deltas of each token, the stop string that ended the text (or None), and the final text."""
    seq = Sequence("0", None, list(prompt), params, max_num_tokens=1 << 30)
    seq.detokenizer = detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), params)
    deltas, stop, checker = [], None, StopChecker(set())
    for token_id in token_ids:
        seq.token_ids.append(token_id)
        finished = checker.check(seq)
        deltas.append(detokenizer.take_new_text(finished=finished))
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


def test_a_multi_byte_stop_string_spanning_tokens(tokenizer):
    token_ids = tokenizer.encode(MULTI_BYTE)
    deltas, stop, text = feed(tokenizer, token_ids, SamplingParams(stop=["界, 日"]))
    assert stop == "界, 日" and text == "".join(deltas) == "Hello 😀 world 你好世"
    deltas, stop, text = feed(tokenizer, token_ids, SamplingParams(stop="😀", include_stop_str_in_output=True))
    assert text == "".join(deltas) == "Hello 😀"


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
