"""Load and faults, bounded in count and time: the mixed load of load.py (NANOGRAPH_SERVE_LOAD=requests,concurrency;
60,8 here, 1000,64 for the full version), then vLLM's cancellation test scaled down (NANOGRAPH_SERVE_CANCELS
requests, 20 here, 200 in vLLM's): after each, nothing runs or waits and every KV block is free."""
import asyncio
import os
import time

import openai

from .load import run_load
from .test_metrics import grew, scrape, wait_idle

NUM_REQUESTS, CONCURRENCY = map(int, os.environ.get("NANOGRAPH_SERVE_LOAD", "60,8").split(","))
NUM_CANCELS = int(os.environ.get("NANOGRAPH_SERVE_CANCELS", "20"))


def test_mixed_load_with_disconnects_and_invalid_requests(server, model):
    before = scrape(server)
    report = asyncio.run(run_load(server.base_url, model, NUM_REQUESTS, CONCURRENCY,
                                  time_limit=max(120, NUM_REQUESTS)))
    assert not report.problems, report.problems[:10]
    assert sum(report.outcomes.values()) == NUM_REQUESTS
    assert report.outcomes["rejected"] > 0 and report.outcomes["disconnected"] > 0 and report.outcomes["completed"]
    assert set(report.health) == {200} and report.health[200] > 1
    after = wait_idle(server)
    assert grew(before, after, "request_success_total", "abort") >= report.outcomes["disconnected"]  # n each


def test_cancelled_requests_end_and_a_fresh_request_is_served_at_once(server, model):
    before = wait_idle(server)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            async def cut():
                try:
                    await client.completions.create(model=model, prompt="Tell me a long story:", max_tokens=400,
                                                    extra_body={"min_tokens": 400}, timeout=0.5)
                except openai.APITimeoutError:
                    return True
                return False

            async def fresh():
                start = time.monotonic()
                completion = await client.completions.create(model=model, prompt="Hello", max_tokens=10, timeout=60,
                                                             extra_body={"ignore_eos": True})
                return time.monotonic() - start, completion

            alone, _ = await fresh()  # this machine's time for it, as the bound's unit
            assert all(await asyncio.gather(*(cut() for _ in range(NUM_CANCELS))))
            return alone, *await fresh()

    alone, seconds, completion = asyncio.run(main())
    assert completion.usage.completion_tokens == 10
    # Served at once: about as fast as alone, with room for this machine's noise. The counters below tell whether
    # the cut requests went on.
    assert seconds < 3 * alone + 2, f"{seconds:.2f} s after the cuts, {alone:.2f} s before them"
    after = wait_idle(server, seconds=2)
    assert grew(before, after, "request_success_total", "abort") == NUM_CANCELS
    assert grew(before, after, "generation_tokens_total") < NUM_CANCELS * 400 / 4
