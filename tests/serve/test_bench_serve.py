"""`nanograph bench serve` against the test server: the JSON's counts agree with the workload (completed requests,
their input and output tokens), its rates with its duration, its percentiles with each other, goodput with SLOs."""
import json

import pytest

from nanograph.bench_serve import parse_goodput, random_workload
from nanograph.cli import main

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 24, 5


def run_cli(server, tmp_path, *args) -> dict:
    result_file = tmp_path / "result.json"
    main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", str(NUM_PROMPTS), "--prompt-len",
          str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--result-file", str(result_file), *args])
    return json.loads(result_file.read_text())


def test_bench_serve_reports_consistent_numbers(server, tmp_path, capsys):
    result = run_cli(server, tmp_path, "--max-concurrency", "3", "--goodput", "ttft:100000", "e2el:100000")
    assert (result["completed"], result["failed"], result["errors"]) == (NUM_PROMPTS, 0, [])
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    duration = result["duration_s"]
    assert result["request_throughput"] == pytest.approx(NUM_PROMPTS / duration)
    assert result["output_throughput"] == pytest.approx(NUM_PROMPTS * OUTPUT_LEN / duration)
    assert result["total_token_throughput"] == pytest.approx(NUM_PROMPTS * (INPUT_LEN + OUTPUT_LEN) / duration)
    assert result["request_goodput"] == result["request_throughput"]  # every request meets SLOs this loose
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"], name
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"] < 1e3 * duration
    out = capsys.readouterr().out
    assert f"completed {NUM_PROMPTS}, failed 0" in out and "TPOT" in out and "goodput" in out


def test_a_poisson_rate_and_a_strict_slo(server, tmp_path):
    result = run_cli(server, tmp_path, "--request-rate", "20", "--goodput", "ttft:0.001")
    assert result["completed"] == NUM_PROMPTS and result["request_rate"] == 20
    assert result["request_goodput"] == 0  # nobody's first token comes within a microsecond


def test_the_workload_repeats_for_a_seed_and_bad_slos_are_named():
    assert random_workload(3, 8, seed=1) == random_workload(3, 8, seed=1) != random_workload(3, 8, seed=2)
    assert all(len(prompt) == 8 for prompt in random_workload(3, 8))
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    with pytest.raises(ValueError, match="NAME:MS pairs with NAME one of ttft, tpot, e2el; got 'itl:5'"):
        parse_goodput(["itl:5"])


def test_profile_needs_a_server_with_a_profiler(server, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli(server, tmp_path, "--profile")
    assert "serves no profiler: start the server with --profiler-config" in capsys.readouterr().err
