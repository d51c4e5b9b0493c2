"""POST /v1/completions through the official OpenAI client and raw SSE: greedy streams equal responses, usage
counts the tokenizer's tokens, finish reasons, n choices, seeds, logprobs equal LLM.generate's, prompt forms, echo."""
import pytest

from nanograph import SamplingParams
from nanograph.outputs import Logprob
from nanograph.serve.completions import top_entries

from .sse import check_finish_reasons, stream_events

PROMPT = "The three primary colours are"


def greedy(client, model, **fields):
    return client.completions.create(model=model, prompt=fields.pop("prompt", PROMPT), temperature=0, **fields)


def test_a_greedy_stream_equals_the_response_and_usage_counts_the_tokens(client, model, tokenizer, reference_llm):
    response = greedy(client, model, max_tokens=12)
    [choice] = response.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert response.object == "text_completion" and response.model == model and response.id.startswith("cmpl-")
    [reference] = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert choice.text == reference.outputs[0].text
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(tokenizer.encode(PROMPT)), 12)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chunks = list(greedy(client, model, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks[:-1]) == choice.text
    assert len({chunk.id for chunk in chunks}) == 1 and len(chunks) > 3  # one chunk per step, not one at the end
    assert [chunk.choices[0].finish_reason for chunk in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == usage


def test_a_stop_string_and_a_stop_token_end_with_stop(client, model, tokenizer):
    text = greedy(client, model, max_tokens=12).choices[0].text
    stop = text.split()[2]
    [choice] = greedy(client, model, max_tokens=12, stop=[stop]).choices
    assert (choice.finish_reason, choice.text) == ("stop", text[:text.index(stop)])
    assert choice.model_extra["stop_reason"] == stop
    token_ids = tokenizer.encode(PROMPT + text)[len(tokenizer.encode(PROMPT)):]
    [choice] = greedy(client, model, max_tokens=12, extra_body={"stop_token_ids": [token_ids[3]]}).choices
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == token_ids[3]
    assert len(tokenizer.encode(choice.text)) < 12


def test_n_choices_and_seeds_repeat(client, model):
    def sampled(**fields):
        return client.completions.create(model=model, prompt=PROMPT, n=3, temperature=1.0, max_tokens=8, **fields)

    first = sampled(seed=7)
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    texts = [choice.text for choice in first.choices]
    assert len(set(texts)) > 1 and first.usage.completion_tokens == 24
    assert [choice.text for choice in sampled(seed=7).choices] == texts
    assert [choice.text for choice in sampled(seed=8).choices] != texts
    streamed = {}
    for chunk in sampled(seed=7, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == texts


@pytest.mark.parametrize("fields", [dict(temperature=0), dict(temperature=1.0, seed=11)], ids=["greedy", "seeded"])
def test_logprobs_equal_llm_generate(client, model, reference_llm, fields):
    prompt = "Logprobs, please: one, two,"
    response = client.completions.create(model=model, prompt=prompt, max_tokens=6, logprobs=3, **fields)
    logprobs = response.choices[0].logprobs
    [reference] = reference_llm.generate(prompt, SamplingParams(max_tokens=6, logprobs=3, **fields), use_tqdm=False)
    completion = reference.outputs[0]
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for i, (token_id, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert logprobs.tokens[i] == top[token_id].decoded_token
        assert logprobs.token_logprobs[i] == pytest.approx(top[token_id].logprob, abs=1e-4)
        assert len(logprobs.top_logprobs[i]) in (3, 4)  # the top 3, and the sampled token when it is not among them
        assert logprobs.top_logprobs[i] == pytest.approx({lp.decoded_token: lp.logprob for lp in top.values()},
                                                         abs=1e-4)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
    streamed = [chunk.choices[0].logprobs for chunk in
                client.completions.create(model=model, prompt=prompt, max_tokens=6, logprobs=3, stream=True,
                                          **fields)]
    assert [token for part in streamed for token in part.tokens] == logprobs.tokens
    assert [offset for part in streamed for offset in part.text_offset] == logprobs.text_offset


def test_prompt_forms_and_echo(client, model, tokenizer):
    token_ids = tokenizer.encode(PROMPT)
    response = client.completions.create(model=model, prompt=[PROMPT, "Water boils at"], max_tokens=4, temperature=0)
    assert [choice.index for choice in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == len(token_ids) + len(tokenizer.encode("Water boils at"))
    by_ids = client.completions.create(model=model, prompt=[token_ids, token_ids], max_tokens=4, temperature=0)
    assert [choice.text for choice in by_ids.choices] == [response.choices[0].text] * 2
    single = client.completions.create(model=model, prompt=token_ids, max_tokens=4, temperature=0)
    assert single.choices[0].text == response.choices[0].text
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + response.choices[0].text
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == echoed.choices[0].text


def test_sse_framing_of_two_prompts_with_two_choices_each(server, model):
    chunks = stream_events(server.base_url, "/v1/completions",
                           {"model": model, "prompt": [PROMPT, "Water boils at"], "n": 2, "seed": 3,
                            "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})
    *token_chunks, usage_chunk = chunks
    assert all(len(chunk["choices"]) == 1 and chunk["object"] == "text_completion" for chunk in token_chunks)
    assert check_finish_reasons(token_chunks, 4) == {i: "length" for i in range(4)}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 20
    without_usage = stream_events(server.base_url, "/v1/completions",
                                  {"model": model, "prompt": PROMPT, "max_tokens": 3, "stream": True})
    assert all(chunk["choices"] for chunk in without_usage) and without_usage[-1]["choices"][0]["finish_reason"]
    # stream_options without include_usage asks for the usage chunk, as in vLLM; false does not, nor does null
    # (vLLM tests it for truth).
    for options, wanted in (({}, True), ({"include_usage": False}, False), ({"include_usage": None}, False)):
        chunks = stream_events(server.base_url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 3,
                                                                    "stream": True, "stream_options": options})
        assert (chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3) == wanted, options


def test_continuous_usage_stats_count_each_choice_so_far(server, model, tokenizer):
    """vLLM's continuous_usage_stats: beside include_usage, every chunk carries its choice's usage so far, against
    its own prompt; without include_usage it adds nothing."""
    prompts = [PROMPT, "Water boils at"]
    body = {"model": model, "prompt": prompts, "n": 2, "seed": 3, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *token_chunks, last = stream_events(server.base_url, "/v1/completions", body)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 20
    seen = {}
    for chunk in token_chunks:
        index, used = chunk["choices"][0]["index"], chunk["usage"]
        assert used["prompt_tokens"] == len(tokenizer.encode(prompts[index // 2]))
        assert used["total_tokens"] == used["prompt_tokens"] + used["completion_tokens"]
        assert used["completion_tokens"] >= seen.get(index, 0)
        seen[index] = used["completion_tokens"]
    assert seen == {0: 5, 1: 5, 2: 5, 3: 5}
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    assert all(chunk["usage"] is None for chunk in stream_events(server.base_url, "/v1/completions", body))


def test_echo_with_logprobs_gives_the_prompts_logprobs_then_the_completions(client, model, tokenizer, reference_llm):
    """vLLM's (lm-eval-harness's log-likelihood requests): echo, logprobs and max_tokens 0 give each prompt token's
    logprob and top alternatives, the first token's null; with tokens to generate, theirs follow."""
    prompt_ids = tokenizer.encode(PROMPT)
    [reference] = reference_llm.generate({"prompt_token_ids": prompt_ids},
                                         SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    [choice] = response.choices
    assert choice.text == PROMPT and response.usage.completion_tokens == 0
    echoed = choice.logprobs
    assert len(echoed.tokens) == len(prompt_ids) and "".join(echoed.tokens) == PROMPT
    assert echoed.token_logprobs[0] is None and echoed.top_logprobs[0] is None
    assert echoed.text_offset == [len("".join(echoed.tokens[:i])) for i in range(len(prompt_ids))]
    for position in range(1, len(prompt_ids)):
        expected = reference.prompt_logprobs[position]
        assert echoed.token_logprobs[position] == pytest.approx(expected[prompt_ids[position]].logprob, abs=1e-3)
        best = min(expected.values(), key=lambda lp: lp.rank)
        assert echoed.top_logprobs[position][best.decoded_token] == pytest.approx(best.logprob, abs=1e-3)
        assert len(echoed.top_logprobs[position]) <= 2
    generated = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1,
                                          temperature=0)
    [choice] = generated.choices
    assert choice.text == PROMPT + greedy(client, model, max_tokens=3).choices[0].text
    assert len(choice.logprobs.tokens) == len(prompt_ids) + 3 and generated.usage.completion_tokens == 3
    assert choice.logprobs.token_logprobs[:len(prompt_ids)] == echoed.token_logprobs
    assert all(isinstance(value, float) for value in choice.logprobs.token_logprobs[len(prompt_ids):])
    [alone] = client.completions.create(model=model, prompt=prompt_ids[:1], max_tokens=0, echo=True,
                                        logprobs=1).choices
    assert alone.logprobs.tokens == [tokenizer.decode(prompt_ids[:1])] and alone.logprobs.token_logprobs == [None]
    top = {token_id: Logprob(-float(rank), rank, str(token_id)) for token_id, rank in ((5, 1), (6, 2), (7, 40))}
    assert list(top_entries(top, 7, 1)) == [5, 7] and list(top_entries(top, 7, -1)) == [5, 6, 7]


def test_prompt_logprobs_come_with_non_streamed_responses(client, model, tokenizer, reference_llm):
    """vLLM's prompt_logprobs field: per prompt token (the first's null) its entry and the top ones by token id."""
    prompt_ids = tokenizer.encode(PROMPT)
    [reference] = reference_llm.generate({"prompt_token_ids": prompt_ids},
                                         SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=1,
                                         extra_body={"prompt_logprobs": 2})
    entries = response.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for position in range(1, len(prompt_ids)):
        expected = reference.prompt_logprobs[position]
        assert set(entries[position]) == {str(token_id) for token_id in expected}
        for token_id, lp in expected.items():
            got = entries[position][str(token_id)]
            assert (got["rank"], got["decoded_token"]) == (lp.rank, lp.decoded_token)
            assert got["logprob"] == pytest.approx(lp.logprob, abs=1e-3)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and chat.usage.prompt_tokens == len(chat_entries)
    assert all(len(entry) == 1 for entry in chat_entries[1:])
