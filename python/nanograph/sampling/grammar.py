"""Structured outputs on the host, with llguidance: a request's grammar compiled once per spec (GrammarCompiler), a
matcher per sequence (Grammar) that says which tokens may come next as a bitmask row and is advanced by each
sampled token. The bitmask is applied on the device by token_bitmask.py."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..sampling_params import StructuredOutputsParams

FIELDS = {"json_schema": "json", "choice": "choice", "regex": "regex", "grammar": "grammar"}
MAX_COMPILED = 1024  # compiled grammars kept, the least recently used dropped first (a server sees endless schemas)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: bit j of word i allows token 32 * i + j."""
    return -(-vocab_size // 32)


class GrammarCompiler:
    """Compiles structured-output specs against one tokenizer, each spec once while it stays among the max_compiled
    most recently used."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], max_compiled: int = MAX_COMPILED):
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        # The model's end-of-text tokens end a grammar (None: the tokenizer's).
        self._eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size] or None
        self._tokenizer = None  # llguidance's, made at the first spec
        self._compiled: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._max_compiled = max_compiled

    def prepare(self) -> bool:
        """Makes llguidance's view of the tokenizer now (about a second for a 150k vocabulary) rather than at the
        first structured request, if llguidance is installed and takes the model's tokenizer; whether it did. A
        tokenizer llguidance refuses (e.g. a slow one) is left to each structured request's error."""
        if self._hf_tokenizer is None:
            return False
        try:
            self._llguidance_tokenizer(_llguidance())
        except (ImportError, ValueError, TypeError, RuntimeError):
            return False
        return True

    def _llguidance_tokenizer(self, llguidance):
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size,
                                                           eos_token=self._eos_token_ids)
        return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The grammar of spec, checked against the tokenizer; ValueError naming the field for a bad one."""
        llguidance = _llguidance()
        key = spec.spec()
        if key not in self._compiled:
            if self._hf_tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer, and this model folder has none")
            self._llguidance_tokenizer(llguidance)
            field = "json" if spec.json_object else FIELDS[key[0]]
            try:
                grammar = llguidance.grammar_from(*key)
                error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
            except (ValueError, TypeError, RuntimeError) as exc:
                error = str(exc)
            if error:
                raise ValueError(f"structured_outputs.{field} is not a valid {key[0].replace('_', ' ')}: {error}")
            self._compiled[key] = grammar
            if len(self._compiled) > self._max_compiled:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return self._compiled[key]

    def matcher(self, grammar: str) -> Grammar:
        """A new sequence's matcher for a compiled grammar."""
        llguidance = _llguidance()
        return Grammar(llguidance.LLMatcher(self._tokenizer, grammar), llguidance.numpy.fill_next_token_bitmask,
                       self._tokenizer.tokenize_str)


class Grammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher, fill, tokenize):
        self._matcher = matcher
        self._fill = fill
        self._tokenize = tokenize  # text -> token ids, as a piece of a reply (no prefix space, no special tokens)
        # With a reasoning parser, while the reply is still thinking: its reasoning.ThinkingEnd. The grammar applies
        # from the token after the thinking's end; until then it masks nothing and takes no token.
        self.thinking = None

    @property
    def applies(self) -> bool:
        """Whether the grammar constrains the next token (it is not waiting for the thinking to end)."""
        return self.thinking is None

    def fill(self, bitmask: np.ndarray, row: int):
        """Writes the tokens that may come next into bitmask[row] (int32 [*, bitmask_words(vocab)])."""
        self._fill(self._matcher, bitmask, row)

    def ended(self) -> bool:
        """Whether the grammar is complete and can take no further token: only the end of text may come."""
        return self._matcher.is_stopped()

    def advance_text(self, text: str) -> bool:
        """Moves past text the grammar did not choose (the answer's first characters, in the token that ended the
        thinking), as tokens of that text in the middle of a reply (a SentencePiece tokenizer's encode would add a
        word start, "▁", before it); False if the grammar does not allow it."""
        return all(self.advance(token_id) for token_id in self._tokenize(text))

    def advance(self, token_id: int) -> bool:
        """Moves past a sampled token; False if the grammar does not allow it. StructuredOutputError where
        llguidance cannot follow the grammar any further (a grammar past its limits, e.g. nested repetitions)."""
        if self._matcher.consume_token(token_id) and not self._matcher.is_error():
            return True
        error = (self._matcher.get_error() or "").split("\n", 1)[0] if self._matcher.is_error() else ""
        if error and "doesn't satisfy the grammar" not in error:
            raise StructuredOutputError(f"structured_outputs: llguidance cannot follow this grammar past the text "
                                        f"generated so far ({error}); simplify it (fewer or smaller nested "
                                        "repetitions)")
        return False


class StructuredOutputError(ValueError):
    """A request's grammar that llguidance accepted but cannot follow as it generates: the request's fault."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise ImportError("structured_outputs needs the llguidance package: pip install 'nanograph[structured]' "
                          "(or pip install llguidance)") from None
    return llguidance
