"""POST /v1/responses through the official OpenAI client on a real server (SmolLM2): the same reply as the chat
endpoint gives the same messages, whole and streamed as typed events; instructions, input items, text.format, a
named function's call and a tool round trip; the fields it refuses, named. The events of thinking, an answer and a
call, from chat chunks."""
import asyncio
import json

import openai
import pytest

from nanograph.serve.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionTokensDetails, Usage
from nanograph.serve.responses import ResponseBuilder, ResponsesRequest
from nanograph.serve.streaming import DONE, event

from .server_process import module_server

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                             "--enable-prompt-tokens-details")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        yield client


def chat_text(client, messages, **kwargs) -> tuple[str, str, object]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage


def test_a_response_is_the_chat_reply_to_the_same_messages(client):
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    text, finish_reason, usage = chat_text(client, [{"role": "user", "content": QUESTION}], max_tokens=24)
    assert response.output_text == text and "Paris" in text
    assert response.status == ("incomplete" if finish_reason == "length" else "completed")
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens,
                                                                           usage.completion_tokens)
    assert response.usage.total_tokens == usage.total_tokens
    # Instructions and input items: a system message, then the items' messages.
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"type": "message", "role": "user", "content": QUESTION}]
    response = client.responses.create(model=MODEL, input=items, instructions="Answer in one word.",
                                       max_output_tokens=8, temperature=0)
    text, _, _ = chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                    {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                                    {"role": "user", "content": QUESTION}], max_tokens=8)
    assert response.output_text == text


def test_a_streamed_response_gives_the_same_text_in_typed_events(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[-2].item.content[0].text == whole.output_text
    assert len({e.item_id for e in events if e.type == "response.output_text.delta"}) == 1


def test_a_response_cut_by_max_output_tokens_is_incomplete(client):
    response = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3,
                                       temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_text_format_json_schema_constrains_the_reply(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input=QUESTION + " Answer in JSON.", max_output_tokens=40,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "answer",
                                                                       "schema": schema}})
    assert json.loads(response.output_text)["city"] in ("Paris", "Rome")
    assert response.text.format.type == "json_schema"


def test_a_named_function_is_called_and_its_result_goes_back_in(client):
    response = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=40, temperature=0)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    events = list(client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, temperature=0, stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == call.arguments and done[0].arguments == arguments and done[0].name == "get_weather"
    # The call and its output go back in as input items; the model answers in text.
    follow_up = client.responses.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=16, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"}])
    assert follow_up.output[0].type == "message" and follow_up.output_text


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": []}, "input"),
    ({"text": {"format": "json"}}, "text"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input"),
])
def test_what_the_server_cannot_do_is_a_400_naming_the_field(client, fields, param):
    body = {"model": MODEL, "input": QUESTION, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**body)
    assert error.value.body["param"] == param, error.value.body
    assert "max_completion_tokens" not in error.value.body["message"] and "messages" not in error.value.body["message"]


def test_thinking_an_answer_and_a_call_stream_as_items_of_their_own():
    """From chat chunks: thinking, then answer text, then a named call whose header came first (before the
    thinking): a reasoning item, a message and a function call, each opened and closed in turn."""
    def chunk(**delta) -> str:
        return event(ChatCompletionChunk(id="c", model="m", choices=[
            ChatChunkChoice(index=0, delta=ChatDelta(**delta))]))

    chunks = [chunk(role="assistant", content=""),
              chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                 "function": {"name": "f", "arguments": ""}}]),
              chunk(reasoning="Hmm", reasoning_content="Hmm") + chunk(reasoning=", sure.", reasoning_content=", sure."),
              chunk(content="Yes."),
              chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a": '}}]),
              chunk(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
              event(ChatCompletionChunk(id="c", model="m", choices=[], usage=Usage(
                  prompt_tokens=5, completion_tokens=7, total_tokens=12,
                  completion_tokens_details=CompletionTokensDetails(reasoning_tokens=3)))) + DONE]

    async def source():
        for text in chunks:
            yield text

    async def collect():
        builder = ResponseBuilder(ResponsesRequest(input="hi", stream=True), "resp_1", "m")
        return [e async for e in builder.events(source())]

    events = [json.loads(line[len("data: "):]) for text in asyncio.run(collect()) for line in text.split("\n")
              if line.startswith("data: ")]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Hmm, sure."
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["usage"]["total_tokens"] == 12
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    reasoning, message, call = final["output"]
    assert reasoning["content"][0]["text"] == "Hmm, sure." and message["content"][0]["text"] == "Yes."
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert all(item["status"] == "completed" for item in final["output"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize("kind", ["message", "reasoning", "function_call"])
def test_a_delta_event_is_the_json_the_generic_writer_gives(kind):
    """The templated delta events: valid JSON, byte for byte what json.dumps writes, for any text."""
    builder = ResponseBuilder(ResponsesRequest(input="hi"), "resp_1", "m")
    item = builder._open([], None, kind, "call_1", "f")
    for text in ['a "quoted"\n\\ é 😀 </script>', "", "\u2028\x00"]:
        kind_line, data_line, *_ = builder._delta(item, text).split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {data['type']}" and data["delta"] == text
        assert data_line == "data: " + json.dumps(data, ensure_ascii=False)
        assert data["item_id"] == item.item["id"] and data["output_index"] == 0


def test_logprobs_come_with_the_answer_when_included(client):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])
    response = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    logprobs = response.output[0].content[0].logprobs
    assert [entry.model_dump() for entry in logprobs] == expected and len(expected) == 8
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs)
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert [entry.model_dump() for entry in streamed] == expected
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [entry.model_dump() for entry in done.logprobs] == expected
    # Without the include, none.
    assert not client.responses.create(**{**kwargs, "include": None}).output[0].content[0].logprobs


def test_a_bad_tool_schema_is_named_as_the_responses_field(client):
    tool = {**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": "nonsense"}}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input=QUESTION, tools=[tool], max_output_tokens=8,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert "tools[0].parameters" in error.value.body["message"] and ".function." not in error.value.body["message"]


def test_the_clients_stream_helper_sees_one_part_and_the_sampling_used(client):
    """Items are announced without content (their part follows), so the client's accumulated snapshot holds one
    part; temperature and top_p echo what the reply used."""
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0) as stream:
        added = [streamed_event.item for streamed_event in stream
                 if streamed_event.type == "response.output_item.added"]
        final = stream.get_final_response()
    assert [item.content for item in added] == [[]]
    assert len(final.output[0].content) == 1 and final.output_text
    assert (final.temperature, final.top_p) == (0.0, 1.0)


def test_a_request_the_engine_fails_mid_stream_ends_with_response_failed(client):
    """A grammar and allowed_token_ids that leave no token: an error event, then response.failed."""
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, stream=True,
                                          extra_body={"guided_choice": ["Paris"], "allowed_token_ids": [100]}))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"], kinds
    assert events[-1].response.status == "failed" and events[-1].response.error.message


def test_input_items_become_the_chats_messages():
    """Instructions first; an assistant turn's reasoning, text and calls one assistant message (its thinking as
    reasoning_content, which Qwen3's template keeps in a tool loop); a call's output a tool message."""
    request = ResponsesRequest(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    messages = [message.model_dump(exclude_defaults=True) for message in request.chat_request().messages]
    assert messages == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "reasoning_content": "Hmm.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(client):
    """--enable-prompt-tokens-details: a prompt sent again finds its whole blocks in the prefix cache, in the chat's,
    the completion's (per prompt, summed) and the response's usage, whole and streamed."""
    text = "Tell me about the history of Paris. " * 12
    messages = [{"role": "user", "content": text}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).usage
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).usage
    cached = again.prompt_tokens_details.cached_tokens
    assert cached >= first.prompt_tokens - 16 and cached % 16 == 0 and cached < again.prompt_tokens
    streamed = [chunk.usage for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}) if chunk.usage]
    assert streamed[-1].prompt_tokens_details.cached_tokens == cached
    prompts = [text, text + "Also Rome."]
    cold = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0).usage
    warm = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0).usage
    both = warm.prompt_tokens_details.cached_tokens  # each prompt's whole blocks, summed
    assert cold.prompt_tokens_details.cached_tokens < both and both >= warm.prompt_tokens - 2 * 16 and both % 16 == 0
    response = client.responses.create(model=MODEL, input=text, max_output_tokens=2, temperature=0)
    assert response.usage.input_tokens_details.cached_tokens == cached
