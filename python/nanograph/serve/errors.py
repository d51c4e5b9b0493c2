"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with the HTTP status, for bad requests (the
body's JSON or schema, the engine's validation), a wrong key, an unknown model or route, and engine failures."""
from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .async_llm import EngineUnavailable
from .protocol import ErrorInfo, ErrorResponse, SamplingRequest

logger = logging.getLogger("nanograph.serve")

ERROR_TYPES = {401: "authentication_error", 500: "server_error", 503: "server_error"}  # else invalid_request_error
CLIENT_CLOSED_REQUEST = 499  # the status of a response nobody reads: the client left first
_UNION_TAGS = {"str", "int", "float", "bool"}  # what pydantic adds to a location inside a union member
# A \uXXXX escape of a high surrogate not followed by a low one, or a low one not after a high one.
_LONE_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status,
                                             "invalid_request_error"), param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def invalid_value(exc: ValueError | TypeError, request: SamplingRequest, renames: dict[str, str] | None = None
                  ) -> APIError:
    """A 400 with the engine's (or SamplingParams') message; param is the request field it starts with. renames:
    an engine field name -> the request's name for it, wherever the message names it (and the grammar's, by the
    field the request gave it in)."""
    message = str(exc)
    for engine_name, field in {**request.grammar_renames(), **(renames or {})}.items():
        message = re.sub(rf"\b{re.escape(engine_name)}\b", field, message)
    word = re.match(r"(?:(?:prompt|input) \d+: )?([a-z_]+)", message)
    param = word.group(1) if word and word.group(1) in type(request).model_fields else None
    return APIError(400, message, param, "invalid_value")


async def parse_body(request: Request, model: type[BaseModel], passed_on: tuple[str, ...] = ()) -> BaseModel:
    """The JSON body as `model`: 400 for a non-JSON Content-Type, malformed JSON, or a body that does not match the
    schema (naming the field, as vLLM's 400 does). Unknown fields are logged, but for those in passed_on (which the
    handler passes on to another request model)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got {content_type or 'none'!r}; send the body "
                            "as JSON", code="unsupported_content_type")
    body = await request.body()
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            lone = _LONE_SURROGATE.search(body.decode("utf-8", "replace")) if _python_json_reads(body) else None
            if lone:  # valid JSON syntax, but its text is not Unicode (pydantic's parser calls it a bad escape)
                raise APIError(400, f"the request body's JSON escapes a lone surrogate ({lone.group(0)}), which is not "
                                    "text; send the character itself in UTF-8, or both halves of its surrogate pair",
                               code="invalid_json")
            raise APIError(400, f"the request body is not valid JSON: {errors[0]['msg']}", code="invalid_json")
        path = ".".join(str(part) for part in errors[0]["loc"]
                        if isinstance(part, int) or (part.isidentifier() and part not in _UNION_TAGS))
        message = errors[0]["msg"].removeprefix("Value error, ")  # a validator's own message, as it is
        raise APIError(400, f"{path or 'the request body'}: {message}", path.split(".")[0] or None,
                       "invalid_type") from None
    unknown = sorted(set(parsed.model_extra or ()) - set(passed_on))
    if unknown:
        logger.warning("ignoring unknown request fields: %s", ", ".join(unknown))
    return parsed


def _python_json_reads(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def add_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    @app.exception_handler(EngineUnavailable)
    async def engine_gone(request: Request, exc: EngineUnavailable):
        """A route's engine call found the engine dead or shutting down."""
        return APIError(503, str(exc), code="engine_unavailable").response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):
        """Gone before its body was read: nothing was queued, and nobody reads the answer."""
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()
