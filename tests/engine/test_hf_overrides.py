"""vLLM's hf_overrides (--hf-overrides): config.json values given at load, as if the folder's config.json had them
(Qwen's YaRN recipe for contexts past the native length is the common one: rope_theta stays); a function of the
loaded config; bad values named."""
import json
import re

import pytest

from nanograph import LLM, SamplingParams

from .tiny_models import make_tiny_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [200, 1, 1, 1, 54]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same weights (qwen3-tied: rope_theta 1e6, 256 positions), with and without YaRN in config.json."""
    plain, yarn = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("yarn")
    make_tiny_model(plain, "qwen3-tied", seed=5, config_overrides={"head_dim": 64})  # a head the CUDA core runs
    # A copy: transformers adds to the dict it is given.
    make_tiny_model(yarn, "qwen3-tied", seed=5, config_overrides={"rope_scaling": dict(YARN), "head_dim": 64})
    return str(plain), str(yarn)


def run(folder, device="cpu", **kwargs):
    llm = LLM(folder, device=device, skip_tokenizer_init=True, max_num_seqs=2, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=6, logprobs=2, detokenize=False))
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [entry[t].logprob for o in outputs for t, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    return llm.llm_engine.config.max_model_len, tokens, logprobs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_yarn_override_runs_as_the_same_rope_scaling_in_config_json(folders, device):
    plain, yarn = folders
    assert json.loads(open(f"{plain}/config.json").read()).get("rope_scaling") is None
    expected = run(yarn, device)
    assert expected[0] == 512  # YaRN's 4 x 128 positions, past the 256 of max_position_embeddings
    overridden = run(plain, device, hf_overrides={"rope_scaling": dict(YARN)})
    assert overridden[0] == expected[0] and overridden[1] == expected[1]
    assert overridden[2] == pytest.approx(expected[2], abs=1e-5)
    if device == "cuda":
        return
    # The same through a function of the loaded config.
    def stretch(config):
        config.rope_scaling = {**config.rope_scaling, **YARN}
        return config
    assert run(plain, hf_overrides=stretch)[1] == expected[1]
    assert run(plain)[0] == 256 and run(plain)[2] != pytest.approx(expected[2], abs=1e-5)


def test_rope_theta_and_no_scaling_run_as_config_json_would_have_them(tmp_path):
    """rope_theta given alone (transformers 5 keeps it inside the rope parameters), by a dict or a function, and a
    rope_scaling of None, which takes a YaRN config back to plain RoPE."""
    plain, slow = str(tmp_path / "plain"), str(tmp_path / "slow")
    make_tiny_model(plain, "qwen3-tied", seed=5)
    make_tiny_model(slow, "qwen3-tied", seed=5, config_overrides={"rope_theta": 1e4})
    expected = run(slow)
    assert run(plain)[1] != expected[1]

    def theta(config):
        config.rope_theta = 1e4
        return config
    for overrides in ({"rope_theta": 1e4}, theta):
        assert run(plain, hf_overrides=overrides)[2] == pytest.approx(expected[2], abs=1e-5)
    yarn, unscaled = str(tmp_path / "yarn"), str(tmp_path / "unscaled")
    make_tiny_model(yarn, "qwen3-yarn-untied", seed=6)
    make_tiny_model(unscaled, "qwen3-yarn-untied", seed=6, config_overrides={"rope_scaling": None})
    expected = run(unscaled)
    assert run(yarn)[0] == 256 and expected[0] == 256
    assert run(yarn, hf_overrides={"rope_scaling": None})[2] == pytest.approx(expected[2], abs=1e-5)


def test_a_rope_scaling_replaces_the_configs_rope_parameters_but_rope_theta(tmp_path):
    from nanograph.model_config import ModelConfig, rope_parameters

    make_tiny_model(tmp_path, "llama3-untied")  # llama3 scaling: factor 8, low and high frequency factors
    params = rope_parameters(ModelConfig.from_pretrained(tmp_path, {"rope_scaling": {"rope_type": "yarn",
                                                                                      "factor": 2.0}}).hf_config)
    assert params["rope_type"] == "yarn" and params["factor"] == 2.0 and params.get("rope_theta") == 1e4
    assert "low_freq_factor" not in params and "high_freq_factor" not in params


def test_an_override_of_a_plain_value_is_read(folders):
    plain, _ = folders
    assert run(plain, hf_overrides={"max_position_embeddings": 96})[0] == 96


@pytest.mark.parametrize("value, message", [
    ("rope", "hf_overrides must be a dict of config.json fields"),
    ({1: 2}, "hf_overrides must be a dict of config.json fields"),
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture ['GPT2LMHeadModel']"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    (lambda config: None, "hf_overrides returned NoneType"),
])
def test_a_bad_override_is_a_value_error_naming_it(folders, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(folders[0], device="cpu", skip_tokenizer_init=True, hf_overrides=value)
