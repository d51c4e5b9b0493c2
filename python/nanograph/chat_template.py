"""Chat conversations rendered into prompts by the tokenizer's chat template, with vLLM's chat() options."""
from __future__ import annotations

import functools
import json

from .inputs import check_utf8


class ChatOptionError(ValueError):
    """An option of render_chat that cannot be honoured; field: the option's name."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ChatTemplateError(ValueError):
    """The chat template's own error on a conversation (a jinja raise_exception, a keyword it cannot take), as
    vLLM raises it: a ValueError."""


# render_chat's own options: the same keys in chat_template_kwargs win over them, as in vLLM.
CHAT_OPTIONS = ("chat_template", "add_generation_prompt", "continue_final_message", "tools")
# apply_chat_template's arguments that rendering a conversation to text sets itself.
CHAT_RESERVED = ("conversation", "messages", "tokenize", "return_dict")


CONTENT_FORMATS = ("auto", "string", "openai")


def render_chat(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                content_format: str = "auto") -> str:
    """One conversation as prompt text: the assistant's turn opened (add_generation_prompt), or the last message
    left open for the model to continue (continue_final_message). A content is a string, a list of text parts, or
    null (an assistant message that only calls tools). chat_template_kwargs go to the template; the keys of the
    options above win over their arguments. content_format (vLLM's chat_template_content_format): how the template
    sees a content, "string" (text parts joined) or "openai" (a list of {"type": "text", "text": ...} parts, a string
    content as one part); "auto": "openai" where the template loops over a message's content, else "string"."""
    if content_format not in CONTENT_FORMATS:
        raise ChatOptionError("chat_template_content_format", f"chat_template_content_format must be one of "
                              f"{', '.join(CONTENT_FORMATS)}; got {content_format!r}")
    options = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "tools": tools}
    kwargs = dict(chat_template_kwargs or {})
    options.update({name: kwargs.pop(name) for name in CHAT_OPTIONS if name in kwargs})
    reserved = [name for name in CHAT_RESERVED if name in kwargs]
    if reserved:
        raise ChatOptionError("chat_template_kwargs", f"chat_template_kwargs cannot set {', '.join(reserved)}: the "
                              "conversation is rendered to text from the messages given")
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise ChatOptionError("continue_final_message", "Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True: pass add_generation_prompt=False to continue the "
                              "final message")
    if content_format == "auto":
        template = options["chat_template"] if options["chat_template"] is not None else \
            getattr(tokenizer, "chat_template", None)
        content_format = "openai" if isinstance(template, str) and loops_over_content(template) else "string"
    try:
        text = tokenizer.apply_chat_template([_template_message(m, content_format) for m in conversation],
                                             tokenize=False, **options, **kwargs)
    except Exception as exc:
        raise ChatTemplateError(f"the chat template could not render the messages: {type(exc).__name__}: "
                                f"{exc}") from exc
    try:
        check_utf8(text, "a chat message")
    except ValueError as exc:
        raise ChatOptionError("messages", str(exc)) from None
    return text


def chat_prompt_token_ids(tokenizer, conversation: list[dict], add_special_tokens: bool = False, **options
                          ) -> list[int]:
    """One conversation rendered by render_chat (options: its keyword arguments), as token ids (the template writes
    the special tokens, so the tokenizer adds none unless add_special_tokens)."""
    return tokenizer.encode(render_chat(tokenizer, conversation, **options), add_special_tokens=add_special_tokens)


def _template_message(message: dict, content_format: str) -> dict:
    """A chat message as the template sees it: its content one string (text parts joined by newlines, null "") or,
    in the "openai" format, a list of {"type": "text", "text": ...} parts (a string one part, null none); its tool
    calls' arguments, JSON text in OpenAI's messages, parsed, as vLLM does."""
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [_parsed_arguments(call) for call in message["tool_calls"]]}
    content = message.get("content")
    if content_format == "openai":
        texts = [] if content is None else [content] if isinstance(content, str) else \
            [text_content([part]) for part in content]
        return {**message, "content": [{"type": "text", "text": text} for text in texts]}
    return message if isinstance(content, str) else {**message, "content": text_content(content)}


@functools.lru_cache(maxsize=16)
def loops_over_content(template: str) -> bool:
    """Whether a Jinja chat template iterates over a message's content (`for part in message['content']`, through
    filters, tests and slices too, or over a variable set from it), and so takes a content as a list of parts:
    vLLM's "auto" content format. Parsed once per template."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(node) -> bool:
        while isinstance(node, (nodes.Filter, nodes.Test)) or \
                (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        return (isinstance(node, nodes.Getattr) and node.attr == "content") or \
            (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content")

    from_content = {assign.target.name for assign in tree.find_all(nodes.Assign)
                    if isinstance(assign.target, nodes.Name) and is_content(assign.node)}
    return any(is_content(loop.iter) or (isinstance(loop.iter, nodes.Name) and loop.iter.name in from_content)
               for loop in tree.find_all(nodes.For))


# The content parts that are text, and the key that holds it: OpenAI's text part, the Responses API's input and
# output text, and an assistant's refusal (as vLLM reads them).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def text_content(content) -> str:
    """A message's content as the chat template sees it: a string as it is, null as "", text parts joined by
    newlines (vLLM's rule)."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return content
    if not all(isinstance(part, dict) and isinstance(part.get(TEXT_PARTS.get(part.get("type"))), str)
               for part in content):
        raise ValueError("chat() takes text content parts only ({'type': 'text', 'text': ...}; also input_text, "
                         "output_text and refusal)")
    return "\n".join(part[TEXT_PARTS[part["type"]]] for part in content)


def _parsed_arguments(call):
    """A tool call whose function's arguments are JSON text, with them parsed (left as they are otherwise)."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        return {**call, "function": {**function, "arguments": json.loads(arguments)}}
    except json.JSONDecodeError:
        return call
