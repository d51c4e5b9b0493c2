"""Reasoning parsers: a reply's thinking apart from its answer, the same however the text is cut into deltas; the
streamed chunks of a chat reply; a server started with --reasoning-parser on the real SmolLM2."""
import asyncio
import json
import random

import openai
import pytest

from nanograph.outputs import CompletionDelta, Logprob
from nanograph.default_model import default_model_path
from nanograph.reasoning import ReasoningSplitter, count_reasoning_tokens, prompt_closes_thinking, split_reasoning
from nanograph.serve.chat import Reasoning, _events
from nanograph.serve.tool_calls import ToolCallStream

from ..reasoning_prompts import SHOTS

from .server_process import module_server

CASES = [  # parser, whether the reply starts thinking, reply, (reasoning, answer) as vLLM's parsers give them
    ("qwen3", True, "<think>\nThe capital.\n</think>\n\nParis.", ("\nThe capital.\n", "\n\nParis.")),
    ("qwen3", True, "The capital.</think>\n\nParis.", ("The capital.", "\n\nParis.")),  # <think> in the prompt
    ("qwen3", True, "  <think>a</think>b</think>c", ("a", "b</think>c")),
    ("qwen3", True, "<think>\nStill thinking", ("\nStill thinking", "")),  # ended inside the thinking
    ("qwen3", True, "<thi", ("<thi", "")),
    ("qwen3", True, "<think></think>Paris", ("", "Paris")),
    ("qwen3", False, "Paris. <think>x</think>", (None, "Paris. <think>x</think>")),  # the prompt closed it
    ("deepseek_r1", True, "Hmm, France.</think>Paris.", ("Hmm, France.", "Paris.")),
    ("deepseek_r1", True, "<think>Hmm.</think>Paris.", ("Hmm.", "Paris.")),
    ("deepseek_r1", True, "Hmm <thi", ("Hmm <thi", "")),
    ("deepseek_r1", True, "Hmm </thi", ("Hmm </thi", "")),
]


@pytest.mark.parametrize("parser, thinking, text, expected", CASES)
def test_a_reply_splits_the_same_whole_and_in_any_pieces(parser, thinking, text, expected):
    assert split_reasoning(parser, text, thinking) == expected
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
        splitter = ReasoningSplitter(parser, thinking)
        pieces = []
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            pieces += splitter.feed(text[start:end])
        pieces += splitter.finish()
        reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
        content = "".join(piece for kind, piece in pieces if kind == "content")
        assert (reasoning, content) == (expected[0] or "", expected[1]), cuts
        kinds = [kind for kind, _ in pieces]
        assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # thinking first, then the answer


def test_a_prompt_that_closed_the_thinking():
    assert prompt_closes_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_closes_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_closes_thinking("<|im_start|>assistant\n")


def test_the_thinkings_tokens_are_those_before_the_one_that_completes_the_end_tag():
    """As vLLM counts them, the tags left out: the tokens before the one that completes </think> (all where none
    does), less a <think> token the reply opens with."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    for text in ["Hmm, let me see.</think>yes", "</think>no", "a>\"</think>>\"x", "no end tag at all"]:
        ids = tokenizer.encode(text)
        expected = next((k - 1 for k in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:k])), len(ids))
        assert count_reasoning_tokens(ids, True, tokenizer.decode) == expected, text
        assert count_reasoning_tokens(ids, False, tokenizer.decode) == 0
    ids = [5, 9, 7, 9]  # with one-token tags: <think> 5, </think> 9 or (absent) 8
    assert count_reasoning_tokens(ids, True, None, end_token=9) == 1
    assert count_reasoning_tokens(ids, True, None, end_token=9, start_token=5) == 0
    assert count_reasoning_tokens(ids, True, None, end_token=8, start_token=5) == 3
    assert count_reasoning_tokens([5, 1, 2, 9, 3], True, None, end_token=9, start_token=5) == 2


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning parser 'r1' is not one of qwen3, deepseek_r1"):
        ReasoningSplitter("r1")


def stream_of(texts_by_choice: list[list[str]], logprobs: bool = False):
    """A RequestStream's items: step i gives every choice its i-th text (one token each)."""
    async def stream():
        steps = max(map(len, texts_by_choice))
        for i in range(steps):
            deltas = []
            for index, texts in enumerate(texts_by_choice):
                if i < len(texts):
                    last = i == len(texts) - 1
                    token = 100 * index + i + 1
                    deltas.append((0, CompletionDelta(
                        "r", index, texts[i], [token], finished=last, finish_reason="stop" if last else None,
                        logprobs=[{token: Logprob(-0.5, 1, texts[i])}] if logprobs else None)))
            yield deltas
    return stream()


def chat_chunks(texts_by_choice, reasoning, **kwargs) -> list[dict]:
    async def events():
        return [event async for event in _events(stream_of(texts_by_choice, kwargs.pop("logprobs", False)),
                                                  "chatcmpl-1", "m", [[1, 2]], len(texts_by_choice), 0, False,
                                                  "assistant", "", reasoning=reasoning, **kwargs)]

    return [json.loads(line.removeprefix("data: ")) for text in asyncio.run(events())
            for line in text.split("\n") if line.startswith("data: {")]


def joined(chunks, index, field) -> str:
    return "".join(chunk["choices"][0]["delta"].get(field) or "" for chunk in chunks
                   if chunk["choices"] and chunk["choices"][0]["index"] == index)


def test_streamed_chunks_carry_the_thinking_apart():
    texts = ["<thi", "nk>\nabc</th", "ink>\n\nPar", "is.</thi"]
    chunks = chat_chunks([texts], Reasoning("qwen3", True, True))
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert joined(chunks, 0, "reasoning") == joined(chunks, 0, "reasoning_content") == "\nabc"
    assert joined(chunks, 0, "content") == "\n\nParis.</thi"  # the held-back end comes out at the finish
    assert all(delta["content"] is None for delta in deltas if "reasoning" in delta)  # chunks of one or the other
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # include_reasoning false: the answer alone.
    chunks = chat_chunks([texts], Reasoning("qwen3", True, False))
    assert not joined(chunks, 0, "reasoning") and joined(chunks, 0, "content") == "\n\nParis.</thi"


def test_streamed_thinking_per_choice_with_logprobs_and_tool_calls():
    """Two choices, each its own splitter; every token's logprob comes once; a call written inside the thinking is
    thinking, one in the answer is a call."""
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    first = ["<think>", "plan ", call, "</think>", "\n\n", call]
    second = ["<think>", "no", "</think>", "Fine."]
    chunks = chat_chunks([first, second], Reasoning("qwen3", True, True), logprobs=True,
                         parse_calls=ToolCallStream)
    assert joined(chunks, 0, "reasoning") == "plan " + call and joined(chunks, 1, "reasoning") == "no"
    assert joined(chunks, 1, "content") == "Fine."
    calls = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls") or []
             if chunk["choices"][0]["index"] == 0]
    assert [c["function"]["name"] for c in calls] == ["f"]
    for index, texts in enumerate((first, second)):
        entries = [entry for chunk in chunks if chunk["choices"] and chunk["choices"][0]["index"] == index
                   and chunk["choices"][0].get("logprobs") for entry in chunk["choices"][0]["logprobs"]["content"]]
        assert [entry["token"] for entry in entries] == texts
    finishes = {chunk["choices"][0]["index"]: chunk["choices"][0]["finish_reason"] for chunk in chunks
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]}
    assert finishes == {0: "tool_calls", 1: "stop"}


def test_a_named_functions_arguments_come_after_the_thinking():
    """Under tool_choice naming a function the grammar applies after the thinking: the thinking streams as reasoning,
    the answer as the call's arguments."""
    chunks = chat_chunks([["Hmm", ", yes.</th", 'ink>{"yes"', ": true}"]], Reasoning("deepseek_r1", True, True),
                         named="answer")
    assert joined(chunks, 0, "reasoning") == "Hmm, yes." and not joined(chunks, 0, "content")
    arguments = [call["function"].get("arguments") or "" for chunk in chunks
                 for call in chunk["choices"][0]["delta"].get("tool_calls") or []]
    assert "".join(arguments) == '{"yes": true}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--reasoning-parser", "deepseek_r1", "--trust-request-chat-template")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        yield client


def test_a_server_with_a_reasoning_parser(client):
    """SmolLM2 writes no </think> to a question: under deepseek_r1 (whose template opens the thinking) its whole reply
    is thinking, streamed or not."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                           temperature=0).choices[0].message
    assert reply.content is None and reply.model_extra["reasoning"] and \
        reply.model_extra["reasoning_content"] == reply.model_extra["reasoning"]
    reply_usage = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                                 temperature=0).usage
    assert reply_usage.completion_tokens_details.reasoning_tokens == reply_usage.completion_tokens > 0
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                              temperature=0, stream=True)
    deltas = [chunk.choices[0].delta for chunk in streamed if chunk.choices]
    assert "".join(delta.model_extra.get("reasoning") or "" for delta in deltas) == reply.model_extra["reasoning"]
    assert not "".join(delta.content or "" for delta in deltas)
    # A template that closes the thinking in the prompt (as Qwen3's does with enable_thinking false): all answer.
    closed = "{% for m in messages %}{{ m.content }}\n{% endfor %}Answer: <think>\n\n</think>\n\n"
    answered = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                              temperature=0, extra_body={"chat_template": closed}).choices[0].message
    assert answered.content and "reasoning" not in (answered.model_extra or {})
    assert client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12, temperature=0,
        extra_body={"chat_template": closed}).usage.completion_tokens_details.reasoning_tokens == 0
    hidden = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                            temperature=0, extra_body={"include_reasoning": False}).choices[0]
    assert hidden.message.content is None and "reasoning" not in (hidden.message.model_extra or {})
    # A grammar applies to the answer, after the thinking: a template of few-shot thinking (SmolLM2 then writes a
    # thought and </think> in pieces) and a choice, whole and streamed, and a JSON schema.
    shots = {"chat_template": SHOTS}
    constrained = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24,
                                                 temperature=0, extra_body={**shots, "guided_choice": ["yes", "no"]})
    message = constrained.choices[0].message
    assert message.content in ("yes", "no") and message.model_extra["reasoning"].strip()
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24,
                                              temperature=0, stream=True,
                                              extra_body={**shots, "guided_choice": ["yes", "no"]})
    deltas = [chunk.choices[0].delta for chunk in streamed if chunk.choices]
    assert "".join(delta.model_extra.get("reasoning") or "" for delta in deltas) == message.model_extra["reasoning"]
    assert "".join(delta.content or "" for delta in deltas) == message.content
    # The thinking's tokens: up to the one that completed </think>, whole, streamed and in a response's usage.
    thought = constrained.usage.completion_tokens_details.reasoning_tokens
    assert 0 < thought < constrained.usage.completion_tokens
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24,
                                              temperature=0, stream=True, stream_options={"include_usage": True},
                                              extra_body={**shots, "guided_choice": ["yes", "no"]})
    assert [chunk.usage.completion_tokens_details.reasoning_tokens for chunk in streamed if chunk.usage] == [thought]
    response = client.responses.create(model="SmolLM2-135M-Instruct", input=messages[0]["content"],
                                       max_output_tokens=24, temperature=0,
                                       extra_body={**shots, "structured_outputs": {"choice": ["yes", "no"]}})
    assert response.output_text in ("yes", "no") and response.usage.output_tokens_details.reasoning_tokens == thought
    closed_constrained = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12, temperature=0,
        extra_body={"chat_template": closed, "guided_choice": ["Paris", "Rome"]}).choices[0].message
    assert closed_constrained.content in ("Paris", "Rome") and "reasoning" not in \
        (closed_constrained.model_extra or {})
    schema = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
    as_json = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40, temperature=0,
        extra_body={**shots, "structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    message = as_json.choices[0].message
    assert message.model_extra["reasoning"].strip() and isinstance(json.loads(message.content)["yes"], bool)
