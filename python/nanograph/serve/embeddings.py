"""POST /v1/embeddings: one embedding per input (text or token ids, one or many), from a server whose model runs as
an embedding model (nanograph serve MODEL --runner pooling), as floats or as base64 of their float32 bytes."""
from __future__ import annotations

import base64

import numpy as np
from fastapi import Request

from ..pooling import PoolingParams
from .async_llm import EngineUnavailable
from .completions import encode_prompts
from .errors import APIError, invalid_value, parse_body
from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from .serving import ServedModel, engine_failure, make_response_id, unavailable, usage


# The engine's name for a request's field -> the embeddings request's, in its error messages.
RENAMES = {"prompt": "input"}


async def create_embedding(served: ServedModel, raw_request: Request) -> EmbeddingResponse:
    request = await parse_body(raw_request, EmbeddingRequest)
    served.check_model(request.model)
    if served.runner != "pooling":
        raise APIError(400, "this server's model generates text: /v1/embeddings needs an embedding model, served "
                            "with `nanograph serve MODEL --runner pooling`", "model", "model_not_supported")
    try:
        params = PoolingParams(request.truncate_prompt_tokens, request.dimensions, request.normalize)
    except ValueError as exc:
        raise invalid_value(exc, request) from None
    prompts, _ = await encode_prompts(served, request.input, request.add_special_tokens, "input")
    prompts = served.truncate(prompts, request)
    for i, prompt in enumerate(prompts):
        if len(prompt) > served.max_model_len:  # a prompt may fill max_model_len: nothing is generated after it
            which = f" (input {i})" if len(prompts) > 1 else ""
            raise APIError(400, f"This model's maximum context length is {served.max_model_len} tokens. However, "
                                f"your request has {len(prompt)} input tokens{which}; shorten the input (or set "
                                f"truncate_prompt_tokens)", "input", "context_length_exceeded")
    stream = await served.generate(request, prompts, params, RENAMES)
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
    data = [EmbeddingData(index=i, embedding=_encoded(vectors[i], request.encoding_format))
            for i in range(len(prompts))]
    return EmbeddingResponse(id=make_response_id("embd", raw_request, request), model=served.name, data=data,
                             usage=usage(prompts, 0))


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a list of floats; base64: the vector's float32 bytes, little-endian, in base64 (what OpenAI's client
    asks for by default and decodes with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
