"""AsyncLLMEngine, vLLM's asynchronous interface, on a tiny random model with a real tokenizer (its engine in a process
of its own, on the CPU): outputs in each output_kind against LLM.generate's, concurrent requests, aborts by id, by
closing the generator and by cancelling its task (each freeing every KV block), bad requests that leave the engine
running, EngineArgs, shutdown, and an engine process killed."""
import asyncio
import os
import signal
import time

import pytest

from nanograph import (LLM, AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineArgs, EngineDeadError, EngineSleeping,
                       LLMEngine, RequestOutputKind, SamplingParams, TokensPrompt)
from nanograph.config import Config

ENGINE_ARGS = dict(device="cpu", max_model_len=1024, max_num_seqs=8)
PROMPTS = ["The capital of France is", "One, two, three,", "Hello"]


@pytest.fixture(scope="module")
def engine(tiny_chat_folder):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_chat_folder), **ENGINE_ARGS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(tiny_chat_folder):
    return LLM(str(tiny_chat_folder), **ENGINE_ARGS)


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 12, "logprobs": 2, **kwargs})


async def outputs_of(engine, prompt, params, request_id) -> list:
    return [output async for output in engine.generate(prompt, params, request_id)]


def run(coroutine):
    return asyncio.run(coroutine)


def wait_until_idle(engine, seconds=10):
    """The engine process reports nothing running or waiting and every KV block free."""
    num_blocks = int(engine.info.cache_config["num_gpu_blocks"])
    deadline = time.monotonic() + seconds
    while True:
        snapshot = engine._async_llm.snapshot
        if snapshot is not None and (snapshot.num_running, snapshot.num_waiting, snapshot.num_free_blocks) == \
                (0, 0, num_blocks):
            return
        assert time.monotonic() < deadline, f"the engine is not idle: {snapshot}"
        time.sleep(0.01)


def assert_same_completion(got, expected, exact=True):
    """exact=False: logprobs within float32 rounding (a batch of other requests computes them in other sums), and
    so ranks within one of near ties (a sampled token deep in the distribution among thousands of close values)."""
    assert (got.index, got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (expected.index, expected.text, expected.token_ids, expected.finish_reason, expected.stop_reason)
    if exact:
        assert got.cumulative_logprob == expected.cumulative_logprob
        assert got.logprobs == expected.logprobs
        return
    assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-3)
    assert (got.logprobs is None) == (expected.logprobs is None)
    for mine, theirs in zip(got.logprobs or [], expected.logprobs or [], strict=True):
        assert list(mine) == list(theirs)
        for token_id, logprob in mine.items():
            assert logprob.decoded_token == theirs[token_id].decoded_token
            assert logprob.logprob == pytest.approx(theirs[token_id].logprob, abs=1e-4)
            assert abs(logprob.rank - theirs[token_id].rank) <= max(1, theirs[token_id].rank // 100)


def test_cumulative_by_default_each_output_holds_everything_so_far(engine, llm):
    assert SamplingParams().output_kind is None  # the interface's own default: vLLM's CUMULATIVE here
    params = sampled()
    [expected] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    outputs = run(outputs_of(engine, PROMPTS[0], params, "cumulative"))
    assert len(outputs) > 2 and outputs[-1].finished and not any(output.finished for output in outputs[:-1])
    final = outputs[-1]
    assert (final.request_id, final.prompt, final.prompt_token_ids) == \
        ("cumulative", PROMPTS[0], expected.prompt_token_ids)
    assert len(final.outputs) == 2
    for got, want in zip(final.outputs, expected.outputs):
        assert_same_completion(got, want)
    for output in outputs:  # every completion begun, each a prefix of its final text and tokens
        for completion in output.outputs:
            want = expected.outputs[completion.index]
            assert want.text.startswith(completion.text)
            assert completion.token_ids == want.token_ids[:len(completion.token_ids)]
            assert completion.logprobs == want.logprobs[:len(completion.token_ids)]
    lengths = [len(output.outputs[0].token_ids) for output in outputs]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    metrics = final.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finished_time


def test_delta_outputs_concatenate_to_the_final_ones(engine, llm):
    params = sampled(output_kind=RequestOutputKind.DELTA)
    [expected] = llm.generate(PROMPTS[1], params, use_tqdm=False)
    outputs = run(outputs_of(engine, PROMPTS[1], params, "delta"))
    assert outputs[-1].finished and not any(output.finished for output in outputs[:-1])
    for want in expected.outputs:
        pieces = [c for output in outputs for c in output.outputs if c.index == want.index]
        assert len(pieces) > 1
        assert "".join(c.text for c in pieces) == want.text
        assert [t for c in pieces for t in c.token_ids] == want.token_ids
        assert [lp for c in pieces for lp in c.logprobs] == want.logprobs
        assert pieces[-1].finish_reason == want.finish_reason
        assert pieces[-1].cumulative_logprob == want.cumulative_logprob  # the total so far, as vLLM's
        assert all(c.finish_reason is None for c in pieces[:-1])


def test_final_only_is_one_output(engine, llm):
    params = sampled(output_kind=RequestOutputKind.FINAL_ONLY)
    [expected] = llm.generate(PROMPTS[2], params, use_tqdm=False)
    [output] = run(outputs_of(engine, PROMPTS[2], params, "final"))
    assert output.finished
    for got, want in zip(output.outputs, expected.outputs, strict=True):
        assert_same_completion(got, want)


def test_concurrent_requests_each_get_their_own_tokens(engine, llm):
    """Four requests at once, greedy and seeded, text and token prompts: each as LLM.generate gives it alone."""
    tokens = llm.get_tokenizer().encode(PROMPTS[2])
    requests = [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20)),
                (TokensPrompt(prompt_token_ids=tokens), sampled(n=3, max_tokens=15)),
                (PROMPTS[1], sampled(max_tokens=25, seed=5, logprobs=None)),
                (tokens, SamplingParams(temperature=0, max_tokens=7, stop=[","]))]

    async def main():
        return await asyncio.gather(*(outputs_of(engine, prompt, params, f"r{i}")
                                      for i, (prompt, params) in enumerate(requests)))

    results = run(main())
    for (prompt, params), outputs in zip(requests, results):
        [expected] = llm.generate(prompt, params, use_tqdm=False)
        final = outputs[-1]
        assert final.prompt_token_ids == expected.prompt_token_ids
        assert final.prompt == (prompt if isinstance(prompt, str) else None)
        if not isinstance(prompt, str):
            assert final.prompt_token_ids == tokens
        for got, want in zip(final.outputs, expected.outputs, strict=True):
            assert_same_completion(got, want, exact=False)
    wait_until_idle(engine)


def long_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=900, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def test_abort_by_id_ends_the_request_and_frees_its_blocks(engine):
    async def main():
        outputs = []
        async for output in engine.generate(PROMPTS[0], long_params(), "to-abort"):
            outputs.append(output)
            if len(outputs) == 1:
                await engine.abort("to-abort")
                await engine.abort(["never-queued"])  # unknown ids are skipped
        return outputs

    outputs = run(main())
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert sum(len(c.token_ids) for output in outputs for c in output.outputs) < 900
    wait_until_idle(engine)


def test_closing_the_generator_or_cancelling_its_task_aborts(engine):
    async def close_early():
        generator = engine.generate(PROMPTS[1], long_params(), "closed")
        await anext(generator)
        await generator.aclose()
        # Within seconds: the 900 tokens left would take far longer on a CPU.
        await asyncio.to_thread(wait_until_idle, engine, 5)

    async def cancel():
        started = asyncio.Event()

        async def read():
            async for _ in engine.generate(PROMPTS[1], long_params(), "cancelled"):
                started.set()

        task = asyncio.create_task(read())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(wait_until_idle, engine, 5)

    run(close_early())
    run(cancel())

    async def abort_while_adding():
        """An abort before generate() has heard that the engine queued its request still ends it."""
        reader = asyncio.create_task(outputs_of(engine, PROMPTS[1], long_params(), "aborted-early"))
        while "aborted-early" not in engine._stream_ids:
            await asyncio.sleep(0)
        assert engine._stream_ids["aborted-early"] == -1
        await engine.abort("aborted-early")
        outputs = await reader
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"

    run(abort_while_adding())
    # The ids are free again.
    assert run(outputs_of(engine, PROMPTS[1], SamplingParams(max_tokens=3), "closed"))[-1].finished


def test_bad_requests_raise_and_leave_the_engine_running(engine, llm):
    async def duplicate():
        first = engine.generate(PROMPTS[0], long_params(), "twice")
        await anext(first)
        try:
            with pytest.raises(ValueError, match="request_id 'twice' is already running"):
                await anext(engine.generate(PROMPTS[0], SamplingParams(max_tokens=2), "twice"))
        finally:
            await first.aclose()

    run(duplicate())
    with pytest.raises(ValueError, match="max_model_len"):
        run(outputs_of(engine, [5] * 1100, SamplingParams(max_tokens=2), "too-long"))
    with pytest.raises(ValueError, match="stop_token_ids holds 100000000, outside the vocabulary"):
        run(outputs_of(engine, PROMPTS[0], SamplingParams(stop_token_ids=[10**8]), "bad-stop"))
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        run(outputs_of(engine, PROMPTS[0], {"max_tokens": 2}, "dict-params"))
    with pytest.raises(ValueError, match="lora"):
        run(anext(engine.generate(PROMPTS[0], SamplingParams(), "lora", lora_request=object())))
    wait_until_idle(engine)
    params = SamplingParams(temperature=0, max_tokens=6)
    [expected] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert_same_completion(run(outputs_of(engine, PROMPTS[0], params, "after"))[-1].outputs[0], expected.outputs[0])
    run(engine.check_health())
    assert engine.is_running and not engine.errored


def test_defaults_tokenizer_and_model_config(engine, llm, tiny_chat_folder):
    assert engine.get_default_sampling_params() == llm.get_default_sampling_params()
    tokenizer = run(engine.get_tokenizer())
    assert tokenizer.encode(PROMPTS[0]) == llm.get_tokenizer().encode(PROMPTS[0])
    config = run(engine.get_model_config())
    assert config.max_model_len == 1024 and config.max_num_seqs == 8 and config.model == str(tiny_chat_folder)
    # No sampling params: the model's defaults, as LLM.generate takes them.
    params = llm.get_default_sampling_params()
    params.seed = 3
    final = run(outputs_of(engine, PROMPTS[2], params, "defaults"))[-1]
    assert final.outputs[0].token_ids == llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].token_ids
    assert AsyncLLM is AsyncLLMEngine


def test_reset_prefix_cache(engine):
    """A prompt's second run finds its blocks in the prefix cache; after a reset, a third finds none. A reset while
    a request holds blocks changes nothing and says so."""
    prompt = list(range(10, 60))
    params = SamplingParams(temperature=0, max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)

    def cached(request_id) -> int:
        return run(outputs_of(engine, prompt, params, request_id))[-1].num_cached_tokens

    cached("warm")
    assert cached("hit") >= 48
    assert run(engine.reset_prefix_cache(device=None)) is True
    assert cached("after-reset") == 0
    with pytest.raises(ValueError, match="reset_running_requests=True is not supported"):
        run(engine.reset_prefix_cache(reset_running_requests=True))

    async def while_running():
        generator = engine.generate(PROMPTS[0], long_params(), "holding")
        await anext(generator)
        try:
            return await engine.reset_prefix_cache()
        finally:
            await generator.aclose()

    assert run(while_running()) is False
    wait_until_idle(engine)


def test_engine_args_check_their_arguments_at_once(tiny_chat_folder):
    args = EngineArgs(model=str(tiny_chat_folder), device="cpu", max_model_len=128)
    assert args.max_model_len == 128 and "max_model_len=128" in repr(args)
    # Defaults where not given.
    assert (args.max_num_seqs, args.swap_space, args.tokenizer_mode) == (Config.max_num_seqs, None, "auto")
    with pytest.raises(AttributeError, match="no argument 'max_modle_len'"):
        args.max_modle_len
    args.max_num_seqs = 4
    assert args.create_engine_config().max_num_seqs == 4
    engine = LLMEngine.from_engine_args(args)
    assert engine.config.max_model_len == 128
    engine.shutdown()
    with pytest.raises(ValueError, match="engine argument 'max_modle_len' is not supported"):
        EngineArgs(model=str(tiny_chat_folder), max_modle_len=128)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported"):
        AsyncEngineArgs(model=str(tiny_chat_folder), pipeline_parallel_size=2)
    quiet = AsyncEngineArgs(model=str(tiny_chat_folder), disable_log_requests=True, enable_log_requests=False)
    assert quiet.disable_log_requests and quiet.create_engine_config().max_model_len is None
    with pytest.raises(ValueError, match="start_engine_loop=False"):
        AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_chat_folder)), start_engine_loop=False)
    with pytest.raises(TypeError, match="engine_args must be an AsyncEngineArgs"):
        AsyncLLMEngine.from_engine_args({"model": str(tiny_chat_folder)})


def test_shutdown_ends_the_engine(tiny_chat_folder):
    engine = AsyncLLMEngine(str(tiny_chat_folder), device="cpu", max_model_len=256)
    assert run(outputs_of(engine, PROMPTS[0], SamplingParams(max_tokens=2), "one"))[-1].finished
    engine.shutdown()
    assert not engine.is_running and engine.is_stopped
    with pytest.raises(EngineDeadError):
        run(engine.check_health())
    with pytest.raises(EngineDeadError):
        run(outputs_of(engine, PROMPTS[0], SamplingParams(max_tokens=2), "two"))


def test_a_killed_engine_process_fails_its_open_requests(tiny_chat_folder):
    engine = AsyncLLMEngine(str(tiny_chat_folder), device="cpu", max_model_len=1024)

    async def main():
        generator = engine.generate(PROMPTS[0], long_params(), "open")
        await anext(generator)
        os.kill(engine._async_llm._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine process exited"):
            async for _ in generator:
                pass

    try:
        run(main())
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            run(outputs_of(engine, PROMPTS[0], SamplingParams(max_tokens=2), "after"))
    finally:
        engine.shutdown()


def test_encode_on_a_pooling_engine(tiny_chat_folder):
    """AsyncLLMEngine.encode(): one PoolingRequestOutput per prompt, the vector LLM.encode() gives; generate() on a
    pooling engine and encode() on a generating one raise the engine's ValueError."""
    import torch

    from nanograph import PoolingParams

    reference = LLM(str(tiny_chat_folder), runner="pooling", **ENGINE_ARGS)
    expected = reference.encode(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
    pooling = AsyncLLMEngine(str(tiny_chat_folder), runner="pooling", **ENGINE_ARGS)
    try:
        async def main():
            async def one(i):
                return [output async for output in pooling.encode(PROMPTS[i], PoolingParams(normalize=False),
                                                                  f"e{i}")]
            got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            with pytest.raises(ValueError, match="embedding model"):
                await outputs_of(pooling, PROMPTS[0], SamplingParams(max_tokens=2), "g")
            return got

        for outputs, want in zip(run(main()), expected):
            [output] = outputs
            assert output.finished and output.error is None and output.prompt_token_ids == want.prompt_token_ids
            torch.testing.assert_close(output.outputs.data, want.outputs.data, atol=1e-5, rtol=0)
        wait_until_idle(pooling)
    finally:
        pooling.shutdown()


def test_encode_on_a_generating_engine_raises(engine):
    async def main():
        return [output async for output in engine.encode(PROMPTS[0], None, "e")]

    with pytest.raises(ValueError, match="runner='pooling'"):
        run(main())
    wait_until_idle(engine)


def test_sleep_wake_up_and_reload_weights_in_the_engine_process(engine, tiny_chat_folder):
    params = SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        run(engine.sleep())
    assert run(engine.is_sleeping()) is False
    sleepy = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_chat_folder), enable_sleep_mode=True,
                                                             **ENGINE_ARGS))
    try:
        expected = run(outputs_of(sleepy, PROMPTS[0], params, "before"))[-1].outputs[0].token_ids
        run(sleepy.sleep(1))
        assert run(sleepy.is_sleeping()) is True
        with pytest.raises(EngineSleeping, match="wake_up"):
            run(outputs_of(sleepy, PROMPTS[0], params, "asleep"))
        run(sleepy.wake_up(["weights"]))
        assert run(sleepy.collective_rpc("reload_weights")) == [None]
        run(sleepy.wake_up())
        assert run(sleepy.is_sleeping()) is False
        assert run(outputs_of(sleepy, PROMPTS[0], params, "after"))[-1].outputs[0].token_ids == expected
        with pytest.raises(ValueError, match="collective_rpc runs 'reload_weights'"):
            run(sleepy.collective_rpc("update_weights"))
    finally:
        sleepy.shutdown()
