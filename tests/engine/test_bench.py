"""`nanograph bench throughput` on CPU: nano-vllm's draws, and the whole report path on a tiny model."""
from random import randint, seed

import pytest

from nanograph.bench import nano_vllm_workload, throughput

from .tiny_models import make_tiny_model


def test_workload_repeats_nano_vllm_bench_draws():
    seed(0)  # nano-vllm's bench.py, verbatim in substance
    prompt_token_ids = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    max_tokens = [randint(100, 1024) for _ in range(256)]
    prompts, params = nano_vllm_workload()
    assert prompts == prompt_token_ids and [p.max_tokens for p in params] == max_tokens
    assert all(p.temperature == 0.6 and p.ignore_eos for p in params)


@pytest.mark.slow
def test_throughput_bench_reports_on_cpu_with_the_hf_comparison(tmp_path, capsys):
    make_tiny_model(tmp_path, "llama3-untied")
    result = throughput(str(tmp_path), num_seqs=12, max_input_len=40, max_output_len=12, compare_hf=True,
                        hf_subset=4, device="cpu", num_kv_blocks=8, block_size=8, max_num_seqs=64,
                        max_num_batched_tokens=64)
    assert result["preemptions"] > 0 and result["kv_blocks"] == 8 and result["block_size"] == 8
    assert result["output_tok_s"] > 0 and result["total_tok_s"] > result["output_tok_s"]
    assert 0 < result["host_share"] < 1 and result["speedup"] > 0
    out = capsys.readouterr().out
    assert "output tok/s" in out and "preemptions" in out and "HF transformers" in out


def test_latency_bench_takes_max_model_len_from_the_command_line(capsys):
    """`nanograph bench latency --max-model-len N` reaches the benchmark, which rejects a length that cannot hold
    its workload before it loads anything (so this runs without a GPU); the CLI prints it as one error line."""
    from nanograph.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--max-model-len", "300", "--no-hf"])
    assert exit_info.value.code == 2
    assert "nanograph: error: max_model_len 300 cannot hold the 128-token prompt and 256 output" in \
        capsys.readouterr().err


def test_weight_bytes_count_fp8_linears_at_one_byte_and_their_scales(tmp_path):
    """The roofline's weight bytes are what the runner holds: FP8 linears (the CUDA runner's) at one byte an
    element, their float32 scales, and the rest in the model dtype; a tied lm_head once."""
    import types

    import torch

    from nanograph.bench import weight_bytes
    from nanograph.model_config import ModelConfig
    from nanograph.models import load_weights

    make_tiny_model(tmp_path, "qwen3-tied")
    mc = ModelConfig.from_pretrained(tmp_path)
    weights = load_weights(tmp_path, mc, torch.bfloat16, "cpu", quantization="fp8")
    llm = types.SimpleNamespace(engine=types.SimpleNamespace(runner=types.SimpleNamespace(weights=weights,
                                                                                          model_config=mc)))
    fp8 = {name for name, t in weights.items() if t.dtype == torch.float8_e4m3fn}
    assert len(fp8) == 4 * mc.num_layers
    expected = sum(weights[name].numel() + 4 * weights[name + "_scale"].numel() for name in fp8) + sum(
        2 * t.numel() for name, t in weights.items()
        if t.dtype == torch.bfloat16 and name != "lm_head")  # lm_head is embed_tokens
    assert weight_bytes(llm) == expected
