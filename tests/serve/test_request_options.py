"""vLLM's request options around the prompt and the logprobs: add_special_tokens (completions: on, chats: off, on
a tokenizer that adds a BOS), echo with max_tokens 0 (the prompts alone), return_tokens_as_token_ids, top_logprobs 0
without logprobs, an empty stream_options without stream, and the text-like content parts (input_text,
output_text, refusal)."""
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from nanograph.default_model import default_model_path

from .server_process import module_server
from .sse import stream_events

PROMPT = "The three primary colours are"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def bos_tokenizer_folder(tmp_path_factory) -> Path:
    """The default model's tokenizer, made to start every encoding with <|im_start|> (as a BOS)."""
    folder = tmp_path_factory.mktemp("bos-tokenizer")
    for path in Path(default_model_path()).iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(path, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = next(token["id"] for token in spec["added_tokens"] if token["content"] == "<|im_start|>")
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos],
                                                                  "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, bos_tokenizer_folder):
    """This module's server (conftest's client and model fixtures then serve it)."""
    yield from module_server(tmp_path_factory, "--tokenizer", str(bos_tokenizer_folder))


def post(server, path, body):
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_add_special_tokens_is_on_for_completions_and_off_for_chats(server, client, model, bos_tokenizer_folder):
    tokenizer = AutoTokenizer.from_pretrained(bos_tokenizer_folder)
    plain = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert tokenizer.encode(PROMPT) == [tokenizer.convert_tokens_to_ids("<|im_start|>")] + plain

    def prompt_tokens(**fields):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                         **fields).usage.prompt_tokens

    assert prompt_tokens() == len(plain) + 1
    assert prompt_tokens(extra_body={"add_special_tokens": False}) == len(plain)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    template_tokens = tokenizer.encode(rendered, add_special_tokens=False)

    def chat_tokens(**fields):
        return client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, temperature=0,
                                              **fields).usage.prompt_tokens

    assert chat_tokens() == len(template_tokens)
    assert chat_tokens(extra_body={"add_special_tokens": True}) == len(template_tokens) + 1
    # /tokenize: a chat's default, though a prompt's is on.
    assert post(server, "/tokenize", {"messages": CHAT}).json()["tokens"] == template_tokens
    assert post(server, "/tokenize", {"messages": CHAT, "add_special_tokens": True}).json()["tokens"] == \
        [tokenizer.convert_tokens_to_ids("<|im_start|>")] + template_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompts_alone(server, stream):
    body = {"prompt": [PROMPT, "Water boils at"], "n": 2, "temperature": 0.5, "seed": 1, "echo": True, "max_tokens": 0}
    if not stream:
        response = post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        result = response.json()
        choices, used = result["choices"], result["usage"]
    else:
        events = stream_events(server.base_url, "/v1/completions",
                               {**body, "stream": True, "stream_options": {"include_usage": True}})
        choices, used = [e["choices"][0] for e in events[:-1]], events[-1]["usage"]
        assert events[-1]["choices"] == []
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, PROMPT, "length"), (1, PROMPT, "length"), (2, "Water boils at", "length"), (3, "Water boils at", "length")]
    assert used["completion_tokens"] == 0 and used["prompt_tokens"] == used["total_tokens"] > 6
    # The engine checks the request as any other.
    response = post(server, "/v1/completions", {**body, "allowed_token_ids": [10**6]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_token_ids"


def test_return_tokens_as_token_ids_names_each_token_by_id(client, model):
    fields = dict(model=model, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    chat = client.chat.completions.create(messages=CHAT, **fields).choices[0].logprobs.content
    by_id = client.chat.completions.create(messages=CHAT, extra_body={"return_tokens_as_token_ids": True},
                                           **fields).choices[0].logprobs.content
    assert [entry.logprob for entry in by_id] == [entry.logprob for entry in chat]
    assert [entry.bytes for entry in by_id] == [entry.bytes for entry in chat]  # the text's bytes still
    for entry in by_id:
        assert entry.token.startswith("token_id:") and int(entry.token.removeprefix("token_id:")) >= 0
        assert all(top.token.startswith("token_id:") for top in entry.top_logprobs)
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True}).choices[0]
    text_tokens = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                            logprobs=2).choices[0]
    ids = [int(token.removeprefix("token_id:")) for token in completion.logprobs.tokens]
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    assert [tokenizer.decode([token_id]) for token_id in ids] == text_tokens.logprobs.tokens
    assert all(key.startswith("token_id:") for top in completion.logprobs.top_logprobs for key in top)
    assert completion.logprobs.text_offset == text_tokens.logprobs.text_offset


def test_top_logprobs_0_and_an_empty_stream_options_are_taken_without_their_switches(server):
    response = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_logprobs": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None
    assert post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_logprobs": 1}
                ).status_code == 400
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream_options": {}}
                ).status_code == 200
    response = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                "stream_options": {"include_usage": False}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


def test_input_text_output_text_and_refusal_parts_are_text(server):
    def tokens(messages):
        response = post(server, "/tokenize", {"messages": messages})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    as_strings = [{"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "I cannot."},
                  {"role": "user", "content": "Why?"}]
    as_parts = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
                {"role": "user", "content": [{"type": "output_text", "text": "Why?"}]}]
    assert tokens(as_parts) == tokens(as_strings)
    response = post(server, "/tokenize", {"messages": [{"role": "assistant", "content": [{"type": "refusal",
                                                                                            "text": "no"}]}]})
    assert response.status_code == 400 and "content part 0 of type 'refusal' needs its 'refusal' string" in response.text


def test_a_priority_other_than_0_needs_the_priority_policy(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"priority": 1})
    body = error.value.body
    assert body["param"] == "priority" and "--scheduling-policy priority" in body["message"]
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                     extra_body={"priority": 0}).choices[0].text
    for route in (lambda: client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                                         extra_body={"priority": 2}),
                  lambda: client.responses.create(model=model, input="Hi", max_output_tokens=2,
                                                  extra_body={"priority": 2})):  # the field reaches the engine
        with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
            route()
