"""vLLM's POST /start_profile and /stop_profile on `nanograph serve --profiler-config` (the default model on the CPU):
the trace of the requests between them, written by the engine process, and the routes' errors."""
import json

import httpx
import pytest

from nanograph import SamplingParams
from nanograph.cli import main

from ..trace_files import range_names, trace_events, trace_files
from .server_process import module_server


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def server(tmp_path_factory, traces):
    config = {"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False}
    yield from module_server(tmp_path_factory, "--profiler-config", json.dumps(config))


def test_a_profile_of_served_requests(server, client, model, traces, reference_llm):
    before = set(trace_files(traces))
    # As vLLM's: a stop with no profile running, and a second start, change nothing and answer 200.
    assert httpx.post(server.base_url + "/stop_profile", timeout=60).status_code == 200
    assert httpx.post(server.base_url + "/start_profile", timeout=60).status_code == 200
    assert httpx.post(server.base_url + "/start_profile", timeout=60).status_code == 200
    text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                     temperature=0).choices[0].text
    assert httpx.post(server.base_url + "/stop_profile", timeout=120).status_code == 200
    # The trace is on disk when /stop_profile answers, and the profile changed no token.
    [trace] = set(trace_files(traces)) - before
    assert trace.endswith(".pt.trace.json.gz")
    names = {event.get("name", "") for event in trace_events(traces / trace)}
    assert "nanograph.step" in names
    assert any(name.startswith("nanograph.forward prefill: 1 sequences") for name in names)
    assert (traces / "profiler_out_0.txt").exists()
    expected = reference_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                                      use_tqdm=False)[0].outputs[0].text
    assert text == expected
    assert "profiler enabled (--profiler-config)" in server.log()


def test_bench_serve_profiles_its_timed_requests(server, traces, tmp_path):
    before = set(trace_files(traces))
    main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "3", "--prompt-len", "8", "--output-len",
          "3", "--profile", "--result-file", str(tmp_path / "result.json")])
    assert json.loads((tmp_path / "result.json").read_text())["completed"] == 3
    [trace] = set(trace_files(traces)) - before
    # The forwards of the three timed requests, and not of the warm-up before the profile began: each request's
    # prompt (8 tokens) and its first two output tokens (the third is sampled, never fed back).
    forwards = [name for name in range_names(traces / trace) if name.startswith("nanograph.forward")]
    assert sum(int(name.split(", ")[1].split()[0]) for name in forwards) == 3 * (8 + 2), forwards
