"""nano-vllm's 256-request benchmark, scaled down: every request finishes with exactly its max_tokens, none is
lost, while a small KV cache forces preemptions and a small token budget chunks prompts."""
import warnings
from random import randint, seed

import pytest

from nanograph import LLM, SamplingParams

from .fake_model import VOCAB_SIZE, fake_engine, reference_completion
from .tiny_models import make_tiny_model


def workload(vocab_size: int, temperature: float):
    seed(0)
    prompts = [[randint(1, vocab_size - 1) for _ in range(randint(5, 40))] for _ in range(256)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=randint(5, 40)) for _ in prompts]
    return prompts, params


def test_256_requests_finish_exactly_through_preemption_on_the_fake_model():
    prompts, params = workload(VOCAB_SIZE, temperature=0)
    engine = fake_engine(num_kv_blocks=200, block_size=4, max_model_len=80, max_num_seqs=128,
                         max_num_batched_tokens=128)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    for out, prompt, p in zip(outputs, prompts, params):
        assert out.outputs[0].token_ids == reference_completion(prompt, p.max_tokens)
        assert out.outputs[0].finish_reason == "length"
    assert all(batch.num_tokens <= 128 for batch in engine.runner.batches)
    assert max(batch.num_seqs for batch in engine.runner.batches) > 16
    assert engine.scheduler.block_manager.num_free_blocks == 200 and not engine.has_unfinished()


@pytest.mark.slow
def test_256_sampled_requests_finish_with_their_max_tokens_on_a_tiny_model(tmp_path):
    make_tiny_model(tmp_path, "qwen3-tied")
    prompts, params = workload(256, temperature=0.6)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=96, num_kv_blocks=24, block_size=16, max_num_seqs=128,
              max_num_batched_tokens=128)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [len(out.outputs[0].token_ids) for out in outputs] == [p.max_tokens for p in params]
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
    assert llm.engine.scheduler.block_manager.num_free_blocks == 24


def test_a_max_model_len_past_the_models_positions_is_capped_with_a_warning(tmp_path):
    make_tiny_model(tmp_path, "qwen3-tied")  # 256 positions
    with pytest.warns(UserWarning, match="max_model_len 100000 is more than the model's 256 positions "
                                         r"\(max_position_embeddings, or its context stretched by YaRN or linear "
                                         r"scaling, at most its sliding window\); using 256"):
        llm = LLM(str(tmp_path), device="cpu", max_model_len=100000, num_kv_blocks=24, block_size=16)
    assert llm.engine.config.max_model_len == 256
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default (4,096) is capped without a warning
        assert LLM(str(tmp_path), device="cpu", num_kv_blocks=24, block_size=16).engine.config.max_model_len == 256
