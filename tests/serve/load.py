"""A mixed load with faults against a running server, bounded in count and time: completions and chat, streamed
and not, greedy and seeded, n up to 3, every valid one with ignore_eos so that it must end with exactly max_tokens
per choice; some clients disconnect mid-stream or before their first token, some requests are invalid and must
get their 4xx. /health is polled throughout.

    python -m tests.serve.load --base-url http://127.0.0.1:8000 --requests 1000 --concurrency 64

runs the full version against a server started by hand (loopback only); tests/serve/test_load.py runs a small one."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

PROMPTS = ["The best way to learn a language is", "Once upon a time, in a quiet village,", "Water boils at",
           "Three facts about the moon:", "My favourite recipe starts with"]
INVALID = [  # (body changes, expected status)
    ({"top_p": 0}, 400), ({"temperature": -1}, 400), ({"model": "no-such-model"}, 404), ({"max_tokens": 1.5}, 400),
    ({"max_tokens": 100_000}, 400),  # more than max_model_len with the prompt
]


@dataclass
class Outcome:
    kind: str  # "completed", "disconnected", "rejected"
    problem: str = ""  # what went wrong, if anything
    key: tuple | None = None  # greedy requests: what must give the same text
    text: str = ""


@dataclass
class LoadReport:
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    health: Counter = field(default_factory=Counter)
    seconds: float = 0.0


def _plan(i: int, rng: random.Random, model: str) -> tuple[str, dict, str, int | None]:
    """Request i: its path, body, fault ("", "disconnect", "early", "invalid") and expected error status."""
    chat = rng.random() < 0.5
    prompt = rng.choice(PROMPTS)
    n = rng.choice([1, 1, 2, 3])
    greedy = n == 1 and rng.random() < 0.5
    body = {"model": model, "max_tokens": rng.randint(2, 8), "ignore_eos": True, "stream": rng.random() < 0.5,
            "temperature": 0 if greedy else 0.8, "n": n}
    if not greedy:
        body["seed"] = i
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    roll = rng.random()
    if roll < 0.05:
        changes, status = rng.choice(INVALID)
        body.update(changes)
        return path, body, "invalid", status
    if roll < 0.13 and body["stream"]:  # cut after two chunks: before its last token, as max_tokens is at least 6
        body["max_tokens"] = max(body["max_tokens"], 6)
        return path, body, "disconnect", None
    fault = "early" if roll < 0.15 else ""
    return path, body, fault, None


def _check_choices(chunks_or_response: list[dict], body: dict, chat: bool) -> tuple[str, dict]:
    """The text of choice 0 and a problem found, if any ("" when every choice has its max_tokens)."""
    n, max_tokens = body["n"], body["max_tokens"]
    texts, finishes, usage = {}, {}, None
    for chunk in chunks_or_response:
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            part = (choice["delta"].get("content") or "") if body["stream"] and chat else \
                choice["message"]["content"] if chat else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + part
            if choice["finish_reason"] is not None:
                if choice["index"] in finishes:
                    return "", f"choice {choice['index']} finished twice"
                finishes[choice["index"]] = choice["finish_reason"]
    if sorted(finishes) != list(range(n)) or set(finishes.values()) != {"length"}:
        return "", f"finish reasons {finishes} for n={n}"
    if usage is None or usage["completion_tokens"] != n * max_tokens:
        return "", f"usage {usage} for n={n} x max_tokens={max_tokens}"
    return texts[0], ""


async def _one(http: httpx.AsyncClient, path: str, body: dict, fault: str, status: int | None) -> Outcome:
    chat = "messages" in body
    key = (path, body.get("prompt") or body["messages"][0]["content"], body["max_tokens"]) \
        if body.get("temperature") == 0 and not fault else None
    if fault == "early":  # gone before its first token
        try:
            await http.post(path, json=body, timeout=0.05)
        except httpx.TimeoutException:
            return Outcome("disconnected")
        return Outcome("completed")
    if not body["stream"] or fault == "invalid":
        response = await http.post(path, json=body)
        if status is not None:
            ok = response.status_code == status and set(response.json().get("error", {})) == \
                {"message", "type", "param", "code"}
            return Outcome("rejected", "" if ok else f"expected {status}, got {response.status_code}")
        if response.status_code != 200:
            return Outcome("completed", f"HTTP {response.status_code}: {response.text[:200]}")
        text, problem = _check_choices([response.json()], body, chat)
        return Outcome("completed", problem, key, text)
    chunks = []
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return Outcome("completed", f"HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                break
            chunks.append(json.loads(line.removeprefix("data: ")))
            if fault == "disconnect" and len(chunks) == 2:
                return Outcome("disconnected")  # leaving the block closes the connection mid-stream
    if any("error" in chunk for chunk in chunks):
        return Outcome("completed", f"error event {chunks[-1]}")
    text, problem = _check_choices(chunks, body, chat)
    return Outcome("completed", problem, key, text)


async def run_load(base_url: str, model: str, num_requests: int, concurrency: int, time_limit: float,
                   seed: int = 0) -> LoadReport:
    rng = random.Random(seed)
    plans = [_plan(i, rng, model) for i in range(num_requests)]
    report = LoadReport()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http, \
            httpx.AsyncClient(base_url=base_url, timeout=10) as health:
        async def gated(plan):
            async with gate:
                return await _one(http, *plan)

        async def poll_health():
            while True:
                report.health[(await health.get("/health")).status_code] += 1
                await asyncio.sleep(0.2)

        poller = asyncio.create_task(poll_health())
        try:
            outcomes = await asyncio.wait_for(asyncio.gather(*(gated(plan) for plan in plans)), time_limit)
        finally:
            poller.cancel()
    report.seconds = time.monotonic() - start
    greedy_texts: dict[tuple, set[str]] = {}
    for outcome in outcomes:
        report.outcomes[outcome.kind] += 1
        if outcome.problem:
            report.problems.append(outcome.problem)
        if outcome.key is not None:
            greedy_texts.setdefault(outcome.key, set()).add(outcome.text)
    report.problems += [f"greedy {key} gave different texts: {texts}" for key, texts in greedy_texts.items()
                        if len(texts) > 1]
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="the served model's name (default: the server's)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=1800)
    args = parser.parse_args()
    model = args.model or httpx.get(args.base_url + "/v1/models").json()["data"][0]["id"]
    report = asyncio.run(run_load(args.base_url, model, args.requests, args.concurrency, args.time_limit))
    print(f"{sum(report.outcomes.values())} requests in {report.seconds:.1f} s: {dict(report.outcomes)}; "
          f"/health {dict(report.health)}; {len(report.problems)} problems")
    for problem in report.problems[:20]:
        print("  ", problem)
    raise SystemExit(1 if report.problems or set(report.health) != {200} else 0)


if __name__ == "__main__":
    main()
