"""The request bodies' SamplingParams: the model's generation_config defaults under what a request gives, and
response_format's schema under either of its names."""
from nanograph.serve.protocol import CompletionRequest


def test_the_models_generation_config_defaults_fill_what_a_request_leaves_out():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    request = CompletionRequest.model_validate({"prompt": "hi", "top_p": 0.5, "max_tokens": None})
    params = request.sampling_params(None, None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.5, 20, 300)
    assert request.sampling_params(7, None, defaults).max_tokens == 7
    # max_new_tokens caps a larger request, as vLLM's server does.
    assert request.sampling_params(1000, None, defaults).max_tokens == 300
    assert request.sampling_params(None, None).temperature == 1.0


def test_response_format_takes_its_schema_as_schema_or_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for key in ("schema", "json_schema"):
        request = CompletionRequest.model_validate(
            {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", key: schema}}})
        assert request.sampling_params(4, None).structured_outputs.json == schema


def test_null_parallel_tool_calls_and_include_usage_are_false_as_vllm_tests_them():
    """vLLM keeps a reply's first call unless parallel_tool_calls is true, and sends the usage chunk only where
    include_usage is true; null is kept (not the default), so that both read as false."""
    from nanograph.serve.protocol import ChatCompletionRequest
    request = ChatCompletionRequest.model_validate({"messages": [], "parallel_tool_calls": None, "stream": True,
                                                    "stream_options": {"include_usage": None}})
    assert request.parallel_tool_calls is None and request.stream_options.include_usage is None
    assert ChatCompletionRequest.model_validate({"messages": []}).parallel_tool_calls is True


def test_structured_outputs_take_vllms_json_options():
    import pytest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = CompletionRequest.model_validate({"prompt": "hi", "structured_outputs": {
        "json": schema, "disable_any_whitespace": True, "disable_additional_properties": True,
        "whitespace_pattern": " ?", "backend": "guidance", "disable_fallback": True}})
    spec = request.sampling_params(4, None).structured_outputs
    assert (spec.json, spec.disable_any_whitespace, spec.disable_additional_properties) == (schema, True, True)
    assert spec.spec()[0] == "json_schema" and '"additionalProperties": false' in spec.spec()[1]
    with pytest.raises(ValueError, match="structured_outputs takes json, regex, choice, grammar or json_object "
                                         r"\(and the options .*\); got jsn"):
        CompletionRequest.model_validate({"prompt": "hi", "structured_outputs": {"jsn": schema}}).sampling_params(
            4, None)
