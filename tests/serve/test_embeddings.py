"""POST /v1/embeddings on `nanograph serve --runner pooling` (the default SmolLM2 on the CPU), through the official
OpenAI client: the vectors against LLM.embed() on the same model, base64 and float encodings, token-id inputs,
vLLM's extra fields, and the errors, after which the server goes on serving."""
import base64

import httpx
import numpy as np
import openai
import pytest

from nanograph import LLM, PoolingParams

from .server_process import MAX_MODEL_LEN, module_server

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "a"]
TOLERANCE = 1e-5  # float32 on both sides; the server batches the prompts differently
MAX_LEN_PROMPTS = MAX_MODEL_LEN  # the one prompt of max_model_len tokens alone counts this many


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "--runner", "pooling", "--served-model-name", "smol-embed")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    """The same model in this process, run as an embedding model."""
    return LLM(device="cpu", max_model_len=MAX_MODEL_LEN, runner="pooling")


def post(server, body):
    return httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=60)


def test_the_client_gets_llm_embed_vectors(client, reference):
    expected = [output.outputs.embedding for output in reference.embed(TEXTS, use_tqdm=False)]
    # The client asks for base64 by default and decodes it with numpy.
    response = client.embeddings.create(model="smol-embed", input=TEXTS)
    assert response.model == "smol-embed" and response.object == "list"
    assert [item.index for item in response.data] == [0, 1, 2]
    tokenizer = reference.get_tokenizer()
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(text)) for text in TEXTS)
    assert response.usage.total_tokens == response.usage.prompt_tokens
    for item, vector in zip(response.data, expected):
        assert len(item.embedding) == 576
        np.testing.assert_allclose(item.embedding, vector, atol=TOLERANCE, rtol=0)
        assert abs(np.linalg.norm(item.embedding) - 1) < 1e-5
    floats = client.embeddings.create(model="smol-embed", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, expected[0], atol=TOLERANCE, rtol=0)


def test_base64_is_little_endian_float32(server, reference):
    body = post(server, {"input": TEXTS[1], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, reference.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding,
                               atol=TOLERANCE, rtol=0)
    assert body["id"].startswith("embd-") and body["data"][0]["object"] == "embedding"


def test_pooling_route_gives_the_embeddings(server, reference):
    """vLLM's /pooling on an embedding model: LLM.encode()'s data, as floats or base64."""
    expected = reference.encode(TEXTS[:2], PoolingParams(normalize=False), use_tqdm=False)
    body = httpx.post(server.base_url + "/pooling", json={"input": TEXTS[:2], "normalize": False},
                      timeout=60).json()
    assert body["object"] == "list" and body["model"] == "smol-embed"
    for item, output in zip(body["data"], expected):
        assert item["object"] == "pooling"
        np.testing.assert_allclose(item["data"], output.outputs.data.numpy(),
                                   atol=TOLERANCE * float(output.outputs.data.abs().max()), rtol=0)
    encoded = httpx.post(server.base_url + "/pooling", json={"input": TEXTS[2], "encoding_format": "base64"},
                         timeout=60).json()["data"][0]["data"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(encoded), dtype="<f4"),
                               reference.embed(TEXTS[2], use_tqdm=False)[0].outputs.embedding, atol=TOLERANCE, rtol=0)
    wrong = httpx.post(server.base_url + "/pooling", json={"input": TEXTS[2], "use_activation": False}, timeout=60)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "use_activation"


def test_token_ids_and_vllm_fields(server, client, reference):
    ids = reference.get_tokenizer().encode(TEXTS[0])
    by_ids = client.embeddings.create(model="smol-embed", input=[ids, ids[:3]], encoding_format="float")
    expected = reference.embed([ids, ids[:3]], use_tqdm=False)
    for item, output in zip(by_ids.data, expected):
        np.testing.assert_allclose(item.embedding, output.outputs.embedding, atol=TOLERANCE, rtol=0)
    one = post(server, {"input": ids, "truncate_prompt_tokens": 3, "normalize": False}).json()
    raw = reference.encode([ids[-3:]], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(one["data"][0]["embedding"], raw.numpy(), atol=TOLERANCE * float(raw.abs().max()),
                               rtol=0)
    assert one["usage"]["prompt_tokens"] == 3
    no_bos = post(server, {"input": TEXTS[2], "add_special_tokens": False}).json()
    assert no_bos["usage"]["prompt_tokens"] == len(reference.get_tokenizer().encode(TEXTS[2],
                                                                                        add_special_tokens=False))


def test_a_chat_is_rendered_and_embedded(server, reference):
    """vLLM's chat form: messages in place of input, rendered by the model's chat template (no generation prompt
    unless asked) into the one prompt embedded; also through /invocations."""
    messages = [{"role": "user", "content": "Where is Paris?"}, {"role": "assistant", "content": "In France."}]
    tokenizer = reference.get_tokenizer()
    for generation_prompt in (False, True):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=False)
        body = post(server, {"messages": messages, "add_generation_prompt": generation_prompt,
                             "encoding_format": "float"}).json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(body["data"][0]["embedding"], reference.embed([ids], use_tqdm=False)[0].outputs
                                   .embedding, atol=TOLERANCE, rtol=0)
    invoked = httpx.post(server.base_url + "/invocations", json={"messages": messages, "encoding_format": "float"},
                         timeout=60).json()
    np.testing.assert_allclose(invoked["data"][0]["embedding"], post(server, {"messages": messages, "encoding_format":
                               "float"}).json()["data"][0]["embedding"], atol=TOLERANCE, rtol=0)
    for fields in ({"messages": messages, "input": "Paris"}, {}):
        error = post(server, fields)
        assert error.status_code == 400 and error.json()["error"]["param"] == "input", fields
        assert "exactly one of input" in error.json()["error"]["message"]


def test_errors_and_the_server_goes_on(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="smol-embed", input=TEXTS[0], dimensions=64)
    assert caught.value.body["param"] == "dimensions" and "Matryoshka" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input=TEXTS[0])
    too_long = post(server, {"input": [[5] * (MAX_MODEL_LEN + 1)]})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    empty = post(server, {"input": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    bad = post(server, {"input": [[5, 10 ** 9]]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    cut = post(server, {"input": TEXTS[0], "truncate_prompt_tokens": 0})
    assert cut.status_code == 400 and cut.json()["error"]["param"] == "truncate_prompt_tokens"
    # A generating route on an embedding model: the engine's error, naming the fix.
    with pytest.raises(openai.BadRequestError, match="embedding model.*--runner generate"):
        client.completions.create(model="smol-embed", prompt="Hello", max_tokens=2)
    # A model that fills max_model_len is embedded (nothing is generated after it).
    full = post(server, {"input": [[5] * MAX_MODEL_LEN], "encoding_format": "float"})
    assert full.status_code == 200 and len(full.json()["data"][0]["embedding"]) == 576
    assert len(client.embeddings.create(model="smol-embed", input=TEXTS[2]).data[0].embedding) == 576
    # The metrics count embeddings as requests that finished with "stop", and their prompt tokens.
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert 'nanograph:request_success_total{finished_reason="stop",model_name="smol-embed"}' in metrics
    prompt_tokens = [line for line in metrics.splitlines() if line.startswith("nanograph:prompt_tokens_total")]
    assert prompt_tokens and float(prompt_tokens[0].split()[-1]) > MAX_LEN_PROMPTS
    # SageMaker's route takes an embedding request by its input.
    invoked = httpx.post(server.base_url + "/invocations", json={"input": TEXTS[2], "encoding_format": "float"},
                         timeout=60).json()
    assert len(invoked["data"][0]["embedding"]) == 576


def test_score_is_llm_score(server, reference):
    """vLLM's /score (and /v1/score) on an embedding model: the cosine similarity of text_1 with each text_2, or
    pairwise, as LLM.score() gives it."""
    expected = [s.outputs.score for s in reference.score(TEXTS[0], TEXTS, use_tqdm=False)]
    for path in ("/score", "/v1/score"):
        body = httpx.post(server.base_url + path, json={"model": "smol-embed", "text_1": TEXTS[0], "text_2": TEXTS},
                          timeout=60).json()
        assert body["id"].startswith("score-") and [item["index"] for item in body["data"]] == [0, 1, 2]
        assert [item["score"] for item in body["data"]] == pytest.approx(expected, abs=1e-5)
        assert body["data"][0]["score"] == pytest.approx(1, abs=1e-5)
    pairwise = httpx.post(server.base_url + "/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]},
                          timeout=60).json()
    assert [item["score"] for item in pairwise["data"]] == pytest.approx(
        [s.outputs.score for s in reference.score(TEXTS[:2], TEXTS[1:], use_tqdm=False)], abs=1e-5)
    tokenizer = reference.get_tokenizer()
    assert pairwise["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(a)) + len(tokenizer.encode(b))
                                                     for a, b in zip(TEXTS[:2], TEXTS[1:]))
    mismatched = httpx.post(server.base_url + "/score", json={"text_1": TEXTS[:2], "text_2": TEXTS}, timeout=60)
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_2"
    assert "got 2 and 3" in mismatched.json()["error"]["message"]
    too_long = httpx.post(server.base_url + "/score", json={"text_1": [7], "text_2": [[5, 6], [5] * (MAX_MODEL_LEN + 1)]},
                          timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "text_2"
    assert "text_2 1 has 513 tokens" in too_long.json()["error"]["message"]
    invoked = httpx.post(server.base_url + "/invocations", json={"text_1": TEXTS[0], "text_2": TEXTS},
                         timeout=60).json()
    assert [item["score"] for item in invoked["data"]] == pytest.approx(expected, abs=1e-5)


def test_rerank_orders_the_documents(server, reference):
    """vLLM's /rerank (/v1/rerank, /v2/rerank) on an embedding model: the documents by their cosine similarity with
    the query, best first, top_n of them."""
    documents = TEXTS[1:] + ["The capital of France is Paris!", "Paris"]
    scores = [s.outputs.score for s in reference.score(TEXTS[0], documents, use_tqdm=False)]
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(server.base_url + path, json={"query": TEXTS[0], "documents": documents},
                          timeout=60).json()
        assert [result["index"] for result in body["results"]] == order
        assert [result["relevance_score"] for result in body["results"]] == \
            pytest.approx([scores[i] for i in order], abs=1e-5)
        assert [result["document"]["text"] for result in body["results"]] == [documents[i] for i in order]
    top = httpx.post(server.base_url + "/rerank", json={"query": TEXTS[0], "documents": documents, "top_n": 2},
                     timeout=60).json()
    assert [result["index"] for result in top["results"]] == order[:2]
    tokenizer = reference.get_tokenizer()
    assert top["id"].startswith("rerank-")
    assert top["usage"]["total_tokens"] == sum(len(tokenizer.encode(TEXTS[0])) + len(tokenizer.encode(document))
                                               for document in documents)
    # top_n 0 or less: every document, as vLLM.
    every = httpx.post(server.base_url + "/rerank", json={"query": TEXTS[0], "documents": documents, "top_n": -1},
                       timeout=60).json()
    assert [result["index"] for result in every["results"]] == order
    empty = httpx.post(server.base_url + "/rerank", json={"query": "q", "documents": []}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"
    # A text of no tokens is named by its field and place.
    blank = httpx.post(server.base_url + "/rerank", json={"query": "q", "documents": ["x", ""]}, timeout=60)
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "documents"
    assert blank.json()["error"]["message"].startswith("documents 1 is empty")
    invoked = httpx.post(server.base_url + "/invocations", json={"query": TEXTS[0], "documents": documents},
                         timeout=60).json()
    assert [result["index"] for result in invoked["results"]] == order
