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
