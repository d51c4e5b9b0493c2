"""StopChecker: the one place that decides whether, and why, a sequence has finished."""
from __future__ import annotations

from .sequence import Sequence


class StopChecker:
    """Applied to each sequence once its newest token is known, in vLLM's order: a stop token (EOS unless
    ignore_eos, or one of stop_token_ids), then a stop string ending in the new text (the text of the first
    min_tokens tokens never counts), then the length (max_tokens, or max_model_len). Sets seq.finish_reason and
    seq.stop_reason; the text of a stop token is left out and the text after a stop string cut, unless
    include_stop_str_in_output. Aborts are the engine's."""

    def __init__(self, eos_token_ids: set[int], tokenizer_eos: int | None = None):
        """tokenizer_eos: the tokenizer's end-of-text token, the one EOS whose stop_reason is None; the model's
        other EOS tokens (config.json's, generation_config.json's) report their id, as vLLM's stop_token_ids do."""
        self.eos_token_ids = eos_token_ids
        self.tokenizer_eos = tokenizer_eos

    def check(self, seq: Sequence) -> bool:
        """Whether seq's newest token (token_ids[-1]) ends it."""
        token_id, params, detokenizer = seq.token_ids[-1], seq.params, seq.detokenizer
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        if is_eos or token_id in params.stop_token_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = None if is_eos and token_id == self.tokenizer_eos else token_id
            if detokenizer is not None:
                if params.include_stop_str_in_output:
                    detokenizer.append(token_id)
                self._flush(seq)
            return True
        if detokenizer is not None:
            detokenizer.append(token_id)
            if params.stop:
                # Released at every token, so that the text of the first min_tokens tokens is never searched
                # (vLLM's rule), however late it is read.
                num_new_chars = detokenizer.release()
                if seq.num_completion_tokens > params.min_tokens:
                    stop_string = self._stop_string(detokenizer, num_new_chars, params.stop,
                                                    params.include_stop_str_in_output)
                    if stop_string is not None:
                        seq.finish_reason, seq.stop_reason = "stop", stop_string
                        return True
        if seq.reached_length:
            seq.finish_reason = "length"
            if detokenizer is not None:
                self._flush(seq)
            return True
        return False

    def _flush(self, seq: Sequence):
        """Release the text held back at the sequence's end (a complete character that shared a token with an
        incomplete one), searched for stop strings like any new text: a stop string it completes ends the text
        there and becomes the stop reason."""
        params = seq.params
        num_new_chars = seq.detokenizer.flush()
        if params.stop and seq.num_completion_tokens > params.min_tokens:
            stop_string = self._stop_string(seq.detokenizer, num_new_chars, params.stop,
                                            params.include_stop_str_in_output)
            if stop_string is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_string

    @staticmethod
    def _stop_string(detokenizer, num_new_chars: int, stops: list[str], include: bool) -> str | None:
        """The stop string that ends within the last num_new_chars characters of the text, if any; the text is cut
        before it (after it, if included)."""
        if not num_new_chars:
            return None
        text = detokenizer.text
        for stop in stops:
            # The match must end within the new characters; it may start in the text before.
            index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if index != -1:
                detokenizer.truncate(index + (len(stop) if include else 0))
                return stop
        return None
