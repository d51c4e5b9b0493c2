"""`nanograph bench serve`: a client that measures a running server (`nanograph serve`, or any OpenAI-compatible
one) on vLLM's `bench serve` random workload: N prompts of random token ids of one input length, each asking for
one output length with EOS ignored, sent all at once (request rate inf) or as a Poisson process, optionally at
most C at a time. Every request streams, so that the client times its first token and the gaps between chunks.
The client is aiohttp, whose connection pool costs little per event with a thousand streams open.

It prints completed and failed requests, request and token throughput, TTFT, TPOT (time per output token after
the first), ITL (the gaps between chunks) and E2EL (end-to-end latency) as mean, median and p99 in ms, and the
goodput for the given SLOs, and writes the same as JSON to --result-file."""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

PROMPT_TOKEN_RANGE = 10000  # token ids are drawn from [0, 10000), inside every supported vocabulary
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def random_workload(num_prompts: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """The prompts: num_prompts lists of input_len random token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_TOKEN_RANGE) for _ in range(input_len)] for _ in range(num_prompts)]


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05}: SLOs given in ms, kept in seconds."""
    slos = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput takes NAME:MS pairs with NAME one of {', '.join(SLO_METRICS)}; got {pair!r}")
        slos[name] = float(value) / 1e3
    return slos


async def _send(session: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    """One streamed request, timed per event. Only the usage chunk and errors are parsed as JSON: the client must
    keep up with a fast server, and an event's arrival is all the timings need."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            pending = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if event.startswith(b'data: {"error"'):
                        result.error = json.loads(event[len(b"data: "):])["error"]["message"]
                        return result
                    if b'"choices":[]' in event:  # the usage chunk
                        result.output_tokens = json.loads(event[len(b"data: "):])["usage"]["completion_tokens"]
                    elif event != b"data: [DONE]":
                        if result.ttft:
                            result.itl.append(now - last)
                        else:
                            result.ttft = now - start
                        last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        result.error = "" if result.ok else "the stream ended without a usage chunk"
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _profile(session: aiohttp.ClientSession, base_url: str, action: str):
    """POST /start_profile or /stop_profile (vLLM's routes, served with --profiler-config)."""
    async with session.post(base_url.rstrip("/") + f"/{action}_profile") as response:
        if response.status == 404:
            raise RuntimeError(f"{base_url} serves no profiler: start the server with --profiler-config (e.g. "
                               "'{\"profiler\": \"torch\", \"torch_profiler_dir\": \"./traces\"}'), or leave out "
                               "--profile")
        if response.status != 200:
            raise RuntimeError(f"POST /{action}_profile answered {response.status}: {await response.text()}")


async def _run(base_url: str, model: str | None, prompts: list[list[int]], output_len: int, request_rate: float,
               max_concurrency: int | None, api_key: str | None, seed: int, profile: bool = False
               ) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    arrivals = random.Random(seed + 1)

    def body(prompt: list[int], max_tokens: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        warm_up = await _send(session, url, body(prompts[0], 2))
        if not warm_up.ok:
            raise RuntimeError(f"the warm-up request to {url} failed: {warm_up.error}")

        async def one(prompt: list[int]) -> RequestResult:
            if gate is None:
                return await _send(session, url, body(prompt, output_len))
            async with gate:
                return await _send(session, url, body(prompt, output_len))

        if profile:
            await _profile(session, base_url, "start")
        try:
            start = time.perf_counter()
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(one(prompt)))
                if request_rate != float("inf"):
                    await asyncio.sleep(arrivals.expovariate(request_rate))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
        finally:
            if profile:  # after the timing (writing the trace takes a while), and whatever ended the run
                await _profile(session, base_url, "stop")
        return results, duration


def _summary(name: str, seconds: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * s for s in seconds) or [0.0]
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"p99_{name}_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))]}


def bench_serve(base_url: str, model: str | None = None, num_prompts: int = 1000, input_len: int = 1024,
                output_len: int = 128, request_rate: float = float("inf"), max_concurrency: int | None = None,
                goodput: list[str] | None = None, api_key: str | None = None, seed: int = 0,
                result_file: str | None = None, profile: bool = False) -> dict:
    """profile: the server's profiler (vLLM's /start_profile and /stop_profile) records the timed requests."""
    slos = parse_goodput(goodput)
    prompts = random_workload(num_prompts, input_len, seed)
    results, duration = asyncio.run(_run(base_url, model, prompts, output_len, request_rate, max_concurrency,
                                         api_key, seed, profile))
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    good = [r for r in done if all(getattr(r, "latency" if name == "e2el" else name) <= limit
                                   for name, limit in slos.items() if name != "tpot" or r.tpot is not None)]
    result = {"base_url": base_url, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
              "request_rate": request_rate, "max_concurrency": max_concurrency, "duration_s": duration,
              "completed": len(done), "failed": len(results) - len(done),
              "errors": sorted({r.error for r in results if not r.ok})[:5],
              "total_input_tokens": input_len * len(done), "total_output_tokens": output_tokens,
              "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
              "total_token_throughput": (input_len * len(done) + output_tokens) / duration,
              **_summary("ttft", [r.ttft for r in done]),
              **_summary("tpot", [r.tpot for r in done if r.tpot is not None]),
              **_summary("itl", [gap for r in done for gap in r.itl]),
              **_summary("e2el", [r.latency for r in done])}
    if slos:
        result.update(goodput_slos_ms={name: limit * 1e3 for name, limit in slos.items()},
                      request_goodput=len(good) / duration)
    _print(result)
    if result_file:
        with open(result_file, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _print(result: dict):
    rate = "inf" if result["request_rate"] == float("inf") else f"{result['request_rate']:g}/s"
    print(f"bench serve: {result['num_prompts']} prompts x {result['input_len']} input, {result['output_len']} "
          f"output tokens; request rate {rate}, max concurrency {result['max_concurrency'] or 'none'}")
    print(f"  completed {result['completed']}, failed {result['failed']}, in {result['duration_s']:.2f} s"
          + (f"; errors: {result['errors']}" if result["errors"] else ""))
    print(f"  request throughput {result['request_throughput']:.2f} req/s, output {result['output_throughput']:.1f} "
          f"tok/s, total {result['total_token_throughput']:.1f} tok/s"
          + (f", goodput {result['request_goodput']:.2f} req/s" if "request_goodput" in result else ""))
    for name in ("ttft", "tpot", "itl", "e2el"):
        print(f"  {name.upper():<5} mean {result[f'mean_{name}_ms']:9.2f} ms   median "
              f"{result[f'median_{name}_ms']:9.2f} ms   p99 {result[f'p99_{name}_ms']:9.2f} ms")
