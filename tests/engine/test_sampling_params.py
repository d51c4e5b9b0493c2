import pytest

from nanograph import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature must be non-negative, got -1.0."),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"top_k": -3}, "top_k must be -1 (disable), or at least 1, got -3."),
    ({"top_k": 0}, "top_k must be -1 (disable), or at least 1, got 0."),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
])
def test_invalid_values_raise_with_vllm_messages(kwargs, message):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value) == message


def test_boundary_values_are_valid():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=1)
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=1)


def test_verify_catches_fields_changed_after_construction():
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        params.verify()
