"""The app around the OpenAI routes, on a server started with --api-key: the key on every /v1 route (401 with
OpenAI's body otherwise), /health, /version, /v1/models, /tokenize, /detokenize, and the error bodies of bad
requests, after which the server goes on serving."""
import httpx
import openai
import pytest

import nanograph

from .server_process import MAX_MODEL_LEN, module_server

KEY = "test-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--api-key", KEY, "--served-model-name", "smol", "smol-alias",
                             "--allowed-origins", '["http://page.test"]', "--trust-request-chat-template",
                             "--response-role", "narrator", "--root-path", "/behind-proxy", "--disable-log-stats",
                             "--disable-log-requests", "--default-chat-template-kwargs",
                             '{"greeting": "hello", "mood": "calm"}')


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def post(server, path, body=None, headers=AUTH, **kwargs):
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60, **kwargs)


def test_every_v1_route_needs_the_key(server):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": f"Bearer {KEY}x"}):
            response = httpx.request(method, server.base_url + path, headers=headers, json={}, timeout=10)
            error = error_of(response, 401)
            assert error["code"] == "invalid_api_key" and "--api-key" in error["message"]
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.base_url + path, timeout=10).status_code == 200
    # The scheme's case does not matter.
    for scheme in ("bearer", "BEARER"):
        response = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=10)
        assert response.status_code == 200, response.text


def test_models_version_tokenize_detokenize(server, client, tokenizer):
    cards = client.models.list().data
    assert [card.id for card in cards] == ["smol", "smol-alias"]
    assert all(card.model_extra["max_model_len"] == MAX_MODEL_LEN for card in cards)
    # Either name serves; a response gives the first, as vLLM's.
    reply = client.completions.create(model="smol-alias", prompt="Hi", max_tokens=2)
    assert reply.model == "smol" and reply.usage.completion_tokens == 2
    assert httpx.get(server.base_url + "/version").json() == {"version": nanograph.__version__}
    text = "Hello 😀 world"
    tokens = post(server, "/tokenize", {"prompt": text}).json()
    assert tokens == {"count": len(tokenizer.encode(text)), "max_model_len": MAX_MODEL_LEN,
                      "tokens": tokenizer.encode(text), "token_strs": None}
    with_strs = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert with_strs["tokens"] == tokens["tokens"]
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    error_of(post(server, "/detokenize", {"tokens": [10 ** 7]}), 400)


@pytest.mark.parametrize("body, status, param, message", [
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1], got 0"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature must be non-negative"),
    ({"prompt": "hi", "n": 2, "temperature": 0}, 400, "n", "n must be 1 when using greedy sampling"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs=50 is more than max_logprobs=20"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"prompt": "hi", "seed": 2**63}, 400, "seed", "seed: Input should be less than or equal to 9223372036854775807"),
    ({"prompt": "hi", "stream": "maybe"}, 400, "stream", "stream: Input should be a valid boolean"),
    ({"prompt": "hi", "stop": 5}, 400, "stop", "stop: Input should be a valid string"),
    ({"max_tokens": 2}, 400, "prompt", "prompt: Field required"),
    ({"prompt": [1] * 600}, 400, "prompt", f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, "
     "your request has 600 input tokens, more than it can hold; shorten the prompt"),
    ({"prompt": [1] * 500, "max_tokens": 20}, 400, "max_tokens",
     f"max_tokens is too large: 20. This model's maximum context length is {MAX_MODEL_LEN} tokens and your request "
     f"has 500 input tokens (20 > {MAX_MODEL_LEN} - 500); lower max_tokens to at most {MAX_MODEL_LEN - 500}"),
    ({"prompt": [[1, 2], [1] * 600]}, 400, "prompt", "your request has 600 input tokens (prompt 1)"),
    ({"prompt": ["fine", [1, 2]]}, 400, "prompt", "prompt: Input should be a valid string"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream_options is only allowed when stream is true"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist"),
    ({"prompt": [], "max_tokens": 2}, 400, "prompt", "prompt is empty"),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, 400, "echo",
     "echo with logprobs asks for the prompt's logprobs, which are served on non-streamed requests"),
    ({"prompt": "Say yes:", "max_tokens": 3, "allowed_token_ids": [9805], "bad_words": ["yes"]}, 400,
     "allowed_token_ids", "are all banned by bad_words"),
    # Valid, but past what llguidance can follow once generation starts: the request's fault, not the server's.
    ({"prompt": "hi", "max_tokens": 3, "guided_regex": "((a{100}){100}){100}"}, 400, None,
     "structured_outputs: llguidance cannot follow this grammar past the text generated so far"),
    ({"prompt": "Say", "max_tokens": 3, "guided_choice": [" hello"], "bad_words": ["hello"]}, 400, None,
     "every token was masked"),
])
def test_completion_error_bodies(server, body, status, param, message):
    error = error_of(post(server, "/v1/completions", body), status)
    assert message in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_fields_coerce_as_vllm_coerces_them(server, tokenizer):
    """Numbers and booleans written as strings, and whole floats for ints, mean their values (pydantic's lax rules,
    which vLLM's request models follow)."""
    plain = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
                                             "logprobs": 1})
    coerced = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": "4",
                                               "temperature": "0", "logprobs": 1.0, "stream": "false"})
    assert plain.status_code == coerced.status_code == 200, coerced.text
    choice, coerced_choice = plain.json()["choices"][0], coerced.json()["choices"][0]
    assert coerced_choice["text"] == choice["text"] and coerced.json()["usage"]["completion_tokens"] == 4
    assert coerced_choice["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3.0,
                                                  "top_p": "0.9", "seed": "7", "stream": "true"})
    assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]"), chat.text


@pytest.mark.parametrize("body, status, param, message", [
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs",
     "top_logprobs needs logprobs"),
    ({"messages": [{"role": "", "content": "hi"}]}, 400, "messages", "messages.0.role: String should have at least 1"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]}, 400,
     "messages", "messages.0.content: content part 1 has type 'image_url'; this server takes text parts only"),
    ({"messages": [{"role": "user", "content": "hi " * 600}]}, 400, "messages",
     f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 6}, 400,
     "max_completion_tokens", "max_completion_tokens is too large: 1000000. This model's maximum context length"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format",
     "response_format.json_schema.schema is not a valid json schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_choice": []}, 400, "guided_choice",
     "guided_choice must be a non-empty list of strings"),
    ({"messages": []}, 400, "messages", "messages is empty"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "max_completion_tokens must be at least 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs",
     "top_logprobs=50 is more than max_logprobs=20"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tools",
     "tool_choice 'required' needs tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "guided_regex": "a+",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tool_choice",
     "tool_choice required constrains the reply to tool calls"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tool_choice",
     '"auto" tool choice requires nanograph serve --enable-auto-tool-choice and --tool-call-parser'),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tool_choice",
     '"auto" tool choice requires nanograph serve --enable-auto-tool-choice and --tool-call-parser'),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tool_choice",
     "tool_choice names the function 'g', which is not among the request's tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "guided_regex": "a+"}, 400,
     "tool_choice", "tool_choice naming a function constrains the reply to tool calls"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": "f"},
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tool_choice",
     'a named tool_choice is {"type": "function", "function": {"name": ...}}'),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400, "tools",
     "tool_choice 'auto' needs tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "g"}},
                {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, 400, "tools",
     "tools[1].function.parameters is not a valid json schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens", "max_completion_tokens=2"),
    ({"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True}, 400,
     "continue_final_message", "Cannot set both `continue_final_message` and `add_generation_prompt`"),
])
def test_chat_error_bodies(server, body, status, param, message):
    error = error_of(post(server, "/v1/chat/completions", body), status)
    assert message in error["message"] and error["param"] == param


@pytest.mark.parametrize("body, status, param, message", [
    ({"prompt": "hi", "suffix": "!"}, 400, "suffix", "suffix is not supported"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of", "best_of=3 is not supported"),
    ({"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search", "beam search is not served"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     "prompt logprobs are served on non-streamed requests"),
    ({"prompt": "hi", "prompt_logprobs": -2}, 400, "prompt_logprobs",
     "prompt_logprobs must be non-negative or -1, got -2"),
    ({"prompt": [1] * MAX_MODEL_LEN, "max_tokens": None}, 400, "prompt", "leaves no room for output"),
    ({"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}, 400, "max_tokens", "leaves no room for output"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "truncate_prompt_tokens must be"),
])
def test_unsupported_fields_and_a_full_prompt_are_400s(server, body, status, param, message):
    error = error_of(post(server, "/v1/completions", body), status)
    assert message in error["message"] and error["param"] == param


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt, message", [
    ([1, 2, 10**6], "prompt token id 1000000 at position 2 is outside the vocabulary [0, "),
    ([1, 2, -1], "prompt token id -1 at position 2 is outside the vocabulary [0, "),
    ([2**64], f"prompt token id {2**64} at position 0 is outside the vocabulary [0, "),
    ([[1, 2], [-2**70, 5]], f"prompt 1: prompt token id {-2**70} at position 0 is outside the vocabulary [0, "),
])
def test_prompt_token_ids_outside_the_vocabulary_are_400s(server, prompt, message, echo, stream):
    """Ids of any size, echoed or not, streamed or not: the engine's message, not an overflow or the tokenizer's
    error; the server then serves the next request."""
    body = {"prompt": prompt, "max_tokens": 2, "echo": echo, "stream": stream}
    error = error_of(post(server, "/v1/completions", body), 400)
    assert message in error["message"] and error["param"] == "prompt"
    assert post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "echo": echo}).status_code == 200


def test_schema_errors_are_bad_requests_for_the_openai_client(client):
    """A body that does not match the schema is a 400 (vLLM's status), which the client raises as BadRequestError."""
    with pytest.raises(openai.BadRequestError, match="max_tokens: Input should be a valid integer"):
        client.completions.create(model="smol", prompt="hi", max_tokens=2.5)
    with pytest.raises(openai.BadRequestError, match="messages.0.content: content part 0 has type 'image_url'"):
        client.chat.completions.create(model="smol", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://page.test/a.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="This model's maximum context length is") as raised:
        client.completions.create(model="smol", prompt="hi " * 600, max_tokens=2)
    assert raised.value.code == "context_length_exceeded" and raised.value.param == "prompt"


def test_a_custom_role_reaches_the_chat_template(server, client, tokenizer):
    """Any role is taken (Llama 3's ipython, ...), as vLLM takes it: the chat template decides what it renders."""
    messages = [{"role": "user", "content": "Call the tool."}, {"role": "ipython", "content": "42"}]
    rendered = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert rendered == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    reply = client.chat.completions.create(model="smol", messages=messages, max_tokens=3, temperature=0)
    # The reply's role is the server's --response-role.
    assert reply.choices[0].message.role == "narrator" and reply.usage.prompt_tokens == len(rendered)
    continued = client.chat.completions.create(model="smol", messages=messages, max_tokens=3, temperature=0,
                                               extra_body={"add_generation_prompt": False,
                                                           "continue_final_message": True})
    assert continued.choices[0].message.role == "ipython"


def test_null_means_the_default_and_vllms_chat_fields_apply(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for nulls in ({"stream": None}, {"logprobs": None, "top_logprobs": None}):
        assert post(server, "/v1/chat/completions", {**chat, **nulls}).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": None}).status_code == 200
    developer = [{"role": "developer", "content": "Be brief."}, *chat["messages"]]
    reply = post(server, "/v1/chat/completions", {**chat, "messages": developer, "n": 2, "best_of": 2}).json()
    assert len(reply["choices"]) == 2
    kept = post(server, "/v1/chat/completions", {**chat, "messages": developer, "truncate_prompt_tokens": 3}).json()
    assert kept["usage"]["prompt_tokens"] == 3
    opened = post(server, "/tokenize", {"messages": chat["messages"]}).json()["count"]
    closed = post(server, "/tokenize", {"messages": chat["messages"], "add_generation_prompt": False}).json()["count"]
    assert closed < opened
    assert post(server, "/tokenize", {"messages": chat["messages"],
                                      "chat_template_kwargs": {"add_generation_prompt": False}}).json()["count"] == closed
    prefill = [*chat["messages"], {"role": "assistant", "content": "The answer is"}]
    tokens = post(server, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": tokens}).json()["prompt"].endswith("The answer is")
    tool_turns = [*chat["messages"],
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert post(server, "/v1/chat/completions", {**chat, "messages": tool_turns}).status_code == 200
    template = ("{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}"
                "{% for message in messages %}{{ message.role }}: {{ message.content }}"
                "{% for call in message.tool_calls or [] %}{{ call.function.arguments.city }}{% endfor %}"
                "{{ '\\n' }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    tokens = post(server, "/tokenize", {"messages": tool_turns, "chat_template": template, "tools": tools,
                                        "add_generation_prompt": False}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == \
        "[get_weather]user: hi\nassistant: Oslo\ntool: 42\n"
    assert post(server, "/v1/chat/completions", {**chat, "messages": tool_turns, "chat_template": template,
                                                 "tools": tools, "tool_choice": "none"}).status_code == 200
    # An explicit null is vLLM's "auto" only on a server that parses calls: here, a reply of text, as "none".
    nulled = post(server, "/v1/chat/completions", {**chat, "messages": tool_turns, "tools": tools, "tool_choice": None,
                                                   "temperature": 0})
    assert nulled.status_code == 200 and nulled.json()["choices"][0]["message"]["content"] == \
        post(server, "/v1/chat/completions", {**chat, "messages": tool_turns, "tools": tools, "tool_choice": "none",
                                              "temperature": 0}).json()["choices"][0]["message"]["content"]
    long_prompt = {"prompt": [1] * (MAX_MODEL_LEN + 100), "max_tokens": 2, "truncate_prompt_tokens": 10}
    assert post(server, "/v1/completions", long_prompt).json()["usage"]["prompt_tokens"] == 10
    # A shortened prompt echoes as the text of the tokens kept; one left whole, as given.
    text = "  Hello   there"
    whole, cut = (post(server, "/v1/completions", {"prompt": [text, "one two three four five six seven"],
                                                   "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 5,
                                                   "temperature": 0}).json()["choices"])
    assert whole["text"].startswith(text) and cut["text"].startswith(" three four five six seven")


def test_cors_preflight_and_headers_follow_allowed_origins(server):
    preflight = {"Origin": "http://page.test", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    response = httpx.options(server.base_url + "/v1/chat/completions", headers=preflight, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "http://page.test"
    assert "POST" in response.headers["access-control-allow-methods"]
    other = httpx.options(server.base_url + "/v1/chat/completions",
                          headers={**preflight, "Origin": "http://other.test"}, timeout=60)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    models = httpx.get(server.base_url + "/v1/models", headers={**AUTH, "Origin": "http://page.test"}, timeout=60)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "http://page.test"


def test_malformed_json_wrong_content_type_and_unknown_routes(server, client):
    raw = {**AUTH, "Content-Type": "application/json"}
    error = error_of(httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": ', headers=raw), 400)
    assert error["code"] == "invalid_json" and "not valid JSON" in error["message"]
    # JSON whose string escapes half a surrogate pair: valid syntax, but not text.
    for prompt in (rb"a\ud83d b", rb"\ude00", rb"a\ud83d\ud83d\ude00"):
        error = error_of(httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "' + prompt + b'"}',
                                    headers=raw), 400)
        assert error["code"] == "invalid_json" and "lone surrogate" in error["message"], error
    paired = httpx.post(server.base_url + "/v1/completions", headers=raw,
                        content=rb'{"prompt": "\ud83d\ude00", "max_tokens": 1}')
    assert paired.status_code == 200, paired.text
    error = error_of(httpx.post(server.base_url + "/v1/completions", content=b'prompt=hi',
                                headers={**AUTH, "Content-Type": "text/plain"}), 400)
    assert "Content-Type must be application/json, got 'text/plain'" in error["message"]
    assert error_of(httpx.get(server.base_url + "/v2/nothing"), 404)["code"] == "not_found"
    # The profiler's routes are served only with --profiler-config (test_profile.py).
    assert error_of(httpx.post(server.base_url + "/start_profile"), 404)["code"] == "not_found"
    # Sleep mode's routes are development routes (test_sleep.py serves them).
    assert error_of(httpx.post(server.base_url + "/sleep"), 404)["code"] == "not_found"
    assert error_of(httpx.get(server.base_url + "/is_sleeping"), 404)["code"] == "not_found"
    error_of(httpx.get(server.base_url + "/v1/completions", headers=AUTH), 405)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="smol", prompt="hi", top_p=2)
    # The server goes on serving after all of these.
    assert client.completions.create(model="smol", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_response_role_streams_and_root_path(server, client):
    """--response-role names a streamed chat reply's role too (test_a_custom_role_reaches_the_chat_template: the
    whole reply's, and a continued message's own); --root-path is the prefix a proxy adds, which the OpenAPI
    document gives, and each route answers with or without it (as vLLM's)."""
    messages = [{"role": "user", "content": "Hi"}]
    chunks = list(client.chat.completions.create(model="smol", messages=messages, max_tokens=2, stream=True))
    assert chunks[0].choices[0].delta.role == "narrator"
    assert httpx.get(server.base_url + "/openapi.json").json()["servers"] == [{"url": "/behind-proxy"}]
    # A proxy that passes the prefix on reaches the same routes.
    for path in ("/behind-proxy/v1/models", "/v1/models"):
        response = httpx.get(server.base_url + path, headers=AUTH, timeout=10)
        assert response.status_code == 200 and response.json()["data"][0]["id"] == "smol", (path, response.text)
    assert httpx.get(server.base_url + "/behind-proxy/health", timeout=10).status_code == 200


def test_sagemakers_ping_and_invocations(server, client):
    """/ping answers as /health does; /invocations runs a body with messages as a chat completion and one with a
    prompt as a completion (behind the API key, as the /v1 routes), streamed too."""
    for method in ("GET", "POST"):
        assert httpx.request(method, server.base_url + "/ping", timeout=10).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    reply = post(server, "/invocations", chat)
    assert reply.status_code == 200, reply.text
    expected = client.chat.completions.create(model="smol", **chat)
    assert reply.json()["object"] == "chat.completion"
    assert reply.json()["choices"][0]["message"]["content"] == expected.choices[0].message.content
    completion = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    reply = post(server, "/invocations", completion)
    assert reply.status_code == 200, reply.text
    assert reply.json()["object"] == "text_completion"
    assert reply.json()["choices"][0]["text"] == client.completions.create(model="smol", **completion).choices[0].text
    streamed = post(server, "/invocations", {**completion, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert error_of(post(server, "/invocations", chat, headers={}), 401)["code"] == "invalid_api_key"
    assert "with messages" in error_of(post(server, "/invocations", {"text": "Hi"}), 400)["message"]
    # An input is an embedding request, which this text model refuses.
    assert error_of(post(server, "/invocations", {"input": "Hi"}), 400)["code"] == "model_not_supported"
    not_json = httpx.post(server.base_url + "/invocations", content=b"{messages", timeout=60,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert error_of(not_json, 400)["code"] == "invalid_json"
    assert error_of(post(server, "/invocations", {"prompt": "Hi", "max_tokens": -1}), 400)["param"] == "max_tokens"


def test_default_chat_template_kwargs_reach_the_template_under_the_requests_own(server, client):
    """--default-chat-template-kwargs: the template's keywords where a request gives none; a request's
    chat_template_kwargs win key by key (chat, /tokenize, and the Responses API, which renders as the chat route)."""
    template = "{{ greeting | default('none') }} {{ mood | default('none') }}:{% for m in messages %}{{ m.content }}" \
               "{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]

    def rendered(**fields) -> str:
        tokens = post(server, "/tokenize", {"messages": messages, "chat_template": template, **fields}).json()
        return post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]

    assert rendered() == "hello calm:hi"
    assert rendered(chat_template_kwargs={"mood": "stormy"}) == "hello stormy:hi"
    reply = client.chat.completions.create(model="smol", messages=messages, max_tokens=1, extra_body={
        "chat_template": template, "chat_template_kwargs": {"greeting": "bye"}})
    tokens = post(server, "/tokenize", {"prompt": "bye calm:hi", "add_special_tokens": False}).json()["tokens"]
    assert reply.usage.prompt_tokens == len(tokens)


def test_embeddings_need_a_pooling_model(server):
    error = error_of(post(server, "/behind-proxy/v1/embeddings", {"model": "smol", "input": "hello"}), 400)
    assert error["code"] == "model_not_supported" and "--runner pooling" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/score", {"text_1": "a", "text_2": "b"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
    ("/rerank", {"query": "a", "documents": ["b"]}), ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ("/v2/rerank", {"query": "a", "documents": ["b"]}), ("/classify", {"input": "a"}),
    ("/v1/classify", {"input": "a"}), ("/pooling", {"input": "a"})])
def test_score_and_rerank_need_a_pooling_model_and_the_key(server, path, body):
    error = error_of(post(server, "/behind-proxy" + path, body), 400)
    assert error["code"] == "model_not_supported" and path.split("/")[-1] in error["message"]
    assert error_of(post(server, path, body, headers={}), 401)["code"] == "invalid_api_key"
