"""AsyncLLM on the fake model, its engine in a process of its own: concurrent streams equal generate's outputs, an
abort frees the blocks, an idle engine process sleeps, a failure inside a step ends only its request (a 500 body),
a dead loop makes /health and new requests 503, and an engine that cannot be built fails start()."""
import asyncio
import os
import threading
import time

import httpx
import pytest

from nanograph import SamplingParams
from nanograph.serve.app import build_app
from nanograph.serve.async_llm import AsyncLLM, EngineUnavailable
from nanograph.serve.metrics import ServerMetrics
from nanograph.serve.serving import ServedModel

from ..engine.fake_model import FakeTokenizer, fake_engine, reference_completion
from . import engines

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
NUM_BLOCKS = 64  # the fake engine's


def started(make_engine) -> AsyncLLM:
    async_llm = AsyncLLM(make_engine, ServerMetrics("fake"), log_interval=60)
    async_llm.start()
    return async_llm


@pytest.fixture(scope="module")
def shared():
    """One engine process for the tests that leave it healthy (starting one costs seconds); its sampling fails for
    requests with engines.FAILING_SEED alone."""
    async_llm = started(engines.failing_sampler)
    yield async_llm
    stop(async_llm)


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


async def drain(stream):
    async for _ in stream:
        pass


def wait_until_idle(async_llm, seconds=5):
    """The engine process reports nothing running or waiting and every KV block free."""
    deadline = time.monotonic() + seconds
    while True:
        snapshot = async_llm.snapshot
        if snapshot is not None and (snapshot.num_running, snapshot.num_waiting, snapshot.num_free_blocks) == \
                (0, 0, NUM_BLOCKS):
            return
        assert time.monotonic() < deadline, f"the engine is not idle: {snapshot}"
        time.sleep(0.01)


def stop(async_llm):
    async_llm.abort_all()
    async_llm.join(10)
    assert not async_llm.is_running and not async_llm._process.is_alive()
    assert async_llm._process.exitcode == 0


def test_concurrent_streams_equal_the_reference_and_free_every_block(shared):
    async_llm = shared
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
    wait_until_idle(async_llm)


def test_closing_a_stream_aborts_its_request_and_frees_its_blocks(shared):
    async_llm = shared
    generated = async_llm.metrics.total_generation_tokens

    async def main():
        stream = await async_llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=50, ignore_eos=True,
                                                                        seed=engines.SLOW_SEED)])
        await anext(stream)
        stream.close()
        # With this event loop still open (a closed one's streams are aborted as the next deltas find it closed).
        await asyncio.to_thread(wait_until_idle, async_llm, 10)

    asyncio.run(main())
    assert async_llm.metrics.total_generation_tokens - generated < 25  # a few steps of 50 ms after the close


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_engine_process_sleeps(shared):
    async_llm = shared
    asyncio.run(collect(async_llm, [PROMPTS[0]], SamplingParams(max_tokens=3)))
    wait_until_idle(async_llm)
    before = cpu_seconds(async_llm._process.pid)
    time.sleep(1.0)
    assert cpu_seconds(async_llm._process.pid) - before < 0.1, "the engine process spins while idle"


def request(app, body: dict) -> httpx.Response:
    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(send())


def test_a_failure_inside_a_step_ends_only_its_request_with_a_500(shared):
    async_llm = shared
    app = build_app(ServedModel(async_llm, "fake", FakeTokenizer()))

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await asyncio.gather(
                client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 6, "seed": engines.FAILING_SEED}),
                client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}))

    failed, survived = asyncio.run(both())
    assert failed.status_code == 500 and "injected sampling failure" in failed.json()["error"]["message"]
    assert failed.json()["error"]["type"] == "server_error"
    assert survived.status_code == 200
    assert survived.json()["choices"][0]["text"] == "".join(f" {t}" for t in reference_completion(PROMPTS[0], 8))
    wait_until_idle(async_llm)


class HoldingTokenizer(FakeTokenizer):
    """Holds the encoding of the text "hold" until released (as a very long prompt would), noting each encoding's
    thread."""

    def __init__(self):
        self.release = threading.Event()
        self.threads = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if text == "hold" and not self.release.wait(20):
            raise TimeoutError("never released")
        return super().encode(text, add_special_tokens)


async def until_encoding(tokenizer: HoldingTokenizer):
    while not tokenizer.threads:
        await asyncio.sleep(0.01)


def test_a_prompt_being_tokenized_holds_up_no_other_request(shared):
    """Text is encoded on the tokenizer's thread, not the event loop's: while one prompt's encoding runs, the
    server answers other requests."""
    tokenizer = HoldingTokenizer()
    app = build_app(ServedModel(shared, "fake", tokenizer))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            held = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hold", "max_tokens": 3,
                                                                            "temperature": 0}))
            try:
                await asyncio.wait_for(until_encoding(tokenizer), 10)
                other = await asyncio.wait_for(client.post("/v1/completions", json={
                    "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}), 10)
                health = await asyncio.wait_for(client.get("/health"), 10)
                assert not held.done()
            finally:
                tokenizer.release.set()
            return other, health, await asyncio.wait_for(held, 10)

    other, health, held = asyncio.run(main())
    assert other.status_code == 200 and health.status_code == 200
    assert other.json()["choices"][0]["text"] == "".join(f" {t}" for t in reference_completion(PROMPTS[0], 4))
    assert held.status_code == 200, held.text
    assert held.json()["choices"][0]["text"] == "".join(f" {t}" for t in
                                                        reference_completion(FakeTokenizer().encode("hold"), 3))
    assert tokenizer.threads == ["tokenizer_0"]
    wait_until_idle(shared)


def test_a_dead_loop_fails_open_streams_and_answers_503(monkeypatch):
    async_llm = started(engines.dying_loop)
    app = build_app(ServedModel(async_llm, "fake", FakeTokenizer()))

    async def main():
        stream = await async_llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=40, ignore_eos=True,
                                                                        seed=engines.DYING_SEED)])
        try:
            async for _ in stream:
                pass
        except EngineUnavailable as exc:
            return str(exc)

    assert "ZeroDivisionError" in asyncio.run(main())
    async_llm.join(5)
    assert not async_llm.is_running and isinstance(async_llm.error, ZeroDivisionError)
    assert not async_llm._process.is_alive()

    async def health():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/health")

    assert asyncio.run(health()).status_code == 503
    response = request(app, {"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503 and "engine loop has died" in response.json()["error"]["message"]
    # A route's own engine call (the development route's here) is a 503 too.
    monkeypatch.setenv("NANOGRAPH_SERVER_DEV_MODE", "1")
    dev_app = build_app(ServedModel(async_llm, "fake", FakeTokenizer()))

    async def reset():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=dev_app), base_url="http://test") as client:
            return await client.post("/reset_prefix_cache")

    response = asyncio.run(reset())
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"

    async def sleep():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=dev_app), base_url="http://test") as client:
            return await client.post("/sleep")

    # An engine built without enable_sleep_mode: /sleep names the server's option.
    response = asyncio.run(sleep())
    assert response.status_code == 400 and "--enable-sleep-mode" in response.json()["error"]["message"]


def test_an_engine_process_that_ends_unasked_makes_the_server_unavailable():
    async_llm = started(engines.failing_sampler)

    async def main():
        stream = await async_llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=60, ignore_eos=True,
                                                                        seed=engines.SLOW_SEED)])
        await anext(stream)
        async_llm._process.kill()
        with pytest.raises(EngineUnavailable, match="engine process exited"):
            await asyncio.wait_for(drain(stream), 10)

    asyncio.run(main())
    async_llm.join(5)
    assert not async_llm.is_running


def test_an_engine_that_cannot_be_built_fails_start_with_its_error():
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        AsyncLLM(engines.unbuildable, ServerMetrics("fake")).start()


def test_an_invalid_prompt_of_several_queues_none_and_names_its_index(shared):
    async_llm = shared
    prompt_tokens = async_llm.metrics.total_prompt_tokens

    async def main():
        with pytest.raises(ValueError, match="prompt 1: "):
            await async_llm.generate([PROMPTS[0], [1] * 65], [SamplingParams(max_tokens=2)] * 2)
        return await collect(async_llm, [PROMPTS[1]], SamplingParams(max_tokens=2, temperature=0))

    token_ids, _ = asyncio.run(main())
    assert token_ids == {(0, 0): reference_completion(PROMPTS[1], 2)}
    wait_until_idle(async_llm)
    assert async_llm.metrics.total_prompt_tokens - prompt_tokens == len(PROMPTS[1])


def test_an_add_that_fails_otherwise_than_by_validation_is_that_requests_error(shared):
    async def main():
        with pytest.raises(RuntimeError, match="injected failure while adding"):
            await shared.generate([PROMPTS[0]], [SamplingParams(max_tokens=2, seed=engines.FAILING_ADD_SEED)])
        return await collect(shared, [PROMPTS[2]], SamplingParams(max_tokens=3, temperature=0))

    token_ids, _ = asyncio.run(main())
    assert token_ids == {(0, 0): reference_completion(PROMPTS[2], 3)} and shared.is_running
    wait_until_idle(shared)


def test_a_defect_in_the_output_reader_fails_streams_and_new_requests_instead_of_hanging():
    async_llm = started(engines.fake)
    record_deltas = async_llm.metrics.record_deltas

    def failing_record(deltas):
        if not deltas:  # a state-only step (the idle engine's first) is not the request's
            return record_deltas(deltas)
        async_llm.metrics.record_deltas = record_deltas
        raise KeyError("injected defect")

    async def main():
        async_llm.metrics.record_deltas = failing_record  # before the request: its first deltas meet the defect
        stream = await async_llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=30, ignore_eos=True)])
        with pytest.raises(EngineUnavailable, match="injected defect"):
            await asyncio.wait_for(drain(stream), 10)
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(async_llm.generate([PROMPTS[1]], [SamplingParams(max_tokens=2)]), 5)

    asyncio.run(main())
    assert not async_llm.is_running
    async_llm.join(10)
    assert not async_llm._process.is_alive()


def test_api_keys_root_path_request_ids_and_docs(shared):
    """vLLM's app options: any of several keys opens /v1 and an empty key asks none; a root path routes with or
    without its prefix; X-Request-Id on every response when asked (the request's own, else a new one); the docs
    pages can be turned off."""
    served = ServedModel(shared, "fake", FakeTokenizer())

    async def get(app, path, headers=None):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get(path, headers=headers or {})

    app = build_app(served, ["first", "", "second"], root_path="/api", request_id_headers=True, docs=False)
    for key, status in [("first", 200), ("second", 200), ("", 401), ("third", 401)]:
        assert asyncio.run(get(app, "/v1/models", {"Authorization": f"Bearer {key}"})).status_code == status, key
    for path in ("/v1/models", "/api/v1/models"):
        response = asyncio.run(get(app, path, {"Authorization": "Bearer second", "X-Request-Id": "abc-1"}))
        assert response.status_code == 200 and response.json()["data"][0]["id"] == "fake", path
        assert response.headers["X-Request-Id"] == "abc-1"
    generated = asyncio.run(get(app, "/health")).headers["X-Request-Id"]
    assert len(generated) == 32 and generated != asyncio.run(get(app, "/health")).headers["X-Request-Id"]
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert asyncio.run(get(app, path)).status_code == 404, path

    open_app = build_app(served, [""])
    response = asyncio.run(get(open_app, "/v1/models"))
    assert response.status_code == 200 and "X-Request-Id" not in response.headers
    assert asyncio.run(get(open_app, "/openapi.json")).status_code == 200
