"""--tool-call-parser llama3_json: Llama 3.1-3.3's JSON calls ({"name": ..., "parameters": {...}}, several separated
by ";"), whole and streamed in any pieces, as vLLM's parser of that name reads them; and on a real server, a reply
forced into that format comes back as tool calls."""
import json

import openai
import pytest

from nanograph.serve.tool_calls import JsonCallStream, extract_tool_calls

from .server_process import module_server

ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}'
TWO = ONE + '; {"name": "get_time", "arguments": {"zone": "CET"}}'


def streamed(text: str, piece: int) -> list:
    stream, out = JsonCallStream(), []
    for i in range(0, len(text), piece):
        out += stream.feed(text[i:i + piece])
    return out + stream.finish()


def calls_of(items) -> list[tuple]:
    return [(item[0], item[1].name, json.loads(item[1].arguments)) for item in items if not isinstance(item, str)]


def test_a_reply_of_calls_is_its_calls_and_no_content():
    content, calls = extract_tool_calls(TWO, "llama3_json")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {"zone": "CET"})]
    assert '"°C"' in calls[0].arguments and calls[0].id != calls[1].id
    assert [c.name for c in extract_tool_calls("\n <|python_tag|>" + ONE + " ;\n", "llama3_json")[1]] == \
        ["get_weather"]
    # Anything else is all content: text, JSON that is not a call, a call with text after it, a broken object.
    for text in ["The weather is fine.", '{"city": "Paris"}', ONE + " That is all.", ONE[:-3],
                 "Sure: " + ONE, ONE + '; {"city": 1}']:
        assert extract_tool_calls(text, "llama3_json") == (text, []), text
    # The hermes parser does not read this format.
    assert extract_tool_calls(ONE, "hermes") == (ONE, [])


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_a_streamed_reply_gives_each_call_whole_or_the_text_in_any_pieces(piece):
    out = streamed("  " + TWO, piece)
    assert all(not isinstance(item, str) or not item.strip() for item in out)
    assert calls_of(out) == [(0, "get_weather", {"city": "Paris", "unit": "°C"}), (1, "get_time", {"zone": "CET"})]
    text = "No call { here }."
    assert "".join(streamed(text, piece)) == text
    # JSON that is not a call, and an object left open at the end: the text, as it was written.
    for text in ['{"city": "Paris"} is the answer', ONE[:-3]]:
        assert "".join(streamed(text, piece)) == text and not calls_of(streamed(text, piece))


FORCED = {"structured_outputs": {"regex": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)"\}\}; '
                                          r'\{"name": "get_weather", "parameters": \{"city": "Oslo"\}\}'}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris and in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")


def test_a_server_returns_llama3_calls_whole_and_streamed(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        choice = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                                temperature=0, extra_body=FORCED).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [json.loads(call.function.arguments)["city"] for call in choice.message.tool_calls][1] == "Oslo"
        stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                                temperature=0, extra_body=FORCED, stream=True)
        calls, content, finish = [], "", None
        for chunk in stream:
            for streamed_choice in chunk.choices:
                calls += streamed_choice.delta.tool_calls or []
                content += streamed_choice.delta.content or ""
                finish = streamed_choice.finish_reason or finish
        assert finish == "tool_calls" and not content.strip()
        assert [(call.index, call.function.name, call.function.arguments) for call in calls] == [
            (i, call.function.name, call.function.arguments) for i, call in enumerate(choice.message.tool_calls)]
        # Plain text stays content.
        text = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                              tools=TOOLS, max_tokens=8, temperature=0).choices[0]
        assert text.message.content and not text.message.tool_calls and text.finish_reason != "tool_calls"
