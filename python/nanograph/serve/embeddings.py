"""The pooling models' routes. POST /v1/embeddings: one embedding per input (text or token ids, one or many), from a
server whose model runs as an embedding model (nanograph serve MODEL --runner pooling), as floats or as base64 of
their float32 bytes. vLLM's POST /classify (/v1/classify) on a classifier: each input's class probabilities; and
its POST /pooling on either: the model's own output, as LLM.encode() gives it. vLLM's POST /score (/v1/score) and
/rerank (/v1/rerank, /v2/rerank) on an embedding model (the cosine similarity of two
texts' embeddings) or a cross-encoder (a classifier of one label, reading the two texts together): pairs of texts
scored, and documents ranked by their score against a query."""
from __future__ import annotations

import base64

import numpy as np
from fastapi import Request

from ..engine.intake import check_prompt_token_ids
from ..pooling import TASK_NOUNS, PoolingParams, activated, cosine, pair_token_ids, pair_truncation, score_pairs
from .async_llm import EngineUnavailable
from .completions import encode_prompts, prompt_list
from .errors import APIError, invalid_value, parse_body
from .protocol import (ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingData,
                       EmbeddingRequest, EmbeddingResponse, PoolingChatRequest, PoolingData, PoolingOutputRequest,
                       PoolingRequest, PoolingResponse, RerankDocument, RerankRequest, RerankResponse, RerankResult,
                       RerankUsage, ScoreData, ScoreRequest, ScoreResponse)
from .serving import ServedModel, engine_failure, make_response_id, unavailable, usage


async def create_embedding(served: ServedModel, raw_request: Request) -> EmbeddingResponse:
    request = await parse_body(raw_request, EmbeddingRequest)
    _check_pooling(served, request, "/v1/embeddings", "embed")
    prompts, vectors = await _input_vectors(served, request, _pooling_params(request, request.dimensions,
                                                                             request.normalize))
    data = [EmbeddingData(index=i, embedding=_encoded(vector, request.encoding_format))
            for i, vector in enumerate(vectors)]
    return EmbeddingResponse(id=make_response_id("embd", raw_request, request), model=served.name, data=data,
                             usage=usage(prompts, 0))


async def create_pooling(served: ServedModel, raw_request: Request) -> PoolingResponse:
    """vLLM's /pooling: each input's pooled output as the model gives it (LLM.encode()'s data): an embedding model's
    vector, a classifier's probabilities."""
    request = await parse_body(raw_request, PoolingOutputRequest)
    _check_pooling(served, request, "/pooling")
    if request.task not in (None, served.pooling_task):
        raise APIError(400, f"task={request.task!r}: this server's model is {TASK_NOUNS[served.pooling_task]}, "
                            f"whose /pooling output is {served.pooling_task!r}; leave task out or pass "
                            f"{served.pooling_task!r}", "task", "invalid_value")
    prompts, vectors = await _input_vectors(served, request, _pooling_params(
        request, request.dimensions, request.normalize, use_activation=request.use_activation))
    data = [PoolingData(index=i, data=_encoded(vector, request.encoding_format)) for i, vector in enumerate(vectors)]
    return PoolingResponse(id=make_response_id("pool", raw_request, request), model=served.name, data=data,
                           usage=usage(prompts, 0))


async def create_classification(served: ServedModel, raw_request: Request) -> ClassificationResponse:
    """vLLM's /classify on a classifier: each input's class probabilities, and its most likely class's name."""
    request = await parse_body(raw_request, ClassificationRequest)
    _check_pooling(served, request, "/classify", "classify")
    prompts, vectors = await _input_vectors(served, request,
                                            _pooling_params(request, use_activation=request.use_activation))
    data = [ClassificationData(index=i, label=served.labels[int(np.argmax(vector))], probs=vector.tolist(),
                               num_classes=len(vector)) for i, vector in enumerate(vectors)]
    return ClassificationResponse(id=make_response_id("classify", raw_request, request), model=served.name,
                                  data=data, usage=usage(prompts, 0))


async def create_score(served: ServedModel, raw_request: Request) -> ScoreResponse:
    """vLLM's /score: text_1 against each of text_2 (or each pair, given as many of each). On an embedding model,
    the cosine similarity of their embeddings; on a cross-encoder, its probability for the pair read together."""
    request = await parse_body(raw_request, ScoreRequest)
    cross_encoder = _check_scoring(served, request, "/score")
    firsts, seconds = prompt_list(request.text_1, "text_1"), prompt_list(request.text_2, "text_2")
    try:
        pairs = score_pairs(range(len(firsts)), range(len(firsts), len(firsts) + len(seconds)))
    except ValueError as exc:
        raise APIError(400, f"text_1 and text_2: {exc}".replace("score()", "/score"), "text_2",
                       "invalid_value") from None
    if cross_encoder:
        texts = firsts + seconds
        names = [f"text_2 {b - len(firsts)} (with text_1 {a})" for a, b in pairs]
        scores, prompts = await _cross_encoder_scores(served, request, [(texts[a], texts[b]) for a, b in pairs],
                                                      names, "/score")
        return ScoreResponse(id=make_response_id("score", raw_request, request), model=served.name,
                             data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
                             usage=usage(prompts, 0))
    firsts, _ = await encode_prompts(served, firsts, request.add_special_tokens, "text_1")
    seconds, _ = await encode_prompts(served, seconds, request.add_special_tokens, "text_2")
    prompts = served.truncate(firsts + seconds, request)
    names = [f"text_1 {i}" for i in range(len(firsts))] + [f"text_2 {i}" for i in range(len(seconds))]
    vectors = await _vectors(served, request, prompts, names, _pooling_params(request))
    data = [ScoreData(index=i, score=cosine(vectors[a], vectors[b])) for i, (a, b) in enumerate(pairs)]
    return ScoreResponse(id=make_response_id("score", raw_request, request), model=served.name, data=data,
                         usage=usage([prompts[a] + prompts[b] for a, b in pairs], 0))


async def create_rerank(served: ServedModel, raw_request: Request) -> RerankResponse:
    """vLLM's /rerank: the documents ordered by their score against the query, best first (the top_n best, when
    top_n is above 0; else all, as vLLM). The score is the cosine similarity of their embeddings on an embedding
    model, a cross-encoder's probability for the query and the document read together on such a model."""
    request = await parse_body(raw_request, RerankRequest)
    cross_encoder = _check_scoring(served, request, "/rerank")
    if not request.documents:
        raise APIError(400, "documents is empty; give at least one document to rank", "documents", "invalid_value")
    names = [f"documents {i}" for i in range(len(request.documents))]
    if cross_encoder:
        scores, prompts = await _cross_encoder_scores(
            served, request, [(request.query, document) for document in request.documents], names, "/rerank")
        num_tokens = sum(map(len, prompts))
    else:
        texts = [request.query, *request.documents]
        prompts = served.truncate((await encode_prompts(served, texts, request.add_special_tokens, "documents"))[0],
                                  request)
        query, *documents = await _vectors(served, request, prompts, ["query", *names], _pooling_params(request))
        scores = [cosine(query, vector) for vector in documents]
        num_tokens = sum(len(prompts[0]) + len(prompt) for prompt in prompts[1:])  # each pair's, as /score counts
    ranked = sorted(((score, i) for i, score in enumerate(scores)), key=lambda item: -item[0])
    if request.top_n > 0:
        ranked = ranked[:request.top_n]
    results = [RerankResult(index=i, document=RerankDocument(text=request.documents[i]), relevance_score=score)
               for score, i in ranked]
    return RerankResponse(id=make_response_id("rerank", raw_request, request), model=served.name,
                          usage=RerankUsage(total_tokens=num_tokens), results=results)


_TASK_FIX = {"embed": "an embedding model (served with `nanograph serve MODEL --runner pooling`)",
             "classify": "a classifier (a model folder whose architectures are *ForSequenceClassification)"}


def _check_pooling(served: ServedModel, request: PoolingRequest, route: str, task: str | None = None):
    """A 400 unless the server's model is a pooling model, of `task` where given."""
    served.check_model(request.model)
    if served.runner != "pooling":
        raise APIError(400, f"this server's model generates text: {route} needs {_TASK_FIX[task or 'embed']}",
                       "model", "model_not_supported")
    if task is not None and served.pooling_task != task:
        other = "/classify" if served.pooling_task == "classify" else "/v1/embeddings"
        raise APIError(400, f"this server's model is {TASK_NOUNS[served.pooling_task]}: {route} needs "
                            f"{_TASK_FIX[task]}; this one serves {other}", "model", "model_not_supported")


def _check_scoring(served: ServedModel, request: PoolingRequest, route: str) -> bool:
    """A 400 unless the server's model scores pairs; whether it is a cross-encoder (a classifier of one label)."""
    _check_pooling(served, request, route)
    if served.pooling_task != "classify":
        return False
    if len(served.labels) != 1:
        raise APIError(400, f"this server's model is a classifier of {len(served.labels)} classes: {route} needs an "
                            f"embedding model or a cross-encoder (a classifier of one label); use /classify",
                       "model", "model_not_supported")
    return True


async def _cross_encoder_scores(served: ServedModel, request: PoolingRequest, pairs: list[tuple], names: list[str],
                                route: str) -> tuple[list[float], list[list[int]]]:
    """A cross-encoder's score of each pair, read together (two texts as the tokenizer encodes a pair, cut to
    truncate_prompt_tokens; two token-id lists joined), and the pairs' tokens."""
    try:
        k = pair_truncation(request.truncate_prompt_tokens, served.max_model_len)
    except ValueError as exc:
        raise invalid_value(exc, request) from None
    try:
        prompts = await served.tokenized(lambda: [pair_token_ids(served.tokenizer, a, b, request.add_special_tokens,
                                                                 k) for a, b in pairs])
    except ValueError as exc:
        raise APIError(400, f"{route}: {exc}", names[0].split()[0], "invalid_value") from None
    logits = await _vectors(served, request, prompts, names,
                            _pooling_params(request, use_activation=False, truncate=False))
    return [float(activated(logit, served.score_activation)[0]) for logit in logits], prompts


def _pooling_params(request: PoolingRequest, dimensions: int | None = None, normalize: bool | None = None,
                    use_activation: bool | None = None, truncate: bool = True) -> PoolingParams:
    """The request's PoolingParams (truncate: with its truncate_prompt_tokens)."""
    try:
        return PoolingParams(request.truncate_prompt_tokens if truncate else None, dimensions, normalize,
                             use_activation)
    except ValueError as exc:
        raise invalid_value(exc, request) from None


async def _input_vectors(served: ServedModel, request: PoolingChatRequest,
                         params: PoolingParams) -> tuple[list[list[int]], list[np.ndarray]]:
    """The request's inputs as token ids (its messages rendered by the chat template into one), truncated as it asks,
    and each one's vector from the engine."""
    if (request.input is None) == (request.messages is None):
        raise APIError(400, "give exactly one of input (texts or token ids) or messages (a chat)", "input",
                       "invalid_value")
    if request.messages is not None:
        if not request.messages:
            raise APIError(400, "messages is empty; give at least one message", "messages", "invalid_value")
        prompts, names = [await served.render_chat(request.messages, request)], ["messages"]
    else:
        prompts, _ = await encode_prompts(served, request.input, request.add_special_tokens, "input")
        names = ["input" if len(prompts) == 1 else f"input {i}" for i in range(len(prompts))]
    prompts = served.truncate(prompts, request)
    return prompts, await _vectors(served, request, prompts, names, params)


async def _vectors(served: ServedModel, request: PoolingRequest, prompts: list[list[int]], names: list[str],
                   params: PoolingParams) -> list[np.ndarray]:
    """Each prompt's vector, in order, from the engine. Each prompt is checked first, a 400 naming it (names[i]:
    its field, and its place there): empty, ids outside the vocabulary, or longer than max_model_len (one that
    fills it is pooled: nothing is generated after it)."""
    for name, prompt in zip(names, prompts):
        field = name.split()[0]
        if not prompt:
            raise APIError(400, f"{name} is empty (no tokens); give it some text", field, "invalid_value")
        try:
            check_prompt_token_ids(prompt, served.async_llm.info.vocab_size)
        except ValueError as exc:
            raise APIError(400, f"{name}: {exc}", field, "invalid_value") from None
        if len(prompt) > served.max_model_len:
            raise APIError(400, f"This model's maximum context length is {served.max_model_len} tokens. However, "
                                f"{name} has {len(prompt)} tokens; shorten it (or set truncate_prompt_tokens)",
                           field, "context_length_exceeded")
    stream = await served.generate(request, prompts, params)
    vectors: dict[int, np.ndarray] = {}
    try:
        async for deltas in stream:
            for prompt_index, delta in deltas:
                if delta.error is not None:
                    raise engine_failure(delta.error)
                if delta.finished and delta.pooled is not None:
                    vectors[prompt_index] = delta.pooled
    except EngineUnavailable as exc:
        raise unavailable(exc) from None
    finally:
        stream.close()
    if len(vectors) != len(prompts):  # ended without a vector: aborted (the server stopping)
        raise APIError(503, "the server stopped before the embeddings were computed; send the request again",
                       code="engine_unavailable")
    return [vectors[i] for i in range(len(prompts))]


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a list of floats; base64: the vector's float32 bytes, little-endian, in base64 (what OpenAI's client
    asks for by default and decodes with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
