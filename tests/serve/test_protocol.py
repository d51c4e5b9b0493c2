"""The request bodies' SamplingParams: the model's generation_config defaults under what a request gives."""
from nanograph.serve.protocol import CompletionRequest


def test_the_models_generation_config_defaults_fill_what_a_request_leaves_out():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    request = CompletionRequest.model_validate({"prompt": "hi", "top_p": 0.5, "max_tokens": None})
    params = request.sampling_params(None, None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.5, 20, 300)
    assert request.sampling_params(7, None, defaults).max_tokens == 7
    assert request.sampling_params(None, None).temperature == 1.0
