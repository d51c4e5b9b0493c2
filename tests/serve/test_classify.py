"""vLLM's /classify on `nanograph serve` of a sequence classifier (a tiny random Qwen3ForSequenceClassification folder
on the CPU), and /score and /rerank on a cross-encoder (a one-label classifier with SmolLM2's tokenizer): the results
against LLM.classify() and LLM.score() on the same folders, and the errors, after which the servers go on serving."""
import httpx
import numpy as np
import pytest

from nanograph import LLM
from nanograph.default_model import default_model_path

from ..engine.tiny_models import make_tiny_classifier
from .server_process import module_server

TOLERANCE = 1e-5  # float32 on both sides
PROMPTS = [list(range(3, 48)), [200, 17, 5, 90, 31], [7]]


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("classifier")
    make_tiny_classifier(folder, "qwen3-tied", num_labels=3, seed=5)
    return folder


@pytest.fixture(scope="module")
def cross_encoder_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cross-encoder")
    make_tiny_classifier(folder, "llama3-untied", num_labels=1, seed=6, with_tokenizer=True)
    return folder


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, classifier_folder):
    # The folder has no tokenizer; inputs are token ids, which the default model's tokenizer decodes for the server.
    yield from module_server(tmp_path_factory, str(classifier_folder), "--dtype", "float32",
                             "--served-model-name", "clf", "--tokenizer", default_model_path())


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, cross_encoder_folder):
    yield from module_server(tmp_path_factory, str(cross_encoder_folder), "--dtype", "float32",
                             "--served-model-name", "ce")


def local(folder) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32")


def post(server, path, body):
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_classify_is_llm_classify(classifier, classifier_folder):
    expected = [output.outputs.probs for output in local(classifier_folder).classify(PROMPTS, use_tqdm=False)]
    for path in ("/classify", "/v1/classify"):
        response = post(classifier, path, {"model": "clf", "input": PROMPTS})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and body["model"] == "clf" and body["id"].startswith("classify-")
        assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS)) == body["usage"]["total_tokens"]
        for i, (item, probs) in enumerate(zip(body["data"], expected)):
            assert item["index"] == i and item["num_classes"] == 3
            np.testing.assert_allclose(item["probs"], probs, atol=TOLERANCE, rtol=0)
            assert item["label"] == f"class_{int(np.argmax(probs))}"
    assert len({item["label"] for item in body["data"]}) > 1 or len({round(p, 4) for item in body["data"]
                                                                    for p in item["probs"]}) > 3
    # One input of token ids, its logits (use_activation false), and through /invocations.
    logits = post(classifier, "/classify", {"input": PROMPTS[1], "use_activation": False}).json()["data"][0]["probs"]
    np.testing.assert_allclose(np.exp(logits) / np.exp(logits).sum(), expected[1], atol=TOLERANCE, rtol=0)
    invoked = post(classifier, "/invocations", {"input": [PROMPTS[2]]}).json()["data"][0]
    np.testing.assert_allclose(invoked["probs"], expected[2], atol=TOLERANCE, rtol=0)
    # vLLM's /pooling: the model's own output, LLM.encode()'s data.
    pooled = post(classifier, "/pooling", {"input": PROMPTS[:2]}).json()
    assert pooled["id"].startswith("pool-") and [item["object"] for item in pooled["data"]] == ["pooling"] * 2
    for item, probs in zip(pooled["data"], expected):
        np.testing.assert_allclose(item["data"], probs, atol=TOLERANCE, rtol=0)


def test_classifier_errors_and_the_server_goes_on(classifier):
    cases = [
        ("/v1/embeddings", {"input": PROMPTS[0]}, "model", "is a classifier: /v1/embeddings needs an embedding model"),
        ("/score", {"text_1": PROMPTS[0], "text_2": PROMPTS[1]}, "model", "classifier of 3 classes"),
        ("/classify", {"input": [[5] * 257]}, "input", "maximum context length is 256"),  # the model's
        ("/classify", {"input": [[1, 2], []]}, "input", "input 1 is empty"),
        ("/classify", {"input": [[1, 100000]]}, "input", "input: "),
        ("/classify", {"input": PROMPTS[0], "model": "other"}, "model", "other"),
        ("/pooling", {"input": PROMPTS[0], "dimensions": 2}, "dimensions", "dimensions is for embeddings"),
        ("/pooling", {"input": PROMPTS[0], "task": "embed"}, "task", "whose /pooling output is 'classify'"),
        ("/classify", {"messages": []}, "messages", "messages is empty"),
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2}, None, ""),
    ]
    for path, body, param, message in cases:
        response = post(classifier, path, body)
        assert response.status_code in (400, 404), (path, body, response.text)
        error = response.json()["error"]
        assert message in error["message"], (path, error)
        if param is not None:
            assert error["param"] == param, (path, error)
    assert post(classifier, "/classify", {"input": PROMPTS[2]}).json()["data"][0]["num_classes"] == 3


def test_cross_encoder_score_and_rerank(cross_encoder, cross_encoder_folder):
    llm = local(cross_encoder_folder)
    query = "What is the capital of France?"
    documents = ["Bananas are yellow.", "Paris is the capital of France.", "The sky is blue."]
    expected = [score.outputs.score for score in llm.score(query, documents, use_tqdm=False)]
    assert len({round(score, 4) for score in expected}) == 3
    body = post(cross_encoder, "/score", {"model": "ce", "text_1": query, "text_2": documents}).json()
    np.testing.assert_allclose([item["score"] for item in body["data"]], expected, atol=TOLERANCE, rtol=0)
    tokenizer = llm.get_tokenizer()
    pair_tokens = [len(tokenizer(query, text_pair=document)["input_ids"]) for document in documents]
    assert body["usage"]["prompt_tokens"] == sum(pair_tokens)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = post(cross_encoder, path, {"query": query, "documents": documents, "top_n": 2}).json()
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [result["index"] for result in ranked["results"]] == order, path
        np.testing.assert_allclose([result["relevance_score"] for result in ranked["results"]],
                                   [expected[i] for i in order], atol=TOLERANCE, rtol=0)
        assert ranked["results"][0]["document"]["text"] == documents[order[0]]
        assert ranked["usage"]["total_tokens"] == sum(pair_tokens)
    mixed = post(cross_encoder, "/score", {"text_1": query, "text_2": [[5, 6]]})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "text_2"
    assert mixed.json()["error"]["message"].startswith("/score: a cross-encoder reads each pair together")
    # truncate_prompt_tokens bounds each pair as the tokenizer truncates one: the query stays whole.
    cut = post(cross_encoder, "/rerank", {"query": query, "documents": documents[1:2],
                                          "truncate_prompt_tokens": 9}).json()
    local_cut = llm.score(query, documents[1], truncate_prompt_tokens=9, use_tqdm=False)[0]
    assert cut["usage"]["total_tokens"] == len(local_cut.prompt_token_ids) == 9
    assert cut["results"][0]["relevance_score"] == pytest.approx(local_cut.outputs.score, abs=TOLERANCE)
    assert local_cut.outputs.score != pytest.approx(expected[1], abs=1e-4)
    too_long = post(cross_encoder, "/score", {"text_1": query, "text_2": documents, "truncate_prompt_tokens": 9000})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "truncate_prompt_tokens"
    # A one-label classifier classifies too, a chat among its inputs (vLLM's messages, rendered by the template).
    single = post(cross_encoder, "/classify", {"input": "Paris"}).json()["data"][0]
    assert single["num_classes"] == 1 and single["label"] == "class_0"
    messages = [{"role": "user", "content": "Is Paris in France?"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    chat = post(cross_encoder, "/classify", {"messages": messages}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["data"][0]["probs"] == pytest.approx(llm.classify([ids], use_tqdm=False)[0].outputs.probs,
                                                     abs=TOLERANCE)
    assert post(cross_encoder, "/score", {"text_1": query, "text_2": documents[1]}).json()["data"][0]["score"] == \
        pytest.approx(expected[1], abs=TOLERANCE)
