"""Reasoning parsers: a reply's thinking apart from its answer, the same however the text is cut into deltas; the
streamed chunks of a chat reply; a server started with --reasoning-parser on the real SmolLM2."""
import asyncio
import json
import random

import openai
import pytest

from nanograph.outputs import CompletionDelta
from nanograph.serve.chat import _events
from nanograph.serve.reasoning import ReasoningSplitter, split_reasoning

from .server_process import module_server

CASES = [  # parser, reply, (reasoning, answer) as vLLM's parsers give them
    ("qwen3", "<think>\nThe capital.\n</think>\n\nParis.", ("\nThe capital.\n", "\n\nParis.")),
    ("qwen3", "Paris.", (None, "Paris.")),  # no thinking (enable_thinking false)
    ("qwen3", "<think>\nStill thinking", ("\nStill thinking", "")),  # ended inside the thinking
    ("qwen3", "<thi", (None, "<thi")),
    ("qwen3", "a </think> b", (None, "a </think> b")),  # not a reply that opened with <think>
    ("qwen3", "<think></think>Paris", ("", "Paris")),
    ("deepseek_r1", "Hmm, France.</think>Paris.", ("Hmm, France.", "Paris.")),
    ("deepseek_r1", "<think>Hmm.</think>Paris.", ("Hmm.", "Paris.")),
    ("deepseek_r1", "Hmm, still", ("Hmm, still", "")),
    ("deepseek_r1", "Hmm <thi", ("Hmm <thi", "")),
]


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_a_reply_splits_the_same_whole_and_in_any_pieces(parser, text, expected):
    assert split_reasoning(parser, text) == expected
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
        splitter = ReasoningSplitter(parser)
        pieces = []
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            pieces += splitter.feed(text[start:end])
        pieces += splitter.finish()
        reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
        content = "".join(piece for kind, piece in pieces if kind == "content")
        assert (reasoning, content) == (expected[0] or "", expected[1]), cuts
        kinds = [kind for kind, _ in pieces]
        assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # thinking first, then the answer


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning parser 'r1' is not one of qwen3, deepseek_r1"):
        ReasoningSplitter("r1")


def test_streamed_chunks_carry_the_thinking_apart():
    texts = ["<thi", "nk>\nabc</th", "ink>\n\nPar", "is."]

    async def stream():
        for i, text in enumerate(texts):
            yield [(0, CompletionDelta("r", 0, text, [i + 1], finished=i == len(texts) - 1,
                                       finish_reason="stop" if i == len(texts) - 1 else None))]

    async def events():
        return [event async for event in _events(stream(), "chatcmpl-1", "m", [[1, 2]], 1, 0, False, "assistant", "",
                                                  reasoning_parser="qwen3")]

    chunks = [json.loads(line.removeprefix("data: ")) for text in asyncio.run(events())
              for line in text.split("\n") if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = "".join(delta.get("reasoning", "") for delta in deltas)
    content = "".join(delta.get("content") or "" for delta in deltas[1:])
    assert reasoning == "\nabc" and content == "\n\nParis."
    assert all(delta.get("reasoning_content") == delta.get("reasoning") for delta in deltas)
    assert all(delta["content"] is None for delta in deltas if "reasoning" in delta)  # chunks of one or the other
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        yield client


def test_a_server_with_a_reasoning_parser(client):
    """SmolLM2 writes no </think>: under deepseek_r1 (whose template opens the thinking) its whole reply is thinking,
    streamed or not; a reply constrained by a grammar is all answer."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                           temperature=0).choices[0].message
    assert reply.content is None and reply.model_extra["reasoning"] and \
        reply.model_extra["reasoning_content"] == reply.model_extra["reasoning"]
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                              temperature=0, stream=True)
    deltas = [chunk.choices[0].delta for chunk in streamed if chunk.choices]
    assert "".join(delta.model_extra.get("reasoning") or "" for delta in deltas) == reply.model_extra["reasoning"]
    assert not "".join(delta.content or "" for delta in deltas)
    constrained = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                                 temperature=0, extra_body={"guided_choice": ["Paris", "Rome"]})
    message = constrained.choices[0].message
    assert message.content in ("Paris", "Rome") and "reasoning" not in (message.model_extra or {})
