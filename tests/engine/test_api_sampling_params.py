"""SamplingParams: vLLM's defaults, normalisation and validation messages; the engine rejects a bad request alone."""
import pytest

from nanograph import SamplingParams

from .fake_model import fake_engine, reference_completion


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n must be at least 1, got 0."),
    ({"n": 129}, "n must be at most 128, got 129."),
    ({"max_tokens": 2.5}, "max_tokens must be an int, got 2.5 (float)."),
    ({"repetition_penalty": 1e-39}, "repetition_penalty must be in [1e-06, 1e+06] (1: none), got 1e-39."),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers, got 5."),
    ({"n": 2.0}, "n must be an int, but is of type <class 'float'>"),
    ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
    ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5."),
    ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2], got 3.0."),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0."),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number, got inf."),
    ({"temperature": -1.0}, "temperature must be non-negative, got -1.0."),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan."),
    ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5."),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"top_k": -3}, "top_k must be 0 (disable), or at least 1, got -3."),
    ({"top_k": 2.5}, "top_k must be an integer, got float"),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be less than or equal to max_tokens=4, got 5."),
    ({"logprobs": -2}, "logprobs must be non-negative or -1, got -2."),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids must contain only integers, got [1, '2']."),
    ({"stop": ["ok", ""]}, "stop cannot contain an empty string."),
    ({"stop": [7]}, "stop must be a string or a list of strings, got [7]."),
    ({"seed": "42"}, "seed must be an int or None, got '42'."),
    ({"seed": True}, "seed must be an int or None, got True."),
    ({"seed": 2**64}, f"seed must be a 64-bit integer, in [-2**63, 2**64 - n] (completion i of n takes seed + i), "
                      f"got {2**64}."),
    ({"seed": -2**63 - 1}, f"seed must be a 64-bit integer, in [-2**63, 2**64 - n] (completion i of n takes seed + "
                           f"i), got {-2**63 - 1}."),
    ({"seed": 2**64 - 2, "n": 3}, f"seed must be a 64-bit integer, in [-2**63, 2**64 - n] (completion i of n takes "
                                  f"seed + i), got {2**64 - 2}."),
])
def test_invalid_values_raise_with_vllm_messages(kwargs, message):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value) == message


def test_defaults_are_vllms():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (params.max_tokens, params.min_tokens, params.logprobs, params.seed) == (16, 0, None, None)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == ([], [], False)
    assert params.skip_special_tokens and not params.include_stop_str_in_output


def test_normalisation_on_construction():
    assert SamplingParams(stop="end").stop == ["end"]
    assert SamplingParams(stop_token_ids=[3, 3, 4]).stop_token_ids == [3, 4]
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2**63).seed == -2**63 and SamplingParams(seed=2**64 - 3, n=3).seed == 2**64 - 3
    assert SamplingParams(temperature=1e-4).temperature == 1e-2  # as vLLM: tiny temperatures overflow
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)


def test_boundary_values_are_valid():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=1, min_p=1.0, logprobs=-1)
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=1, presence_penalty=-2, frequency_penalty=2,
                   max_tokens=None, min_tokens=100, logprobs=0)


def test_verify_catches_fields_changed_after_construction():
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        params.verify()


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, "temperature must be non-negative, got -0.5."),
    ("top_k", -3, "top_k must be 0 \\(disable\\), or at least 1, got -3."),
    ("min_p", 2.0, "min_p must be in \\[0, 1\\], got 2.0."),
    ("repetition_penalty", -1.0, "repetition_penalty must be greater than zero, got -1.0."),
    ("n", 0, "n must be at least 1, got 0."),
])
def test_a_bad_request_is_rejected_alone(field, value, message):
    engine = fake_engine()
    good = SamplingParams(temperature=0, max_tokens=5)
    engine.add_request([5, 6, 7], good)
    bad = SamplingParams()
    setattr(bad, field, value)
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2], bad)
    with pytest.raises(ValueError, match="request 1: " + message):
        engine.generate([[8, 9], [1, 2]], [good, bad], use_tqdm=False)
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [out.outputs[0].token_ids for out in finished] == [reference_completion([5, 6, 7], 5)]
