"""Per-request sampling parameters: vLLM's names, defaults and validation messages."""
from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from enum import Enum

import numpy as np

MIN_TEMPERATURE = 1e-2  # lower positive temperatures are raised to this (vLLM's _MAX_TEMP): logits / T overflows
# A penalised logit is divided or multiplied by the penalty, then by the temperature, in float32: within these bounds
# it stays finite (|logit| / 1e-6 / 1e-2 is far below float32's 3e38), and a token's chance stays well defined.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
MAX_N = 128  # completions per request (OpenAI's limit for n)
MAX_LOGIT_BIAS = 100.0  # logit_bias values are clamped to [-100, 100], as OpenAI's


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's names); exactly one of json (a JSON schema, as a dict or its JSON
    text), regex, choice (the output is one of these strings), grammar (Lark or GBNF) or json_object=True (any
    JSON object). vLLM's options for JSON: disable_any_whitespace (compact JSON: no whitespace between tokens),
    disable_additional_properties (objects of the schema that do not say otherwise take no properties beyond theirs),
    whitespace_pattern (a regex the whitespace between tokens follows); they leave other grammars as they are.
    backend and disable_fallback are taken and have no effect: llguidance is the one backend."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # vLLM's; not supported (a ValueError)
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    backend: str | None = None

    def __post_init__(self):
        given = [name for name in GRAMMAR_KINDS if getattr(self, name) not in (None, False)]
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported yet; use json, regex, choice or "
                             "grammar")
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar or "
                             f"json_object=True; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(choice, str) for choice in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("regex", "grammar", "whitespace_pattern", "backend"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {getattr(self, name)!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict, or its JSON text), got "
                             f"{type(self.json).__name__}")

    def spec(self) -> tuple[str, str]:
        """(kind, text): the grammar as llguidance's grammar_from takes it, also the key of its compiled form."""
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if not (self.disable_any_whitespace or self.disable_additional_properties or self.whitespace_pattern):
                return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON object, got {type(schema).__name__}")
            if self.disable_additional_properties and not self.json_object:
                schema = _no_additional_properties(schema)
            # llguidance's options for a schema, beside it (the schema's own x-guidance wins).
            options = {"whitespace_flexible": False} if self.disable_any_whitespace else {}
            if self.whitespace_pattern is not None:
                options["whitespace_pattern"] = self.whitespace_pattern
            if options:
                schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
            return "json_schema", json.dumps(schema)
        if self.choice is not None:
            # One regex of the choices as literals: llguidance's own "choice" is a grammar rule of one
            # alternative per choice, and its parser takes at most 2,000.
            return "regex", "(?:" + "|".join(map(_regex_literal, self.choice)) + ")"
        if self.regex is not None:
            return "regex", self.regex
        return "grammar", self.grammar


GRAMMAR_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# StructuredOutputsParams' fields that are options, not a grammar.
GRAMMAR_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                   "disable_fallback", "backend")


def _no_additional_properties(schema):
    """The schema with additionalProperties false on every object schema that does not set it (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, list):
        return [_no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _no_additional_properties(value) if key not in ("const", "enum", "default", "examples") else value
           for key, value in schema.items()}
    # Only an object schema that lists its properties: a free-form {"type": "object"} stays free.
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name
_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$")


def _regex_literal(text: str) -> str:
    """A regex (llguidance's syntax, Rust's regex crate) matching exactly text."""
    return "".join("\\" + char if char in _REGEX_SPECIAL else char for char in text)


class RequestOutputKind(Enum):
    """What each item of LLM.stream() (and the engine's take_deltas) holds for a completion."""
    CUMULATIVE = 0  # everything so far: text and token_ids from the first token on
    DELTA = 1  # only what the step added (LLM.stream()'s default: a completion's deltas concatenate to its output)
    FINAL_ONLY = 2  # nothing until it finishes, then everything at once


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks through the prefix cache
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and generated tokens
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None  # the request's own random stream: same seed, same output, whatever the batch
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logprobs: int | None = None  # top logprobs per generated token, the sampled token always included; -1: all
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # every other token is masked
    bad_words: list[str] | None = None  # words never generated (each with and without a leading space)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output follows
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name for structured_outputs

    # Prompt logprobs: computed in the prefill; the request then takes no prefix-cache hits (as in vLLM).
    prompt_logprobs: int | None = None  # top logprobs per prompt token after the first, the token itself always
                                        # included; -1: all

    # vLLM's options around the output, apart from sampling.
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens; -1: the last max_model_len
    detokenize: bool = True  # False: token ids only, no text (stop strings then need detokenize=True)
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode (slow tokenizers use it)
    # A stream's unit. None: the stream's own default: deltas for LLM.stream() and the engine's take_deltas(),
    # everything so far (CUMULATIVE, vLLM's default) for AsyncLLMEngine.generate(). generate() and chat() return
    # final outputs whatever it says, as vLLM's LLM does.
    output_kind: RequestOutputKind | None = None
    extra_args: dict | None = None  # the caller's own data, carried along; nanograph reads none of it
    best_of: int | None = None  # None or n: nanograph returns every completion it samples
    use_beam_search: bool = False  # vLLM's removed flag, refused: beam search is LLM.beam_search()

    def __post_init__(self):
        _check_float("temperature", self.temperature)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("pass structured_outputs or guided_decoding (its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.logit_bias, dict):
            # OpenAI's JSON keys are strings; values are clamped as OpenAI does.
            self.logit_bias = {_token_id("logit_bias", token_id): _clamped_bias(bias)
                               for token_id, bias in self.logit_bias.items()}
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM's: True asks for one
                setattr(self, name, 1)
        if isinstance(self.seed, np.integer):
            self.seed = int(self.seed)
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)  # the request's own copy
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.verify()
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.temperature == 0:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's), to change without touching this one."""
        return copy.deepcopy(self)

    def verify(self):
        """Raise ValueError on an invalid field (a wrong type too, as vLLM does); also called by the engine, as
        fields may change after construction."""
        if isinstance(self.n, bool) or not isinstance(self.n, (int, np.integer)):
            raise ValueError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        _check_int("top_k", self.top_k)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}.")
        if self.seed is not None and not -2**63 <= self.seed <= 2**64 - self.n:
            raise ValueError(f"seed must be a 64-bit integer, in [-2**63, 2**64 - n] (completion i of n takes seed + "
                             f"i), got {self.seed}.")
        _check_int("min_tokens", self.min_tokens)
        for name in ("max_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            _check_float(name, getattr(self, name))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                             f"(1: none), got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:  # -1 is accepted for disabled, as vLLM does
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < -1:
                raise ValueError(f"{name} must be non-negative or -1, got {getattr(self, name)}.")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}.")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if not isinstance(self.stop, list) or not all(isinstance(stop_str, str) for stop_str in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not stop_str for stop_str in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}.")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not all(
                    isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be a list of integers, got {self.allowed_token_ids!r}.")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not None and empty!")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or not all(
                isinstance(word, str) and word.strip() for word in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}.")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        self._verify_output_options()

    def _verify_output_options(self):
        if self.truncate_prompt_tokens is not None:
            check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        for name in ("detokenize", "spaces_between_special_tokens", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. Set detokenize=True to use "
                             "stop.")
        if self.output_kind is not None and not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY) or None, "
                             f"got {self.output_kind!r}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}.")
        if self.best_of is not None:
            _check_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and "
                                 f"best_of={self.best_of}.")
            if self.best_of > self.n:
                raise ValueError(f"best_of={self.best_of} is not supported: nanograph does not sample extra "
                                 f"completions to return the best n; leave best_of unset (or equal to n), or ask "
                                 f"for n={self.best_of} with logprobs=0 and keep the highest cumulative_logprob")
        if self.use_beam_search:
            raise ValueError("use_beam_search is not a sampling option: beam search is "
                             "LLM.beam_search(prompts, BeamSearchParams(beam_width=..., max_tokens=...))")


def check_truncate_prompt_tokens(value):
    """truncate_prompt_tokens keeps the prompt's last k tokens: k >= 1, or -1 for max_model_len."""
    _check_int("truncate_prompt_tokens", value)
    if value == 0 or value < -1:
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {value}")


def truncation_length(truncate_prompt_tokens: int, max_model_len: int) -> int:
    """The tokens truncate_prompt_tokens keeps (-1: max_model_len)."""
    if truncate_prompt_tokens > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={truncate_prompt_tokens} is more than max_model_len={max_model_len}; "
                         f"keep at most {max_model_len} tokens (-1: max_model_len)")
    return max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def _check_int(name: str, value):
    """An int field takes ints (numpy's too), never bools or floats: 2.5 tokens is a mistake, not a request."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if not -2**31 <= value < 2**31:
        raise ValueError(f"{name} must fit in 32 bits, got {value}.")


def _check_float(name: str, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")


def _token_id(name: str, token_id) -> int:
    """A token id given as an int or its decimal text (OpenAI's JSON keys)."""
    if isinstance(token_id, str) and re.fullmatch(r"-?[0-9]+", token_id):
        return int(token_id)
    if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
        raise ValueError(f"{name} keys must be token ids (ints), got {token_id!r}.")
    return int(token_id)


def _clamped_bias(bias) -> float:
    _check_float("logit_bias value", bias)
    return float(min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias)))


# Beam search (LLM.beam_search, beam_search.py).

@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters (vLLM's names and defaults)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # 0: each beam's sampled candidate is its most likely token
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep a final EOS token's text in BeamSearchSequence.text

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            _check_int(name, getattr(self, name))
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        for name in ("temperature", "length_penalty"):
            _check_float(name, getattr(self, name))
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
