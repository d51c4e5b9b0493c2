"""Incremental detokenisation of one completion, and its stop strings.

Each token is decoded inside a short window of the tokens before it (starting in the prompt), because a token's
text can depend on its neighbours (a leading space, a character split over several byte tokens). Text is only
released once it no longer ends in "\\ufffd", i.e. never in the middle of a UTF-8 character. Without stop
strings nothing needs the text token by token, so it is decoded only when read: one decode per read instead of one
per token keeps detokenisation off the per-step path of large batches."""
from __future__ import annotations

from ..sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Streamed text stays this far behind, so that a stop string being completed is never streamed.
        self.stop_buffer_length = max(map(len, self.stop)) - 1 if self.stop and not self.include_stop_str_in_output \
            else 0
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # the window: token_ids[prefix_offset:read_offset] is already text
        self.read_offset = len(self.token_ids)
        self.num_output_tokens = 0
        self._text = ""
        self.num_streamed_chars = 0

    def update(self, token_id: int, stopped_by_token: bool) -> str | None:
        """Add one generated token; return the stop string that its text completed, if any. The text of a token
        that ended the sequence (EOS, a stop token id) is left out, unless include_stop_str_in_output."""
        self.num_output_tokens += 1
        if stopped_by_token and not self.include_stop_str_in_output:
            return None
        self.token_ids.append(token_id)
        if not self.stop:
            return None
        num_new_chars = self._release()
        if num_new_chars and self.num_output_tokens > self.min_tokens:
            return self._truncate_at_stop_string(num_new_chars)
        return None

    @property
    def output_text(self) -> str:
        self._release()
        return self._text

    def flush(self):
        """At the end of a sequence: release the text still held back, even an incomplete character."""
        self._text += self._pending_text()
        self.prefix_offset = self.read_offset = len(self.token_ids)

    def _release(self) -> int:
        """Moves the pending tokens' text into the output unless it ends inside a character; returns its length."""
        new_text = self._pending_text()
        if not new_text or new_text.endswith("\ufffd"):
            return 0
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._text += new_text
        return len(new_text)

    def take_new_text(self, finished: bool) -> str:
        """Text not streamed yet; it keeps the stop-string margin back until the sequence is finished."""
        output_text = self.output_text
        end = len(output_text) - (0 if finished else self.stop_buffer_length)
        if end <= self.num_streamed_chars:
            return ""
        text, self.num_streamed_chars = output_text[self.num_streamed_chars:end], end
        return text

    def decode_each(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included (logprobs' decoded_token)."""
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]

    def _pending_text(self) -> str:
        """The text of the tokens after read_offset, decoded within the window."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset],
                             skip_special_tokens=self.skip_special_tokens)
        text = decode(self.token_ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        return text[len(prefix_text):]

    def _truncate_at_stop_string(self, num_new_chars: int) -> str | None:
        """Find a stop string that ends in the new text; cut the text before it (after it, if included)."""
        for stop_str in self.stop:
            # The match must end within the new characters; it may start in the text before.
            index = self._text.find(stop_str, max(0, len(self._text) - num_new_chars - len(stop_str) + 1))
            if index != -1:
                self._text = self._text[:index + (len(stop_str) if self.include_stop_str_in_output else 0)]
                return stop_str
        return None
