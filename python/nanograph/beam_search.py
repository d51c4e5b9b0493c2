"""Beam search, as vLLM's LLM.beam_search: each step extends every live beam by one token.

A step is one generate call in which each beam is a request of max_tokens=1 asking for 2 * beam_width logprobs: its
candidates are the sampled token and those top tokens. The beams of a prompt share their prompt and most of their
tokens, which the prefix cache holds, so a step computes little more than each beam's last partial block. Beams are
ranked by their cumulative logprob over their length (prompt included, a final EOS not) to the length_penalty."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from tqdm.auto import tqdm

from .engine.intake import Prompt
from .outputs import Logprob
from .sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the generated ones
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token: the step's candidates
    cum_logprob: float = 0.0  # of the generated tokens
    text: str | None = None  # the tokens' text (prompt included, as in vLLM); None without a tokenizer
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens, or max_model_len)
    stop_reason: int | str | None = None  # None, as for the tokenizer's EOS in generate()


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # at most beam_width, best first


def beam_search_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    """vLLM's (and transformers') score: the cumulative logprob over the length, a final EOS not counted."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length ** length_penalty


def beam_search(engine, prompts: list[Prompt], params: BeamSearchParams, use_tqdm: bool = False
                ) -> list[BeamSearchOutput]:
    """The beam_width best beams of each prompt (any form that generate() takes), best first; use_tqdm shows the
    steps (an upper bound: every beam may end early)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    num_candidates = 2 * params.beam_width
    max_logprobs = engine.config.max_logprobs
    if max_logprobs != -1 and num_candidates > max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} takes 2 * beam_width = {num_candidates} logprobs per step, "
                         f"more than max_logprobs={max_logprobs}; lower beam_width or raise the engine's "
                         "max_logprobs (-1: no limit)")
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=num_candidates)
    eos_token_ids = engine.stop_checker.eos_token_ids
    score = partial(beam_search_score, eos_token_ids=eos_token_ids, length_penalty=params.length_penalty)
    beams = [[BeamSearchSequence(engine.intake.validate(prompt, step_params).token_ids)] for prompt in prompts]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        for live, done in zip(beams, completed):  # a beam as long as max_model_len cannot take another token
            done += [_finished(beam, "length") for beam in live if len(beam.tokens) >= engine.config.max_model_len]
            live[:] = [beam for beam in live if len(beam.tokens) < engine.config.max_model_len]
        flat = [(i, beam) for i, live in enumerate(beams) for beam in live]
        if not flat:
            break
        outputs = engine.generate([{"prompt_token_ids": beam.tokens} for _, beam in flat],
                                  [step_params] * len(flat), use_tqdm=False)
        children: list[list[BeamSearchSequence]] = [[] for _ in beams]
        for (i, beam), output in zip(flat, outputs):
            candidates = output.outputs[0].logprobs[0]
            for token_id, logprob in candidates.items():
                child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [candidates],
                                           beam.cum_logprob + logprob.logprob)
                if token_id in eos_token_ids and not params.ignore_eos:
                    completed[i].append(_finished(child, "stop"))
                else:
                    children[i].append(child)
        beams = [sorted(extended, key=score, reverse=True)[:params.beam_width] for extended in children]
    results = []
    for live, done in zip(beams, completed):
        best = sorted(done + [_finished(beam, "length") for beam in live], key=score, reverse=True)
        for beam in best[:params.beam_width]:
            beam.text = _text(engine.tokenizer, beam, eos_token_ids, params.include_stop_str_in_output)
        results.append(BeamSearchOutput(best[:params.beam_width]))
    return results


def _finished(beam: BeamSearchSequence, reason: str) -> BeamSearchSequence:
    beam.finish_reason = reason
    return beam


def _text(tokenizer, beam: BeamSearchSequence, eos_token_ids: set[int], include_stop_str: bool) -> str | None:
    if tokenizer is None:
        return None
    ends_in_eos = beam.finish_reason == "stop" and beam.tokens[-1] in eos_token_ids
    return tokenizer.decode(beam.tokens[:-1] if ends_in_eos and not include_stop_str else beam.tokens)
