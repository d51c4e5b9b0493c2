"""Tool calls: the hermes parser on whole and streamed replies (CPU, no server), then a server started with
--enable-auto-tool-choice --tool-call-parser hermes, driven by the official openai client. The model is made to
write a call with a regex grammar, which tests the parsing end to end whatever the model would write; a named
tool_choice constrains the reply to the function's parameters schema, and "required" to a JSON array of calls."""
import json

import pytest

from nanograph.serve.tool_calls import (RequiredCallStream, ToolCall, ToolCallStream, extract_tool_calls,
                                        required_calls_schema)

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
    # Whitespace before a call is kept as the content, as vLLM keeps it.
    assert extract_tool_calls("\n\n" + CALL)[0] == "\n\n"
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
    calls = [item for item in out if not isinstance(item, str)]
    # Streamed, text after a call is content too (the whole reply's parse drops it, as vLLM's does).
    assert content == "Weather <tool maybe> then  and after"
    assert [(i, c.name, json.loads(c.arguments)) for i, c in calls] == [
        (0, "get_weather", {"city": "Paris", "unit": "°C"})]
    assert isinstance(calls[0][1], ToolCall) and stream.num_calls == 1
    # Held-back text that turns out not to open a call is given out by the end.
    stream = ToolCallStream()
    assert stream.feed("a <tool_") == ["a "] and stream.finish() == ["<tool_"]


def test_calls_that_complete_in_one_piece_get_their_own_indexes_in_order():
    stream = ToolCallStream()
    out = stream.feed("x" + CALL + "mid" + CALL.replace("Paris", "Oslo") + '<tool_call>{"name": "f", "arguments": {}}')
    out += stream.finish()  # the third call, left open by the end of the reply, still parses
    assert [item if isinstance(item, str) else (item[0], item[1].name) for item in out] == [
        "x", (0, "get_weather"), "mid", (1, "get_weather"), (2, "f")]
    assert stream.num_calls == 3


def test_a_call_that_does_not_parse_streams_as_the_text_the_model_wrote():
    stream = ToolCallStream()
    assert stream.feed('Hi <tool_call>\n{"') == ["Hi "]
    assert stream.finish() == ['<tool_call>\n{"']  # cut off: no closing tag that the model never wrote
    stream = ToolCallStream()
    assert stream.feed("<tool_call>{oops}</tool_call> ok") == ["<tool_call>{oops}</tool_call>", " ok"]
    assert stream.num_calls == 0



@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_a_required_reply_streams_each_call_whole_once_its_object_closes(piece):
    """tool_choice "required": the reply is a JSON array of {"name", "parameters"} objects; each is a call (its
    parameters as JSON text) as soon as it closes, in any pieces, and nothing is left over."""
    text = ' [ {"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}} ,\n' \
           '{"name": "f", "parameters": {}}]'
    stream, out, seen_at = RequiredCallStream(), [], []
    for i in range(0, len(text), piece):
        out += stream.feed(text[i:i + piece])
        seen_at.append(len(out))
    out += stream.finish()
    assert [(i, c.name, json.loads(c.arguments)) for i, c in out] == [
        (0, "get_weather", {"city": "Paris", "unit": "°C"}), (1, "f", {})]
    assert '"°C"' in out[0][1].arguments and stream.num_calls == 2
    closing = (text.index("}}") + 1) // piece  # the first call goes out with the piece that closes its object
    assert seen_at[closing] >= 1 and (closing == 0 or seen_at[closing - 1] == 0)
    # A reply cut short by max_tokens: the calls that closed, then the rest as text.
    stream = RequiredCallStream()
    out = stream.feed('[{"name": "f", "parameters": {}}, {"name": "g", "para') + stream.finish()
    assert [item if isinstance(item, str) else item[1].name for item in out] == ["f", '{"name": "g", "para']
    stream = RequiredCallStream()
    assert stream.feed('[{"name": "f"') == [] and stream.finish() == ['[{"name": "f"']


def test_the_required_schema_moves_each_tools_defs_to_its_root():
    """Tool parameters made by pydantic hold "$defs" that their "$ref"s find from the root of the schema: under
    "required"'s array they would point nowhere, so the definitions move to the root (the grammar engine then
    compiles the schema); two tools that define one name differently are refused, naming the tool."""
    pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")
    from transformers import AutoTokenizer

    from nanograph import StructuredOutputsParams
    from nanograph.default_model import default_model_path
    from nanograph.sampling.grammar import GrammarCompiler

    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    located = {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
        "$defs": {"Place": place}}}}
    schema = required_calls_schema([located, *TOOLS])
    assert schema["$defs"] == {"Place": place} and "$defs" in located["function"]["parameters"]  # copied, not moved
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiler.compile(StructuredOutputsParams(json=schema))
    other = {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"Place": {"type": "string"}}}}}
    with pytest.raises(ValueError, match=r"tools\[1\].function.parameters defines \$defs/Place unlike"):
        required_calls_schema([located, other])

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


def test_two_calls_stream_with_their_own_indexes_and_one_finish_reason(client):
    two = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>\n' \
          r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                            temperature=0, extra_body={"structured_outputs": {"regex": two}},
                                            stream=True)
    calls, finishes = [], []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"]
    assert [(call.index, json.loads(call.function.arguments)["city"]) for call in calls] == [(0, "Paris"), (1, "Oslo")]
    assert calls[0].id != calls[1].id
    whole = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                           temperature=0, extra_body={"structured_outputs": {"regex": two}})
    assert whole.choices[0].message.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert [json.loads(call.function.arguments)["city"] for call in whole.choices[0].message.tool_calls] == \
        ["Paris", "Oslo"]


def test_parallel_tool_calls_false_keeps_a_replys_first_call(client):
    """As vLLM: the reply's first call only, whole and streamed; tool_choice "required" is held to one call."""
    two = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>\n' \
          r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
    model = client.models.list().data[0].id
    fields = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0,
                  parallel_tool_calls=False, extra_body={"structured_outputs": {"regex": two}})
    whole = client.chat.completions.create(**fields)
    assert [json.loads(call.function.arguments)["city"] for call in whole.choices[0].message.tool_calls] == ["Paris"]
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = [call for chunk in client.chat.completions.create(**fields, stream=True) for choice in chunk.choices
             for call in choice.delta.tool_calls or []]
    assert [(call.index, json.loads(call.function.arguments)["city"]) for call in calls] == [(0, "Paris")]
    assert required_calls_schema(TOOLS, one_call=True)["maxItems"] == 1
    assert "maxItems" not in required_calls_schema(TOOLS)
    required = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              max_tokens=80, temperature=0, parallel_tool_calls=False)
    assert len(required.choices[0].message.tool_calls) == 1


def test_tool_choice_required_gives_one_or_more_calls_of_the_tools(client):
    """tool_choice "required": the reply is held to a JSON array of calls of the request's tools (vLLM's schema),
    returned as tool_calls with finish_reason "tool_calls", whole and streamed alike; a tool that is not a function
    is a 400 naming it."""
    model = client.models.list().data[0].id
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]
    response = client.chat.completions.create(model=model, messages=MESSAGES, tools=tools, tool_choice="required",
                                              max_tokens=80, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert (call.function.name, arguments) in [("get_time", {})] or \
            (call.function.name == "get_weather" and arguments["city"] in ("Paris", "Oslo"))
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=tools, tool_choice="required",
                                            max_tokens=80, temperature=0, stream=True)
    calls, finishes = [], []
    for chunk in stream:
        for streamed in chunk.choices:
            calls += streamed.delta.tool_calls or []
            finishes += [streamed.finish_reason] if streamed.finish_reason else []
    assert finishes == ["tool_calls"]
    assert [(call.index, call.function.name, call.function.arguments) for call in calls] == \
        [(i, call.function.name, call.function.arguments) for i, call in enumerate(choice.message.tool_calls)]
    cut = client.chat.completions.create(model=model, messages=MESSAGES, tools=tools, tool_choice="required",
                                         max_tokens=4, temperature=0)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.choices[0].message.content.startswith("[")  # the reply as far as it came
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match=r"tools\[1\] is not"):
        client.chat.completions.create(model=model, messages=MESSAGES, tools=[TOOLS[0], {"type": "function"}],
                                       tool_choice="required", max_tokens=8)
