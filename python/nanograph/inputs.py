"""Prompt types, as vLLM's nanograph.inputs names them: TextPrompt and TokensPrompt are plain dicts with these keys."""
from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str  # text, tokenised by the engine (with the tokenizer's special tokens, e.g. a BOS)


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text of the ids, if known: RequestOutput.prompt reports it


PromptType = str | list[int] | TextPrompt | TokensPrompt


def check_utf8(text: str, what: str):
    """ValueError unless text encodes as UTF-8 (a lone surrogate, e.g. from a bytes-escaped argument, does not,
    and no tokenizer takes one); `what` names the text in the message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 text: {exc.reason} at position {exc.start} "
                         f"({text[exc.start:exc.end]!r}); remove or replace the lone surrogate") from None
