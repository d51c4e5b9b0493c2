"""The other tool-call parsers, as vLLM's parsers of those names read them: llama3_json (Llama 3.1-3.3's JSON calls,
{"name": ..., "parameters": {...}}, several separated by ";"), mistral (the content before [TOOL_CALLS], the calls
of the JSON array after it, each with a 9-character id, as Mistral's template takes no other) and pythonic (a Python
list of calls with keyword arguments); whole and streamed in any pieces; and on a real server of each, a reply
forced into that format comes back as tool calls."""
import json
import re

import openai
import pytest

from nanograph.serve.tool_calls import (JsonCallStream, MistralCallStream, PythonicCallStream, ToolCall,
                                        extract_tool_calls)

from .server_process import module_server
from .test_tool_calls import TOOLS

WEATHER = ("get_weather", {"city": "Paris", "unit": "°C"})
TIME = ("get_time", {"zone": "CET"})
ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}'
TWO = ONE + '; {"name": "get_time", "arguments": {"zone": "CET"}}'
MISTRAL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, ' \
          '{"name": "get_time", "arguments": {"zone": "CET"}}]'


def streamed(stream_class, text: str, piece: int) -> tuple[str, list[tuple]]:
    """The text fed in pieces: (the content given out, the calls as (index, name, arguments))."""
    stream, out = stream_class(), []
    for i in range(0, len(text), piece):
        out += stream.feed(text[i:i + piece])
    out += stream.finish()
    return ("".join(item for item in out if isinstance(item, str)),
            [(item[0], item[1].name, json.loads(item[1].arguments)) for item in out if not isinstance(item, str)])


def named(calls) -> list[tuple]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_llama3_json_a_reply_of_calls_is_its_calls_and_no_content():
    content, calls = extract_tool_calls(TWO, "llama3_json")
    assert content is None and named(calls) == [WEATHER, TIME]
    assert '"°C"' in calls[0].arguments and calls[0].id != calls[1].id
    assert named(extract_tool_calls("\n <|python_tag|>" + ONE + " ;\n", "llama3_json")[1]) == [WEATHER]
    # Anything else is all content: text, JSON that is not a call, a call with text after it, a broken object.
    for text in ["The weather is fine.", '{"city": "Paris"}', ONE + " That is all.", ONE[:-3],
                 "Sure: " + ONE, ONE + '; {"city": 1}']:
        assert extract_tool_calls(text, "llama3_json") == (text, []), text
    assert extract_tool_calls(ONE, "hermes") == (ONE, [])  # the hermes parser does not read this format


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_llama3_json_streamed_gives_each_call_whole_or_the_text_in_any_pieces(piece):
    content, calls = streamed(JsonCallStream, "  " + TWO, piece)
    assert not content.strip() and calls == [(0, *WEATHER), (1, *TIME)]
    # Text, JSON that is not a call, and an object left open at the end: the text, as it was written.
    for text in ["No call { here }.", '{"city": "Paris"} is the answer', ONE[:-3]]:
        assert streamed(JsonCallStream, text, piece) == (text, [])


def test_mistral_a_reply_with_the_tag_gives_its_content_and_calls():
    content, calls = extract_tool_calls("Let me check. " + MISTRAL, "mistral")
    assert content == "Let me check. " and named(calls) == [WEATHER, TIME]
    assert all(re.fullmatch(r"[0-9a-zA-Z]{9}", c.id) for c in calls) and calls[0].id != calls[1].id
    assert extract_tool_calls(MISTRAL, "mistral")[0] is None
    # A lone object is one call; text after the array is not read.
    assert [c.name for c in extract_tool_calls('[TOOL_CALLS]{"name": "f", "arguments": {}} ok', "mistral")[1]] == ["f"]
    for text in ["No calls.", "[TOOL_CALLS] not json", '[TOOL_CALLS] [{"city": "Paris"}]', "[TOOL_CALLS]"]:
        assert extract_tool_calls(text, "mistral") == (text, []), text


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_mistral_streamed_gives_the_same_content_and_calls_in_any_pieces(piece):
    assert streamed(MistralCallStream, "Let me [TOOL] check. " + MISTRAL, piece) == \
        ("Let me [TOOL] check. ", [(0, *WEATHER), (1, *TIME)])
    broken = "Hi [TOOL_CALLS] [{not json"  # an array that never parses: the text it was
    assert streamed(MistralCallStream, broken, piece) == (broken, [])


# The replies the grammar forces, in each parser's format: (regex, the content expected).
FORCED = {
    "llama3_json": (r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)"\}\}; '
                    r'\{"name": "get_weather", "parameters": \{"city": "Oslo"\}\}', None),
    "mistral": (r'Checking\. \[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}, '
                r'\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\]', "Checking. "),
    "pythonic": (r'\[get_weather\(city="(Paris|Oslo)"\), get_weather\(city="Oslo"\)\]', None),
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris and in Oslo?"}]


# Mistral's template's way with tool calls, in short: it raises on a call id that is not 9 characters long.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'user' %}[INST] {{ message.content }} [/INST]"
    "{% elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{% for tool_call in message.tool_calls %}"
    "{% if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ tool_call.function | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS] {{ message.content }}[/TOOL_RESULTS]{% endif %}"
    "{% endfor %}")


@pytest.fixture(scope="module", params=list(FORCED))
def parser_client(request, tmp_path_factory):
    template = []
    if request.param == "mistral":
        path = tmp_path_factory.mktemp("template") / "mistral.jinja"
        path.write_text(MISTRAL_TEMPLATE)
        template = ["--chat-template", str(path)]
    for server in module_server(tmp_path_factory, "--enable-auto-tool-choice", "--tool-call-parser", request.param,
                                *template):
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=180) as client:
            yield request.param, client


def test_a_server_returns_the_calls_whole_and_streamed(parser_client):
    parser, client = parser_client
    regex, content = FORCED[parser]
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    calls = choice.message.tool_calls
    assert [call.function.name for call in calls] == ["get_weather"] * 2
    assert json.loads(calls[1].function.arguments) == {"city": "Oslo"}
    if parser == "mistral":
        assert all(re.fullmatch(r"[0-9a-f]{9}", call.id) for call in calls)
    streamed_calls, streamed_content, finish = [], "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for streamed_choice in chunk.choices:
            streamed_calls += streamed_choice.delta.tool_calls or []
            streamed_content += streamed_choice.delta.content or ""
            finish = streamed_choice.finish_reason or finish
    assert streamed_content == (content or "") and finish == "tool_calls"
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed_calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
    # Plain text stays content; under mistral, special tokens stay in the text of a request with tools
    # ([TOOL_CALLS] is one; SmolLM2's <|im_start|>, forced here, stands in for it).
    forced = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=2,
                                            temperature=0, logit_bias={"1": 100}).choices[0]
    assert forced.message.content == ("<|im_start|>" * 2 if parser == "mistral" else "")
    assert not forced.message.tool_calls


def test_named_and_required_calls_have_ids_the_template_takes_back(parser_client):
    """A named or required tool choice's calls, whole and streamed, get 9-character ids under the mistral parser
    (whose template raises on others: the next turn, which sends the calls back, renders), the usual ones else."""
    parser, client = parser_client
    model = client.models.list().data[0].id
    id_rule = r"[0-9a-zA-Z]{9}" if parser == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"
    for tool_choice in [{"type": "function", "function": {"name": "get_weather"}}, "required"]:
        kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0,
                      tool_choice=tool_choice)
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.tool_calls and all(re.fullmatch(id_rule, call.id) for call in message.tool_calls)
        streamed_ids = [call.id for chunk in client.chat.completions.create(**kwargs, stream=True)
                        for choice in chunk.choices for call in choice.delta.tool_calls or [] if call.id]
        assert streamed_ids and all(re.fullmatch(id_rule, call_id) for call_id in streamed_ids)
        turn = [*MESSAGES, message.model_dump(exclude_none=True),
                *[{"role": "tool", "tool_call_id": call.id, "content": "Sunny."} for call in message.tool_calls]]
        assert client.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=2,
                                              temperature=0).choices[0].finish_reason == "length"


def test_a_template_that_checks_for_nine_character_ids_gets_them_under_any_parser():
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from nanograph.default_model import default_model_path
    from nanograph.serve.serving import ServedModel

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    engine = SimpleNamespace(info=SimpleNamespace(reasoning_parser=None, model="m", max_model_len=64,
                                                  sampling_defaults={}, tokenizer=None, runner="generate",
                                                  pooling_task=None, labels=(), score_activation=None))
    checks_equal = MISTRAL_TEMPLATE.replace("!=", "==")
    for template, parser, nine in [(MISTRAL_TEMPLATE, "hermes", True), (checks_equal, None, True),
                                   (None, "hermes", False), (None, "mistral", True)]:
        served = ServedModel(engine, "m", tokenizer=tokenizer, chat_template=template, tool_call_parser=parser)
        call_id = served.with_call_id(ToolCall("f", "{}")).id
        assert (re.fullmatch(r"[0-9a-f]{9}", call_id) is not None) is nine, (template, parser, call_id)
        # A request's own chat_template (--trust-request-chat-template) decides for its calls.
        for own, own_nine in [(MISTRAL_TEMPLATE, True), ("{{ messages[0].content }}", parser == "mistral")]:
            call_id = served.with_call_id(ToolCall("f", "{}"), own).id
            assert (re.fullmatch(r"[0-9a-f]{9}", call_id) is not None) is own_nine, (template, parser, own)


PYTHONIC = '[get_weather(city="Paris", unit="°C"), get_time(zone=\'CET\')]'


def test_pythonic_a_list_of_calls_is_its_calls_and_no_content():
    content, calls = extract_tool_calls(PYTHONIC, "pythonic")
    assert content is None and named(calls) == [WEATHER, TIME]
    assert named(extract_tool_calls('[f(a=[1, {"b": None}], c=True, d=-2.5)]', "pythonic")[1]) == [
        ("f", {"a": [1, {"b": None}], "c": True, "d": -2.5})]
    assert named(extract_tool_calls(" [f()]\n", "pythonic")[1]) == [("f", {})]
    # Anything else is all content: text, a list that is not calls, positional or non-literal arguments, values
    # JSON cannot hold, a list cut short.
    for text in ["Sure: [f()]", "[1, 2]", "[]", '[f("Paris")]', "[f(a=g())]", "[f(**d)]", "[f(a={1, 2})]",
                 "[f(a=float('nan'))]", "[f(a=b'x')]", "[a.b(c=1)]", PYTHONIC[:-1]]:
        assert extract_tool_calls(text, "pythonic") == (text, []), text


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_pythonic_streamed_gives_the_calls_at_the_end_of_a_reply_that_is_a_list_of_calls(piece):
    assert streamed(PythonicCallStream, PYTHONIC, piece) == ("", [(0, *WEATHER), (1, *TIME)])
    assert streamed(PythonicCallStream, '[f(a=[1, 2])]\n', piece) == ("", [(0, "f", {"a": [1, 2]})])
    # Text after the list makes the reply text, as the whole reply's parse reads it.
    for text in ["No call [f()] here.", "[f(a=1), oops", "[1, 2]", "[f(a=1)] That is the call.", "[f()] [g()]"]:
        assert streamed(PythonicCallStream, text, piece) == (text, []) == (extract_tool_calls(text, "pythonic")[0],
                                                                           [])


STREAMS = {"llama3_json": JsonCallStream, "mistral": MistralCallStream, "pythonic": PythonicCallStream}


@pytest.mark.parametrize("parser", list(STREAMS))
@pytest.mark.parametrize("piece", [1, 2, 3, 1000])
def test_a_reply_streamed_in_any_pieces_reads_as_the_whole_reply(parser, piece):
    """The content and calls of a stream are those of the whole reply's parse, for replies of calls and of text:
    a reply's text given back as it was written (its whitespace and <|python_tag|> too)."""
    texts = {
        "llama3_json": ["<|python_tag|>" + ONE, "\n <|python_tag|> " + TWO, "<|python_tag|>", "<|python_tag|> x",
                        "  <|python_tag|>{\"city\": 1}", " \n{\"city\": \"Paris\"} and text", "\n\n" + ONE[:-2]],
        "mistral": [MISTRAL, "Checking. " + MISTRAL, "[TOOL", "Text [TOOL_CALLS] [{broken", "[TOOL_CALLS]"],
        "pythonic": [PYTHONIC, "  " + PYTHONIC + "\n", " [f(a=1)] done", "\n[1, 2]", "[f(a=1"],
    }[parser]
    for text in texts:
        content, calls = extract_tool_calls(text, parser)
        whole = ("" if content is None else content,
                 [(i, call.name, json.loads(call.arguments)) for i, call in enumerate(calls)])
        assert streamed(STREAMS[parser], text, piece) == whole, text


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_a_lone_surrogate_in_the_arguments_is_an_escape_in_their_json(parser):
    """A model's "\\ud800" (a lone surrogate, which UTF-8 cannot carry) stays an escape in the arguments' JSON text,
    the rest of it as it is; in a function's name it makes the reply text."""
    body = {"hermes": '<tool_call>{{"name": "{name}", "arguments": {{"a": "°\\ud800"}}}}</tool_call>',
            "llama3_json": '{{"name": "{name}", "parameters": {{"a": "°\\ud800"}}}}',
            "mistral": '[TOOL_CALLS] [{{"name": "{name}", "arguments": {{"a": "°\\ud800"}}}}]',
            "pythonic": '[{name}(a="°\\ud800")]'}[parser]
    [call] = extract_tool_calls(body.format(name="f"), parser)[1]
    call.arguments.encode()
    assert json.loads(call.arguments) == {"a": "°\ud800"}
    if parser != "pythonic":  # a Python name cannot hold one
        text = body.format(name="\\udc00")
        assert extract_tool_calls(text, parser) == (text, [])


@pytest.mark.parametrize("parser, stream_class", [("hermes", None), ("llama3_json", JsonCallStream),
                                                  ("mistral", MistralCallStream)])
def test_json_nested_too_deep_or_a_record_with_a_name_is_text(parser, stream_class):
    """JSON nested past the decoder's depth (a model stuck opening brackets) and an object with a "name" but no
    arguments or parameters (a JSON record the user asked for) are text, not a crash or a call."""
    prefix = {"hermes": "<tool_call>", "llama3_json": "", "mistral": "[TOOL_CALLS] "}[parser]
    deep = ["[" * 1100 + "]" * 1100, "{" + '"a": {' * 1100]
    for text in [prefix + body for body in [*deep, '{"name": "Alice", "age": 30}']]:
        assert extract_tool_calls(text, parser) == (text, [])
        if stream_class is not None:
            assert streamed(stream_class, text, 7)[1] == []
