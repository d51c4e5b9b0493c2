"""Incremental detokenisation of one completion: text only (the stop checker decides where it ends).

Each token is decoded inside a short window of the tokens before it (starting in the prompt), because a token's
text can depend on its neighbours (a leading space, a character split over several byte tokens). Text is only
released once it no longer ends in "\\ufffd", i.e. never in the middle of a UTF-8 character (nor, at the end, a
character left incomplete). Without stop strings nothing needs the text token by token, so it is decoded only when
read: one decode per read instead of one per token keeps detokenisation off the per-step path of large batches."""
from __future__ import annotations

import os

from ..sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character's bytes come from at most this many tokens (its 4 bytes, one a token).
CHARACTER_TOKENS = 4
# The tokens before a logprob's position that decode_each reads.
LOGPROB_CONTEXT_TOKENS = PROMPT_CONTEXT_TOKENS + CHARACTER_TOKENS - 1


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        # Never the tokenizer's clean_up_tokenization_spaces (Llama 3's config sets it): it drops the space before
        # punctuation (" ." -> "."), which the model wrote; vLLM's texts never have it.
        self.raw_options = {"clean_up_tokenization_spaces": False} \
            if getattr(tokenizer, "clean_up_tokenization_spaces", False) else {}
        self.decode_options = {"skip_special_tokens": params.skip_special_tokens,
                               "spaces_between_special_tokens": params.spaces_between_special_tokens,
                               **self.raw_options}
        # Streamed text stays this far behind, so that a stop string being completed is never streamed.
        self.stop_buffer_length = max(map(len, params.stop)) - 1 \
            if params.stop and not params.include_stop_str_in_output else 0
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # the window: token_ids[prefix_offset:read_offset] is already text
        self.read_offset = len(self.token_ids)
        # A prompt that ends inside a character leaves that character's first bytes pending (at most 3 of UTF-8's
        # 4): the completion's first tokens finish it, and its text starts with the whole character.
        last_bytes = max(self.read_offset - 3, 0)
        while self.read_offset > last_bytes and self._decode(self.token_ids[:self.read_offset]).endswith("\ufffd"):
            self.read_offset -= 1
        self._text = ""
        self.num_streamed_chars = 0

    def append(self, token_id: int):
        """Add one generated token to the text (decoded when the text is next read)."""
        self.token_ids.append(token_id)

    @property
    def text(self) -> str:
        self.release()
        return self._text

    def release(self) -> int:
        """Moves the pending tokens' text into the output unless it ends inside a character; returns its length."""
        new_text = self._pending_text()
        if not new_text or new_text.endswith("\ufffd"):
            return 0
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._text += new_text
        return len(new_text)

    def truncate(self, length: int):
        """Cut the text to its first length characters (at a stop string)."""
        self._text = self._text[:length]

    def flush(self) -> int:
        """At the end of a sequence: release the text still held back, but for a character left incomplete at its
        end (vLLM's rule: a partial character is never text); returns its length."""
        new_text = self._pending_text().rstrip("\ufffd")
        self._text += new_text
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return len(new_text)

    def take_new_text(self, finished: bool) -> str:
        """Text not streamed yet; it keeps the stop-string margin back until the sequence is finished."""
        text = self.text
        end = len(text) - (0 if finished else self.stop_buffer_length)
        if end <= self.num_streamed_chars:
            return ""
        new_text, self.num_streamed_chars = text[self.num_streamed_chars:end], end
        return new_text

    @property
    def streamed_text(self) -> str:
        """The text take_new_text has handed out so far."""
        return self._text[:self.num_streamed_chars]

    def decode_each(self, token_ids: list[int], context: list[int] = ()) -> list[str]:
        """Each token's text as the next token after `context` (the tokens before it, the last
        LOGPROB_CONTEXT_TOKENS of them are enough), special tokens included: logprobs' decoded_token. A token whose
        own text holds part of a character (byte tokens of an emoji) is decoded after the tokens before it that hold
        the character's first bytes: "" while the character is still incomplete, and the whole character, with the
        text of those tokens, from the token that completes it, as vLLM gives them."""
        texts = [self._decode([token_id], self.raw_options) for token_id in token_ids]
        if not any("\ufffd" in text for text in texts):
            return texts
        context = list(context)
        start = len(context)  # context[start:]: the tokens holding the first bytes of a character not yet complete
        raw = self.raw_options
        while start > 0 and len(context) - start < CHARACTER_TOKENS - 1 and \
                self._decode(context[max(0, start - PROMPT_CONTEXT_TOKENS):start], raw).endswith("\ufffd"):
            start -= 1
        before = context[max(0, start - PROMPT_CONTEXT_TOKENS):start]
        before_text = self._decode(before, self.raw_options)
        for i, (token_id, text) in enumerate(zip(token_ids, texts)):
            if "\ufffd" not in text:
                continue
            whole = self._decode(before + context[start:] + [token_id], self.raw_options)
            text = whole[len(os.path.commonprefix([whole, before_text])):]
            texts[i] = "" if text.endswith("\ufffd") else text
        return texts

    def discard_pending(self):
        """Keep the text released so far and drop the tokens not decoded yet (a request that failed reading them
        ends with the text it had)."""
        del self.token_ids[self.read_offset:]
        self.prefix_offset = self.read_offset

    def _pending_text(self) -> str:
        """The text of the tokens after read_offset, decoded within the window."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        return text[len(prefix_text):]

    def _decode(self, token_ids: list[int], options: dict | None = None) -> str:
        """The tokens' text (with decode_options unless options are given). A model's vocabulary is often padded
        past its tokenizer's: the ids past the tokenizer have no text, as Hugging Face's fast tokenizers give them,
        where a slow (SentencePiece) one would raise."""
        options = self.decode_options if options is None else options
        try:
            return self.tokenizer.decode(token_ids, **options)
        except Exception:
            size = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else None
            known = token_ids if size is None else [token_id for token_id in token_ids if token_id < size]
            if len(known) == len(token_ids):
                raise
            return self.tokenizer.decode(known, **options)
