"""Tool calls: the hermes parser on whole and streamed replies (CPU, no server), then a server started with
--enable-auto-tool-choice --tool-call-parser hermes, driven by the official openai client. The model is made to
write a call with a regex grammar, which tests the parsing end to end whatever the model would write; a named
tool_choice constrains the reply to the function's parameters schema."""
import json

import pytest

from nanograph.serve.tool_calls import ToolCall, ToolCallStream, extract_tool_calls

from .server_process import module_server

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}]


def test_a_reply_with_calls_gives_its_content_and_calls():
    content, calls = extract_tool_calls("Let me look. " + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert content == "Let me look. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "°C"}), ("get_weather", {"city": "Oslo", "unit": "°C"})]
    assert calls[0].id.startswith("chatcmpl-tool-") and calls[0].id != calls[1].id
    assert '"°C"' in calls[0].arguments  # arguments are JSON text, not ASCII-escaped
    # Only calls: no content. Plain text: all content. A call that does not parse: the reply stays text.
    content, calls = extract_tool_calls(CALL)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert extract_tool_calls("no calls here") == ("no calls here", [])
    broken = "x <tool_call>{not json}</tool_call>"
    assert extract_tool_calls(broken) == (broken, [])
    # A call cut off by max_tokens after its JSON is still a call.
    assert [c.name for c in extract_tool_calls('<tool_call>{"name": "f", "arguments": {}}')[1]] == ["f"]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_a_streamed_reply_gives_the_same_content_and_calls_in_any_pieces(piece):
    text = "Weather <tool maybe> then " + CALL + " and after"
    stream, out = ToolCallStream(), []
    for i in range(0, len(text), piece):
        out += stream.feed(text[i:i + piece])
    out += stream.finish()
    content = "".join(item for item in out if isinstance(item, str))
    calls = [item for item in out if isinstance(item, ToolCall)]
    assert content == "Weather <tool maybe> then  and after"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "°C"})]
    assert stream.num_calls == 1
    # Held-back text that turns out not to open a call is given out by the end.
    stream = ToolCallStream()
    assert stream.feed("a <tool_") == ["a "] and stream.finish() == ["<tool_"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")


# The reply the grammar forces: text, then one call (the model's own tokens, constrained).
FORCED = {"structured_outputs": {"regex": r'Weather: <tool_call>\n\{"name": "get_weather", "arguments": '
                                          r'\{"city": "(Paris|Oslo)"\}\}\n</tool_call>'}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_auto_tool_choice_returns_the_parsed_calls(client):
    response = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS,
                                              max_tokens=80, temperature=0, extra_body=FORCED)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Weather: "
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


def test_auto_tool_choice_streams_the_content_then_each_call_whole(client):
    stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS,
                                            tool_choice="auto", max_tokens=80, temperature=0, extra_body=FORCED,
                                            stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert content == "Weather: " and finish == "tool_calls"
    [call] = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


def test_a_named_tool_choice_constrains_the_reply_to_the_functions_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    model = client.models.list().data[0].id
    response = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                              max_tokens=40, temperature=0)
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and response.choices[0].finish_reason == "stop"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                            max_tokens=40, temperature=0, stream=True)
    pieces = [call for chunk in stream for choice in chunk.choices for call in choice.delta.tool_calls or []]
    assert pieces[0].function.name == "get_weather" and pieces[0].id.startswith("chatcmpl-tool-")
    assert all(piece.index == 0 for piece in pieces)
    assert "".join(piece.function.arguments or "" for piece in pieces) == call.function.arguments
