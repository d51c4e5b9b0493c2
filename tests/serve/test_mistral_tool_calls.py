"""--tool-call-parser mistral: the content before [TOOL_CALLS] and the calls of the JSON array after it, each with a
9-character id (Mistral's template takes no other), whole and streamed in any pieces, as vLLM's parser reads them;
on a real server, a reply forced into that format comes back as tool calls."""
import json
import re

import openai
import pytest

from nanograph.serve.tool_calls import MistralCallStream, extract_tool_calls

from .server_process import module_server

CALLS = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, ' \
        '{"name": "get_time", "arguments": {"zone": "CET"}}]'
EXPECTED = [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {"zone": "CET"})]


def test_a_reply_with_the_tag_gives_its_content_and_calls():
    content, calls = extract_tool_calls("Let me check. " + CALLS, "mistral")
    assert content == "Let me check. " and [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert all(re.fullmatch(r"[0-9a-zA-Z]{9}", c.id) for c in calls) and calls[0].id != calls[1].id
    assert extract_tool_calls(CALLS, "mistral")[0] is None
    # A lone object is one call; text after the array is not read.
    assert [c.name for c in extract_tool_calls('[TOOL_CALLS]{"name": "f", "arguments": {}} ok', "mistral")[1]] == ["f"]
    for text in ["No calls.", "[TOOL_CALLS] not json", '[TOOL_CALLS] [{"city": "Paris"}]', "[TOOL_CALLS]"]:
        assert extract_tool_calls(text, "mistral") == (text, []), text


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_a_streamed_reply_gives_the_same_content_and_calls_in_any_pieces(piece):
    def streamed(text):
        stream, out = MistralCallStream(), []
        for i in range(0, len(text), piece):
            out += stream.feed(text[i:i + piece])
        return out + stream.finish()

    out = streamed("Let me [TOOL] check. " + CALLS)
    assert "".join(item for item in out if isinstance(item, str)) == "Let me [TOOL] check. "
    calls = [item for item in out if not isinstance(item, str)]
    assert [(i, c.name, json.loads(c.arguments)) for i, c in calls] == [(0, *EXPECTED[0]), (1, *EXPECTED[1])]
    # An array that never parses comes out as the text it was.
    broken = "Hi [TOOL_CALLS] [{not json"
    assert "".join(item for item in streamed(broken) if isinstance(item, str)) == broken


FORCED = {"structured_outputs": {"regex": r'Checking\. \[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": '
                                          r'\{"city": "(Paris|Oslo)"\}\}\]'}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--enable-auto-tool-choice", "--tool-call-parser", "mistral")


def test_a_server_returns_mistral_calls_whole_and_streamed(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        choice = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                                temperature=0, extra_body=FORCED).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and re.fullmatch(r"[0-9a-f]{9}", call.id)
        stream = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                                temperature=0, extra_body=FORCED, stream=True)
        calls, content, finish = [], "", None
        for chunk in stream:
            for streamed_choice in chunk.choices:
                calls += streamed_choice.delta.tool_calls or []
                content += streamed_choice.delta.content or ""
                finish = streamed_choice.finish_reason or finish
        assert content == "Checking. " and finish == "tool_calls"
        assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
            (0, "get_weather", call.function.arguments)]
        # [TOOL_CALLS] is a special token: with tools, special tokens stay in the text (SmolLM2's <|im_start|>,
        # forced here, stands in for it).
        forced = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=2,
                                                temperature=0, logit_bias={"1": 100})
        assert forced.choices[0].message.content == "<|im_start|><|im_start|>"
