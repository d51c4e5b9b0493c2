"""Regression tests for engine defects, on a tiny random Qwen3 model (CPU): a bad request must not corrupt the
others, concurrent generate() calls, repetition_penalty's range, results of requests queued with add_request,
field types of SamplingParams, prompt types, limits on n and logprobs, streams left open, and errors raised at the
boundary (construction or the generate call) naming what is wrong."""
import gc
import json
import math
import re
import threading
import time

import numpy as np
import pytest

from nanograph import LLM, SamplingParams

from .test_api_inputs import save_word_tokenizer
from .tiny_models import make_tiny_model

VOCAB_SIZE = 256  # tiny_models' vocabulary
PROMPT = [5, 17, 33, 2, 5, 17]
OTHER_PROMPTS = ([7, 7, 1], [100, 3, 4, 5, 6], [9], [44, 45, 46, 47])


def free_kv_blocks(llm) -> tuple[int, int]:
    """(free, total) KV blocks of llm's engine. A block whose contents stay in the prefix cache but that no sequence
    references is free: the block manager keeps it in its free list until it is handed out again."""
    block_manager = llm.engine.scheduler.block_manager
    return block_manager.num_free_blocks, len(block_manager.blocks)


def step_outputs(engine) -> list:
    """The RequestOutputs that one engine.step() finished, whether step() returns them alone or with its batch."""
    result = engine.step()
    if isinstance(result, tuple):
        result = result[0]
    return list(result)


def step_until(engine, request_ids, max_steps: int = 300) -> dict:
    """Step the engine until every one of request_ids has come back finished (or max_steps): {request_id: output}."""
    found = {}
    for _ in range(max_steps):
        for output in step_outputs(engine):
            found[output.request_id] = output
        if all(request_id in found for request_id in request_ids):
            break
    return found


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def problem(errors, pattern: str, fn) -> str | None:
    """None when fn() raises one of errors with a message matching pattern; else what it did instead."""
    try:
        fn()
    except errors as exc:
        if re.search(pattern, str(exc)):
            return None
        return f"{type(exc).__name__}({str(exc)[:160]!r}) does not match {pattern!r}"
    except Exception as exc:  # noqa: BLE001 - reported, with its type
        return f"{type(exc).__name__}({str(exc)[:160]!r}) instead of {errors}"
    return "no error"


def assert_no_problems(problems: dict):
    """problems: {case: what went wrong, or None}; fails listing every case that went wrong."""
    wrong = {case: found for case, found in problems.items() if found}
    assert not wrong, "\n".join(f"{case}: {found}" for case, found in wrong.items())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-tied-defects")
    make_tiny_model(path, "qwen3-tied")
    return path


def new_llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), **{"device": "cpu", "max_model_len": 64, "num_kv_blocks": 32, "block_size": 16, **kwargs})


@pytest.fixture(scope="module")
def llm(folder):
    """Shared by the tests that only check validation (nothing is left running)."""
    return new_llm(folder)


def edited_model(tmp_path, **config_changes):
    """A tiny model folder whose config.json was edited after saving."""
    make_tiny_model(tmp_path, "qwen3-tied")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


# 1. A sampling error must not corrupt the other running requests.

def _survivor_after_a_refused_request(folder, refuse):
    """Queue a greedy request, step once, let refuse(llm) raise, then run the survivor and another request to the
    end: both must equal clean runs on a fresh LLM."""
    clean = new_llm(folder)
    expected = token_ids(clean.generate([PROMPT], greedy(24), use_tqdm=False))[0]
    expected_other = token_ids(new_llm(folder).generate([OTHER_PROMPTS[0]], greedy(6), use_tqdm=False))[0]
    llm = new_llm(folder)
    engine = llm.engine
    survivor = engine.add_request(PROMPT, greedy(24))
    engine.step()
    refuse(llm)
    other = engine.add_request(OTHER_PROMPTS[0], greedy(6))
    outputs = step_until(engine, [survivor, other])
    assert survivor in outputs, "the surviving request never finished"
    assert outputs[survivor].finished and outputs[survivor].outputs[0].token_ids == expected
    assert other in outputs and outputs[other].outputs[0].token_ids == expected_other
    assert not engine.has_unfinished() and free_kv_blocks(llm)[0] == free_kv_blocks(llm)[1]


def test_a_sampling_error_leaves_other_running_requests_intact(folder):
    def refuse(llm):
        with pytest.raises(ValueError, match="repetition_penalty"):
            llm.generate([[1, 2, 3]], SamplingParams(top_k=5, repetition_penalty=1e-300), use_tqdm=False)

    _survivor_after_a_refused_request(folder, refuse)


def test_params_made_invalid_after_construction_are_refused_and_leave_other_requests_intact(folder):
    def refuse(llm):
        params = SamplingParams(top_k=5)
        params.repetition_penalty = 1e-300
        with pytest.raises(ValueError, match="repetition_penalty"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)

    _survivor_after_a_refused_request(folder, refuse)


# 2. generate() from two threads on one LLM.

def test_concurrent_generate_calls_from_two_threads_match_sequential_runs(folder):
    prompts = [PROMPT, *OTHER_PROMPTS]
    calls = {k: [prompts[(k + i) % 5:(k + i) % 5 + 3] for i in range(3)] for k in range(2)}
    reference = new_llm(folder)
    expected = {k: [token_ids(reference.generate(p, greedy(8), use_tqdm=False)) for p in calls[k]] for k in calls}

    llm = new_llm(folder)
    results = {k: [] for k in calls}
    errors = []
    start = threading.Barrier(2, timeout=30)

    def work(k):
        try:
            start.wait()
            for p in calls[k]:
                results[k].append(token_ids(llm.generate(p, greedy(8), use_tqdm=False)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if any(thread.is_alive() for thread in threads):
        llm.engine.has_unfinished = lambda: False  # let a runaway generate() loop end
        pytest.fail("a generate() thread did not finish within 60 s")
    if errors:
        raise errors[0]
    assert results == expected


# 3. repetition_penalty's range is [1e-6, 1e6].

def test_repetition_penalty_outside_its_range_is_refused():
    problems = {value: problem(ValueError, "repetition_penalty", lambda: SamplingParams(repetition_penalty=value))
                for value in (1e-39, 1e-300, 0.0, -1, math.inf, math.nan, 1e-7, 1e7)}
    assert_no_problems(problems)
    SamplingParams(repetition_penalty=1e-6)
    SamplingParams(repetition_penalty=1e6)


def test_extreme_accepted_repetition_penalties_emit_in_vocabulary_tokens(folder):
    llm = new_llm(folder)
    prompt = [5, 5, 17, 5, 33, 17, 2, 5]
    for penalty in (1e-6, 1e6):
        params = [SamplingParams(temperature=0, repetition_penalty=penalty, max_tokens=8, ignore_eos=True)]
        params += [SamplingParams(temperature=1.0, repetition_penalty=penalty, max_tokens=8, ignore_eos=True,
                                  seed=seed) for seed in range(4)]
        outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        for ids in token_ids(outputs):
            assert len(ids) == 8 and all(0 <= t < VOCAB_SIZE for t in ids), (penalty, ids)


# 4. generate() must not swallow the results of requests queued before with add_request.

def test_generate_keeps_the_results_of_requests_queued_with_add_request(folder):
    expected = token_ids(new_llm(folder).generate([PROMPT], greedy(24), use_tqdm=False))[0]
    expected_own = token_ids(new_llm(folder).generate([OTHER_PROMPTS[0]], greedy(6), use_tqdm=False))[0]
    llm = new_llm(folder)
    engine = llm.engine
    queued = engine.add_request(PROMPT, greedy(24))
    outputs = llm.generate([OTHER_PROMPTS[0]], greedy(6), use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].request_id != queued
    assert outputs[0].outputs[0].token_ids == expected_own
    found = step_until(engine, [queued], max_steps=100)
    assert queued in found, "step() never returned the request queued before generate()"
    output = found[queued]
    assert output.finished and output.outputs[0].token_ids == expected and len(expected) == 24


# 5. max_tokens and the numeric fields' types.

def test_max_tokens_zero_set_after_construction_is_refused(folder):
    llm = new_llm(folder)
    params = SamplingParams(max_tokens=4)
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5, 7]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


INT_FIELD_CASES = [("max_tokens", 2.5), ("max_tokens", math.nan), ("max_tokens", True), ("n", 2.0), ("top_k", 1.5),
                   ("min_tokens", 1.0), ("logprobs", 1.5), ("seed", 1.5)]
FLOAT_FIELDS = {"temperature": 1, "top_p": 1, "min_p": 1, "presence_penalty": 1, "frequency_penalty": 1,
                "repetition_penalty": 2}  # each with an int value it accepts


def test_integer_fields_refuse_floats_bools_and_nan():
    problems = {f"{name}={value!r}": problem((TypeError, ValueError), rf"\b{name}\b",
                                             lambda: SamplingParams(**{name: value}))
                for name, value in INT_FIELD_CASES}
    assert_no_problems(problems)


def test_float_fields_take_ints_but_refuse_bools_and_nan():
    for name, value in FLOAT_FIELDS.items():
        SamplingParams(**{name: value})
    problems = {f"{name}={value!r}": problem((TypeError, ValueError), rf"\b{name}\b",
                                             lambda: SamplingParams(**{name: value}))
                for name in FLOAT_FIELDS for value in (True, math.nan)}
    assert_no_problems(problems)


def test_fields_set_after_construction_are_checked_by_generate(folder):
    cases = [*INT_FIELD_CASES, *((name, value) for name in FLOAT_FIELDS for value in (True, math.nan))]
    problems = {}
    for name, value in cases:
        llm = new_llm(folder)  # a case that slips through may leave the engine in any state
        params = SamplingParams(max_tokens=4)
        setattr(params, name, value)
        found = problem((TypeError, ValueError), rf"\b{name}\b",
                        lambda: llm.generate([[5, 7]], params, use_tqdm=False))
        problems[f"{name}={value!r}"] = found
    assert_no_problems(problems)


# 6. Prompts of the wrong type.

def test_non_prompt_types_are_refused_naming_their_type(llm):
    cases = [([b"hello"], r"\bbytes\b"), (bytearray(b"hi"), r"\bbytearray\b"), (range(5), r"\brange\b"),
             (b"hi", r"\bbytes\b"), ([[1.5, 2.0]], r"\bfloat"), ([None], r"None"), (None, r"None"),
             (3.5, r"\bfloat")]
    problems = {repr(prompts): problem(TypeError, pattern, lambda: llm.generate(prompts, greedy(4), use_tqdm=False))
                for prompts, pattern in cases}
    assert_no_problems(problems)
    assert not llm.engine.has_unfinished()


def test_numpy_integer_token_ids_are_accepted(llm):
    [expected] = token_ids(llm.generate([[5, 7]], greedy(4), use_tqdm=False))
    cases = {"[[np.int64, np.int64]]": [[np.int64(5), np.int64(7)]],
             "[np.int64, np.int64]": [np.int64(5), np.int64(7)],
             "1-D np.int32 array": np.array([5, 7], dtype=np.int32),
             "[1-D np.int32 array]": [np.array([5, 7], dtype=np.int32)]}
    results = {}
    for name, prompts in cases.items():
        try:
            results[name] = token_ids(llm.generate(prompts, greedy(4), use_tqdm=False))
        except Exception as exc:  # noqa: BLE001 - reported below
            results[name] = f"{type(exc).__name__}: {exc}"
    assert results == {name: [expected] for name in cases}


# 7. Limits on n and logprobs; aborting many completions.

def test_n_is_capped_at_128():
    start = time.perf_counter()
    with pytest.raises(ValueError) as exc_info:
        SamplingParams(n=10 ** 6)
    assert time.perf_counter() - start < 1.0
    assert re.search(r"\bn\b", str(exc_info.value)) and "128" in str(exc_info.value)
    with pytest.raises(ValueError, match="128"):
        SamplingParams(n=129)
    SamplingParams(n=128)


def test_logprobs_are_capped_by_max_logprobs(folder, llm):
    with pytest.raises(ValueError) as exc_info:
        llm.generate([[5, 7]], SamplingParams(logprobs=21, max_tokens=2), use_tqdm=False)
    assert "max_logprobs" in str(exc_info.value) and re.search(r"\b20\b", str(exc_info.value))
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([[5, 7]], SamplingParams(logprobs=-1, max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    [out] = llm.generate([[5, 7]], SamplingParams(logprobs=20, max_tokens=2, seed=0), use_tqdm=False)
    assert all(len(logprobs) in (20, 21) for logprobs in out.outputs[0].logprobs)

    wider = new_llm(folder, max_logprobs=30)
    [out] = wider.generate([[5, 7]], SamplingParams(logprobs=21, max_tokens=3, seed=0), use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 3
    assert all(token in logprobs and len(logprobs) in (21, 22)
               for token, logprobs in zip(completion.token_ids, completion.logprobs))
    with pytest.raises(ValueError, match="max_logprobs"):
        wider.generate([[5, 7]], SamplingParams(logprobs=-1, max_tokens=2), use_tqdm=False)

    unlimited = new_llm(folder, max_logprobs=-1)
    [out] = unlimited.generate([[5, 7]], SamplingParams(logprobs=-1, max_tokens=2, seed=0), use_tqdm=False)
    assert [len(logprobs) for logprobs in out.outputs[0].logprobs] == [VOCAB_SIZE] * 2


def test_aborting_many_n128_requests_is_fast_and_frees_every_block(folder):
    llm = new_llm(folder, num_kv_blocks=512)
    engine = llm.engine
    params = SamplingParams(n=128, temperature=1.0, max_tokens=4)
    request_ids = [engine.add_request([5, 7, 1 + i], params) for i in range(21)]
    for _ in range(3):  # prefill; the first tokens are read and the siblings queued; the siblings run
        engine.step()
    start = time.perf_counter()
    for request_id in reversed(request_ids):
        engine.abort_request(request_id)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"aborting 21 x 128 completions took {elapsed:.2f} s"
    assert not engine.has_unfinished()
    free, total = free_kv_blocks(llm)
    assert free == total



def test_a_request_that_masks_nothing_and_gets_no_finite_logit_fails_as_the_models_fault(folder):
    """A sampled row with no finite logit draws the id past the vocabulary, as a fully masked row does. Only a
    request that masks tokens itself (allowed_token_ids, bad_words, min_tokens, a grammar) is told that its masks
    left none (NoTokenLeftError, which the server answers with a 400); for one that masks nothing the fault is the
    model's (a RuntimeError: a 500)."""
    llm = new_llm(folder)
    engine = llm.engine
    engine.runner.weights["lm_head"].fill_(-math.inf)
    plain = engine.add_request([5, 6, 7], SamplingParams(temperature=1.0, seed=1, max_tokens=3))
    masking = engine.add_request([5, 6, 7], SamplingParams(temperature=1.0, seed=1, max_tokens=3,
                                                           allowed_token_ids=[3, 4]))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    assert outputs[plain].error.startswith("RuntimeError: ") and "masks no token" in outputs[plain].error
    assert outputs[masking].error.startswith("NoTokenLeftError: ")
    assert "every token was masked" in outputs[masking].error
    free, total = free_kv_blocks(llm)
    assert free == total

# 8. A stream left open, or dropped.

def test_generate_aborts_an_open_stream_that_holds_the_engine(folder):
    params = greedy(32)
    p1, p2, p3 = [5, 7, 9], [11, 13, 200, 3, 4], [17, 19]
    expected = token_ids(new_llm(folder).generate([p3], params, use_tqdm=False))
    llm = new_llm(folder)
    stream = llm.stream([p1, p2], params)
    deltas = [next(stream)]
    out = llm.generate([p3], params, use_tqdm=False)
    assert token_ids(out) == expected
    assert not llm.engine.has_unfinished()
    free, total = free_kv_blocks(llm)
    assert free == total
    deltas += list(stream)  # still referenced: iterating it to its end raises nothing
    last = {}
    for delta in deltas:
        last[delta.request_id, delta.index] = delta
    assert len(last) == 2
    assert {key: (delta.finished, delta.finish_reason) for key, delta in last.items()} == \
        {key: (True, "abort") for key in last}


def test_a_dropped_stream_leaves_no_request_and_frees_its_blocks(folder):
    llm = new_llm(folder)
    stream = llm.stream([[5, 7, 9], [11, 13]], greedy(32))
    next(stream)
    del stream
    gc.collect()
    assert not llm.engine.has_unfinished()
    free, total = free_kv_blocks(llm)
    assert free == total



def test_a_closed_stream_never_ends_a_later_request_that_took_its_id(folder):
    """A reader stops iterating once its completion has finished, and the id is free for add_request. Closing (or
    dropping) the stream afterwards ends only what the stream itself queued, not the new request of that id."""
    p1, p2 = [5, 7, 9], [11, 13, 200]
    expected = token_ids(new_llm(folder).generate([p2], greedy(8), use_tqdm=False))
    llm = new_llm(folder)
    engine = llm.engine
    stream = llm.stream([p1], greedy(3))
    for delta in stream:
        if delta.finished:
            break
    reused = engine.add_request(p2, greedy(8), request_id=delta.request_id)
    engine.step()
    stream.close()
    outputs = {}
    for _ in range(50):
        outputs.update((out.request_id, out) for out in engine.step())
        if not engine.has_unfinished():
            break
    assert reused in outputs and outputs[reused].error is None
    assert outputs[reused].outputs[0].finish_reason == "length"
    assert [outputs[reused].outputs[0].token_ids] == expected
    free, total = free_kv_blocks(llm)
    assert free == total

# 9. Errors at the boundary, naming the field or value.

def test_float_and_none_token_prompts_raise_type_errors_naming_the_prompt(llm):
    problems = {repr(prompts): problem(TypeError, rf"(?i)prompt(.|\n)*{pattern}|{pattern}(.|\n)*prompt",
                                       lambda: llm.generate(prompts, greedy(4), use_tqdm=False))
                for prompts, pattern in (([[1.0, 2.0]], r"float|1\.0"), ([None], r"None"))}
    assert_no_problems(problems)


def test_a_surrogate_string_prompt_raises_a_value_error(tmp_path):
    make_tiny_model(tmp_path, "qwen3-tied")
    save_word_tokenizer(tmp_path, eos_token="<end>")
    llm = new_llm(tmp_path)
    with pytest.raises(ValueError, match=r"(?i)utf-?8|surrogate"):
        llm.generate("\ud800abc", greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_stop_and_stop_token_ids_of_the_wrong_type_are_named():
    problems = {"stop=123": problem((TypeError, ValueError), r"\bstop\b", lambda: SamplingParams(stop=123)),
                "stop_token_ids=5": problem((TypeError, ValueError), r"\bstop_token_ids\b",
                                            lambda: SamplingParams(stop_token_ids=5))}
    assert_no_problems(problems)


def test_a_float_max_model_len_is_refused_by_name(folder):
    with pytest.raises((TypeError, ValueError), match="max_model_len"):
        LLM(str(folder), max_model_len=4.5, device="cpu")


def test_an_empty_model_name_is_refused(monkeypatch, tmp_path):
    from nanograph import default_model

    def no_default_model():
        raise RuntimeError("model='' went on to load the default model")

    monkeypatch.setenv("NANOGRAPH_CACHE", str(tmp_path))  # no converted default model there
    monkeypatch.setattr(default_model, "smollm2_gguf_path", no_default_model)
    with pytest.raises(ValueError):
        LLM(model="", device="cpu", max_model_len=64, num_kv_blocks=4)


def test_a_head_count_that_disagrees_with_the_weights_fails_at_construction(tmp_path):
    folder = edited_model(tmp_path, num_attention_heads=8)  # the saved q_proj has 4 heads of 32: [128, 64]
    with pytest.raises(ValueError) as exc_info:
        LLM(str(folder), device="cpu", max_model_len=64, num_kv_blocks=8)
    message = str(exc_info.value)
    assert "proj" in message and "256" in message and ("128" in message or "384" in message), message


def test_a_vocab_size_larger_than_the_embedding_fails_at_construction(tmp_path):
    folder = edited_model(tmp_path, vocab_size=300)  # the saved embedding has 256 rows
    with pytest.raises(ValueError, match=r"(?i)vocab|embed"):
        LLM(str(folder), device="cpu", max_model_len=64, num_kv_blocks=8)


class SentencePieceLikeTokenizer:
    """A tokenizer that raises on an id past its vocabulary, as a slow (SentencePiece) one does ("piece id is out of
    range"), around a real one; everything else is the real tokenizer's."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self):
        return len(self._tokenizer)

    def decode(self, token_ids, **kwargs):
        if any(token_id >= len(self._tokenizer) for token_id in token_ids):
            raise IndexError("piece id is out of range.")
        return self._tokenizer.decode(token_ids, **kwargs)


@pytest.fixture(scope="module")
def worded_folder(tmp_path_factory):
    """The tiny model (256 ids) with a tokenizer of 10: a vocabulary padded far past its tokenizer's."""
    path = tmp_path_factory.mktemp("qwen3-tied-words")
    make_tiny_model(path, "qwen3-tied")
    save_word_tokenizer(path, eos_token="<end>")
    return path


def test_ids_past_the_tokenizer_have_no_text_even_where_the_tokenizer_raises_on_them(worded_folder):
    """Sampled ids past the tokenizer's vocabulary (most of the tiny model's) decode to no text, in the completion
    (with and without stop strings) and in logprobs, with a tokenizer that raises on them as with one that does
    not; the outputs are the same."""
    words = ["w3 w4 w5", "w9 w8"]
    params = [SamplingParams(temperature=1.0, seed=4, max_tokens=12, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=12, stop=["w7"], ignore_eos=True)]
    llm = new_llm(worded_folder)
    fast = llm.generate(words, params, use_tqdm=False)
    assert any(token_id >= 10 for out in fast for token_id in out.outputs[0].token_ids)
    llm.set_tokenizer(SentencePieceLikeTokenizer(llm.get_tokenizer()))
    raising = llm.generate(words, params, use_tqdm=False)
    for ours, theirs in zip(raising, fast):
        assert ours.error is None
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].text == theirs.outputs[0].text
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs
    logprobs = raising[0].outputs[0].logprobs
    assert all(lp.decoded_token == "" for step in logprobs for token_id, lp in step.items() if token_id >= 10)
    assert free_kv_blocks(llm)[0] == free_kv_blocks(llm)[1]


@pytest.mark.parametrize("where", ["completion", "streamed_text", "prompt_logprobs"])
def test_a_request_whose_tokenizer_fails_ends_alone(worded_folder, where):
    """Decoding one request's text starts to fail: mid-decode (its stop strings read the text at every token; it
    streams, and asks for logprobs), where its stream reads the text (no stop strings: only take_deltas decodes
    it), or on its prompt logprobs' tokens. That request ends with the error and the text it had, a stream reports
    the end, and the request decoding beside it gives its tokens of a run alone; no block is lost."""
    llm = new_llm(worded_folder)
    engine = llm.engine
    neighbour = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, stop=["w8"])
    alone = llm.generate(["w3 w4"], neighbour, use_tqdm=False)[0].outputs[0]
    free = free_kv_blocks(llm)[0]
    good = engine.add_request("w3 w4", neighbour)
    if where != "prompt_logprobs":
        reading = dict(stop=["w9"], logprobs=2) if where == "completion" else {}
        doomed = engine.add_request("w5 w6", SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True,
                                                            **reading), stream=True)
        engine.step()
        engine.step()
    else:
        doomed = engine.add_request("w5 w6 w7 w3", SamplingParams(temperature=1.0, max_tokens=10, prompt_logprobs=2))
    [seq] = engine.requests[doomed].seqs
    real_tokenizer = seq.detokenizer.tokenizer

    class FailingTokenizer(SentencePieceLikeTokenizer):
        def decode(self, token_ids, **kwargs):
            raise RuntimeError("tokenizer fault")

    seq.detokenizer.tokenizer = FailingTokenizer(real_tokenizer)
    outputs, deltas = {}, []
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
        deltas += engine.take_deltas()
    assert outputs[good].error is None and outputs[good].outputs[0].token_ids == alone.token_ids
    assert outputs[good].outputs[0].text == alone.text
    failed = outputs[doomed]
    assert failed.error == "RuntimeError: tokenizer fault" and failed.outputs[0].finish_reason == "abort"
    assert real_tokenizer.decode(failed.outputs[0].token_ids).startswith(failed.outputs[0].text)
    if where != "prompt_logprobs":
        assert deltas and deltas[-1].finished and deltas[-1].error == "RuntimeError: tokenizer fault"
        assert "".join(delta.text for delta in deltas) == failed.outputs[0].text
    else:  # it ended on its prompt, before its first token was applied
        assert failed.outputs[0].token_ids == [] and failed.prompt_logprobs == [None]
    assert free_kv_blocks(llm)[0] == free



def test_a_stream_whose_tokenizer_fails_after_its_abort_ends_alone(worded_folder):
    """A streamed request is aborted before its newest tokens were read as text, and its tokenizer then fails on
    them: take_deltas reports its end (with the text it had) and goes on reporting the stream beside it, which
    ends with the text and tokens of a run alone; no block is lost."""
    llm = new_llm(worded_folder)
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    alone = llm.generate(["w3 w4"], params, use_tqdm=False)[0].outputs[0]
    free = free_kv_blocks(llm)[0]
    good = engine.add_request("w3 w4", params, stream=True)
    doomed = engine.add_request("w5 w6", params, stream=True)
    engine.step()
    engine.step()
    [seq] = engine.requests[doomed].seqs

    class FailingTokenizer(SentencePieceLikeTokenizer):
        def decode(self, token_ids, **kwargs):
            raise RuntimeError("tokenizer fault")

    seq.detokenizer.tokenizer = FailingTokenizer(seq.detokenizer.tokenizer)
    engine.abort_request(doomed)
    deltas = []
    for _ in range(50):
        engine.step()
        deltas += engine.take_deltas()
        if not engine.has_unfinished():
            break
    deltas += engine.take_deltas()
    mine = [delta for delta in deltas if delta.request_id == good]
    assert mine[-1].finished and mine[-1].finish_reason == "length"
    assert "".join(delta.text for delta in mine) == alone.text
    assert [token for delta in mine for token in delta.token_ids] == alone.token_ids
    theirs = [delta for delta in deltas if delta.request_id == doomed]
    assert theirs[-1].finished and theirs[-1].finish_reason == "abort"
    assert not engine._streamed and free_kv_blocks(llm)[0] == free

def test_a_sibling_whose_tokenizer_fails_loses_none_of_the_others_stream(worded_folder):
    """An aborted n=2 request whose second completion's tokenizer fails on its unread tokens: the first
    completion's part taken before the failure is still reported (its tokens, its text and its end), not
    dropped with the failed call."""
    llm = new_llm(worded_folder)
    engine = llm.engine
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    free = free_kv_blocks(llm)[0]
    doomed = engine.add_request("w5 w6", params, stream=True)
    for _ in range(4):
        engine.step()
    first, second = engine.requests[doomed].seqs
    tokenizer = first.detokenizer.tokenizer
    assert len(first.completion_token_ids) >= 2 and len(second.completion_token_ids) >= 2

    class FailingTokenizer(SentencePieceLikeTokenizer):
        def decode(self, token_ids, **kwargs):
            raise RuntimeError("tokenizer fault")

    second.detokenizer.tokenizer = FailingTokenizer(second.detokenizer.tokenizer)
    engine.abort_request(doomed)
    deltas = engine.take_deltas()
    for _ in range(5):
        engine.step()
        deltas += engine.take_deltas()
    first_tokens = first.completion_token_ids
    assert first_tokens
    mine = [delta for delta in deltas if delta.request_id == doomed and delta.index == 0]
    assert mine and mine[-1].finished and mine[-1].finish_reason == "abort"
    assert [token for delta in mine for token in delta.token_ids] == first_tokens
    assert "".join(delta.text for delta in mine) == tokenizer.decode(first_tokens)
    theirs = [delta for delta in deltas if delta.request_id == doomed and delta.index == 1]
    assert theirs and theirs[-1].finished
    assert not engine._streamed and free_kv_blocks(llm)[0] == free


def test_a_stream_call_goes_on_past_a_sibling_whose_tokenizer_fails(worded_folder):
    """LLMEngine.stream with an n=2 request whose second completion's tokenizer fails on its unread tokens: the
    call does not raise. That request ends (the error named, every completion's end reported, the first
    completion's tokens all streamed), and the request beside it streams the tokens and text of a run alone."""
    llm = new_llm(worded_folder)
    engine = llm.engine
    good = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    twins = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)
    alone = llm.generate(["w3 w4"], good, use_tqdm=False)[0].outputs[0]
    free = free_kv_blocks(llm)[0]

    class FailingTokenizer(SentencePieceLikeTokenizer):
        def decode(self, token_ids, **kwargs):
            raise RuntimeError("tokenizer fault")

    deltas, doomed = [], None
    for delta in engine.stream(["w3 w4", "w5 w6"], [good, twins]):
        deltas.append(delta)
        if doomed is None and delta.index == 1:
            doomed = engine.requests[delta.request_id]
            first, second = doomed.seqs
            tokenizer = first.detokenizer.tokenizer
            second.detokenizer.tokenizer = FailingTokenizer(second.detokenizer.tokenizer)
    assert doomed is not None
    mine = [delta for delta in deltas if delta.request_id != doomed.request_id]
    assert mine[-1].finished and mine[-1].finish_reason == "length"
    assert "".join(delta.text for delta in mine) == alone.text
    assert [token for delta in mine for token in delta.token_ids] == alone.token_ids
    for index in (0, 1):
        theirs = [delta for delta in deltas if delta.request_id == doomed.request_id and delta.index == index]
        assert theirs[-1].finished and theirs[-1].finish_reason == "abort"
        assert "tokenizer fault" in theirs[-1].error
    first_tokens = first.completion_token_ids
    theirs = [delta for delta in deltas if delta.request_id == doomed.request_id and delta.index == 0]
    assert [token for delta in theirs for token in delta.token_ids] == first_tokens
    assert "".join(delta.text for delta in theirs) == tokenizer.decode(first_tokens)
    assert not doomed._taken and free_kv_blocks(llm)[0] == free


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=5),
                                    dict(temperature=1.0, seed=5, top_k=2, top_p=0.9)], ids=["greedy", "full", "top"])
def test_a_request_that_bad_words_leave_no_token_fails_alone(tiny_chat_folder, params):
    """allowed_token_ids [" the", " cat"] with the four two-word bad_words of them: intake sees a token to draw,
    but after the first either one masks both. That request fails naming the cause (not token 0 emitted in silence,
    nor the batch failed), the request beside it gives its tokens of a run alone, and no block is lost."""
    llm = LLM(str(tiny_chat_folder), device="cpu", max_model_len=64, num_kv_blocks=16, block_size=16)
    engine, the, cat = llm.engine, 260, 2644
    assert [llm.get_tokenizer().encode(word, add_special_tokens=False) for word in (" the", " cat")] == [[the], [cat]]
    free = engine.scheduler.block_manager.num_free_blocks
    good = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, logprobs=1)
    bad = SamplingParams(max_tokens=6, allowed_token_ids=[the, cat], logprobs=1,
                         bad_words=["the the", "the cat", "cat the", "cat cat"], **params)
    alone = llm.generate([[5, 6, 7]], good, use_tqdm=False)[0].outputs[0]
    good_id, bad_id = engine.add_request([5, 6, 7], good), engine.add_request([8, 9], bad)
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    assert outputs[good_id].error is None and outputs[good_id].outputs[0].token_ids == alone.token_ids
    failed = outputs[bad_id]
    assert failed.outputs[0].token_ids in ([the], [cat]) and failed.outputs[0].finish_reason == "abort"
    assert "every token was masked" in failed.error
    assert engine.scheduler.block_manager.num_free_blocks == free
