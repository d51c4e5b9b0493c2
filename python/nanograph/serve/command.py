"""`nanograph serve [MODEL]`: the OpenAI-compatible server on uvicorn. It logs where it listens, the model and the KV
cache's capacity, then one stats line per interval; SIGTERM or SIGINT stops accepting, aborts what runs and exits 0.

This module imports nothing of the server until it runs, so that `nanograph --help` works without the serve extra."""
from __future__ import annotations

import argparse
import logging
import os

from ..config import Config

INSTALL_HINT = "pip install 'nanograph[serve]'"


def add_arguments(parser: argparse.ArgumentParser, model_help: str):
    parser.add_argument("model", nargs="?", help=model_help)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the name clients use (default: MODEL as given, or the default "
                        "model's name)")
    parser.add_argument("--api-key", default=os.environ.get("NANOGRAPH_API_KEY"),
                        help="every /v1 route then needs 'Authorization: Bearer KEY' (default: $NANOGRAPH_API_KEY)")
    parser.add_argument("--max-model-len", type=int, help="default: the model's own length, capped by what the KV "
                        "cache holds")
    parser.add_argument("--max-num-seqs", type=int, default=Config.max_num_seqs)
    parser.add_argument("--gpu-memory-utilization", type=float, default=Config.gpu_memory_utilization)
    parser.add_argument("--enforce-eager", action="store_true", help="run decode without CUDA graphs")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=Config.enable_prefix_caching)
    parser.add_argument("--device", default=Config.device, help="auto, cuda, cpu, or torch:<torch device>")
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats lines")


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
    engine = LLMEngine.from_config(Config(
        model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching, device=args.device, seed=args.seed))
    name = args.served_model_name or args.model or MODEL_NAME
    async_llm = AsyncLLM(engine, ServerMetrics(name), args.log_interval)
    app = build_app(ServedModel(async_llm, name), args.api_key)
    runner, config = engine.runner, engine.config
    logger.info("model %s (%s) on %s; max_model_len %d, max_num_seqs %d", name, config.model, runner.device,
                config.max_model_len, config.max_num_seqs)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens", runner.num_kv_blocks, runner.block_size,
                runner.num_kv_blocks * runner.block_size)
    logger.info("listening on http://%s:%d%s", args.host, args.port, " (API key required on /v1)" if args.api_key
                else "")
    server = EngineServer(uvicorn.Config(app, host=args.host, port=args.port, access_log=False,
                                         timeout_graceful_shutdown=SHUTDOWN_SECONDS), async_llm)
    async_llm.start()
    server.run()

