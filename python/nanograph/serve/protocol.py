"""The OpenAI API's request and response bodies (with vLLM's extra sampling fields), as pydantic models.

Requests are validated as vLLM validates them, by pydantic's default (lax) rules: "0.7" is a float, "16" and 2.0 are
ints, "true" is a bool, but 2.5 is not an int and 5 is not a string; a null field means its default (OpenAI's schema
allows null for every optional field, and vLLM takes it). Unknown fields are accepted and ignored, as vLLM
does, and the handler logs their names."""
from __future__ import annotations

import time
import typing
from typing import Generic, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from ..chat_template import TEXT_PARTS, text_content
from ..sampling_params import GRAMMAR_KINDS, GRAMMAR_OPTIONS, SamplingParams, StructuredOutputsParams

# The request fields that SamplingParams takes under the same name.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                   "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "bad_words",
                   "spaces_between_special_tokens", "best_of")
# vLLM's older request fields for a grammar, each one kind of StructuredOutputsParams.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _admits_none(annotation) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


class Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """A null field that cannot hold None takes its default ("stream": null is "stream": false), as the module's
        docstring says; a field that can (max_tokens) keeps its null, which means something."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields
                    or cls.model_fields[key].is_required() or _admits_none(cls.model_fields[key].annotation)}
        return data


class StreamOptions(Request):
    # vLLM's default: stream_options given without include_usage asks for the usage chunk (null: none, as vLLM
    # tests it for truth).
    include_usage: bool | None = True
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class JsonSchemaFormat(Request):
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, validation_alias=AliasChoices("schema", "json_schema"))
    strict: bool | None = None


class ResponseFormat(Request):
    """OpenAI's: text (no constraint), json_object (any JSON object) or json_schema (JSON following its schema)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ValueError("response_format.json_schema.schema is required when response_format.type is "
                             "json_schema")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


class SamplingRequest(Request):
    """What completions and chat completions share: the model, streaming and the sampling fields."""
    model: str | None = None  # None or "": the one this server serves (as vLLM)
    request_id: str | None = None  # vLLM's: the response's id (after an X-Request-Id header)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)  # vLLM's bounds: an int64
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None  # token id (as OpenAI's JSON key) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # vLLM's: one of json, regex, choice, grammar, json_object; its options
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    spaces_between_special_tokens: bool | None = None
    best_of: int | None = None  # None or n: more is a 400 (SamplingParams' message)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len), as vLLM
    # vLLM's: logprobs name each token "token_id:{id}", not by its text (None: --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: each prompt token's logprob and the top ones (-1: all), on non-streamed requests.
    prompt_logprobs: int | None = None
    # vLLM's: under --scheduling-policy priority, lower values are served first (else only 0 is taken).
    priority: int = 0
    # vLLM's field that this server does not implement: a 400 rather than silently ignored.
    use_beam_search: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field asked for that this server cannot honour."""
        if self.use_beam_search:
            return "use_beam_search", "beam search is not served over HTTP; drop use_beam_search"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt logprobs are served on non-streamed requests; set stream to false, " \
                                      "or drop prompt_logprobs"
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
                        ) -> SamplingParams:
        """The request's SamplingParams; the fields it left out (or null) take the model's defaults (its
        generation_config.json's, as vLLM's server does; its max_new_tokens caps max_tokens, as vLLM's does), then
        SamplingParams' own. Raises SamplingParams' ValueError on an invalid value."""
        defaults = dict(defaults or {})
        default_max_tokens = defaults.pop("max_tokens", None)
        given = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        max_tokens = min((value for value in (max_tokens, default_max_tokens) if value is not None), default=None)
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=self._grammar(), **{**defaults, **given})

    def grammar_renames(self) -> dict[str, str]:
        """The grammar's name in StructuredOutputsParams' messages -> the request field that gave it."""
        if self.response_format is not None and self.response_format.type == "json_schema":
            return {"structured_outputs.json": "response_format.json_schema.schema"}
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                return {f"structured_outputs.{kind}": name}
        return {}

    def _grammar(self) -> StructuredOutputsParams | None:
        """The one grammar the request asks for, by whichever field it uses."""
        grammars = {}
        if self.response_format is not None and self.response_format.type != "text":
            grammars["response_format"] = self.response_format.structured_outputs()
        if self.structured_outputs is not None:
            unknown = set(self.structured_outputs) - {*GRAMMAR_KINDS, *GRAMMAR_OPTIONS, "structural_tag"}
            if unknown:
                raise ValueError(f"structured_outputs takes json, regex, choice, grammar or json_object (and the "
                                 f"options {', '.join(GRAMMAR_OPTIONS)}); got {', '.join(sorted(unknown))}")
            grammars["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                grammars[name] = StructuredOutputsParams(**{kind: getattr(self, name)})
        if len(grammars) > 1:
            raise ValueError(f"{' and '.join(grammars)} each ask for a grammar: give one of them")
        return next(iter(grammars.values()), None)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # null: up to max_model_len
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # OpenAI's; not supported (a 400, as vLLM)
    add_special_tokens: bool = True  # vLLM's: a text prompt takes the tokenizer's special tokens (a BOS)

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix is not None:
            return "suffix", "suffix is not supported; drop it"
        return super().unsupported()


class TextPart(Request):
    """A text content part (chat_template.TEXT_PARTS): its text under "text", or a refusal's under "refusal"
    (ChatMessage checks that it has it)."""
    type: Literal["text", "input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None


class ChatMessage(Request):
    """OpenAI's messages; extra fields (name, tool_calls, tool_call_id) reach the chat template as they are. Any
    role is taken, as vLLM takes custom roles (Llama 3's ipython, ...): the chat template decides what it renders."""
    role: str = Field(min_length=1)
    content: str | list[TextPart] = ""  # null: an assistant message that only calls tools

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """A content part of another type (image_url, input_audio, ...) is named, rather than left to the union's
        first error ("should be a valid string")."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in TEXT_PARTS:
                    raise ValueError(f"content part {i} has type {kind!r}; this server takes text parts only "
                                     "({\"type\": \"text\", \"text\": ...}; also input_text, output_text and "
                                     "refusal) or a string")
                if not isinstance(part.get(TEXT_PARTS[kind]), str):
                    raise ValueError(f"content part {i} of type {kind!r} needs its {TEXT_PARTS[kind]!r} string")
        return content

    def text(self) -> str:
        """The content as the chat template sees it (chat_template.text_content)."""
        return text_content(self.model_dump(include={"content"})["content"])


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # null: up to max_model_len
    max_tokens: int | None = None  # the older name of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True  # vLLM's
    continue_final_message: bool = False  # vLLM's
    chat_template: str | None = None  # vLLM's: a Jinja template in place of the tokenizer's
    tools: list[dict] | None = None  # given to the chat template (tool_calls.py: what comes back)
    tool_choice: str | dict | None = None  # "none", "auto" (a tool-call parser) or a named function
    parallel_tool_calls: bool | None = True  # false (or null, as vLLM tests it): a reply keeps its first call
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning parser's thinking out of the reply
    echo: bool = False  # vLLM's: the last message's content starts the reply when that message has the reply's role
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the template's

    def reply_role(self, response_role: str) -> str:
        """vLLM's rule: the server's response role, unless add_generation_prompt is off, then the last message's
        (continued)."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    def echoed(self, response_role: str) -> str:
        """What echo puts before each choice's text: the last message's content if it has the reply's role."""
        last = self.messages[-1] if self.echo and self.messages else None
        return last.text() if last is not None and last.role == self.reply_role(response_role) else ""

    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice "none": a call comes back as text), "auto" (tools without tool_choice
        too, as in vLLM), "required" or "named"."""
        if isinstance(self.tool_choice, dict):
            return "named"
        choice = self.tool_choice if self.tool_choice is not None or not self.tools else "auto"
        return None if choice in (None, "none") else choice

    def unsupported(self) -> tuple[str, str] | None:
        mode = self.tool_mode()
        if mode not in (None, "auto", "required", "named"):
            return "tool_choice", (f"tool_choice {self.tool_choice!r} is not supported; use 'auto' (with nanograph "
                                   "serve --enable-auto-tool-choice --tool-call-parser hermes), 'required', a named "
                                   "function, or 'none'")
        return super().unsupported()


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # rendered by the chat template instead of a prompt
    add_special_tokens: bool = True
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[dict] | None = None
    return_token_strs: bool = False  # vLLM's: the response's token_strs, each token's own string in the vocabulary


class PoolingRequest(Request):
    """What the pooling model's routes share (vLLM's fields)."""
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # keep each input's last k tokens (-1: max_model_len)
    add_special_tokens: bool = True  # a text input takes the tokenizer's special tokens (a BOS)
    priority: int = 0  # under --scheduling-policy priority
    request_id: str | None = None  # the response's id (after an X-Request-Id header)

    def grammar_renames(self) -> dict[str, str]:
        return {}  # no grammar


class PoolingChatRequest(PoolingRequest):
    """What /v1/embeddings and /classify take besides input: vLLM's chat form, a conversation that the chat template
    renders into the one prompt to pool."""
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None  # in place of input
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = False  # vLLM's default here: the conversation as it is
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[dict] | None = None


class EmbeddingRequest(PoolingChatRequest):
    """OpenAI's embeddings request, with vLLM's extra fields."""
    encoding_format: Literal["float", "base64"] = "float"  # base64: each vector's float32 bytes, little-endian
    dimensions: int | None = None  # a Matryoshka model's leading dimensions
    user: str | None = None  # OpenAI's; not used
    normalize: bool | None = None  # vLLM's: None as the model's pooler does


class PoolingOutputRequest(EmbeddingRequest):
    """vLLM's /pooling request: the model's own pooled output (an embedding, or a classifier's probabilities)."""
    use_activation: bool | None = None  # a classifier's: False gives its logits
    task: str | None = None  # vLLM's: the output asked for, "embed" or "classify" (the model's own; None: it)


class PoolingData(BaseModel):
    index: int
    object: str = "pooling"
    data: list[float] | str


class ClassificationRequest(PoolingChatRequest):
    """vLLM's /classify request on a classifier."""
    use_activation: bool | None = None  # False: each class's logit, not its probability
    user: str | None = None  # not used


class ClassificationData(BaseModel):
    index: int
    label: str  # the most likely class's name
    probs: list[float]
    num_classes: int


class ScoreRequest(PoolingRequest):
    """vLLM's /score request on an embedding model or a cross-encoder: text_1 against each of text_2, or
    pairwise."""
    text_1: str | list[str] | list[int] | list[list[int]]
    text_2: str | list[str] | list[int] | list[list[int]]


class RerankRequest(PoolingRequest):
    """vLLM's /rerank (Jina's and Cohere's API) on an embedding model or a cross-encoder: the documents by their
    score against the query."""
    query: str
    documents: list[str]
    top_n: int = 0  # the best top_n documents; 0 (or less): all of them


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's place in the request
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[int]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # the prompt tokens found in the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details (vLLM's)
    completion_tokens_details: CompletionTokensDetails | None = None  # a chat's, with --reasoning-parser


DataT = TypeVar("DataT")


class ListResponse(BaseModel, Generic[DataT]):
    """The pooling routes' response: one item of data per input (or pair)."""
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[DataT]
    usage: Usage


PoolingResponse = ListResponse[PoolingData]
ClassificationResponse = ListResponse[ClassificationData]
ScoreResponse = ListResponse[ScoreData]
EmbeddingResponse = ListResponse[EmbeddingData]


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs: per token its text, logprob, top alternatives and text offset (an echoed
    prompt's first token has no logprob and no alternatives: null)."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: a token's logprob, its rank and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (null for the first), its token and the top ones by token id.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, where the request asked for them


class CompletionResponse(BaseModel):
    """A completion, and each chunk of a streamed one (the same object, as OpenAI sends it)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None  # None: a reply of tool calls alone
    tool_calls: list[dict] = Field(default_factory=list)  # OpenAI's: id, type "function", function name, arguments
    # With a reasoning parser: the reply's thinking, under vLLM's name and its older one; left out when None.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _reasoning_only_when_given(self, handler):
        return _without_none(handler(self), "reasoning", "reasoning_content")


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, where the request asked for them


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # each with its index among the choice's calls; left out when None
    reasoning: str | None = None  # as ChatResponseMessage's; left out when None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _tool_calls_only_when_given(self, handler):
        return _without_none(handler(self), "tool_calls", "reasoning", "reasoning_content")


def _without_none(data: dict, *names: str) -> dict:
    for name in names:
        if data.get(name) is None:
            data.pop(name, None)
    return data


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanograph"
    root: str | None  # the model folder
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
