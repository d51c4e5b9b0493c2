"""Prompt logprobs and beam search with the bundled SmolLM2-135M-Instruct and its real tokenizer (CPU): text prompts,
decoded tokens, HF transformers' teacher-forced logprobs."""
import pytest
import torch

from nanograph import LLM, BeamSearchParams, SamplingParams
from nanograph.default_model import default_model_path

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


def teacher_forced(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_of_a_text_prompt(llm, hf):
    [output] = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    prompt = output.prompt_token_ids
    reference = teacher_forced(hf, prompt)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    tokenizer = llm.tokenizer
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        token_id = prompt[position]
        assert entry[token_id].logprob == pytest.approx(reference[position - 1, token_id].item(), abs=1e-3)
        assert entry[token_id].decoded_token == tokenizer.decode([token_id])
        assert {rank for info in entry.values() if (rank := info.rank) <= 2} == {1, 2}


def test_beam_search_of_a_text_prompt_beats_greedy(llm, hf):
    [greedy] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=0), use_tqdm=False)
    [output] = llm.beam_search([{"prompt": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=6))
    prompt = greedy.prompt_token_ids
    best = output.sequences[0]
    assert len(output.sequences) == 2 and best.tokens[:len(prompt)] == prompt
    # The text holds the prompt's, and an ending EOS's only with include_stop_str_in_output.
    ends_in_eos = best.finish_reason == "stop"
    assert best.text == llm.tokenizer.decode(best.tokens[:-1] if ends_in_eos else best.tokens)
    assert best.text.startswith(PROMPT)
    assert best.cum_logprob >= greedy.outputs[0].cumulative_logprob - 1e-4
    reference = teacher_forced(hf, best.tokens)
    expected = sum(reference[p - 1, best.tokens[p]].item() for p in range(len(prompt), len(best.tokens)))
    assert best.cum_logprob == pytest.approx(expected, abs=1e-3)
