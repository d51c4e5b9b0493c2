"""The FastAPI app: the OpenAI routes under /v1 (embeddings for a model served with --runner pooling), and vLLM's
/pooling, /classify, /score and /rerank routes for pooling models and SageMaker's /invocations (all behind the API
key when one is set), and /health, /ping, /version, /tokenize, /detokenize and /metrics beside them."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import __version__
from .chat import create_chat_completion
from .completions import create_completion
from .embeddings import create_classification, create_embedding, create_pooling, create_rerank, create_score
from ..engine.llm_engine import check_rpc_method
from .async_llm import EngineUnavailable
from .errors import APIError, add_error_handlers, parse_body
from .protocol import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                       TokenizeResponse)
from .responses import create_response
from .serving import ServedModel

logger = logging.getLogger("nanograph.serve")

SHUTDOWN_SECONDS = 10  # how long the engine loop may take to end its requests when the server stops
# What /load counts (vLLM's: the requests that run in the engine).
GENERATING_PATHS = ("/completions", "/chat/completions", "/responses", "/embeddings", "/pooling", "/classify",
                    "/score", "/rerank", "/invocations")


def dev_mode() -> bool:
    """NANOGRAPH_SERVER_DEV_MODE (or vLLM's VLLM_SERVER_DEV_MODE) set: the development routes are served."""
    value = os.environ.get("NANOGRAPH_SERVER_DEV_MODE") or os.environ.get("VLLM_SERVER_DEV_MODE")
    return (value or "0").strip().lower() not in ("", "0", "false", "no")


class ServerLoad:
    """The generating requests in flight (POSTs to GENERATING_PATHS), each counted until its whole response, a
    stream's last chunk included, has been sent."""

    def __init__(self):
        self.value = 0

    class Counter:
        """The ASGI middleware that counts them."""

        def __init__(self, app, load: ServerLoad):
            self.app = app
            self.load = load

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(GENERATING_PATHS):
                return await self.app(scope, receive, send)
            self.load.value += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.load.value -= 1


def build_app(served: ServedModel, api_keys: list[str] | None = None, cors: dict | None = None,
              root_path: str = "", request_id_headers: bool = False, docs: bool = True,
              load_tracking: bool = False) -> FastAPI:
    """api_keys: a /v1 request must bring one of them (empty keys are left out, as vLLM does: none left, no key is
    asked). cors: CORSMiddleware's keyword arguments (allow_origins, allow_methods, ...); None: no CORS headers.
    root_path: the prefix a proxy may leave on the paths (/api/v1/models and /v1/models are then the same route).
    request_id_headers: every response carries X-Request-Id (the request's, else a new one). docs: FastAPI's /docs,
    /redoc and /openapi.json. load_tracking: /load counts the generating requests in flight (vLLM's
    --enable-server-load-tracking). With NANOGRAPH_SERVER_DEV_MODE (or VLLM_SERVER_DEV_MODE) set, vLLM's development
    routes POST /reset_prefix_cache, /sleep, /wake_up and /collective_rpc and GET /is_sleeping are served too. With the engine's profiler_config (--profiler-config), vLLM's
    POST /start_profile and /stop_profile are served."""
    if isinstance(api_keys, str):
        raise TypeError("build_app takes api_keys as a list of keys")
    keys = [key.encode() for key in api_keys or () if key]
    async_llm = served.async_llm

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        async_llm.abort_all()
        await asyncio.to_thread(async_llm.join, SHUTDOWN_SECONDS)

    pages = {} if docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="nanograph", version=__version__, lifespan=lifespan, **pages)
    app.root_path = root_path  # each request's scope gets it: a path with the prefix routes as one without
    add_error_handlers(app)
    if request_id_headers:
        @app.middleware("http")
        async def add_request_id(request: Request, call_next):
            response = await call_next(request)
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            return response

    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)
    load = ServerLoad()
    if load_tracking:
        app.add_middleware(ServerLoad.Counter, load=load)

    def check_api_key(request: Request):
        if not keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip().encode()
        # The scheme's case does not matter (RFC 9110); the key's does. Every key is compared (no early exit).
        matches = [secrets.compare_digest(given, key) for key in keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                "key the server was started with (--api-key)", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=served.path, max_model_len=served.max_model_len)
                               for name in served.names])

    @v1.post("/completions")
    async def completions(request: Request):
        return await create_completion(served, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(served, request)

    @v1.post("/responses")
    async def responses(request: Request):
        return await create_response(served, request)

    @v1.post("/embeddings")
    async def embeddings(request: Request):
        return await create_embedding(served, request)

    app.include_router(v1)

    @app.post("/invocations", dependencies=[Depends(check_api_key)])
    async def invocations(request: Request):
        """SageMaker's one route, as vLLM's: a body with messages is a chat completion (a chat to pool on a pooling
        model), one with a prompt a completion, one with an input an embedding (a classification on a classifier),
        one with text_1 a score, one with a query and documents a rerank."""
        try:
            body = json.loads(await request.body())
        except ValueError:  # not JSON: the chat route's parse says so, as for any route
            return await create_chat_completion(served, request)
        pool = create_classification if served.pooling_task == "classify" else create_embedding
        if isinstance(body, dict) and "messages" in body:
            if served.runner == "pooling":  # a chat to pool
                return await pool(served, request)
            return await create_chat_completion(served, request)
        if isinstance(body, dict) and "prompt" in body:
            return await create_completion(served, request)
        if isinstance(body, dict) and "input" in body:
            return await pool(served, request)
        if isinstance(body, dict) and "text_1" in body:
            return await create_score(served, request)
        if isinstance(body, dict) and "query" in body and "documents" in body:
            return await create_rerank(served, request)
        raise APIError(400, "/invocations takes a chat completion request (with messages), a completion request "
                            "(with a prompt), an embedding request (with an input), a score request (text_1 and "
                            "text_2) or a rerank request (query and documents)", "messages", "invalid_value")

    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health():
        """/ping: SageMaker's health check, as vLLM serves it."""
        if not async_llm.is_running:
            raise APIError(503, "the engine loop is not running" + (f": {async_llm.error}" if async_llm.error else
                                                                     " (the server is shutting down)"),
                           code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def server_load():
        """vLLM's: the generating requests in flight (0 unless the server tracks them)."""
        return {"server_load": load.value}

    if dev_mode():
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            """vLLM's development route: forget the cached prompt prefixes (refused while a request holds KV
            blocks)."""
            if not await async_llm.reset_prefix_cache():
                raise APIError(409, "the prefix cache was not reset: requests are running (their KV blocks are in "
                                    "use); retry once they have finished", code="requests_running")
            return Response(status_code=200)

    if dev_mode():
        @app.post("/sleep")
        async def sleep(request: Request):
            """vLLM's development route (a server started with --enable-sleep-mode): LLM.sleep(level, tags, mode),
            ?level=1 (weights kept in host memory, the default) or 2, ?tags=weights / kv_cache (over the level),
            ?mode=abort (the default: unfinished requests end with "abort") or wait."""
            if not async_llm.info.sleep_mode:
                raise APIError(400, "sleep mode is not enabled: start the server with --enable-sleep-mode",
                               code="sleep_mode_disabled")
            query = request.query_params
            level = query.get("level", "1")
            if level not in ("1", "2"):
                raise APIError(400, f"level must be 1 (weights kept in host memory) or 2 (weights let go), got "
                                    f"{level!r}", "level", "invalid_value")
            try:
                await async_llm.sleep(int(level), query.getlist("tags") or None, query.get("mode", "abort"))
            except ValueError as exc:
                raise APIError(400, str(exc), "mode" if str(exc).startswith("mode") else "tags",
                               "invalid_value") from None
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up(request: Request):
            """vLLM's: LLM.wake_up(tags), ?tags=weights and/or ?tags=kv_cache (none: both)."""
            try:
                await async_llm.wake_up(request.query_params.getlist("tags") or None)
            except ValueError as exc:
                raise APIError(400, str(exc), "tags", "invalid_value") from None
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping():
            return {"is_sleeping": await async_llm.is_sleeping()}

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request):
            """vLLM's: {"method": "reload_weights", "args": [...]} runs LLM.collective_rpc in the engine process;
            the answer is {"results": [...]}, one per worker (one here)."""
            try:
                body = json.loads(await request.body() or b"{}")
            except ValueError:
                body = None
            if not isinstance(body, dict):
                raise APIError(400, 'the body must be a JSON object such as {"method": "reload_weights"}', None,
                               "invalid_json")
            method, args = body.get("method"), body.get("args") or []
            if not isinstance(args, list):
                raise APIError(400, f"args must be a list, got {args!r}", "args", "invalid_value")
            if body.get("kwargs"):
                raise APIError(400, f"kwargs are not passed to the engine process; give {sorted(body['kwargs'])} in "
                                    f"args, by position", "kwargs", "invalid_value")
            try:
                check_rpc_method(method)
            except ValueError as exc:
                raise APIError(400, str(exc), "method", "invalid_value") from None
            try:
                result = await async_llm.call(method, *args)
            except EngineUnavailable:
                raise
            except (TypeError, ValueError) as exc:
                raise APIError(400, f"{method}: {exc}", None, "invalid_value") from None
            except RuntimeError as exc:  # the weights asleep
                raise APIError(409, f"{method}: {exc}", None, "engine_asleep") from None
            return {"results": [result]}

    if async_llm.info.profiler is not None:
        logger.warning("profiler enabled (--profiler-config): POST /start_profile and /stop_profile are served, "
                       "without the API key, for local development only")

        @app.post("/start_profile")
        async def start_profile():
            """vLLM's profiling route, served where --profiler-config configures a profiler."""
            await async_llm.start_profile()
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile():
            """vLLM's: end the profile, its trace written (the answer waits for the file)."""
            await async_llm.stop_profile()
            return Response(status_code=200)

    @app.post("/pooling", dependencies=[Depends(check_api_key)])
    async def pooling(request: Request):
        """vLLM's /pooling: the pooling model's own output."""
        return await create_pooling(served, request)

    @app.post("/classify", dependencies=[Depends(check_api_key)])
    @app.post("/v1/classify", dependencies=[Depends(check_api_key)])
    async def classify(request: Request):
        return await create_classification(served, request)

    @app.post("/score", dependencies=[Depends(check_api_key)])
    @app.post("/v1/score", dependencies=[Depends(check_api_key)])
    async def score(request: Request):
        return await create_score(served, request)

    @app.post("/rerank", dependencies=[Depends(check_api_key)])
    @app.post("/v1/rerank", dependencies=[Depends(check_api_key)])
    @app.post("/v2/rerank", dependencies=[Depends(check_api_key)])
    async def rerank(request: Request):
        """vLLM's rerank routes (Jina's /v1 and Cohere's /v2 shape: the same body)."""
        return await create_rerank(served, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        body = await parse_body(request, TokenizeRequest)
        served.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt (text) or messages (a chat)", "prompt", "invalid_value")
        if body.messages is not None:
            tokens = await served.render_chat(body.messages, body)
        else:
            tokens = await served.tokenized(served.tokenizer.encode, body.prompt,
                                            add_special_tokens=body.add_special_tokens)
        token_strs = served.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=served.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        body = await parse_body(request, DetokenizeRequest)
        served.check_model(body.model)
        vocab_size = async_llm.info.vocab_size
        outside = [token for token in body.tokens if not 0 <= token < vocab_size]
        if outside:
            raise APIError(400, f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})", "tokens",
                           "invalid_value")
        return DetokenizeResponse(prompt=await served.tokenized(served.tokenizer.decode, body.tokens))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(async_llm.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
