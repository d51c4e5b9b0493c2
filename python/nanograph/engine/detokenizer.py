"""Incremental detokenisation of one completion, and its stop strings.

Each token is decoded inside a short window of the tokens before it (starting in the prompt), because a token's
text can depend on its neighbours (a leading space, a character split over several byte tokens). Text is only
released once it no longer ends in "\\ufffd", i.e. never in the middle of a UTF-8 character."""
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
        self.output_text = ""
        self.num_streamed_chars = 0

    def update(self, token_id: int, stopped_by_token: bool) -> str | None:
        """Add one generated token; return the stop string that its text completed, if any. The text of a token
        that ended the sequence (EOS, a stop token id) is left out, unless include_stop_str_in_output."""
        self.num_output_tokens += 1
        if stopped_by_token and not self.include_stop_str_in_output:
            return None
        self.token_ids.append(token_id)
        new_text = self._pending_text()
        if not new_text or new_text.endswith("\ufffd"):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += new_text
        if self.stop and self.num_output_tokens > self.min_tokens:
            return self._truncate_at_stop_string(len(new_text))
        return None

    def flush(self):
        """At the end of a sequence: release the text still held back, even an incomplete character."""
        self.output_text += self._pending_text()
        self.prefix_offset = self.read_offset = len(self.token_ids)

    def take_new_text(self, finished: bool) -> str:
        """Text not streamed yet; it keeps the stop-string margin back until the sequence is finished."""
        end = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if end <= self.num_streamed_chars:
            return ""
        text, self.num_streamed_chars = self.output_text[self.num_streamed_chars:end], end
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
            index = self.output_text.find(stop_str, max(0, len(self.output_text) - num_new_chars - len(stop_str) + 1))
            if index != -1:
                self.output_text = self.output_text[:index + (len(stop_str) if self.include_stop_str_in_output else 0)]
                return stop_str
        return None
