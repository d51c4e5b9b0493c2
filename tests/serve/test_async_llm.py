"""AsyncLLM on the fake model, in process: concurrent streams equal generate's outputs, an abort frees the blocks,
an idle loop sleeps, a failure inside a step ends only its request (a 500 body), and a dead loop makes /health and
new requests 503."""
import asyncio
import time

import httpx

from nanograph import SamplingParams
from nanograph.serve.app import build_app
from nanograph.serve.async_llm import AsyncLLM, EngineUnavailable
from nanograph.serve.metrics import ServerMetrics
from nanograph.serve.serving import ServedModel

from ..engine.fake_model import FakeTokenizer, fake_engine, reference_completion

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]


def started(engine) -> AsyncLLM:
    async_llm = AsyncLLM(engine, ServerMetrics("fake"), log_interval=60)
    async_llm.start()
    return async_llm


async def collect(async_llm, prompts, params):
    token_ids, finishes = {}, {}
    async for deltas in await async_llm.generate(prompts, [params] * len(prompts)):
        for prompt_index, delta in deltas:
            key = (prompt_index, delta.index)
            assert key not in finishes, "nothing after a completion's last delta"
            token_ids[key] = token_ids.get(key, []) + delta.token_ids
            if delta.finished:
                finishes[key] = delta.finish_reason
    return token_ids, finishes


def stop(async_llm):
    async_llm.abort_all()
    async_llm.join(10)
    assert not async_llm.is_running


def test_concurrent_streams_equal_the_reference_and_free_every_block():
    engine = fake_engine(peak=1.0)
    async_llm = started(engine)
    greedy = SamplingParams(temperature=0, max_tokens=9)
    sampled = SamplingParams(n=2, max_tokens=7, seed=4)

    async def main():
        return await asyncio.gather(*(collect(async_llm, [prompt], greedy) for prompt in PROMPTS),
                                    collect(async_llm, PROMPTS, sampled))

    *greedy_results, (sampled_ids, sampled_finishes) = asyncio.run(main())
    for prompt, (token_ids, finishes) in zip(PROMPTS, greedy_results):
        assert token_ids == {(0, 0): reference_completion(prompt, 9)} and finishes == {(0, 0): "length"}
    expected = fake_engine(peak=1.0).generate(PROMPTS, [sampled] * 3, use_tqdm=False)
    assert sampled_ids == {(i, c.index): c.token_ids for i, out in enumerate(expected) for c in out.outputs}
    assert not engine.has_unfinished() and engine.scheduler.block_manager.num_free_blocks == 64
    stop(async_llm)


def test_closing_a_stream_aborts_its_request_and_frees_its_blocks():
    engine = fake_engine()
    async_llm = started(engine)

    async def main():
        stream = await async_llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=50, ignore_eos=True)])
        await anext(stream)
        stream.close()
        deadline = time.monotonic() + 5
        while engine.has_unfinished() or engine.scheduler.block_manager.num_free_blocks != 64:
            assert time.monotonic() < deadline, "the abort did not free the blocks"
            await asyncio.sleep(0.01)
        assert engine.stats.generated_tokens < 50

    asyncio.run(main())
    stop(async_llm)


def test_an_idle_loop_sleeps():
    engine = fake_engine()
    calls = []
    has_unfinished = engine.has_unfinished
    engine.has_unfinished = lambda: calls.append(1) or has_unfinished()
    async_llm = started(engine)
    asyncio.run(collect(async_llm, [PROMPTS[0]], SamplingParams(max_tokens=3)))
    before = len(calls)
    time.sleep(0.5)
    assert len(calls) - before <= 1, "the loop spins while idle"
    stop(async_llm)


def request(app, body: dict) -> httpx.Response:
    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(send())


def test_a_failure_inside_a_step_ends_only_its_request_with_a_500():
    engine = fake_engine()
    sample = engine.runner.sample

    def failing_sample(rows, seqs):
        if any(seq.params.seed == 666 for seq in seqs):
            raise RuntimeError("injected sampling failure")
        return sample(rows, seqs)

    engine.runner.sample = failing_sample
    async_llm = started(engine)
    app = build_app(ServedModel(async_llm, "fake", FakeTokenizer()))

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await asyncio.gather(
                client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 6, "seed": 666}),
                client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}))

    failed, survived = asyncio.run(both())
    assert failed.status_code == 500 and "injected sampling failure" in failed.json()["error"]["message"]
    assert failed.json()["error"]["type"] == "server_error"
    assert survived.status_code == 200
    assert survived.json()["choices"][0]["text"] == "".join(f" {t}" for t in reference_completion(PROMPTS[0], 8))
    assert engine.scheduler.block_manager.num_free_blocks == 64
    stop(async_llm)


def test_a_dead_loop_fails_open_streams_and_answers_503():
    engine = fake_engine()
    async_llm = started(engine)
    app = build_app(ServedModel(async_llm, "fake", FakeTokenizer()))

    async def main():
        stream = await async_llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=40, ignore_eos=True)])
        await anext(stream)
        engine.step = lambda: 1 / 0  # a defect outside any request
        try:
            async for _ in stream:
                pass
        except EngineUnavailable as exc:
            return str(exc)

    assert "ZeroDivisionError" in asyncio.run(main())
    async_llm.join(5)
    assert not async_llm.is_running and isinstance(async_llm.error, ZeroDivisionError)

    async def health():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/health")

    assert asyncio.run(health()).status_code == 503
    response = request(app, {"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503 and "engine loop has died" in response.json()["error"]["message"]
