"""The `nanograph` command: `nanograph chat` (a conversation on stdin, or one message), `nanograph generate "prompt"`,
`nanograph serve` (the OpenAI-compatible server), `nanograph bench latency` (batch-1 decode speed against the
roofline and HF transformers), `nanograph bench throughput` (nano-vllm's 256-request benchmark), `nanograph bench
sweep` (decode step time over batch sizes and context lengths beside the roofline, as JSON), `nanograph bench plot`
(a sweep's JSON as a PNG) and `nanograph bench serve` (a client timing a running server). Chat and generate stream
their text as it comes."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import __version__
from .cli_options import (MODEL_HELP, add_engine_arguments, add_sampling_arguments, engine_kwargs,
                          sampling_params)
from .cli_stream import END_COMMANDS, chat, flushing_writer, read_lines, stream_text
from .bench_sweep import DEFAULT_BATCH_SIZES, DEFAULT_CONTEXT_LENS, sizes, sweep
from .config import Config
from .llm import LLM
from .serve import command as serve_command

CHAT_HELP = ("with a MESSAGE, answer it; without one, read messages from stdin, one a line, and answer each in "
             "turn with the whole conversation in view, until end of input (Ctrl-D), an empty line or /exit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanograph", description="Generate text with nanograph.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    chat_command = commands.add_parser("chat", help="talk with the model through its chat template",
                                       description=f"Chat with the model: {CHAT_HELP}.")
    chat_command.add_argument("prompt", nargs="?", metavar="MESSAGE", help=CHAT_HELP)
    chat_command.add_argument("--system-prompt", help="the conversation's system message (default: the chat "
                              "template's own, if any)")
    generate_command = commands.add_parser("generate", help="continue a prompt")
    generate_command.add_argument("prompt")
    for command in (chat_command, generate_command):
        add_engine_arguments(command)
        add_sampling_arguments(command)
    serve_command.add_arguments(commands.add_parser("serve", help="run the OpenAI-compatible HTTP server"))
    add_bench_arguments(commands.add_parser("bench", help="measure speed on a GPU (or a running server's), or plot "
                                            "a sweep"))
    for command in commands.choices.values():
        command.add_argument("--config", metavar="FILE", help="a YAML file of options (vLLM's): each key an option's "
                             "name (max-model-len or max_model_len), each value its value (true for a flag, a list "
                             "for several values); options given on the command line win")
    parser.command_parsers = commands.choices
    return parser


def add_bench_arguments(bench: argparse.ArgumentParser):
    bench.add_argument("workload", choices=["latency", "throughput", "sweep", "plot", "serve"])
    bench.add_argument("sweep_json", nargs="?", metavar="SWEEP_JSON", help="plot: the JSON that bench sweep wrote")
    add_engine_arguments(bench, model_help=f"latency, throughput, sweep: {MODEL_HELP}; serve: the served model's name "
                         "(default: the server's)", defaults={
                             "device": "cuda",
                             "max_num_seqs": f"{Config.max_num_seqs}; latency: 1; sweep: the largest batch size",
                             "max_model_len": "latency: prompt + output + 16; throughput: max input + output; sweep: "
                                              "the longest context",
                             "seed": "0; serve: the seed of the prompts and their arrivals"})
    bench.add_argument("--prompt-len", type=_positive_int, help="latency, serve: prompt tokens (default 128; serve: 1024, "
                       "random ids)")
    bench.add_argument("--output-len", type=_positive_int, help="latency, serve: output tokens (default 256; serve: 128, EOS "
                       "ignored)")
    bench.add_argument("--no-hf", action="store_true", help="latency: skip the HF transformers comparison")
    bench.add_argument("--num-seqs", type=_positive_int, default=256, help="throughput: requests")
    bench.add_argument("--max-input-len", type=_positive_int, default=1024, help="throughput: longest prompt")
    bench.add_argument("--max-output-len", type=_positive_int, default=1024, help="throughput: longest output")
    bench.add_argument("--compare", choices=["hf"], help="throughput: also run HF transformers batched generate "
                       "on the first 16 requests and print the ratio")
    bench.add_argument("--batch-sizes", type=_size_list, default=DEFAULT_BATCH_SIZES, metavar="B,B,...",
                       help=f"sweep: sequences per decode step (default {','.join(map(str, DEFAULT_BATCH_SIZES))})")
    bench.add_argument("--context-lens", type=_size_list, default=DEFAULT_CONTEXT_LENS, metavar="C,C,...",
                       help="sweep: tokens each sequence attends (default "
                            f"{','.join(map(str, DEFAULT_CONTEXT_LENS))})")
    bench.add_argument("--steps", type=int, default=100, help="sweep: decode steps timed per point")
    bench.add_argument("--output", help="sweep: write the JSON here (default sweep.json); plot: the PNG (default: "
                       "the JSON's name with .png)")
    bench.add_argument("--plot", metavar="PNG", help="sweep: also draw the result here (needs matplotlib)")
    bench.add_argument("--base-url", default="http://127.0.0.1:8000", help="serve: the server")
    bench.add_argument("--num-prompts", type=_positive_int, default=1000, help="serve: requests")
    bench.add_argument("--request-rate", type=float, default=float("inf"), help="serve: requests per second, "
                       "Poisson arrivals (inf: all at once)")
    bench.add_argument("--max-concurrency", type=_positive_int, help="serve: requests in flight at most")
    bench.add_argument("--goodput", nargs="*", metavar="NAME:MS", help="serve: SLOs (ttft, tpot, e2el in ms) "
                       "for the goodput, e.g. ttft:500 tpot:50")
    bench.add_argument("--api-key", help="serve: the server's API key")
    bench.add_argument("--result-file", help="serve: write the results as JSON here")
    bench.add_argument("--profile", action="store_true", help="serve: the server's profiler records the timed "
                       "requests (POST /start_profile and /stop_profile; the server needs --profiler-config)")


def _positive_int(text: str) -> int:
    """A count of at least 1; argparse names the option in front of the error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _size_list(text: str) -> list[int]:
    """`1,2,4` -> [1, 2, 4]; argparse names the option in front of the error."""
    try:
        return sizes("sizes", [int(part) for part in text.split(",")])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers, such as "
                                         "1,2,4") from None


def bench(args: argparse.Namespace):
    if args.workload == "plot" and args.sweep_json is None:
        raise ValueError("bench plot needs the JSON that bench sweep wrote: nanograph bench plot sweep.json")
    if args.workload != "plot" and args.sweep_json is not None:
        raise ValueError(f"only bench plot takes a file (SWEEP_JSON); got {args.sweep_json!r} for bench "
                         f"{args.workload}")
    if args.workload in ("sweep", "plot"):
        sweep_or_plot(args)
        return
    if args.workload == "serve":
        try:
            from .bench_serve import bench_serve
        except ImportError as exc:
            raise SystemExit(f"nanograph bench serve needs the {exc.name} package: pip install aiohttp")
        bench_serve(args.base_url, args.model, args.num_prompts, args.prompt_len or 1024, args.output_len or 128,
                    args.request_rate, args.max_concurrency, args.goodput, args.api_key, getattr(args, "seed", 0),
                    args.result_file, args.profile)
        return
    from . import bench as benchmarks
    if args.workload == "latency":
        benchmarks.latency(args.model, args.prompt_len or 128, args.output_len or 256, compare_hf=not args.no_hf,
                           **engine_kwargs(args))
    else:
        benchmarks.throughput(args.model, args.num_seqs, args.max_input_len, args.max_output_len,
                              compare_hf=args.compare == "hf", **engine_kwargs(args))


def sweep_or_plot(args: argparse.Namespace):
    from .bench_plot import plot_file, plot_sweep, require_matplotlib
    try:
        if args.workload == "plot":
            output = args.output or str(Path(args.sweep_json).with_suffix(".png"))
            plot_file(args.sweep_json, output)
            print(f"wrote {output}", flush=True)
            return
        if args.plot:
            require_matplotlib()  # before the sweep, not after it
    except ImportError as exc:
        raise SystemExit(f"nanograph: error: {exc}") from None
    result = sweep(args.model, args.batch_sizes, args.context_lens, args.output or "sweep.json", args.steps,
                   **engine_kwargs(args))
    if args.plot:
        plot_sweep(result, args.plot)
        print(f"wrote {args.plot}", flush=True)


def generate_or_chat(args: argparse.Namespace):
    sampling_params(args)  # the options' values are checked before the model loads
    if args.command == "chat" and args.prompt is not None and args.prompt.strip() in END_COMMANDS:
        raise ValueError(f"the message {args.prompt!r} is empty (or ends a chat): give the message to answer, or "
                         "leave it out to chat on stdin")
    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args, llm.engine.sampling_defaults)
    if llm.tokenizer is None:
        needs = "a tokenizer for its text prompt" if args.command == "generate" else "a tokenizer"
        raise ValueError(f"{args.command} needs {needs}, and the model folder has none: add its tokenizer files to "
                         "the folder, or name a folder that holds them with --tokenizer")
    write = flushing_writer(sys.stdout)
    try:
        if args.command == "generate":
            stream_text(llm, args.prompt, params, write)
            write("\n")
        else:
            messages = [args.prompt] if args.prompt is not None else read_lines(sys.stdin, sys.stdout)
            chat(llm, params, messages, write, args.system_prompt)
    except BrokenPipeError:
        # The reader went away (`nanograph generate ... | head`): stop as a Unix tool does, without an error line.
        # Python's own flush of stdout at exit would fail again, so stdout becomes /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def dashed_options(argv: list[str]) -> list[str]:
    """Options spelled with underscores (--max_model_len 4096, --max_model_len=4096) as their dashed names, as vLLM's
    command line takes them; nothing after a bare "--" changes."""
    out = []
    for index, arg in enumerate(argv):
        if arg == "--":
            return out + argv[index:]
        if arg.startswith("--"):
            name, equals, value = arg.partition("=")
            arg = "--" + name[2:].replace("_", "-") + equals + value
        out.append(arg)
    return out


def config_file_options(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's `--config FILE` after the command: a YAML mapping of the command's option names (dashes or
    underscores) to values, taken as the command's defaults, so that the options on the command line win wherever
    they stand. Returns argv without the --config. A flag's value is true or false (false: its --no- form, where it
    has one), a list gives an option of several values its values (or a JSON-valued option its JSON), a mapping a
    JSON-valued option (hf-overrides, ...) its JSON."""
    end = argv.index("--") if "--" in argv else len(argv)
    cut = next((i + 1 for i, arg in enumerate(argv[:end]) if arg in parser.command_parsers), None)
    if cut is None:
        return argv
    command = argv[cut - 1]
    at = [i for i in range(cut, end) if argv[i] == "--config" or argv[i].startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        parser.error("--config is given twice: give one YAML file")
    at = at[0]
    path, rest = (argv[at + 1] if at + 1 < end else None, argv[at + 2:]) if argv[at] == "--config" else \
        (argv[at].partition("=")[2], argv[at + 1:])
    if not path:
        parser.error("--config needs a YAML file")
    subparser = parser.command_parsers[command]
    subparser.set_defaults(**_config_file_values(path, command, subparser, parser.error))
    return [*argv[:at], *rest]


def _config_file_values(path: str, command: str, subparser: argparse.ArgumentParser, error) -> dict:
    """The file's values by the options' destinations, as the command line would parse them."""
    import yaml  # the command line's own dependency, read only for a --config

    try:
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        error(f"--config {path}: {exc}")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        error(f"--config {path}: the file holds a {type(values).__name__}, not a mapping of option names to values "
              "(such as 'max-model-len: 4096')")
    options = {option: action for action in subparser._actions for option in action.option_strings}
    # serve's MODEL: the file's model is the positional's default, so that a MODEL given on the command line wins.
    positional_model = any(action.dest == "model" and not action.option_strings for action in subparser._actions)
    parsed = {}
    for key, value in values.items():
        name = "--" + str(key).replace("_", "-")
        if name == "--model" and positional_model and isinstance(value, str):
            parsed["model"] = value
            continue
        action = options.get(name)
        if action is None or name in ("--config", "--help"):
            error(f"--config {path}: {key!r} is not an option of `nanograph {command}`")
        if value is None:
            continue
        where = f"--config {path}: {key}"
        if action.nargs == 0:  # a flag
            if not isinstance(value, bool):
                error(f"{where}: a flag takes true or false, not {value!r}")
            if value or isinstance(action, argparse.BooleanOptionalAction):
                parsed[action.dest] = value
        elif action.nargs in ("+", "*"):
            parsed[action.dest] = [_converted(action, item, where, error)
                                   for item in (value if isinstance(value, list) else [value])]
        else:
            parsed[action.dest] = _converted(action, value, where, error)
    return parsed


def _converted(action: argparse.Action, value, where: str, error):
    """One YAML value through the option's type, as its text on the command line would go (lists and mappings as
    JSON), checked against its choices."""
    text = json.dumps(value) if isinstance(value, (dict, list)) else \
        ("true" if value else "false") if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        error(f"{where}: {exc or f'invalid value {value!r}'}")
    if action.choices is not None and converted not in action.choices:
        error(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line as vLLM's takes it: options with underscores, and a --config file (which becomes the
    command's defaults in parser)."""
    args = parser.parse_args(config_file_options(dashed_options(argv), parser))
    if getattr(args, "config", None) is not None:  # an abbreviation of --config, which argparse took as such
        parser.error("spell the option out as --config FILE")
    return args


def main(argv: list[str] | None = None):
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "serve":
            serve_command.serve(args)
        elif args.command == "bench":
            bench(args)
        else:
            generate_or_chat(args)
    except (ValueError, OSError, RuntimeError) as exc:
        # What a user can fix (a model folder or file, a device, an argument) is one line, not a traceback.
        parser.error(str(exc))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
