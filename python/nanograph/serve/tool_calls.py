"""Tool calls in a chat reply, as vLLM's server returns them.

tool_choice "auto" (or tools without tool_choice) needs `nanograph serve --enable-auto-tool-choice
--tool-call-parser hermes`: the model writes each call as Hermes' format, which Qwen2.5 and Qwen3 use,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the parser turns those into the message's tool_calls (the text before the first call is its content; text
after a call is dropped, as vLLM's parser drops it), with finish_reason "tool_calls". A call whose JSON does not
parse leaves the whole reply as text, as vLLM's parser does. Streamed, the content goes out as it comes (text after
a call too), text that may open a call is held back until it is known, and each call is sent whole once its
closing tag arrives (or the reply ends); a call that does not parse then goes out as text, the others stay calls.

`--tool-call-parser llama3_json` reads Llama 3.1-3.3's JSON tool calls, as vLLM's parser of that name does: a reply
that is one or more calls, each a JSON object {"name": ..., "parameters": {...}} (or "arguments"), separated by
";" (after <|python_tag|>, where special tokens are kept), is the message's tool_calls with no content; any other
reply, or one whose objects are not all calls, is all content. Streamed, a reply that starts with "{" is held back
and each call sent whole as its object closes; one that does not is content as it comes, as it was written. A call
once sent stays sent: text after a reply's calls is content in a stream (the whole reply's parse makes all of it
content).

`--tool-call-parser mistral` reads Mistral's: the text before [TOOL_CALLS] is the content, and the JSON array after
it ([{"name": ..., "arguments": {...}}, ...]) the calls, each with a 9-character id (Mistral's chat template takes
no other; the server gives named and required tool choices' calls such ids too, ServedModel.with_call_id).
[TOOL_CALLS] is a special token: a request with tools keeps special tokens in its text, as vLLM's parser asks.
Streamed, the content goes out as it comes, and the calls once their array closes (or the reply ends); text after
the array is content, and a later [TOOL_CALLS] array more calls (the whole reply's parse reads the first array
alone, as vLLM's does).

`--tool-call-parser pythonic` reads calls written as a Python list of calls with keyword arguments,
[get_weather(city="Paris"), get_time()] (Llama 3.2 and 4 with a pythonic template, ToolACE): a reply that is such
a list (its arguments literals: strings, numbers, True/False/None, lists, dicts) is its calls with no content; any
other reply (text after the list too) is all content. Streamed, a reply that starts with "[" is held back to its
end.

Arguments are JSON text as the model wrote their characters; a lone surrogate (a model's "\\ud800") is escaped.

A named tool_choice ({"type": "function", "function": {"name": ...}}) needs no parser: the reply is constrained
to JSON that follows the function's parameters schema (structured outputs), and that JSON is the call's
arguments. tool_choice "required" needs none either: the reply is constrained to a JSON array of one or more
{"name": ..., "parameters": {...}} objects, each naming one of the tools and following its parameters schema (vLLM's
schema), and each object is a call, sent whole once it closes when streamed."""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from ..reasoning import tag_prefix_at_end

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_ERRORS = (ValueError, RecursionError)  # what decoding a model's JSON raises (RecursionError: nested too deep)
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE) + r"|" + re.escape(OPEN) + r"(.*)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex}"

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _parsed(body: str) -> ToolCall | None:
    """A call's JSON ({"name": ..., "arguments": {...}}), or None when it is not one."""
    try:
        return _call_of(json.loads(body))
    except JSON_ERRORS:
        return None


def _call_of(call) -> ToolCall | None:
    """A decoded call ({"name": ..., "arguments" or "parameters": {...}}), or None when it is not one."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
            not ("arguments" in call or "parameters" in call):  # {"name": "Alice", "age": 30} is no call
        return None
    if not _utf8(call["name"]):
        return None
    arguments = call["arguments"] if "arguments" in call else call["parameters"]
    return ToolCall(call["name"], json_text(arguments))


def json_text(value, allow_nan: bool = True) -> str:
    """A decoded value as JSON text, its characters as they are, but for those UTF-8 cannot carry (a lone surrogate,
    which a model's "\\ud800" decodes to): then every non-ASCII character is escaped."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=allow_nan)
    return text if _utf8(text) else json.dumps(value, allow_nan=allow_nan)


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def extract_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """A whole reply -> (its content, its calls), by the parser's format. Without a call, or with one that does not
    parse, the content is the text and there are no calls; otherwise the content is the text before the first call
    (None if empty)."""
    if parser == "llama3_json":
        return _json_calls(text)
    if parser == "mistral":
        return _mistral_calls(text)
    if parser == "pythonic":
        calls = _pythonic_calls(text)
        return (text, []) if calls is None else (None, calls)
    if OPEN not in text:
        return text, []
    calls = []
    for match in _CALL.finditer(text):
        call = _parsed((match.group(1) if match.group(1) is not None else match.group(2)).strip())
        if call is None:
            return text, []
        calls.append(call)
    content = text[:text.index(OPEN)]
    return (content or None), calls


class ToolCallStream:
    """One choice's streamed reply -> its content pieces and its whole calls, in order; each call as (its index
    among the choice's calls, the call)."""

    def __init__(self):
        self.buffer = ""  # text not yet given out: a possible start of a call, or a call still open
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> list[str | tuple[int, ToolCall]]:
        self.buffer += text
        out: list[str | tuple[int, ToolCall]] = []
        while self.buffer:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                out.append(self._call(self.buffer[:end], closed=True))
                self.buffer, self.in_call = self.buffer[end + len(CLOSE):], False
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                if start:
                    out.append(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(OPEN):], True
                continue
            keep = _partial_open(self.buffer)
            if len(self.buffer) > keep:
                out.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return out

    def finish(self) -> list[str | tuple[int, ToolCall]]:
        """The end of the reply: a call left open is parsed as it stands; held text is content."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            return [self._call(rest, closed=False)]
        return [rest] if rest else []

    def _call(self, body: str, closed: bool) -> str | tuple[int, ToolCall]:
        """A call's body -> (its index, the call), or, when it does not parse, its text as the model wrote it."""
        call = _parsed(body.strip())
        if call is None:
            return OPEN + body + (CLOSE if closed else "")
        self.num_calls += 1
        return self.num_calls - 1, call


def _partial_open(text: str) -> int:
    """How many characters at text's end could be the start of OPEN."""
    return tag_prefix_at_end(text, OPEN)



PYTHON_TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


def _json_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """llama3_json: a reply that is only calls, each a JSON object, separated by ";" -> (None, the calls); any
    other reply -> (the text, no calls)."""
    body = _after_python_tag(text.lstrip())
    if not body.startswith("{"):
        return text, []
    calls, position = [], 0
    while position < len(body):
        try:
            decoded, position = _decoder.raw_decode(body, position)
        except JSON_ERRORS:
            return text, []
        call = _call_of(decoded)
        if call is None:
            return text, []
        calls.append(call)
        position = _past_separator(body, position)
    return None, calls


def _after_python_tag(text: str) -> str:
    return text[len(PYTHON_TAG):].lstrip() if text.startswith(PYTHON_TAG) else text


def _past_separator(text: str, position: int) -> int:
    """The position after the whitespace and the one ";" that may follow a call's object."""
    while position < len(text) and text[position].isspace():
        position += 1
    if position < len(text) and text[position] == ";":
        position += 1
    while position < len(text) and text[position].isspace():
        position += 1
    return position


class JsonCallStream:
    """llama3_json, streamed: ToolCallStream's interface. A reply that starts with "{" (after <|python_tag|>) is
    held back and each call given out whole as its object closes; a reply that starts otherwise, or an object that
    is not a call, is content (all the text held back too, once known)."""

    def __init__(self):
        self.buffer = ""  # text not yet given out
        self.mode = "start"  # "start": the reply's start is not known yet; "calls"; "content"
        self.num_calls = 0

    def feed(self, text: str) -> list[str | tuple[int, ToolCall]]:
        self.buffer += text
        if self.mode == "start":
            start = self.buffer.lstrip()
            if not start or (PYTHON_TAG.startswith(start) and len(start) < len(PYTHON_TAG)) or \
                    (start.startswith(PYTHON_TAG) and not _after_python_tag(start)):
                return []  # still whitespace, <|python_tag|> or a part of it
            self.mode = "calls" if _after_python_tag(start).startswith("{") else "content"
        if self.mode == "content":
            text, self.buffer = self.buffer, ""
            return [text] if text else []
        out: list[str | tuple[int, ToolCall]] = []
        while True:
            rest = _after_python_tag(self.buffer.lstrip()) if not self.num_calls else self.buffer
            rest = rest[_past_separator(rest, 0):]
            if not rest.startswith("{"):
                # Something other than the next call: the rest of the reply is content.
                return out + (self._content(rest) if rest else [])
            try:
                decoded, end = _decoder.raw_decode(rest)
            except JSON_ERRORS:  # not closed yet (or nested too deep: text at the end)
                return out
            call = _call_of(decoded)
            if call is None:
                return out + self._content(rest)
            out.append((self.num_calls, call))
            self.num_calls += 1
            self.buffer = rest[end:]

    def _content(self, rest: str) -> list[str]:
        """The reply from rest on is content: before any call, all of it as written (its <|python_tag|> and
        whitespace too, as the whole reply's parse gives it back)."""
        text = rest if self.num_calls else self.buffer
        self.mode, self.buffer = "content", ""
        return [text]

    def finish(self) -> list[str | tuple[int, ToolCall]]:
        """The end of the reply: what is held back (an object left open) is content."""
        rest, self.buffer = self.buffer, ""
        if self.mode == "calls" and self.num_calls:
            rest = rest[_past_separator(rest, 0):]
        return [rest] if rest else []


MISTRAL_TAG = "[TOOL_CALLS]"


def _mistral_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """mistral: the text before [TOOL_CALLS] and the calls of the JSON array after it; the whole text and no calls
    when there is no tag or the array does not parse."""
    content, tag, rest = text.partition(MISTRAL_TAG)
    calls = _mistral_array(rest) if tag else None
    if calls is None:
        return text, []
    return (content or None), calls


def _mistral_array(text: str) -> list[ToolCall] | None:
    """The calls of the JSON array of {"name", "arguments"} objects that text starts with (a lone object is one
    call; what follows it is not read, as vLLM's parser reads the array alone), or None."""
    try:
        decoded, _ = _decoder.raw_decode(text.strip())
    except JSON_ERRORS:
        return None
    calls = [_call_of(call) for call in (decoded if isinstance(decoded, list) else [decoded])]
    if not calls or None in calls:
        return None
    for call in calls:
        call.id = mistral_call_id()
    return calls


def mistral_call_id() -> str:
    """A call id Mistral's chat template takes back: 9 letters and digits."""
    return uuid.uuid4().hex[:9]


class MistralCallStream:
    """mistral, streamed: ToolCallStream's interface. Text before [TOOL_CALLS] is content as it comes (a possible
    start of the tag held back); after it, the array is held back and its calls given out whole once it closes. An
    array that never parses comes out as text at the end, its tag included."""

    def __init__(self):
        self.buffer = ""
        self.in_calls = False
        self.num_calls = 0

    def feed(self, text: str) -> list[str | tuple[int, ToolCall]]:
        self.buffer += text
        if not self.in_calls:
            start = self.buffer.find(MISTRAL_TAG)
            if start < 0:
                keep = tag_prefix_at_end(self.buffer, MISTRAL_TAG)
                out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return [out] if out else []
            content, self.buffer, self.in_calls = self.buffer[:start], self.buffer[start + len(MISTRAL_TAG):], True
            return ([content] if content else []) + self._calls()
        return self._calls()

    def _calls(self) -> list[str | tuple[int, ToolCall]]:
        rest = self.buffer.lstrip()
        try:
            _, end = _decoder.raw_decode(rest)
        except JSON_ERRORS:  # not closed yet (or nested too deep: text at the end)
            return []
        calls = _mistral_array(rest[:end])
        if calls is None:
            return []
        out = [(self.num_calls + i, call) for i, call in enumerate(calls)]
        self.num_calls += len(calls)
        self.buffer, self.in_calls = "", False  # text after the array is content again
        return out + self.feed(rest[end:])

    def finish(self) -> list[str | tuple[int, ToolCall]]:
        """The end of the reply: held text is content (the tag too, before an array that did not parse)."""
        rest, self.buffer = self.buffer, ""
        if self.in_calls:
            rest = MISTRAL_TAG + rest
        return [rest] if rest else []


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """pythonic: the calls of a reply that is a Python list of calls with literal keyword arguments, else None."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            if None in arguments:  # **kwargs
                return None
            # JSON's values only (no sets, bytes, complex numbers, NaN).
            calls.append(ToolCall(node.func.id, json_text(arguments, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return calls


class PythonicCallStream:
    """pythonic, streamed: ToolCallStream's interface. A reply that starts with "[" is held back to its end and is
    then its calls if it is a list of calls, as the whole reply's parse reads it (text after the list makes the
    reply content); a reply that starts otherwise is content as it comes."""

    def __init__(self):
        self.buffer = ""
        self.mode = "start"  # "start", "calls" (held back), "content"
        self.num_calls = 0

    def feed(self, text: str) -> list[str | tuple[int, ToolCall]]:
        self.buffer += text
        if self.mode == "start" and self.buffer.strip():
            self.mode = "calls" if self.buffer.lstrip().startswith("[") else "content"
        if self.mode == "content":
            text, self.buffer = self.buffer, ""
            return [text] if text else []
        return []

    def finish(self) -> list[str | tuple[int, ToolCall]]:
        rest, self.buffer = self.buffer, ""
        calls = _pythonic_calls(rest) if self.mode == "calls" else None
        if calls is not None:
            self.num_calls = len(calls)
            return list(enumerate(calls))
        return [rest] if rest else []


# The streamed parser of each --tool-call-parser.
CALL_STREAMS = {"hermes": ToolCallStream, "llama3_json": JsonCallStream, "mistral": MistralCallStream,
                "pythonic": PythonicCallStream}

# A function without parameters takes none: its arguments are an empty object (OpenAI's reading).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def named_function(tool_choice, tools: list[dict] | None) -> dict | None:
    """The tool a named tool_choice picks (its "function" entry), or None for "none", "auto" and no choice.
    Raises ValueError naming the problem when the name is not among the tools."""
    if not isinstance(tool_choice, dict):
        return None
    chosen = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = chosen.get("name") if isinstance(chosen, dict) else None
    if not isinstance(name, str):
        raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and tool.get("type") == "function" and function.get("name") == name:
            return function
    raise ValueError(f"tool_choice names the function {name!r}, which is not among the request's tools")


def required_calls_schema(tools: list[dict], one_call: bool = False) -> dict:
    """tool_choice "required": the JSON schema of the reply, an array of at least one call of the tools (exactly one
    with one_call: parallel_tool_calls false). The
    parameters' "$defs" move to the schema's root, where their "$ref"s point (as vLLM's do). Raises ValueError
    naming a tool that is not a function, or two tools that define one name differently."""
    calls, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and tool.get("type") == "function"
                and isinstance(function.get("name"), str)):
            raise ValueError(f'tools[{i}] is not {{"type": "function", "function": {{"name": ..., '
                             f'"parameters": ...}}}}')
        parameters = function.get("parameters") or NO_PARAMETERS
        if isinstance(parameters, dict) and isinstance(parameters.get("$defs"), dict):
            parameters = dict(parameters)
            for name, schema in parameters.pop("$defs").items():
                if defs.setdefault(name, schema) != schema:
                    raise ValueError(f"tools[{i}].function.parameters defines $defs/{name} unlike another tool "
                                     "does; give the two definitions different names")
        calls.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, **({"maxItems": 1} if one_call else {}),
              "items": {"type": "object", "anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


class RequiredCallStream:
    """One choice's reply under tool_choice "required" (a JSON array of calls, required_calls_schema) -> its calls,
    each whole once its object closes, as (its index, the call); ToolCallStream's interface. Text that is not such
    an array (a reply cut short by max_tokens) comes out as content at the end."""

    _decoder = json.JSONDecoder()

    def __init__(self):
        self.buffer = ""  # text not yet given out: the rest of the array
        self.opened = False  # the array's "[" has been read
        self.num_calls = 0

    def feed(self, text: str) -> list[str | tuple[int, ToolCall]]:
        self.buffer += text
        out: list[str | tuple[int, ToolCall]] = []
        while True:
            rest = self.buffer.lstrip()
            if not self.opened:
                if not rest.startswith("["):
                    return out
                self.opened, self.buffer = True, rest[1:]
                continue
            if rest.startswith(","):
                rest = rest[1:].lstrip()
            try:
                decoded, end = self._decoder.raw_decode(rest)
            except JSON_ERRORS:  # not closed yet (or nested too deep: text at the end)
                return out
            call = _call_of(decoded) if isinstance(decoded, dict) and "parameters" in decoded else None
            if call is None:
                return out
            self.buffer = rest[end:]
            out.append((self.num_calls, call))
            self.num_calls += 1

    def finish(self) -> list[str | tuple[int, ToolCall]]:
        """The end of the reply: what is left beyond the array's close is content (nothing, when it closed)."""
        rest, self.buffer = self.buffer.strip(), ""
        if self.opened and rest == "]":
            return []
        if self.num_calls and rest.startswith(","):  # the separator before a call cut short
            rest = rest[1:].lstrip()
        return [("[" if self.opened and not self.num_calls else "") + rest] if rest else []
