"""The request API on the fake model: stop strings and stop reasons, min/max tokens, n completions sharing the
prompt's blocks, seeds across batch compositions, logprobs, metrics, and streaming."""
import time
from collections import defaultdict

import pytest

from nanograph import SamplingParams

from .fake_model import EOS, fake_engine, reference_completion

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def text_of(token_ids) -> str:
    return "".join(f" {t}" for t in token_ids)


def run(engine, prompts, params) -> list:
    return engine.generate(prompts, [params] * len(prompts) if not isinstance(params, list) else params,
                           use_tqdm=False)


def test_a_stop_string_spanning_tokens_ends_the_text_before_it():
    reference = reference_completion(PROMPT, 12)
    full_text = text_of(reference)
    stop = f"{str(reference[3])[-1]} {reference[4]}"  # the end of token 3's text and the start of token 4's
    cut = full_text.find(stop)
    assert cut >= len(text_of(reference[:3]))
    [out] = run(fake_engine(), [PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=["zz", stop]))
    completion = out.outputs[0]
    assert completion.text == full_text[:cut]
    assert completion.token_ids == reference[:5]  # generation stops at the token that completed the stop string
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    [out] = run(fake_engine(), [PROMPT], SamplingParams(temperature=0, max_tokens=12, stop=stop,
                                                        include_stop_str_in_output=True))
    assert out.outputs[0].text == full_text[:cut + len(stop)]


def test_stop_strings_wait_for_min_tokens():
    reference = reference_completion(PROMPT, 12)
    stop = text_of(reference[1:2])
    assert text_of(reference).find(stop) == len(text_of(reference[:1]))
    params = SamplingParams(temperature=0, max_tokens=12, stop=stop)
    assert run(fake_engine(), [PROMPT], params)[0].outputs[0].token_ids == reference[:2]
    params.min_tokens = 6
    assert len(run(fake_engine(), [PROMPT], params)[0].outputs[0].token_ids) > 6


def test_stop_token_ids_and_eos_report_their_stop_reason():
    reference = reference_completion(PROMPT, 10)
    [out] = run(fake_engine(), [PROMPT], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[reference[4]]))
    completion = out.outputs[0]
    end = reference.index(reference[4]) + 1
    assert completion.token_ids == reference[:end] and completion.stop_reason == reference[4]
    assert completion.text == text_of(reference[:end - 1])  # the stop token's text is left out
    [out] = run(fake_engine(eos_token_ids=[reference[2]]), [PROMPT], SamplingParams(temperature=0, max_tokens=10))
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)
    # The model's other EOS tokens (generation_config.json's, beside the tokenizer's) report their id, as vLLM
    # makes them stop_token_ids.
    [out] = run(fake_engine(eos_token_ids=[EOS, reference[2]]), [PROMPT], SamplingParams(temperature=0, max_tokens=10))
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", reference[2])
    assert out.outputs[0].token_ids == reference[:3]
    [out] = run(fake_engine(), [PROMPT], SamplingParams(temperature=0, max_tokens=10))
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("length", None)


def test_min_tokens_holds_off_eos():
    reference = reference_completion(PROMPT, 10)
    eos = reference[1]
    [out] = run(fake_engine(eos_token_ids=[eos]), [PROMPT], SamplingParams(temperature=0, max_tokens=10, min_tokens=4))
    token_ids = out.outputs[0].token_ids
    assert len(token_ids) >= 4 and eos not in token_ids[:4]
    [out] = run(fake_engine(eos_token_ids=[eos]), [PROMPT], SamplingParams(temperature=0, max_tokens=10))
    assert out.outputs[0].token_ids == reference[:2]


def test_max_tokens_none_runs_to_max_model_len():
    [out] = run(fake_engine(max_model_len=24), [PROMPT], SamplingParams(temperature=0, max_tokens=None))
    assert out.outputs[0].token_ids == reference_completion(PROMPT, 14) and out.outputs[0].finish_reason == "length"


def test_n_completions_are_distinct_and_share_the_prompt_blocks():
    engine = fake_engine(peak=1.0)  # blocks of 4: the 10-token prompt has 2 full blocks that can be shared
    request_id = engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=8, seed=0))
    seqs = engine.requests[request_id].seqs
    for _ in range(3):  # prefill; the first token is read (the siblings join) while the next is fed; siblings run
        engine.step()
    assert len({tuple(seq.block_table[:2]) for seq in seqs}) == 1
    shared = engine.scheduler.block_manager.blocks[seqs[0].block_table[0]]
    assert shared.ref_count == 4
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    [out] = finished
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert out.num_cached_tokens == 8  # every completion after the first found both blocks cached (at most the prompt)
    again = run(fake_engine(peak=1.0), [PROMPT], SamplingParams(n=4, max_tokens=8, seed=0))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_a_seeded_request_gives_the_same_tokens_whatever_else_is_in_the_batch():
    params = SamplingParams(max_tokens=12, seed=42)
    [alone] = run(fake_engine(peak=1.0, seed=1), [PROMPT], params)
    crowd = run(fake_engine(peak=1.0, seed=2), [[7, 7, 7], PROMPT[:4], PROMPT, [2] * 9],
                [SamplingParams(max_tokens=5), SamplingParams(max_tokens=20), params, SamplingParams(max_tokens=3)])
    assert crowd[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert alone.outputs[0].token_ids != reference_completion(PROMPT, 12)  # really sampled
    [other] = run(fake_engine(peak=1.0, seed=1), [PROMPT], SamplingParams(max_tokens=12, seed=43))
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_logprobs_and_cumulative_logprob():
    [out] = run(fake_engine(peak=1.0), [PROMPT], SamplingParams(max_tokens=6, logprobs=2, seed=0))
    completion = out.outputs[0]
    assert len(completion.logprobs) == 6
    total = 0.0
    for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
        assert token_id in logprobs and len(logprobs) in (2, 3)
        assert logprobs[token_id].decoded_token == f" {token_id}"
        assert sorted(lp.rank for t, lp in logprobs.items() if t != token_id) == [1, 2][:len(logprobs) - 1]
        total += logprobs[token_id].logprob
    assert abs(completion.cumulative_logprob - total) < 1e-6
    [plain] = run(fake_engine(), [PROMPT], SamplingParams(max_tokens=2))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_metrics_are_in_order():
    [out] = run(fake_engine(), [PROMPT], SamplingParams(max_tokens=3))
    metrics = out.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finished_time
    assert metrics.time_in_queue == metrics.first_scheduled_time - metrics.arrival_time


def test_a_request_queued_behind_a_full_batch_reports_its_queue_time():
    """max_num_seqs 1: the second request is first scheduled once the first has finished; every delta of a request
    carries that time."""
    engine = fake_engine(max_num_seqs=1)
    first = engine.add_request(PROMPT, SamplingParams(max_tokens=3), stream=True)
    second = engine.add_request(PROMPT, SamplingParams(max_tokens=2), stream=True)
    deltas = []
    while engine.has_unfinished():
        engine.step()
        deltas += engine.take_deltas()
    scheduled = {delta.request_id: {d.scheduled_time for d in deltas if d.request_id == delta.request_id}
                 for delta in deltas}
    assert len(scheduled[first]) == len(scheduled[second]) == 1
    [first_time], [second_time] = scheduled[first], scheduled[second]
    assert first_time is not None and second_time is not None and first_time < second_time


def test_a_preempted_request_keeps_its_first_scheduling_time():
    engine = fake_engine()
    request_id = engine.add_request(PROMPT, SamplingParams(max_tokens=6), stream=True)
    engine.step()
    [seq] = engine.requests[request_id].seqs
    first = seq.first_scheduled_time
    assert first is not None
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq)  # back to waiting, its blocks gone: admitted again later
    while engine.has_unfinished():
        engine.step()
    deltas = engine.take_deltas()
    assert seq.first_scheduled_time == first
    assert {delta.scheduled_time for delta in deltas} == {first}


def collect(deltas):
    """Texts and token ids per (request_id, index), and how many finished deltas each got."""
    texts, token_ids, finishes = defaultdict(str), defaultdict(list), defaultdict(int)
    for delta in deltas:
        key = (delta.request_id, delta.index)
        assert not finishes[key], "nothing after the finished delta"
        assert delta.text or delta.token_ids or delta.finished
        texts[key] += delta.text
        token_ids[key] += delta.token_ids
        finishes[key] += delta.finished
    return texts, token_ids, finishes


def test_stream_deltas_concatenate_to_the_final_outputs():
    reference = reference_completion(PROMPT, 12)
    stop = f"{str(reference[6])[-1]} {reference[7]}"
    prompts = [PROMPT, [4, 4, 2], [9, 1]]
    params = [SamplingParams(temperature=0, max_tokens=12, stop=stop), SamplingParams(n=2, max_tokens=7, seed=3),
              SamplingParams(temperature=0, max_tokens=5)]
    deltas = list(fake_engine(peak=1.0).stream(prompts, params))
    final = fake_engine(peak=1.0).generate(prompts, params, use_tqdm=False)
    texts, token_ids, finishes = collect(deltas)
    assert len(texts) == 4 and set(finishes.values()) == {1}
    for out in final:
        for completion in out.outputs:
            key = (out.request_id, completion.index)
            assert texts[key] == completion.text and token_ids[key] == completion.token_ids
    assert stop not in texts[("0", 0)] and final[0].outputs[0].stop_reason == stop
    steps_with_text = [d for d in deltas if d.request_id == "2" and d.text]
    assert len(steps_with_text) == 5  # one delta per generated token, not one at the end


def test_closing_a_stream_early_aborts_its_requests():
    engine = fake_engine()
    stream = engine.stream([PROMPT, [1, 2]], [SamplingParams(max_tokens=20)] * 2)
    next(stream)
    stream.close()
    assert not engine.has_unfinished() and not engine.requests
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_another_generate_ends_an_open_stream_with_abort():
    """A generate() while a stream is open ends the stream's requests (an abandoned stream must not hold the
    engine's KV blocks, nor run ahead of the new call): the stream yields what it had, then a last delta finished
    with "abort"; generate's own output is what it would be alone."""
    engine = fake_engine()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    deltas, generated = [], None
    for delta in engine.stream([PROMPT], [greedy]):
        deltas.append(delta)
        if len(deltas) == 2:
            [generated] = engine.generate([[9, 9]], [greedy], use_tqdm=False)
            assert not engine.has_unfinished() and engine.scheduler.block_manager.num_free_blocks == 64
    assert generated.outputs[0].token_ids == reference_completion([9, 9], 8)
    texts, token_ids, finishes = collect(deltas)
    tokens = token_ids[("0", 0)]
    assert 0 < len(tokens) < 8 and tokens == reference_completion(PROMPT, 8)[:len(tokens)]
    assert texts[("0", 0)] == text_of(tokens)
    assert finishes[("0", 0)] == 1 and deltas[-1].finished and deltas[-1].finish_reason == "abort"


def test_aborting_a_streamed_request_ends_it_with_an_abort_delta():
    """An abort during a stream gives the request one last delta, finished with reason "abort", whose tokens and
    text still agree (the token that was on its way from the device is dropped, not appended unseen); the other
    request runs to its end."""
    engine = fake_engine()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for prompts in ([PROMPT], [PROMPT, [2, 7]]):
        deltas, seen = [], 0
        for delta in engine.stream(prompts, [greedy] * len(prompts)):
            deltas.append(delta)
            if delta.request_id == deltas[0].request_id:
                seen += 1
                if seen == 2:
                    engine.abort_request(delta.request_id)
        texts, token_ids, finishes = collect(deltas)
        aborted = (deltas[0].request_id, 0)
        last = [d for d in deltas if (d.request_id, d.index) == aborted][-1]
        assert last.finished and last.finish_reason == "abort" and finishes[aborted] == 1
        tokens = token_ids[aborted]
        assert tokens == reference_completion(PROMPT, 8)[:len(tokens)] and len(tokens) < 8
        assert texts[aborted] == text_of(tokens)
        if len(prompts) == 2:
            other = (str(int(deltas[0].request_id) + 1), 0)
            assert token_ids[other] == reference_completion([2, 7], 8) and finishes[other] == 1
        assert not engine.has_unfinished() and engine.scheduler.block_manager.num_free_blocks == 64


def test_vllms_engine_loop_runs_as_written():
    """vLLM's LLMEngine loop: add_request(request_id, prompt, params), has_unfinished_requests(), step(), and
    abort_request with a list of ids (aborted requests end without an output, as vLLM's)."""
    engine = fake_engine()
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=4))
    engine.add_request("b", PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request(request_id="c", prompt=PROMPT, params=SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("d", PROMPT, SamplingParams(temperature=0, max_tokens=3), time.time())  # an arrival time
    engine.abort_request(["b", "c", "unknown"])
    engine.abort_request(7)  # no such request: ignored
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert sorted(finished) == ["a", "d"] and finished["a"].outputs[0].token_ids == reference_completion(PROMPT, 4)
    assert engine.get_tokenizer() is engine.tokenizer
    assert engine.scheduler.block_manager.num_free_blocks == 64  # the fake engine's



def test_vllms_add_request_keywords_and_unfinished_count():
    """add_request takes vLLM's keywords (arrival_time, which the request's metrics count from; lora_request=None,
    priority=0, tokenization_kwargs=None, trace_headers=None) and refuses what it cannot honour, naming it;
    get_num_unfinished_requests counts the requests step() has yet to return; an id is taken again only once its
    output has been returned."""
    engine = fake_engine()
    arrived = time.time() - 5.0
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=3), arrival_time=arrived,
                       lora_request=None, priority=0, tokenization_kwargs=None, trace_headers=None)
    engine.add_request("b", PROMPT, SamplingParams(temperature=0, max_tokens=2), arrived)  # vLLM's positional one
    for kwargs, error, message in [(dict(lora_request=object()), ValueError, "lora_request"),
                                   (dict(priority=1), ValueError, "priority=1: .*scheduling_policy='priority'"),
                                   (dict(priority=1.5), TypeError, "priority must be an int"),
                                   (dict(tokenization_kwargs={"truncation": True}), ValueError, "tokenization_kwargs"),
                                   (dict(prompt_adapter_request=None), TypeError, "prompt_adapter_request")]:
        with pytest.raises(error, match=message):
            engine.add_request("x", PROMPT, SamplingParams(max_tokens=2), **kwargs)
    assert engine.get_num_unfinished_requests() == 2
    engine.generate([PROMPT], [SamplingParams(temperature=0, max_tokens=6)])  # finishes "a" and "b" on the way
    assert engine.get_num_unfinished_requests() == 2  # their outputs wait for step()
    with pytest.raises(ValueError, match="nor a finished one whose output step"):
        engine.add_request("a", PROMPT, SamplingParams(max_tokens=2))
    outputs = engine.step()
    assert sorted(out.request_id for out in outputs) == ["a", "b"]
    assert all(out.metrics.arrival_time == arrived for out in outputs)
    assert engine.get_num_unfinished_requests() == 0
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2))  # returned: the id is free again
    assert engine.get_num_unfinished_requests() == 1
    with pytest.raises(TypeError, match="arrival_time must be a time in seconds"):
        engine.add_request("late", PROMPT, SamplingParams(max_tokens=2), arrival_time="soon")
    assert "late" not in engine.requests  # refused before it was queued


def test_a_new_request_id_is_never_one_whose_output_step_has_yet_to_return():
    engine = fake_engine()
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=2), "1")
    engine.generate([PROMPT], [SamplingParams(temperature=0, max_tokens=6)])  # takes id "0", finishes "1"
    new = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=2))
    assert new != "1"
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sorted(out.request_id for out in outputs) == sorted(["1", new])
