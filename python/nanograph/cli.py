"""The `nanograph` command: `nanograph generate "prompt"`, `nanograph chat "message"`, `nanograph serve` (the
OpenAI-compatible server), `nanograph bench latency` (batch-1 decode speed against the roofline and HF
transformers), `nanograph bench throughput` (nano-vllm's 256-request benchmark) and `nanograph bench serve` (a
client timing a running server)."""
from __future__ import annotations

import argparse

from .llm import LLM
from .sampling_params import SamplingParams
from .serve import command as serve_command

MODEL_HELP = "Hugging Face model folder (default: the bundled SmolLM2-135M-Instruct)"


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="nanograph", description="Generate text with nanograph.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("generate", "continue a prompt"),
                            ("chat", "answer one user message, with the model's chat template")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("prompt")
        command.add_argument("--model", help=MODEL_HELP)
        command.add_argument("--max-tokens", type=int, default=256)
        command.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        command.add_argument("--device", default="auto", help="auto, cuda, cpu, or torch:<torch device>")
    serve_command.add_arguments(commands.add_parser("serve", help="run the OpenAI-compatible HTTP server"),
                                MODEL_HELP)
    bench = commands.add_parser("bench", help="measure speed on a GPU, or a running server's")
    bench.add_argument("workload", choices=["latency", "throughput", "serve"])
    bench.add_argument("--model", help=f"latency, throughput: {MODEL_HELP}; serve: the served model's name "
                       "(default: the server's)")
    bench.add_argument("--enforce-eager", action="store_true", help="run decode without CUDA graphs")
    bench.add_argument("--prompt-len", type=int, help="latency, serve: prompt tokens (default 128; serve: 1024, "
                       "random ids)")
    bench.add_argument("--output-len", type=int, help="latency, serve: output tokens (default 256; serve: 128, EOS "
                       "ignored)")
    bench.add_argument("--no-hf", action="store_true", help="latency: skip the HF transformers comparison")
    bench.add_argument("--max-model-len", type=int, help="latency: the engine's max_model_len (default: prompt + "
                       "output + 16; larger values size bigger attention grids, as a server's would)")
    bench.add_argument("--num-seqs", type=int, default=256, help="throughput: requests")
    bench.add_argument("--max-input-len", type=int, default=1024, help="throughput: longest prompt")
    bench.add_argument("--max-output-len", type=int, default=1024, help="throughput: longest output")
    bench.add_argument("--compare", choices=["hf"], help="throughput: also run HF transformers batched generate "
                       "on the first 16 requests and print the ratio")
    bench.add_argument("--base-url", default="http://127.0.0.1:8000", help="serve: the server")
    bench.add_argument("--num-prompts", type=int, default=1000, help="serve: requests")
    bench.add_argument("--request-rate", type=float, default=float("inf"), help="serve: requests per second, "
                       "Poisson arrivals (inf: all at once)")
    bench.add_argument("--max-concurrency", type=int, help="serve: requests in flight at most")
    bench.add_argument("--goodput", nargs="*", metavar="NAME:MS", help="serve: SLOs (ttft, tpot, e2el in ms) "
                       "for the goodput, e.g. ttft:500 tpot:50")
    bench.add_argument("--api-key", help="serve: the server's API key")
    bench.add_argument("--seed", type=int, default=0, help="serve: the prompts' and arrivals' seed")
    bench.add_argument("--result-file", help="serve: write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            serve_command.serve(args)
            return
        if args.command == "bench" and args.workload == "serve":
            try:
                from .bench_serve import bench_serve
            except ImportError as exc:
                raise SystemExit(f"nanograph bench serve needs the {exc.name} package: pip install aiohttp")
            bench_serve(args.base_url, args.model, args.num_prompts, args.prompt_len or 1024, args.output_len or 128,
                        args.request_rate, args.max_concurrency, args.goodput, args.api_key, args.seed,
                        args.result_file)
            return
        if args.command == "bench":
            from . import bench as benchmarks
            if args.workload == "latency":
                benchmarks.latency(args.model, args.prompt_len or 128, args.output_len or 256,
                                   compare_hf=not args.no_hf, max_model_len=args.max_model_len,
                                   enforce_eager=args.enforce_eager)
            else:
                benchmarks.throughput(args.model, args.num_seqs, args.max_input_len, args.max_output_len,
                                      compare_hf=args.compare == "hf", enforce_eager=args.enforce_eager)
            return
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        llm = LLM(args.model, device=args.device)
        if args.command == "chat":
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except (ValueError, OSError, RuntimeError) as exc:
        # What a user can fix (a model folder or file, a device, an argument) is one line, not a traceback.
        parser.error(str(exc))
    print(outputs[0].outputs[0].text)


if __name__ == "__main__":
    main()
