"""vLLM's profiler_config with start_profile() / stop_profile(): torch.profiler traces of the engine's steps."""
import logging

import pytest
import torch

from nanograph import LLM, SamplingParams
from nanograph.config import Config
from nanograph.profiler import CUDA_TIME_TABLE, ProfilerConfig

from ..trace_files import range_names as step_ranges
from ..trace_files import trace_events
from ..trace_files import trace_files as traces
from .fake_model import fake_engine, reference_completion
from .tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def test_a_profile_traces_the_steps_between_start_and_stop_and_changes_no_token(tmp_path):
    # Without the Python stacks: torch now and then cannot read their events back for the table (profiler.py).
    engine = fake_engine(profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces"),
                                          "torch_profiler_with_stack": False})
    [before] = engine.generate([[3, 4, 5]], [GREEDY], use_tqdm=False)  # not profiled
    assert not (tmp_path / "traces").exists()
    engine.start_profile()
    [profiled] = engine.generate([[3, 4, 5]], [GREEDY], use_tqdm=False)
    engine.stop_profile()
    assert profiled.outputs[0].token_ids == before.outputs[0].token_ids == reference_completion([3, 4, 5], 6)

    [trace] = traces(tmp_path / "traces")
    assert trace.startswith("rank0.") and trace.endswith(".pt.trace.json.gz")
    ranges = step_ranges(tmp_path / "traces" / trace)
    # One prefill and five decode forwards (the sixth token is sampled by the fifth decode's step), each inside a
    # step; one more step applies the last token.
    forwards = [name for name in ranges if name.startswith("nanograph.forward")]
    assert forwards == ["nanograph.forward prefill: 1 sequences, 3 tokens"] + \
        ["nanograph.forward decode: 1 sequences, 1 tokens"] * 5
    assert ranges.count("nanograph.step") == 7
    table = (tmp_path / "traces" / CUDA_TIME_TABLE).read_text()
    assert "Self CPU" in table and "nanograph.step" in table


def test_iteration_limits_and_the_trace_options(tmp_path):
    folder = tmp_path / "traces"
    engine = fake_engine(profiler_config=ProfilerConfig(torch_profiler_dir=folder, delay_iterations=2,
                                                        max_iterations=3, torch_profiler_use_gzip=False,
                                                        torch_profiler_dump_cuda_time_total=False))
    assert engine.config.profiler_config.profiler == "torch"  # a folder alone means the torch profiler
    engine.start_profile()
    engine.generate([[3, 4, 5]], [SamplingParams(temperature=0, max_tokens=12)], use_tqdm=False)
    # It ended by itself after three steps, the two before it skipped: the trace is written before stop_profile().
    [trace] = traces(folder)
    assert trace.endswith(".pt.trace.json")
    ranges = step_ranges(folder / trace)
    assert ranges.count("nanograph.step") == 3
    assert "nanograph.forward prefill: 1 sequences, 3 tokens" not in ranges  # the first step was skipped
    assert not (folder / CUDA_TIME_TABLE).exists()
    engine.stop_profile()
    assert traces(folder) == [trace]
    # A second profile writes a second trace.
    engine.start_profile()
    engine.generate([[3, 4, 5]], [SamplingParams(temperature=0, max_tokens=12)], use_tqdm=False)
    engine.stop_profile()
    assert len(traces(folder)) == 2


def test_the_profilers_state_changes_as_vllms(tmp_path, caplog):
    with pytest.raises(RuntimeError, match="no profiler is configured: pass profiler_config="):
        fake_engine().start_profile()
    with pytest.raises(RuntimeError, match="no profiler is configured"):
        fake_engine().stop_profile()
    engine = fake_engine(profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    # A stop with no profile running, and a start while one runs, change nothing (warnings say so).
    with caplog.at_level(logging.WARNING, logger="nanograph"):
        engine.stop_profile()
        engine.start_profile(profile_prefix="first")
        engine.start_profile(profile_prefix="second")
    assert "the profiler is not running; nothing changed" in caplog.text
    assert "the profiler is already running; nothing changed" in caplog.text
    engine.stop_profile()
    [output] = engine.generate([[3, 4, 5]], [GREEDY], use_tqdm=False)  # the engine goes on
    assert output.outputs[0].token_ids == reference_completion([3, 4, 5], 6)
    [trace] = traces(tmp_path)
    assert trace.startswith("first_rank0.")  # vLLM's profile_prefix
    # A profile still running at shutdown ends there, its trace written.
    engine.start_profile()
    engine.generate([[3, 4, 5]], [GREEDY], use_tqdm=False)
    engine.shutdown()
    assert len(traces(tmp_path)) == 2 and not engine.profiler.running
    with pytest.raises(ValueError, match="profile_prefix must be a non-empty file name prefix"):
        fake_engine(profiler_config={"torch_profiler_dir": str(tmp_path)}).start_profile(profile_prefix="a/b")


def test_a_profiler_that_fails_never_fails_a_step(tmp_path, monkeypatch, caplog):
    # A folder that cannot be made fails start_profile(), naming it.
    (tmp_path / "file").write_text("")
    engine = fake_engine(profiler_config={"torch_profiler_dir": str(tmp_path / "file" / "traces")})
    with pytest.raises(ValueError, match="torch_profiler_dir=.*cannot be made a folder"):
        engine.start_profile()
    assert not engine.profiler.running
    # A profile that fails to begin between steps (delay_iterations) ends with the error logged; the requests'
    # tokens are the same.
    engine = fake_engine(profiler_config={"torch_profiler_dir": str(tmp_path / "traces"), "delay_iterations": 2})

    def refuse(self):
        raise RuntimeError("no profiler today")
    monkeypatch.setattr(torch.profiler.profile, "start", refuse)
    engine.start_profile()
    with caplog.at_level(logging.ERROR, logger="nanograph"):
        [output] = engine.generate([[3, 4, 5]], [GREEDY], use_tqdm=False)
    assert output.outputs[0].token_ids == reference_completion([3, 4, 5], 6)
    assert "the profiler failed between engine steps; its profile has ended" in caplog.text
    assert "no profiler today" in caplog.text
    assert not engine.profiler.running and not engine.profiler.recording
    engine.stop_profile()  # nothing to stop: a warning
    monkeypatch.undo()
    engine.start_profile()  # and it starts again
    engine.generate([[3, 4, 5]], [GREEDY], use_tqdm=False)
    engine.stop_profile()
    assert len(traces(tmp_path / "traces")) == 1


@pytest.mark.parametrize("given, message", [
    ({"profiler": "nsys"}, "profiler_config.profiler='nsys' is not one nanograph has; use 'torch' or 'cuda'"),
    ({"profiler": "torch"}, "profiler='torch' writes its traces into torch_profiler_dir; give one"),
    ({"torch_profiler_dir": ""}, "torch_profiler_dir must be a folder's path"),
    ({"torch_profiler_dir": "t", "max_iterations": -1}, "max_iterations must be a whole number of engine steps"),
    ({"torch_profiler_dir": "t", "delay_iterations": 1.5}, "delay_iterations must be a whole number"),
    ({"torch_profiler_dir": "t", "torch_profiler_with_stack": "yes"}, "torch_profiler_with_stack must be a bool"),
    ({"torch_profiler_dir": "t", "trace_dir": "t"}, "profiler_config takes .*; got unknown key\\(s\\) \\['trace_dir'\\]"),
    ({"profiler": "cuda", "torch_profiler_dir": "t"}, "torch_profiler_dir is for profiler='torch'"),
    ({"torch_profiler_dir": "t", "ignore_frontend": 1}, "ignore_frontend must be a bool"),
    ("torch", "profiler_config must be a ProfilerConfig or a dict"),
])
def test_bad_profiler_configs_name_the_field_and_the_fix(given, message):
    with pytest.raises(ValueError, match=message):
        Config(profiler_config=given)


def test_the_folder_is_expanded_and_absolute(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ProfilerConfig(torch_profiler_dir="~/traces").torch_profiler_dir == str(tmp_path / "traces")
    monkeypatch.chdir(tmp_path)
    config = ProfilerConfig.of({"torch_profiler_dir": "rel", "ignore_frontend": True})
    assert config.torch_profiler_dir == str(tmp_path / "rel") and config.profiler == "torch"


def test_the_cuda_profiler_needs_a_cuda_device():
    with pytest.raises(ValueError, match="profiler='cuda' brackets a profile for Nsight Systems, and this engine runs "
                                         "on cpu; use profiler='torch'"):
        fake_engine(profiler_config={"profiler": "cuda"})


def test_llm_profiles_a_real_model_on_the_torch_backend(tmp_path):
    make_tiny_model(tmp_path / "model", "qwen3-tied")
    llm = LLM(str(tmp_path / "model"), device="cpu", max_model_len=64, skip_tokenizer_init=True,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces"),
                               "torch_profiler_record_shapes": True})
    llm.start_profile()
    [output] = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], GREEDY, use_tqdm=False)
    llm.stop_profile()
    assert len(output.outputs[0].token_ids) == 6
    [trace] = traces(tmp_path / "traces")
    events = trace_events(tmp_path / "traces" / trace)
    names = {e.get("name") for e in events}
    assert "nanograph.forward prefill: 1 sequences, 4 tokens" in names
    assert any(name and name.startswith("aten::") for name in names)  # the torch backend's ops
    assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes
