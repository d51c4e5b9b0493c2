"""`nanograph serve [MODEL]`: the OpenAI-compatible server on uvicorn. It binds its port first (a port in use fails
before the model loads), logs where it listens, the model and the KV cache's capacity, then one stats line per
interval; SIGTERM or SIGINT stops accepting, aborts what runs and exits 0 (while the engine starts: ends the engine
process and exits 143 or 130). If the engine dies, the server stops and exits 1, unless
NANOGRAPH_KEEP_ALIVE_ON_ENGINE_DEATH (or VLLM_KEEP_ALIVE_ON_ENGINE_DEATH) keeps it answering 503.

This module imports nothing of the server until it runs, so that `nanograph --help` works without the serve extra."""
from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import ssl
import stat
from functools import partial
from pathlib import Path

from ..chat_template import CHAT_OPTIONS, CHAT_RESERVED, CONTENT_FORMATS
from ..cli_options import add_engine_arguments, engine_kwargs
from ..engine_args import engine_config
from ..reasoning import REASONING_PARSERS
from .tool_calls import TOOL_CALL_PARSERS

INSTALL_HINT = "pip install 'nanograph[serve]'"


def add_arguments(parser: argparse.ArgumentParser):
    add_engine_arguments(parser, model_positional=True)
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="the model, as the positional MODEL")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s, this "
                        "machine only; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uds", metavar="PATH", help="listen on this Unix domain socket instead of --host and --port")
    parser.add_argument("--ssl-keyfile", metavar="FILE", help="HTTPS: the server's private key (PEM)")
    parser.add_argument("--ssl-certfile", metavar="FILE", help="HTTPS: the server's certificate chain (PEM)")
    parser.add_argument("--ssl-ca-certs", metavar="FILE", help="HTTPS: the CA certificates that client certificates "
                        "are checked against")
    parser.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[int(mode) for mode in
                        ssl.VerifyMode], help="HTTPS: whether clients must show a certificate: 0 no, 1 optional, "
                        "2 required (Python's ssl.CERT_*; default: %(default)s)")
    parser.add_argument("--enable-ssl-refresh", action="store_true", help="vLLM's certificate reload on change: not "
                        "supported (restart the server after renewing them)")
    parser.add_argument("--served-model-name", nargs="+", help="the names clients may use, the first in responses "
                        "(default: MODEL as given, or the default model's name)")
    parser.add_argument("--api-key", nargs="+", default=env_api_keys(),
                        help="every /v1 route then needs 'Authorization: Bearer KEY', KEY one of those given (an "
                        "empty one is left out) (default: $NANOGRAPH_API_KEY, else $VLLM_API_KEY)")
    parser.add_argument("--chat-template", help="the chat template for requests that bring none: a Jinja file, or "
                        "the template itself (default: the tokenizer's)")
    parser.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                        help="how the chat template sees a message's content: one string, or OpenAI's list of text "
                             "parts (default: auto, as the template reads it)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats lines")
    parser.add_argument("--disable-log-stats", action="store_true", help="no stats lines")
    parser.add_argument("--disable-log-requests", "--enable-log-requests", action="store_true",
                        help="accepted for vLLM's command lines: requests are not logged one by one")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="accepted for vLLM's command lines: uvicorn's access log is off")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name each token \"token_id:{id}\" rather than by its text, unless a request "
                             "says otherwise (its return_tokens_as_token_ids)")
    parser.add_argument("--max-log-len", type=int, help="accepted for vLLM's command lines: requests are not logged")
    parser.add_argument("--enable-log-outputs", action="store_true",
                        help="accepted for vLLM's command lines: outputs are not logged")
    parser.add_argument("--disable-frontend-multiprocessing", action="store_true",
                        help="accepted for vLLM's command lines: the engine always runs in a process of its own")
    parser.add_argument("--enable-server-load-tracking", action="store_true",
                        help="GET /load counts the generating requests in flight (else it reports 0)")
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="every stream ends with a usage chunk, whatever its stream_options say")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage carries prompt_tokens_details.cached_tokens: the prompt tokens found in the "
                             "prefix cache")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="every response carries an X-Request-Id header: the request's own, else a new id")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="no /docs, /redoc or /openapi.json")
    parser.add_argument("--default-chat-template-kwargs", type=json_dict, metavar="JSON",
                        help="the chat template's keywords where a request gives none of its own (its "
                             "chat_template_kwargs win key by key), a JSON object such as '{\"enable_thinking\": "
                             "false}'")
    parser.add_argument("--response-role", default="assistant",
                        help="the role of a chat reply when add_generation_prompt is on (default: %(default)s)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto" (and tools without tool_choice): the reply\'s tool calls are parsed '
                             'by --tool-call-parser')
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, "
                             "Hermes), llama3_json ({\"name\": ..., \"parameters\": {...}}: Llama 3.1-3.3), mistral "
                             "([TOOL_CALLS][{...}]: Mistral), pythonic ([f(a=1), ...]: Llama 3.2 and 4 with a "
                             "pythonic template)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="a chat reply's thinking (<think>...</think>) comes back apart from its answer, in the "
                             "message's reasoning field, and a grammar applies to the answer after it: qwen3 "
                             "(Qwen3), deepseek_r1 (DeepSeek-R1, QwQ)")
    parser.add_argument("--root-path", default="",
                        help="the path prefix a proxy serves the API under (ASGI root_path): each route answers "
                        "with or without it")
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


def env_api_keys() -> list[str] | None:
    key = os.environ.get("NANOGRAPH_API_KEY") or os.environ.get("VLLM_API_KEY")
    return [key] if key else None


def keep_alive_on_engine_death() -> bool:
    """NANOGRAPH_KEEP_ALIVE_ON_ENGINE_DEATH (or vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH) set: the server stays up
    answering 503 after its engine has died, where by default it stops and exits 1 for a supervisor to restart it."""
    value = os.environ.get("NANOGRAPH_KEEP_ALIVE_ON_ENGINE_DEATH") or os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH")
    return (value or "0").strip().lower() not in ("", "0", "false", "no")


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine is built so that a port in use fails at once (uvicorn listens
    on it once the engine is up)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = "choose another --port (or stop what uses it)" if exc.errno == errno.EADDRINUSE else \
            "check --host and --port"
        raise SystemExit(f"nanograph serve: cannot listen on {host}:{port}: {exc.strerror or exc}; {hint}") from None
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """--uds: the server's Unix domain socket, bound and listening before the engine is built (so that another
    server sees it taken; connections wait until the engine is up). A socket file left by a server that is gone is
    replaced; one that a server listens on, or any other file, is an error."""
    try:
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise SystemExit(f"nanograph serve: --uds {path} exists and is not a socket; choose another path")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                if probe.connect_ex(path) == 0:
                    raise SystemExit(f"nanograph serve: a server already listens on --uds {path}; choose another "
                                     "path (or stop that server)")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen()
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        raise SystemExit(f"nanograph serve: cannot listen on --uds {path}: {exc.strerror or exc}") from None
    return sock


def socket_file(path: str) -> tuple[int, int, int]:
    """Which file is at path now: (device, inode, change time in ns); an inode freed may be reused."""
    info = os.lstat(path)
    return info.st_dev, info.st_ino, info.st_ctime_ns


def remove_socket_file(path: str, bound: tuple[int, int, int]):
    """--uds: the socket file goes with the server, unless another has been put in its place (bound: socket_file
    when it was bound)."""
    with contextlib.suppress(OSError):
        if socket_file(path) == bound:
            os.unlink(path)


def ssl_options(args: argparse.Namespace) -> dict:
    """uvicorn's SSL settings for the --ssl-* flags (none: plain HTTP), the files checked before the engine starts:
    a missing or unreadable file, or a key that does not match its certificate, is one error line."""
    if args.enable_ssl_refresh:
        raise SystemExit("nanograph serve: --enable-ssl-refresh is not supported: certificates are read once, at "
                         "start; restart the server after renewing them")
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs != ssl.CERT_NONE:
            raise SystemExit("nanograph serve: --ssl-ca-certs and --ssl-cert-reqs need HTTPS: give --ssl-keyfile and "
                             "--ssl-certfile too")
        return {}
    if args.ssl_certfile is None:
        raise SystemExit("nanograph serve: --ssl-keyfile needs --ssl-certfile (the certificate of that key)")
    if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        raise SystemExit(f"nanograph serve: --ssl-cert-reqs {args.ssl_cert_reqs} checks client certificates, which "
                         "needs --ssl-ca-certs (the CAs that sign them)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.access(path, os.R_OK):
            raise SystemExit(f"nanograph serve: {flag} {path}: no such file, or not readable")
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        key = f" with --ssl-keyfile {args.ssl_keyfile}" if args.ssl_keyfile else " (the key in the same file)"
        raise SystemExit(f"nanograph serve: cannot use --ssl-certfile {args.ssl_certfile}{key}: {exc} (a PEM "
                         "certificate chain and the private key that matches it)") from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise SystemExit(f"nanograph serve: cannot use --ssl-ca-certs {args.ssl_ca_certs}: {exc} (PEM "
                             "certificates)") from None
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs,
            "ssl_cert_reqs": args.ssl_cert_reqs}


class _Terminated(KeyboardInterrupt):
    """SIGTERM while the engine starts: unwinds the start like Ctrl-C, so that the engine process is ended too."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline (vLLM's rule: text that is no file but holds
    Jinja's braces or a newline, its backslash escapes such as \\n decoded)."""
    if value is None:
        return None
    if os.path.isfile(value):
        return Path(value).read_text(encoding="utf-8")
    if not any(char in value for char in "{}\n"):
        raise SystemExit(f"nanograph serve: --chat-template {value!r} is not a file, nor a template (no Jinja "
                         "braces): give the path of a Jinja file or the template's text")
    return codecs.decode(value, "unicode_escape")


def json_str_list(text: str) -> list[str]:
    """A command-line JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): give a list such as '[\"*\"]'") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings, such as '[\"*\"]'")
    return value


def check_default_chat_template_kwargs(kwargs: dict | None):
    """--default-chat-template-kwargs may not set what a request sets in its own fields (add_generation_prompt,
    tools, ...) or what rendering sets itself."""
    taken = [name for name in (*CHAT_OPTIONS, *CHAT_RESERVED) if name in (kwargs or {})]
    if taken:
        raise SystemExit(f"nanograph serve: --default-chat-template-kwargs cannot set {', '.join(taken)}: those are "
                         "each request's own fields, or set by the rendering itself; give the template's own "
                         "keywords (such as enable_thinking)")


def json_dict(text: str) -> dict:
    """A command-line JSON object, e.g. '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): give an object such as '{{\"enable_thinking\": false}}'") \
            from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object, such as '{{\"enable_thinking\": false}}'")
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
    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        raise SystemExit(f"nanograph serve: two models given, {args.model!r} and --model {args.model_option!r}; "
                         "give one")
    model = args.model or args.model_option
    if model is None and args.served_model_name and any(
            "/" in name or os.path.isdir(name) for name in args.served_model_name[1:]):
        raise SystemExit(f"nanograph serve: --served-model-name took {args.served_model_name[1:]} as names too; "
                         "give the model first (nanograph serve MODEL --served-model-name NAME ...) or as --model")
    if model is None and args.api_key and any("/" in key or os.path.isdir(key) for key in args.api_key[1:]):
        raise SystemExit(f"nanograph serve: --api-key took {args.api_key[1:]} as keys too; give the model first "
                         "(nanograph serve MODEL --api-key KEY ...) or as --model")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("nanograph serve: --enable-auto-tool-choice needs --tool-call-parser (one of: "
                         f"{', '.join(TOOL_CALL_PARSERS)})")
    chat_template = read_chat_template(args.chat_template)
    check_default_chat_template_kwargs(args.default_chat_template_kwargs)
    config = engine_config(model, reasoning_parser=args.reasoning_parser, **engine_kwargs(args))
    names = args.served_model_name or [model or MODEL_NAME]
    name = names[0]
    api_keys = [key for key in args.api_key or () if key]
    ssl_settings = ssl_options(args)
    sock = bind_unix_socket(args.uds) if args.uds else bind_socket(args.host, args.port)
    uds_file = socket_file(args.uds) if args.uds else None
    started = False
    async_llm = AsyncLLM(partial(LLMEngine.from_config, config), ServerMetrics(name),
                         None if args.disable_log_stats else args.log_interval)
    # Until uvicorn takes the signals over, SIGTERM unwinds as Ctrl-C does, ending the engine process.
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        info = async_llm.start()
        cors = {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
                "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}
        served = ServedModel(async_llm, names, trust_request_chat_template=args.trust_request_chat_template,
                             chat_template=chat_template, content_format=args.chat_template_content_format,
                             trust_remote_code=config.trust_remote_code,
                             response_role=args.response_role,
                             tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                             prompt_tokens_details=args.enable_prompt_tokens_details,
                             return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                             default_chat_template_kwargs=args.default_chat_template_kwargs,
                             force_include_usage=args.enable_force_include_usage)
        app = build_app(served, api_keys, cors, root_path=args.root_path,
                        request_id_headers=args.enable_request_id_headers, docs=not args.disable_fastapi_docs,
                        load_tracking=args.enable_server_load_tracking)
        server = EngineServer(uvicorn.Config(app, host=args.host, port=args.port, access_log=False,
                                             log_level=args.uvicorn_log_level,
                                             timeout_graceful_shutdown=SHUTDOWN_SECONDS, **ssl_settings), async_llm,
                              stop_on_engine_death=not keep_alive_on_engine_death())
        started = True
    # A bad folder or engine argument, or a setting this device does not run yet: the message says which.
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        async_llm.close()
        raise SystemExit(f"nanograph serve: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt as exc:
        async_llm.close()
        logger.info("stopped while the engine was starting")
        raise SystemExit(128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)) from None
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        if not started and args.uds:
            remove_socket_file(args.uds, uds_file)
    logger.info("model %s (%s) on %s; max_model_len %d, max_num_seqs %d", name, info.model, info.device,
                info.max_model_len, info.max_num_seqs)
    logger.info("KV cache: %s", info.kv_cache)
    if args.uds:
        where = f"unix:{args.uds}"
    else:
        host, port = sock.getsockname()[:2]
        where = f"{'https' if ssl_settings else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"
    logger.info("listening on %s%s", where, " (API key required on /v1)" if api_keys else "")
    try:
        server.run(sockets=[sock])
    finally:
        if args.uds:
            remove_socket_file(args.uds, uds_file)
    if server.engine_died:
        raise SystemExit(1)

