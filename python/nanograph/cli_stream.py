"""What `nanograph generate` and `nanograph chat` print: a completion's text streamed as it comes, and a chat that
keeps its conversation, each turn rendered by the model's chat template over the whole history."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

from .chat_template import chat_prompt_token_ids
from .engine.intake import Prompt, PromptTooLongError
from .llm import LLM
from .sampling_params import SamplingParams

END_COMMANDS = ("", "/exit")  # an empty line or /exit ends a chat, as end of input does


def stream_text(llm: LLM, prompt: Prompt, params: SamplingParams, write: Callable[[str], object]) -> str:
    """Write the completion of one prompt piece by piece as the engine produces it; its whole text."""
    pieces = []
    for delta in llm.stream(prompt, params):
        if delta.error is not None:
            raise RuntimeError(f"the request failed: {delta.error}")
        if delta.text:
            write(delta.text)
            pieces.append(delta.text)
    return "".join(pieces)


def chat(llm: LLM, params: SamplingParams, user_messages: Iterable[str], write: Callable[[str], object],
         system_prompt: str | None = None) -> list[dict]:
    """Answer each user message in turn, streaming the reply, until the messages end or one is an end command; the
    conversation, system prompt first."""
    conversation = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    for message in user_messages:
        if message.strip() in END_COMMANDS:
            break
        conversation.append({"role": "user", "content": message})
        try:
            reply = stream_text(llm, chat_prompt_token_ids(llm.tokenizer, conversation), params, write)
        except PromptTooLongError as exc:
            turns = sum(turn["role"] == "user" for turn in conversation)
            if turns == 1:
                raise
            raise PromptTooLongError(f"{exc}. A turn's prompt is the whole conversation so far ({turns} of your "
                                     "messages, with the replies): a new chat starts afresh") from None
        write("\n")
        conversation.append({"role": "assistant", "content": reply})
    return conversation


def read_lines(stdin: TextIO, prompt_out: TextIO) -> Iterator[str]:
    """The lines of stdin without their line ends, each asked for with "> " on prompt_out when stdin is a terminal."""
    asking = stdin.isatty()
    while True:
        if asking:
            prompt_out.write("> ")
            prompt_out.flush()
        line = stdin.readline()
        if not line:
            if asking:
                prompt_out.write("\n")  # the shell's prompt then starts its own line
            return
        yield line.rstrip("\r\n")


def flushing_writer(out: TextIO) -> Callable[[str], None]:
    def write(text: str):
        out.write(text)
        out.flush()
    return write
