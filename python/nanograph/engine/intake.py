"""Request intake: a prompt and its SamplingParams checked at the boundary, then made into a Request's sequences.

Every error names the field, what was given and what to do; an invalid request raises before anything is queued."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..config import Config
from ..inputs import PromptType, check_utf8
from ..pooling import Pooler, PoolingParams, PoolingState
from ..reasoning import ThinkingEnd, end_token_id, reply_thinks
from ..sampling import seeded_generator
from ..sampling.grammar import GrammarCompiler
from ..sampling_params import SamplingParams, truncation_length
from .detokenizer import IncrementalDetokenizer
from .request import Request
from .sequence import Sequence

Prompt = PromptType
PROMPT_FORMS = "a string, a list of token ids, TextPrompt {'prompt': str} or TokensPrompt {'prompt_token_ids': [...]}"
_MULTI_MODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


@dataclass
class ValidRequest:
    prompt: str | None  # the text, when given as text (or with its token ids)
    token_ids: list[int]
    params: SamplingParams  # the request's own copy, max_tokens resolved
    bad_words_token_ids: list[list[int]]  # params.bad_words, tokenized
    grammar: str | None  # params.structured_outputs, compiled
    # With the engine's reasoning parser: the grammar applies once the reply's thinking has ended (the prompt did
    # not close the thinking).
    grammar_after_thinking: bool = False
    pooling: PoolingParams | None = None  # a pooling request's (params then only fill the sequence's fields)


def prompt_parts(prompt: Prompt) -> tuple[str | None, list[int] | None]:
    """(text, None) for a text prompt, (text or None, token ids) for token ids; TypeError for anything else."""
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", *_MULTI_MODAL_KEYS})
        if unknown:
            raise ValueError(f"a prompt dict takes 'prompt' (text), or 'prompt_token_ids' (and optionally their text "
                             f"as 'prompt'); got unknown key(s) {unknown}")
        for key in _MULTI_MODAL_KEYS:
            if prompt.get(key):
                raise ValueError(f"{key} is not supported: nanograph's models take text only; pass the prompt's text "
                                 f"or token ids without {key}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"a prompt dict's 'prompt' is its text (a string); got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return text, token_id_list(prompt["prompt_token_ids"])
        if text is None:
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids'; got keys {sorted(prompt)}")
        return text, None
    if isinstance(prompt, str):
        return prompt, None
    return None, token_id_list(prompt)


class PromptTooLongError(ValueError):
    """A prompt of more tokens than max_model_len (prompt_too_long says it)."""


def prompt_too_long(prompt_tokens: int, max_model_len: int, max_context: int) -> PromptTooLongError:
    """The error, with the fixes that are left: raising max_model_len only below the model's own context."""
    keep = f"shorten the prompt (truncate_prompt_tokens=-1 keeps its last {max_model_len} tokens)"
    if max_model_len < max_context:
        fix = f"{keep}, or raise max_model_len (the model takes up to {max_context} positions)"
    else:
        fix = f"{keep}; max_model_len is already the model's whole context"
    return PromptTooLongError(f"prompt has {prompt_tokens} tokens; max_model_len is {max_model_len}: {fix}")


def truncated(token_ids: list[int], truncate_prompt_tokens: int, max_model_len: int) -> list[int]:
    """The last truncate_prompt_tokens tokens (-1: max_model_len), as vLLM keeps them."""
    return token_ids[-truncation_length(truncate_prompt_tokens, max_model_len):]


def token_id_list(token_ids) -> list[int]:
    """A list (or tuple, or 1-D integer numpy array) of ints as a list of Python ints."""
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1 and token_ids.dtype.kind in "iu":
        return token_ids.tolist()
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"a prompt is {PROMPT_FORMS}; got {type(token_ids).__name__}")
    for position, token_id in enumerate(token_ids):
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
            raise TypeError(f"prompt token ids must be ints; the one at position {position} is {token_id!r} "
                            f"({type(token_id).__name__})")
    return [int(token_id) for token_id in token_ids]


def check_prompt_token_ids(token_ids: list[int], vocab_size: int):
    """ValueError naming the first prompt token id outside [0, vocab_size) and its position (ids of any size)."""
    try:
        ids = np.asarray(token_ids, dtype=np.int64)
    except OverflowError:  # an id beyond int64: found one by one
        position = next(i for i, token_id in enumerate(token_ids) if not 0 <= token_id < vocab_size)
    else:
        outside = (ids < 0) | (ids >= vocab_size)
        if not outside.any():
            return
        position = int(outside.argmax())
    raise ValueError(f"prompt token id {token_ids[position]} at position {position} is outside the vocabulary "
                     f"[0, {vocab_size})")


class Intake:
    def __init__(self, config: Config, vocab_size: int, max_context: int, tokenizer, eos_token_ids=(),
                 pooler: Pooler | None = None):
        self.config = config
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.eos_token_ids = list(eos_token_ids)
        self.pooler = pooler  # a pooling engine's (runner="pooling"); None: the engine generates
        self.use_tokenizer(tokenizer)

    def use_tokenizer(self, tokenizer):
        """The tokenizer for text prompts, bad words and grammars (compiled anew against its vocabulary)."""
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        # </think>, where the tokenizer has it as one token (else the reply's text shows the thinking's end).
        self.thinking_end_token = end_token_id(tokenizer) \
            if tokenizer is not None and self.config.reasoning_parser is not None else None

    def validate(self, prompt: Prompt, params: SamplingParams | PoolingParams) -> ValidRequest:
        if isinstance(params, PoolingParams):
            return self._validate_pooling(prompt, params)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams (or a PoolingParams, on an engine built with "
                            f"runner='pooling'), got {type(params).__name__}")
        if self.pooler is not None:
            raise ValueError("this engine runs the model as an embedding model (runner='pooling'): it pools prompts "
                             "(embed(), encode()) and generates nothing; build it with runner='generate' (the "
                             "command line's --runner generate, its default) to generate text")
        # Its own copy, validated again (its fields may have changed since construction).
        params = replace(params)
        text, token_ids = self._prompt_tokens(prompt, params.truncate_prompt_tokens)
        max_model_len = self.config.max_model_len
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model folder has none; use stop_token_ids")
        for token_id in params.stop_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"stop_token_ids holds {token_id}, outside the vocabulary [0, {self.vocab_size})")
        max_logprobs = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and max_logprobs != -1 and not 0 <= asked <= max_logprobs:
                raise ValueError(f"{name}={'all (-1)' if asked == -1 else asked} is more than "
                                 f"max_logprobs={max_logprobs}; ask for at most {max_logprobs}, or raise the "
                                 "engine's max_logprobs (-1: no limit)")
        room = max(1, max_model_len - len(token_ids))
        if params.max_tokens is None and params.min_tokens > room:
            raise ValueError(f"min_tokens={params.min_tokens} does not fit: the {len(token_ids)}-token prompt "
                             f"leaves {room} of max_model_len={max_model_len}; lower min_tokens or raise "
                             f"max_model_len")
        if params.max_tokens is None:
            params.max_tokens = room
        self._check_token_ids("logit_bias", params.logit_bias or ())
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or ())
        bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        if params.allowed_token_ids is not None:
            self._check_something_allowed(params, bad_words_token_ids)
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        after_thinking = grammar is not None and self.config.reasoning_parser is not None and \
            reply_thinks(self.tokenizer, token_ids)
        return ValidRequest(text, token_ids, params, bad_words_token_ids, grammar, after_thinking)

    def _validate_pooling(self, prompt: Prompt, params: PoolingParams) -> ValidRequest:
        if self.pooler is None:
            raise ValueError("pooling (embed(), encode()) needs the model run as an embedding model: build the engine "
                             "with runner='pooling' (vLLM's task='embed' is taken too)")
        params = params.clone()  # its own copy, validated again (its fields may have changed since construction)
        self.pooler.check(params)
        text, token_ids = self._prompt_tokens(prompt, params.truncate_prompt_tokens)
        return ValidRequest(text, token_ids, SamplingParams(max_tokens=1, detokenize=False), [], None,
                            pooling=params)

    def _prompt_tokens(self, prompt: Prompt, truncate_prompt_tokens: int | None) -> tuple[str | None, list[int]]:
        """The prompt's text (if given) and its token ids, encoded, truncated and checked."""
        text, token_ids = prompt_parts(prompt)
        if token_ids is None:
            token_ids = self._encode(text)
        if not token_ids:
            raise ValueError("prompt is empty; give at least one token")
        max_model_len = self.config.max_model_len
        if truncate_prompt_tokens is not None:
            token_ids = truncated(token_ids, truncate_prompt_tokens, max_model_len)
        check_prompt_token_ids(token_ids, self.vocab_size)
        if len(token_ids) > max_model_len:
            raise prompt_too_long(len(token_ids), max_model_len, self.max_context)
        return text, token_ids

    def _check_something_allowed(self, params: SamplingParams, bad_words_token_ids: list[list[int]]):
        """allowed_token_ids must leave a token to sample at every step: one that no one-token bad word bans,
        and while min_tokens holds, one that is neither EOS nor a stop token id."""
        banned = {word[0] for word in bad_words_token_ids if len(word) == 1}
        left = set(params.allowed_token_ids) - banned
        if not left:
            raise ValueError(f"allowed_token_ids {sorted(params.allowed_token_ids)} are all banned by bad_words, "
                             "so no token can be sampled; allow a token that bad_words does not hold")
        if params.min_tokens > 0 and left <= {*self.eos_token_ids, *params.stop_token_ids}:
            raise ValueError(f"min_tokens={params.min_tokens} holds back EOS and stop_token_ids, and "
                             f"allowed_token_ids {sorted(params.allowed_token_ids)} allow nothing else; allow "
                             "another token or set min_tokens to 0")

    def request(self, request_id: str, valid: ValidRequest, owner: object | None = None) -> Request:
        """The request's n sequences: sibling i has seed + i, so that the completions differ yet each repeats."""
        params, token_ids = valid.params, valid.token_ids
        if valid.pooling is not None:
            seq = Sequence(request_id, valid.prompt, token_ids, params, 0, len(token_ids) + 1)
            seq.pooling = PoolingState(valid.pooling, self.pooler.pooling_type)
            return Request(request_id, [seq], owner)
        # At least one token, even for a prompt of max_model_len tokens.
        max_num_tokens = min(len(token_ids) + params.max_tokens, max(self.config.max_model_len, len(token_ids) + 1))
        seqs = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            seq_params = params if params.n == 1 else replace(params, n=1, best_of=None, seed=seed)
            seq = Sequence(request_id, valid.prompt, token_ids, seq_params, index, max_num_tokens)
            if seed is not None:  # a sibling's seed + index may be -1, which SamplingParams reads as no seed
                seq.generator = seeded_generator(seed)
            if self.tokenizer is not None and seq_params.detokenize:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, seq_params)
            seq.bad_words_token_ids = valid.bad_words_token_ids
            if valid.grammar is not None:
                seq.grammar = self.grammars.matcher(valid.grammar)
                # Without a </think> token the thinking's end is read from the text: none without a detokenizer
                # (detokenize=False), where the grammar applies from the first token.
                if valid.grammar_after_thinking and (self.thinking_end_token is not None or
                                                     seq.detokenizer is not None):
                    seq.grammar.thinking = ThinkingEnd(self.thinking_end_token)
            seqs.append(seq)
        return Request(request_id, seqs, owner)

    def _check_token_ids(self, field: str, token_ids):
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"{field} holds token id {token_id}, outside the vocabulary [0, {self.vocab_size}) "
                                 f"of {self.vocab_size} tokens")

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as vLLM takes them: the word without leading spaces (banned at the start of the
        text), and with one leading space where that makes another first token of as many tokens (in the middle)."""
        if bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer, and this model folder has none; use logit_bias")
        words = []
        for word in bad_words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            words.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                words.append(spaced)
        self._check_token_ids("bad_words", [token_id for word in words for token_id in word])
        return words

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (the model folder has none, or skip_tokenizer_init is "
                             "set); pass prompts as token-id lists")
        check_utf8(text, "prompt")
        return self.tokenizer.encode(text)
