"""The profiler on the CUDA core (GPU): the trace holds the kernels of the engine's steps, graph replays included,
and profiler='cuda' brackets a profile without changing a token."""
import gc

import pytest
import torch

from nanograph import LLM, SamplingParams

from ..hf_models import make_random_model
from ..trace_files import trace_events, trace_files

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(100, 140))}


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return make_random_model(str(tmp_path_factory.mktemp("qwen3-0.6b")), "qwen3-0.6b", num_hidden_layers=2)


def generate(folder, profile: bool, **config) -> list[int]:
    llm = LLM(folder, device="cuda", max_model_len=256, max_num_seqs=4, **config)
    try:
        assert llm.engine.runner.use_graphs
        if profile:
            llm.start_profile()
        tokens = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        if profile:
            llm.stop_profile()
        return list(tokens)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_the_torch_trace_holds_the_steps_kernels(qwen3_folder, tmp_path):
    expected = generate(qwen3_folder, profile=False)
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_with_stack": False}
    assert generate(qwen3_folder, profile=True, profiler_config=config) == expected
    [trace] = trace_files(tmp_path)
    events = trace_events(tmp_path / trace)
    kernels = [event["name"] for event in events if event.get("cat") == "kernel"]
    # The prefill's and the graph-replayed decode steps' kernels: the GEMVs run only at decode, in the graphs.
    assert any("gemv" in name for name in kernels), sorted(set(kernels))[:20]
    assert any("decode_attention" in name or "split_kernel" in name for name in kernels), sorted(set(kernels))[:20]
    names = {event.get("name", "") for event in events}
    assert "nanograph.forward decode: 1 sequences, 1 tokens" in names
    assert "Self CUDA" in (tmp_path / "profiler_out_0.txt").read_text()  # the table, by the kernels' time


def test_the_cuda_profiler_brackets_a_profile(qwen3_folder, monkeypatch):
    calls = []
    for name in ("start", "stop"):
        real = getattr(torch.cuda.profiler, name)
        monkeypatch.setattr(torch.cuda.profiler, name, lambda real=real, name=name: (calls.append(name), real())[1])
    expected = generate(qwen3_folder, profile=False)
    assert generate(qwen3_folder, profile=True, profiler_config={"profiler": "cuda"}) == expected
    assert calls == ["start", "stop"]
