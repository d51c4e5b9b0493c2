"""`nanograph serve [MODEL]`: the OpenAI-compatible server on uvicorn. It logs where it listens, the model and the KV
cache's capacity, then one stats line per interval; SIGTERM or SIGINT stops accepting, aborts what runs and exits 0.

This module imports nothing of the server until it runs, so that `nanograph --help` works without the serve extra."""
from __future__ import annotations

import argparse
import json
import logging
import os
from functools import partial

from ..cli_options import add_engine_arguments, engine_kwargs
from ..config import Config

INSTALL_HINT = "pip install 'nanograph[serve]'"


def add_arguments(parser: argparse.ArgumentParser):
    add_engine_arguments(parser, model_positional=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the name clients use (default: MODEL as given, or the default "
                        "model's name)")
    parser.add_argument("--api-key", default=os.environ.get("NANOGRAPH_API_KEY"),
                        help="every /v1 route then needs 'Authorization: Bearer KEY' (default: $NANOGRAPH_API_KEY)")
    parser.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats lines")
    # CORS, as vLLM's flags: which web pages a browser lets call the server.
    parser.add_argument("--allowed-origins", type=json_str_list, default=["*"],
                        help='CORS: the origins allowed, a JSON list (default: ["*"])')
    parser.add_argument("--allowed-methods", type=json_str_list, default=["*"],
                        help='CORS: the methods allowed, a JSON list (default: ["*"])')
    parser.add_argument("--allowed-headers", type=json_str_list, default=["*"],
                        help='CORS: the request headers allowed, a JSON list (default: ["*"])')
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let chat requests bring their own chat_template (Jinja run on the server)")


def json_str_list(text: str) -> list[str]:
    """A command-line JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): give a list such as '[\"*\"]'") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings, such as '[\"*\"]'")
    return value


def serve(args: argparse.Namespace):
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise SystemExit(f"nanograph serve needs the {exc.name} package, which is not installed: {INSTALL_HINT}")
    from ..default_model import MODEL_NAME
    from ..engine.llm_engine import LLMEngine
    from .app import SHUTDOWN_SECONDS, build_app
    from .async_llm import AsyncLLM
    from .metrics import ServerMetrics
    from .server import EngineServer
    from .serving import ServedModel

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logger = logging.getLogger("nanograph.serve")
    config = Config(model=args.model, **engine_kwargs(args))
    name = args.served_model_name or args.model or MODEL_NAME
    async_llm = AsyncLLM(partial(LLMEngine.from_config, config), ServerMetrics(name), args.log_interval)
    try:
        info = async_llm.start()
    # A bad folder or engine argument, or a setting this device does not run yet: the message says which.
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        raise SystemExit(f"nanograph serve: {type(exc).__name__}: {exc}")
    cors = {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
            "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}
    served = ServedModel(async_llm, name, trust_request_chat_template=args.trust_request_chat_template)
    app = build_app(served, args.api_key, cors)
    logger.info("model %s (%s) on %s; max_model_len %d, max_num_seqs %d", name, info.model, info.device,
                info.max_model_len, info.max_num_seqs)
    logger.info("KV cache: %s", info.kv_cache)
    logger.info("listening on http://%s:%d%s", args.host, args.port, " (API key required on /v1)" if args.api_key
                else "")
    server = EngineServer(uvicorn.Config(app, host=args.host, port=args.port, access_log=False,
                                         timeout_graceful_shutdown=SHUTDOWN_SECONDS), async_llm)
    server.run()

