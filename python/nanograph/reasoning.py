"""Reasoning parsers (LLM(reasoning_parser=...), `nanograph serve --reasoning-parser`): a reply's thinking, written
between <think> and </think>, apart from its answer.

Both parsers (qwen3: Qwen3; deepseek_r1: DeepSeek-R1, QwQ) read a reply the same way: it thinks from its start (a
<think> the model writes itself is dropped; a template may have opened the thinking in the prompt) until </think>,
and the rest is the answer, as it is (Qwen3's starts with its blank line). A reply that ends while still thinking
is all reasoning. Where the prompt itself closed the thinking (Qwen3's chat_template_kwargs {"enable_thinking":
false} renders an empty <think></think>), the reply is all answer: `thinking=False`.

The server gives the thinking back in a chat message's (or delta's) `reasoning` field, as vLLM's parsers do; the
same state machine serves whole replies and streams, whose tags may arrive split over deltas. The engine applies a
request's structured-output grammar to the answer only, from the token after </think> (ThinkingEnd), as vLLM
does."""
from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class ReasoningSplitter:
    """Feeds a reply's text as it comes; each feed returns ("reasoning" | "content", text) pieces in order."""

    def __init__(self, parser: str, thinking: bool = True):
        """thinking: whether the reply starts in its thinking (False: the prompt closed it)."""
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        # "start": not yet known whether the reply opens with a <think> to drop; "reasoning": until </think>;
        # "content": the rest.
        self.state = "start" if thinking else "content"
        self.pending = ""  # text held back: it may be the start of a tag
        self.thought = thinking  # whether the reply has a reasoning part (if empty)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        pieces: list[tuple[str, str]] = []
        while self.pending:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if START.startswith(stripped) and len(stripped) < len(START):
                    break  # could still be <think>
                if stripped.startswith(START):
                    self.pending = stripped[len(START):]
                self.state = "reasoning"
            elif self.state == "reasoning":
                end = self.pending.find(END)
                if end >= 0:
                    _add(pieces, "reasoning", self.pending[:end])
                    self.pending = self.pending[end + len(END):]
                    self.state = "content"
                    continue
                held = tag_prefix_at_end(self.pending, END)
                _add(pieces, "reasoning", self.pending[:len(self.pending) - held])
                self.pending = self.pending[len(self.pending) - held:]
                break
            else:
                _add(pieces, "content", self.pending)
                self.pending = ""
        return pieces

    def finish(self) -> list[tuple[str, str]]:
        """The text held back, once the reply has ended."""
        text, self.pending = self.pending, ""
        if not text:
            return []
        if self.state == "start":  # a reply shorter than <think>, or only a part of it
            self.state = "reasoning"
        return [(self.state, text)]


# The prompt's last tokens that say whether its template closed the thinking (<think></think> and blank lines).
PROMPT_END_TOKENS = 8


def prompt_closes_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt's end closed the thinking (<think></think>), so that the reply is all answer."""
    return prompt_text.rstrip().endswith(END)


def reply_thinks(tokenizer, prompt_token_ids: list[int]) -> bool:
    """Whether a reply to this prompt starts in its thinking (the prompt's end did not close it)."""
    return not prompt_closes_thinking(tokenizer.decode(prompt_token_ids[-PROMPT_END_TOKENS:]))


def end_token_id(tokenizer) -> int | None:
    """</think>'s token, where the tokenizer's vocabulary has it as one token (Qwen3's, DeepSeek-R1's), else None."""
    return tokenizer.get_vocab().get(END)


def start_token_id(tokenizer) -> int | None:
    """<think>'s token, where the tokenizer's vocabulary has it as one token, else None."""
    return tokenizer.get_vocab().get(START)


def count_reasoning_tokens(token_ids: list[int], thinking: bool, decode, end_token: int | None = None,
                           start_token: int | None = None) -> int:
    """How many of a reply's tokens are its thinking: those before the token that completes </think> (all of them
    where the reply never does; none where the prompt closed the thinking), less a <think> token it opens with, as
    vLLM counts the tokens between the tags. end_token, start_token: end_token_id's and start_token_id's; decode:
    token ids -> text, searched where the tokenizer has no </think> token."""
    if not thinking:
        return 0
    opened = int(start_token is not None and token_ids[:1] == [start_token])
    if end_token is not None:
        return (token_ids.index(end_token) if end_token in token_ids else len(token_ids)) - opened
    if END not in decode(token_ids):
        return len(token_ids) - opened
    low, high = 1, len(token_ids)  # the fewest first tokens whose text holds </think>
    while low < high:
        middle = (low + high) // 2
        if END in decode(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return max(0, low - 1 - opened)


class ThinkingEnd:
    """Watches a reply, token by token, for the end of its thinking: the token </think> where the tokenizer has it
    as one token, else the first text that completes </think> (read from the reply's detokenizer)."""

    def __init__(self, end_token: int | None):
        self.end_token = end_token
        self.searched = 0  # the text's characters already searched

    def ends_at(self, token_id: int, detokenizer) -> str | None:
        """None while token_id, the reply's newest token, leaves it thinking; else the answer's text that came with
        the end (what the token that completed </think> holds after it; "" for the token </think>)."""
        if self.end_token is not None:
            return "" if token_id == self.end_token else None
        text = detokenizer.text
        start, self.searched = max(0, self.searched - len(END) + 1), len(text)
        end = text.find(END, start)
        return None if end < 0 else text[end + len(END):]


def split_reasoning(parser: str, text: str, thinking: bool = True) -> tuple[str | None, str]:
    """A whole reply's (reasoning, answer); reasoning None where the reply has none."""
    splitter = ReasoningSplitter(parser, thinking)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
    content = "".join(piece for kind, piece in pieces if kind == "content")
    return (reasoning if splitter.thought else None), content


def _add(pieces: list[tuple[str, str]], kind: str, text: str):
    if text:
        pieces.append((kind, text))


def tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (held back until the next text says which)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
