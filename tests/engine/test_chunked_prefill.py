"""Chunked prefill mixed with decodes gives the same greedy outputs as whole-prompt prefill."""
import random

import pytest

from nanograph import LLM, SamplingParams

from .fake_model import VOCAB_SIZE, fake_engine, reference_completion


def test_chunked_prefill_mixed_with_decodes_keeps_outputs_exact():
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 12)) for _ in prompts]
    outputs, batches = {}, {}
    for budget in (8, 1000):
        engine = fake_engine(num_kv_blocks=256, block_size=4, max_model_len=64, max_num_seqs=6,
                             max_num_batched_tokens=budget)
        outputs[budget] = [out.outputs[0].token_ids for out in engine.generate(prompts, params, use_tqdm=False)]
        batches[budget] = engine.runner.batches
        assert all(batch.num_tokens <= budget and batch.num_seqs <= 6 for batch in batches[budget])
    assert outputs[8] == outputs[1000] == [reference_completion(p, s.max_tokens) for p, s in zip(prompts, params)]
    q_lens = [batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1] for batch in batches[8]]
    assert any((q == 1).any() and (q > 1).any() for q in q_lens), "no step mixed decodes with a prompt chunk"


@pytest.mark.slow
def test_smollm2_greedy_outputs_do_not_depend_on_the_token_budget():
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
            "movable metal type, oil-based ink and a wooden press adapted from wine making. ")
    prompts = [text * 2, "Count: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, " * 3,
               text * 2 + "In short,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for budget in (64, 4096):
        llm = LLM(device="cpu", max_model_len=256, max_num_seqs=min(budget, 256), max_num_batched_tokens=budget,
                  enable_prefix_caching=False)
        assert all(len(ids) > 64 for ids in map(llm.tokenizer.encode, prompts))
        outputs.append([out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]
