"""Sequence classifiers (transformers' XForSequenceClassification folders) on the torch backend against HF
transformers' own classifier: classify()'s probabilities over prompts prefilled in chunks, the logits without the
activation, a one-label cross-encoder's score() of text pairs, and the errors."""
import pytest
import torch

from nanograph import LLM, PoolingParams
from nanograph.engine_args import engine_config

from .tiny_models import make_tiny_classifier

# Prompts of 1 to 45 tokens: with max_num_batched_tokens=16 the longest are prefilled over three or more steps.
PROMPTS = [list(range(3, 48)), [200, 17, 5, 90, 31], [7], list(range(100, 133))]
TOLERANCE = 1e-5  # float32 on both sides


def classifier_llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), **{"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 16, "max_num_seqs": 4,
                               **kwargs})


def hf_logits(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="module")
def qwen3_classifier(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-classifier")
    return folder, make_tiny_classifier(folder, "qwen3-tied", num_labels=3, seed=5)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A one-label Llama classifier with SmolLM2's tokenizer (untied: the folder has no lm_head at all)."""
    folder = tmp_path_factory.mktemp("cross-encoder")
    return folder, make_tiny_classifier(folder, "llama3-untied", num_labels=1, seed=6, with_tokenizer=True)


def test_classify_matches_transformers(qwen3_classifier):
    """runner="auto" (the default) pools a classifier's folder; each prompt's probabilities are the softmax of HF's
    logits, and use_activation=False gives the logits themselves."""
    folder, model = qwen3_classifier
    llm = classifier_llm(folder)
    assert llm.engine.config.runner == "pooling" and llm.engine.pooler.task == "classify"
    assert llm.engine.pooler.labels == ("class_0", "class_1", "class_2")

    def no_sampling(rows, seqs):
        raise AssertionError("a classification request was sampled")

    llm.engine.runner.sample = no_sampling
    outputs = llm.classify(PROMPTS, use_tqdm=False)
    logits = llm.encode(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    for prompt, output, raw in zip(PROMPTS, outputs, logits):
        reference = hf_logits(model, prompt)
        assert output.prompt_token_ids == prompt and output.finished and output.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(output.outputs.probs), reference.softmax(-1), atol=TOLERANCE,
                                   rtol=0)
        torch.testing.assert_close(raw.outputs.data, reference, atol=TOLERANCE * reference.abs().max(), rtol=0)
    # The prompts' probabilities differ (no test above passes by scoring one row for all).
    assert (torch.tensor(outputs[0].outputs.probs) - torch.tensor(outputs[1].outputs.probs)).abs().max() > 1e-3
    manager = llm.engine.scheduler.block_manager
    assert manager.num_free_blocks == llm.engine.runner.num_kv_blocks


def test_cross_encoder_scores_pairs(cross_encoder):
    """score() on a one-label classifier reads each pair together, as the tokenizer encodes a pair: its score is
    the sigmoid of HF's logit for that input; one text against many, or pairwise; token-id pairs are joined."""
    folder, model = cross_encoder
    llm = classifier_llm(folder)
    tokenizer = llm.get_tokenizer()
    query, documents = "What is the capital of France?", ["Paris is the capital of France.", "Bananas are yellow."]
    scores = llm.score(query, documents, use_tqdm=False)
    for document, score in zip(documents, scores):
        ids = tokenizer(query, text_pair=document)["input_ids"]
        assert score.prompt_token_ids == ids
        assert score.outputs.score == pytest.approx(hf_logits(model, ids).sigmoid().item(), abs=TOLERANCE)
    assert scores[0].outputs.score != pytest.approx(scores[1].outputs.score, abs=1e-4)
    pairwise = llm.score([[5, 6, 7], [8, 9]], [[10, 11], [12]], use_tqdm=False)
    for ids, score in zip(([5, 6, 7, 10, 11], [8, 9, 12]), pairwise):
        assert score.prompt_token_ids == ids
        assert score.outputs.score == pytest.approx(hf_logits(model, ids).sigmoid().item(), abs=TOLERANCE)
    # classify() on it gives the same probability.
    probs = llm.classify([[5, 6, 7, 10, 11]], use_tqdm=False)[0].outputs.probs
    assert probs == pytest.approx([pairwise[0].outputs.score], abs=1e-6)
    with pytest.raises(ValueError, match="both sides as texts, or both as token ids"):
        llm.score(query, [[5, 6]])


def test_cross_encoder_truncation_keeps_the_query(cross_encoder):
    """truncate_prompt_tokens bounds a pair's tokens as the tokenizer truncates a pair (the longer text cut first), so
    the query stays whole; token-id pairs keep their first tokens."""
    folder, model = cross_encoder
    llm = classifier_llm(folder)
    tokenizer = llm.get_tokenizer()
    query, document = "capital of France?", "Paris is the capital of France and a large city on the Seine river."
    full = tokenizer(query, text_pair=document)["input_ids"]
    cut = tokenizer(query, text_pair=document, truncation=True, max_length=10)["input_ids"]
    assert len(cut) == 10 < len(full) and cut[:len(tokenizer(query)["input_ids"])] == tokenizer(query)["input_ids"]
    for score in (llm.score(query, document, truncate_prompt_tokens=10, use_tqdm=False)[0],
                  llm.score(query, document, pooling_params=PoolingParams(truncate_prompt_tokens=10),
                            use_tqdm=False)[0]):
        assert score.prompt_token_ids == cut
        assert score.outputs.score == pytest.approx(hf_logits(model, cut).sigmoid().item(), abs=TOLERANCE)
    assert llm.score([1, 2, 3], [4, 5, 6], truncate_prompt_tokens=4, use_tqdm=False)[0].prompt_token_ids == \
        [1, 2, 3, 4]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=9000 is more than max_model_len=8192"):
        llm.score(query, document, truncate_prompt_tokens=9000)


@pytest.mark.parametrize("overrides, activation", [
    ({"problem_type": "regression"}, lambda logits: logits),
    ({"problem_type": "multi_label_classification"}, torch.sigmoid),
])
def test_activation_follows_the_problem_type(tmp_path, overrides, activation):
    model = make_tiny_classifier(tmp_path, "qwen3-tied", num_labels=3, seed=8, config_overrides=overrides)
    probs = classifier_llm(tmp_path).classify(PROMPTS[:2], use_tqdm=False)
    for prompt, output in zip(PROMPTS, probs):
        torch.testing.assert_close(torch.tensor(output.outputs.probs), activation(hf_logits(model, prompt)),
                                   atol=TOLERANCE, rtol=0)


def test_cross_encoder_activation_from_sentence_transformers(tmp_path):
    """A cross-encoder saved by sentence-transformers with an Identity activation scores with its logit."""
    model = make_tiny_classifier(tmp_path, "qwen3-tied", num_labels=1, seed=9, config_overrides={
        "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}})
    llm = classifier_llm(tmp_path)
    score = llm.score([5, 6], [7, 8], use_tqdm=False)[0].outputs.score
    logit = hf_logits(model, [5, 6, 7, 8]).item()
    assert score == pytest.approx(logit, abs=TOLERANCE)
    # classify() keeps the classifier's own activation (a sigmoid for one label), as vLLM's.
    assert llm.classify([[5, 6, 7, 8]], use_tqdm=False)[0].outputs.probs == pytest.approx(
        [torch.sigmoid(torch.tensor(logit)).item()], abs=TOLERANCE)
    # Without the activation, a score is the logit on any cross-encoder.
    assert llm.score([5, 6], [7, 8], pooling_params=PoolingParams(use_activation=False),
                     use_tqdm=False)[0].outputs.score == pytest.approx(logit, abs=TOLERANCE)


def test_errors(qwen3_classifier, cross_encoder):
    folder, _ = qwen3_classifier
    llm = classifier_llm(folder)
    with pytest.raises(ValueError, match="this model is a classifier, .* call classify"):
        llm.embed(PROMPTS[:1])
    with pytest.raises(ValueError, match="request 0: dimensions is for embeddings"):
        llm.classify(PROMPTS[:1], pooling_params=PoolingParams(dimensions=4))
    with pytest.raises(ValueError, match="request 0: normalize is for embeddings"):
        llm.classify(PROMPTS[:1], pooling_params=PoolingParams(normalize=True))
    with pytest.raises(ValueError, match=r"needs a cross-encoder, a classifier of one label; this one has 3 "
                                         r"\(class_0, class_1, class_2\)"):
        llm.score(PROMPTS[0], PROMPTS[1:])
    with pytest.raises(ValueError, match="use_activation must be a bool"):
        PoolingParams(use_activation=1)
    assert not llm.engine.has_unfinished()
    assert len(llm.classify(PROMPTS[:1], use_tqdm=False)[0].outputs.probs) == 3  # it still serves
    # A classifier's folder holds no lm_head (tied embeddings or not): generating from it is refused, naming the fix.
    for classifier_folder in (folder, cross_encoder[0]):
        with pytest.raises(ValueError, match="without an lm_head .* run it with runner='pooling'"):
            LLM(str(classifier_folder), device="cpu", runner="generate")
    with pytest.raises(ValueError, match="task='embed' .* asks for an embedding model, .* holds a classifier"):
        classifier_llm(folder, task="embed")
    with pytest.raises(ValueError, match="pooler_config.normalize is for embeddings"):
        classifier_llm(folder, pooler_config={"normalize": True})


def test_embedding_model_refuses_classification(tmp_path):
    from .tiny_models import make_tiny_model
    make_tiny_model(tmp_path, "qwen3-tied")
    llm = classifier_llm(tmp_path, runner="pooling")
    with pytest.raises(ValueError, match="this model is an embedding model, .* call embed"):
        llm.classify(PROMPTS[:1])
    with pytest.raises(ValueError, match="request 0: use_activation is for a classifier"):
        llm.embed(PROMPTS[:1], pooling_params=PoolingParams(use_activation=False))
    with pytest.raises(ValueError, match="task='classify' .* asks for a classifier, .* holds an embedding model .*"
                                         "use a sequence classifier's folder"):
        classifier_llm(tmp_path, task="classify")


def test_vllm_spellings(tmp_path):
    assert engine_config(None, task="classify").runner == "pooling"
    assert engine_config(None, convert="classify").pooling_task == "classify"
    with pytest.raises(ValueError, match="task='classify' and convert='embed' ask for two kinds"):
        engine_config(None, task="classify", convert="embed")
    with pytest.raises(ValueError, match="pooling_task='embed' is for a pooling model, which runner='generate'"):
        engine_config(None, runner="generate", pooling_task="embed")
    # A pooling task asked with runner="auto" pools a causal LM's folder.
    from .tiny_models import make_tiny_model
    make_tiny_model(tmp_path, "qwen3-tied")
    llm = LLM(str(tmp_path), device="cpu", runner="auto", pooling_task="embed")
    assert llm.engine.config.runner == "pooling" and llm.engine.pooler.task == "embed"
    with pytest.raises(ValueError, match="task='classify' makes a pooling model, which runner='generate'"):
        engine_config(None, task="classify", runner="generate")
