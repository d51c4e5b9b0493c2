"""TextEvents writes the same bytes as the chunk model's own JSON for any text: quotes, backslashes, control
characters, non-ASCII, emoji, and the marker itself."""
import random

from nanograph.serve.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, \
    CompletionResponse
from nanograph.serve.streaming import TextEvents, event

ALPHABET = ['"', "\\", "/", "\n", "\r", "\t", "\b", "\f", "\x00", "\x1f", "\x7f", "\u2028", "é", "中", "😀", " ", "a",
            "<", ">", "&", "'", "\u00a0", "\ufeff", TextEvents.MARKER]


def completion_chunk(text: str, model: str = "m") -> CompletionResponse:
    return CompletionResponse(id="cmpl-1", created=7, model=model, choices=[CompletionChoice(index=2, text=text)])


def chat_chunk(text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m",
                               choices=[ChatChunkChoice(index=1, delta=ChatDelta(content=text))])


def test_text_events_equal_the_models_json_on_random_texts():
    rng = random.Random(0)
    texts = ["", " Paris."] + ["".join(rng.choices(ALPHABET, k=rng.randint(1, 12))) for _ in range(500)]
    texts += ["".join(chr(rng.randint(1, 0xD7FF)) for _ in range(20)) for _ in range(200)]
    for make_chunk in (completion_chunk, chat_chunk):
        events = TextEvents(make_chunk)
        assert events.halves is not None
        for text in texts:
            assert events(text) == event(make_chunk(text)), repr(text)
    # A reasoning delta holds its text twice.
    events = TextEvents(reasoning_chunk, fields=2)
    assert events.halves is not None and TextEvents(reasoning_chunk).halves is None
    for text in texts:
        assert events(text) == event(reasoning_chunk(text)), repr(text)


def reasoning_chunk(text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[
        ChatChunkChoice(index=0, delta=ChatDelta(reasoning=text, reasoning_content=text))])


def test_a_model_name_holding_the_marker_takes_the_models_path():
    events = TextEvents(lambda text: completion_chunk(text, model=TextEvents.MARKER))
    assert events.halves is None
    assert events(" x\n") == event(completion_chunk(" x\n", model=TextEvents.MARKER))

