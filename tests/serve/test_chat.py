"""POST /v1/chat/completions: the chat template renders the messages, streams equal responses (the role chunk
first), logprobs with top_logprobs equal LLM.chat's, max_completion_tokens, text parts, usage; response_format,
vLLM's grammar fields and logit_bias."""
import json
import re

import httpx
import openai
import pytest

from nanograph import SamplingParams

from .sse import check_finish_reasons, stream_events

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_and_the_stream_equals_the_response(client, model, tokenizer):
    response = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=24)
    [choice] = response.choices
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and response.object == "chat.completion"
    prompt = tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert response.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks[:-1]) == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == response.usage
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)


def test_max_completion_tokens_and_text_parts(client, model):
    # Text parts are joined by newlines, as vLLM joins them.
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    as_parts = client.chat.completions.create(model=model, messages=parts, temperature=0, max_completion_tokens=3)
    as_joined = client.chat.completions.create(model=model, messages=joined, temperature=0, max_tokens=3)
    as_string = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=3)
    assert as_parts.choices[0].message.content == as_joined.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_joined.usage.prompt_tokens != as_string.usage.prompt_tokens
    assert as_parts.choices[0].finish_reason == "length" and as_parts.usage.completion_tokens == 3
    system = [{"role": "system", "content": "Answer in one word."}, *CAPITAL]
    with_system = client.chat.completions.create(model=model, messages=system, temperature=0, max_tokens=3)
    assert with_system.usage.prompt_tokens != as_string.usage.prompt_tokens


@pytest.mark.parametrize("fields", [dict(temperature=0), dict(temperature=1.0, seed=5)], ids=["greedy", "seeded"])
def test_logprobs_and_top_logprobs_equal_llm_chat(client, model, reference_llm, fields):
    messages = [{"role": "user", "content": "Name three fruits."}]
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=6, logprobs=True,
                                              top_logprobs=2, **fields)
    content = response.choices[0].logprobs.content
    [reference] = reference_llm.chat(messages, SamplingParams(max_tokens=6, logprobs=2, **fields), use_tqdm=False)
    completion = reference.outputs[0]
    assert len(content) == len(completion.token_ids) == 6
    for entry, token_id, top in zip(content, completion.token_ids, completion.logprobs):
        assert entry.token == top[token_id].decoded_token and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(top[token_id].logprob, abs=1e-4)
        best = sorted((lp for lp in top.values() if lp.rank <= 2), key=lambda lp: lp.rank)
        assert [alt.token for alt in entry.top_logprobs] == [lp.decoded_token for lp in best]
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx([lp.logprob for lp in best], abs=1e-4)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=2, logprobs=True, **fields)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model=model, messages=messages, max_tokens=2).choices[0].logprobs is None


def test_sse_framing_with_n_choices(server, model):
    chunks = stream_events(server.base_url, "/v1/chat/completions",
                           {"model": model, "messages": CAPITAL, "n": 3, "temperature": 0.9, "seed": 1,
                            "max_tokens": 4, "logprobs": True, "stream": True,
                            "stream_options": {"include_usage": True}})
    *token_chunks, usage_chunk = chunks
    assert [chunk["choices"][0]["delta"] for chunk in token_chunks[:3]] == [{"role": "assistant", "content": ""}] * 3
    assert check_finish_reasons(token_chunks, 3) == {0: "length", 1: "length", 2: "length"}
    assert sum(len(chunk["choices"][0]["logprobs"]["content"]) for chunk in token_chunks[3:]) == 12
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12


def test_include_usage_null_sends_no_usage_chunk(server, model):
    """vLLM tests include_usage for truth: null asks for no usage chunk, as false does; left out, it asks for one."""
    for options, wanted in [({"include_usage": None}, False), ({"include_usage": False}, False), ({}, True)]:
        chunks = stream_events(server.base_url, "/v1/chat/completions",
                               {"model": model, "messages": CAPITAL, "max_tokens": 2, "stream": True,
                                "stream_options": options})
        assert (chunks[-1]["choices"] == [] and "usage" in chunks[-1]) == wanted, options


def test_an_empty_model_name_is_the_served_model_and_a_request_id_names_the_response(server, model):
    """As vLLM: "model": "" is the served model (the openai client needs the argument); the response's id is the
    X-Request-Id header's, else the body's request_id."""
    body = {"model": "", "messages": CAPITAL, "max_tokens": 1}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["model"] == model
    named = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "request_id": "mine-1"}, timeout=60)
    assert named.json()["id"] == "chatcmpl-mine-1"
    headed = httpx.post(server.base_url + "/v1/completions", json={"model": "", "prompt": "Hi", "max_tokens": 1},
                        headers={"X-Request-Id": "trace-7"}, timeout=60)
    assert headed.status_code == 200 and headed.json()["id"] == "cmpl-trace-7"
    assert httpx.post(server.base_url + "/v1/completions", json={"model": "other", "prompt": "Hi"},
                      timeout=60).status_code == 404


def test_continuous_usage_stats_count_each_choice_so_far(server, model):
    chunks = stream_events(server.base_url, "/v1/chat/completions",
                           {"model": model, "messages": CAPITAL, "n": 2, "temperature": 0.9, "seed": 1,
                            "max_tokens": 4, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *token_chunks, last = chunks
    prompt_tokens = last["usage"]["prompt_tokens"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert [chunk["usage"]["completion_tokens"] for chunk in token_chunks[:2]] == [0, 0]  # the role chunks
    seen = {}
    for chunk in token_chunks[2:]:
        index, used = chunk["choices"][0]["index"], chunk["usage"]
        assert used["prompt_tokens"] == prompt_tokens and used["completion_tokens"] >= seen.get(index, 0)
        assert used["total_tokens"] == prompt_tokens + used["completion_tokens"]
        seen[index] = used["completion_tokens"]
    assert seen == {0: 4, 1: 4}


def test_chat_template_kwargs_reach_the_template(client, model):
    """SmolLM2's template ignores unknown variables; a kwarg that rendering sets itself is a 400 that names it, and
    a request's own template needs a server started with --trust-request-chat-template (this one is not)."""
    import openai

    ok = client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=1,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert ok.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs cannot set tokenize") as error:
        client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"tokenize": False}})
    assert error.value.body["param"] == "chat_template_kwargs"
    for body in ({"chat_template": "{{ messages[0].content }}"},
                 {"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}):
        with pytest.raises(openai.BadRequestError, match="needs a server started with --trust-request-chat-template"):
            client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=1, extra_body=body)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object_give_json(client, model):
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    response = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    person = json.loads(response.choices[0].message.content)
    assert list(person) == ["name", "age"] and isinstance(person["name"], str) and isinstance(person["age"], int)
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=40, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == response.choices[0].message.content
    anything = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_a_choice_a_regex_and_logit_bias_through_the_body(client, model, tokenizer):
    messages = [{"role": "user", "content": "Is Paris in France?"}]
    choice = client.chat.completions.create(model=model, messages=messages, temperature=0.8, seed=3, max_tokens=10,
                                            extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    regex = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=20,
                                           extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex.choices[0].message.content)
    [banana] = tokenizer.encode(" banana")
    biased = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=3,
                                            logit_bias={str(banana): 100})
    assert biased.choices[0].message.content == " banana" * 3



def test_top_logprobs_of_tokens_a_grammar_masks_are_vllms_floor(server, client, model):
    """A grammar leaves one token at each step: the other top tokens' logprobs are -inf, which JSON cannot carry;
    they come as -9999.0 (vLLM's floor) in the chat response, its stream and the completions response, not as a 500
    or a null."""
    body = dict(temperature=0, max_tokens=4, extra_body={"guided_regex": "Ok done"})
    response = client.chat.completions.create(model=model, messages=CAPITAL, logprobs=True, top_logprobs=3, **body)
    assert response.choices[0].message.content == "Ok done"
    tops = [top.logprob for entry in response.choices[0].logprobs.content for top in entry.top_logprobs]
    assert -9999.0 in tops and all(-9999.0 <= value <= 0 for value in tops)
    chunks = stream_events(server.base_url, "/v1/chat/completions",
                           {"model": model, "messages": CAPITAL, "stream": True, "logprobs": True,
                            "top_logprobs": 3, "temperature": 0, "max_tokens": 4, "guided_regex": "Ok done"})
    streamed = [top["logprob"] for chunk in chunks for choice in chunk["choices"]
                for entry in (choice.get("logprobs") or {}).get("content") or [] for top in entry["top_logprobs"]]
    assert streamed == tops
    completion = client.completions.create(model=model, prompt="The capital of France is", logprobs=3, **body)
    assert completion.choices[0].text == "Ok done"
    values = [value for top in completion.choices[0].logprobs.top_logprobs for value in top.values()]
    assert -9999.0 in values and all(-9999.0 <= value <= 0 for value in values)

def test_two_grammars_in_one_request_are_a_400(client, model):
    with pytest.raises(openai.BadRequestError, match="give one of them"):
        client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=3,
                                       response_format={"type": "json_object"},
                                       extra_body={"guided_regex": "a+"})
    with pytest.raises(openai.BadRequestError, match="json_schema.schema is required"):
        client.chat.completions.create(model=model, messages=CAPITAL, max_tokens=3,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_echo_puts_the_continued_message_first(server, client, model):
    """vLLM's echo: a reply that continues the last message (add_generation_prompt off, continue_final_message on)
    starts with that message's content, in the response and in the stream's first content chunk; the reply's role is
    the last message's. Where the last message is not the reply's role, echo adds nothing."""
    started = [*CAPITAL, {"role": "assistant", "content": "The capital of France is"}]
    fields = dict(add_generation_prompt=False, continue_final_message=True)
    plain = client.chat.completions.create(model=model, messages=started, temperature=0, max_tokens=4,
                                           extra_body=fields)
    echoed = client.chat.completions.create(model=model, messages=started, temperature=0, max_tokens=4,
                                            extra_body={**fields, "echo": True})
    assert echoed.choices[0].message.content == "The capital of France is" + plain.choices[0].message.content
    assert echoed.choices[0].message.role == "assistant" and echoed.usage == plain.usage
    chunks = stream_events(server.base_url, "/v1/chat/completions",
                           {"model": model, "messages": started, "temperature": 0, "max_tokens": 4,
                            "stream": True, "echo": True, **fields})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"]["content"] == "The capital of France is"
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == \
        echoed.choices[0].message.content
    sampled = stream_events(server.base_url, "/v1/chat/completions",
                            {"model": model, "messages": started, "temperature": 0.8, "seed": 2, "max_tokens": 4,
                             "n": 2, "stream": True, "echo": True, **fields})
    assert [chunk["choices"][0]["delta"]["content"] for chunk in sampled[2:4]] == ["The capital of France is"] * 2
    assert sorted(chunk["choices"][0]["index"] for chunk in sampled[:4]) == [0, 0, 1, 1]
    # The last message is the user's and the reply the assistant's: nothing to echo.
    asked = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=4,
                                           extra_body={"echo": True})
    assert asked.choices[0].message.content == client.chat.completions.create(
        model=model, messages=CAPITAL, temperature=0, max_tokens=4).choices[0].message.content
    # A reply that continues the user's message is the user's.
    continued = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=2,
                                               extra_body={"add_generation_prompt": False, "echo": True})
    assert continued.choices[0].message.role == "user"
    assert continued.choices[0].message.content.startswith("What is the capital of France?")
