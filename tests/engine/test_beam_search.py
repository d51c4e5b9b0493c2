"""LLM.beam_search on a tiny random model (torch backend, float32) against greedy decoding and HF transformers'
teacher-forced logprobs; its beams share blocks through the prefix cache; EOS ends a beam."""
import json
import shutil

import numpy as np
import pytest
import torch

from nanograph import LLM, BeamSearchOutput, BeamSearchParams, BeamSearchSequence, SamplingParams
from nanograph.beam_search import beam_search_score


@pytest.fixture(scope="module")
def model(qwen3_tied):
    return qwen3_tied


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model[0]), device="cpu", block_size=4, max_num_seqs=8, max_model_len=64)


PROMPT = np.random.default_rng(0).integers(0, 256, 13).tolist()


def hf_cum_logprob(hf, tokens: list[int], num_prompt_tokens: int) -> float:
    """The sum of the generated tokens' logprobs, teacher-forced."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)
    return sum(logprobs[position - 1, tokens[position]].item() for position in range(num_prompt_tokens, len(tokens)))


def test_beam_width_one_is_greedy(llm):
    [output] = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=1, max_tokens=8,
                                                                              ignore_eos=True))
    [greedy] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    assert isinstance(output, BeamSearchOutput) and len(output.sequences) == 1
    beam = output.sequences[0]
    assert isinstance(beam, BeamSearchSequence)
    assert beam.tokens == PROMPT + greedy.outputs[0].token_ids and beam.finish_reason == "length"


def test_beams_are_sorted_scored_by_teacher_forcing_and_share_cached_blocks(llm, model):
    hf = model[1]
    block_manager = llm.engine.scheduler.block_manager
    hits = block_manager.num_prefix_hit_tokens
    prompts = [PROMPT, PROMPT[:6]]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    # Each step's beams find their prompt's (and their own earlier tokens') full blocks in the cache.
    assert block_manager.num_prefix_hit_tokens - hits >= 7 * 3 * 4
    for prompt, output in zip(prompts, outputs):
        beams = output.sequences
        assert len(beams) == 3 and len({tuple(beam.tokens) for beam in beams}) == 3
        assert [beam.cum_logprob for beam in beams] == sorted((beam.cum_logprob for beam in beams), reverse=True)
        for beam in beams:
            assert beam.tokens[:len(prompt)] == prompt and len(beam.tokens) == len(prompt) + 8
            assert beam.cum_logprob == pytest.approx(hf_cum_logprob(hf, beam.tokens, len(prompt)), abs=1e-4)
            chosen = [step[token].logprob for step, token in zip(beam.logprobs, beam.tokens[len(prompt):])]
            assert beam.cum_logprob == pytest.approx(sum(chosen), abs=1e-6)
        [greedy] = llm.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        greedy_cum = hf_cum_logprob(hf, prompt + greedy.outputs[0].token_ids, len(prompt))
        assert beams[0].cum_logprob >= greedy_cum - 1e-4


def test_eos_completes_a_beam_and_the_others_go_on(model, tmp_path):
    """With the greedy first token made the EOS token, beams end on it (the EOS not counted in their length)."""
    folder, hf = model
    with torch.no_grad():
        first = int(hf(torch.tensor([PROMPT])).logits[0, -1].argmax())
    eos_folder = tmp_path / "eos"
    shutil.copytree(folder, eos_folder)
    config = json.loads((eos_folder / "config.json").read_text())
    (eos_folder / "config.json").write_text(json.dumps({**config, "eos_token_id": first}))
    llm = LLM(str(eos_folder), device="cpu", block_size=4, max_num_seqs=8, max_model_len=64)
    params = BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.5)
    [output] = llm.beam_search([PROMPT], params)
    ended = [beam for beam in output.sequences if beam.finish_reason == "stop"]
    assert ended and all(beam.tokens[-1] == first and first not in beam.tokens[len(PROMPT):-1] for beam in ended)
    eos = {first}
    scores = [beam_search_score(beam, eos, 0.5) for beam in output.sequences]
    assert scores == sorted(scores, reverse=True)
    assert scores[output.sequences.index(ended[0])] == \
        pytest.approx(ended[0].cum_logprob / (len(ended[0].tokens) - 1) ** 0.5)
    others = [beam for beam in output.sequences if beam.finish_reason != "stop"]
    assert all(beam.finish_reason == "length" and len(beam.tokens) == len(PROMPT) + 5
               and first not in beam.tokens[len(PROMPT):] for beam in others)


def test_bad_beam_search_params_raise(llm):
    with pytest.raises(ValueError, match="beam_width must be at least 1, got 0."):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be an int"):
        BeamSearchParams(beam_width=2, max_tokens=2.5)
    with pytest.raises(ValueError, match="temperature must be in \\[0, 2\\], got 3"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=3)
    with pytest.raises(ValueError, match="beam_width=11 takes 2 \\* beam_width = 22 logprobs per step, more than "
                                         "max_logprobs=20"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(TypeError, match="params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search([PROMPT], SamplingParams())
