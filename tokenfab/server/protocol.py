"""Request and response models of the OpenAI-compatible API (OpenAI's field names plus vLLM's extensions).

Requests are pydantic models: a wrong type or out-of-range value becomes a 400 with OpenAI's error JSON
(``{"error": {"message", "type", "param", "code"}}``) naming the field. Numbers must be finite (no NaN or
infinity), token ids strict integers (not ``true`` or ``1.0``), and no string may hold a lone UTF-16 surrogate
(``"\ud800"``, which UTF-8 cannot encode). The ranges of sampling fields are checked where SamplingParams is built,
by the checks the offline API runs (tokenfab/request_validation.py). Unknown fields are ignored (as OpenAI and
vLLM do). Streamed chunks and full responses are plain dicts in OpenAI's shape, built by the serving code.
"""
from __future__ import annotations

import time
import types
import typing
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from tokenfab.request_validation import find_lone_surrogate


class OpenAIError(Exception):
    """An error to return as OpenAI's error JSON with HTTP ``status``.

    Attributes:
        status: HTTP status (400, 404, 500, 503).
        message: one line naming the field at fault.
        type: OpenAI's error type ("BadRequestError", "NotFoundError", ...).
        param: the request field at fault, or None.
    """

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                             503: "ServiceUnavailableError"}.get(status, "BadRequestError")
        self.param = param


def error_body(status: int, message: str, type: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error JSON. ``code`` is the HTTP status (as vLLM sends it)."""
    e = OpenAIError(status, _utf8_safe(message), type, _utf8_safe(param) if param is not None else None)
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": status}}


def _utf8_safe(s: str) -> str:
    """``s`` with lone surrogates written as ``\\udXXX`` escapes, so the JSON body always encodes as UTF-8."""
    return s if s.isascii() else s.encode("utf-8", "backslashreplace").decode("utf-8")


def json_kinds(annotation) -> frozenset[str]:
    """The JSON value kinds a field annotation takes: "boolean", "integer", "number", "string", "array",
    "object", "null", or "any" (``Any``, unknown types)."""
    if annotation is Any:
        return frozenset({"any"})
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return frozenset().union(*(json_kinds(a) for a in typing.get_args(annotation)))
    if origin is typing.Annotated:
        return json_kinds(typing.get_args(annotation)[0])
    if origin is Literal:
        return frozenset({"string"})
    if origin in (list, tuple, set):
        return frozenset({"array"})
    if origin is dict:
        return frozenset({"object"})
    if annotation is type(None):
        return frozenset({"null"})
    for t, kinds in ((bool, {"boolean"}), (int, {"integer"}), (float, {"number", "integer"}), (str, {"string"}),
                     (BaseModel, {"object"})):
        if isinstance(annotation, type) and issubclass(annotation, t):
            return frozenset(kinds)
    return frozenset({"any"})


_KIND_OF = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
            (dict, "object"))
_KIND_WORDS = {"boolean": "true or false", "integer": "an integer", "number": "a number", "string": "a string",
               "array": "a list", "object": "an object", "null": "null"}


class _Base(BaseModel):
    """Every request model: unknown fields ignored, finite numbers only, no lone surrogate in any string, and JSON
    types as declared (no pydantic lax conversions of top-level fields: ``true`` is not the number 1, ``"0.5"``
    not a number, ``2.0`` not an integer, ``1`` not ``true``), as the offline SamplingParams checks refuse them."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _json_type_as_declared(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or info.field_name is None:
            return v
        field = cls.model_fields.get(info.field_name)
        kinds = json_kinds(field.annotation) if field is not None else frozenset({"any"})
        if "any" in kinds:
            return v
        got = next((k for t, k in _KIND_OF if isinstance(v, t)), None)
        if got is None or got in kinds or (got == "integer" and "number" in kinds):
            return v
        want = " or ".join(_KIND_WORDS[k] for k in sorted(kinds - {"null"}) if k != "integer" or "number" not in kinds)
        raise PydanticCustomError("wrong_json_type", "must be {want}, got {got} {value}",
                                  {"want": want, "got": _KIND_WORDS[got].split(" ")[-1] if got != "boolean" else
                                   "boolean", "value": _utf8_safe(repr(v))[:40]})

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogates(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not isinstance(v, (int, float, bool)) and find_lone_surrogate(v) is not None:
            raise PydanticCustomError(
                "lone_surrogate", "the text holds a lone UTF-16 surrogate (U+D800..U+DFFF, e.g. the JSON escape "
                "\\ud800 without its pair), which is not valid Unicode; send UTF-8 text or a complete pair")
        return v


class StreamOptions(_Base):
    """``include_usage``: send a final chunk with ``usage`` and empty ``choices``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    """Sampling fields shared by completions and chat (OpenAI names, vLLM extensions at the end)."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = None  # ranges of sampling fields: request_validation.check_sampling_params
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[list[StrictInt]] = None
    skip_special_tokens: bool = True
    allowed_token_ids: Optional[list[StrictInt]] = None
    bad_words: Optional[list[str]] = None
    # structured outputs (server/structured_request.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields; one per request
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    priority: StrictInt = 0  # lower runs earlier; non-zero needs --scheduling-policy priority (scheduling_policy.py)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a one-element list of either."""

    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None


class ChatMessage(_Base):
    """One chat message; ``content`` as text or OpenAI content parts (only ``text`` parts are used)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (new name) wins over ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    logit_bias: Optional[dict[str, float]] = None
    # tool calling (server/tool_calls.py): tools go to the chat template; tool_choice named / "required" is
    # enforced with structured outputs, "auto" needs --enable-auto-tool-choice
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None


class TokenizeRequest(_Base):
    """``POST /tokenize`` (vLLM): a ``prompt`` string or chat ``messages``."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Base):
    """``POST /detokenize`` (vLLM): token ids -> ``{"prompt": text}``."""

    model: Optional[str] = None
    tokens: list[StrictInt]


class UsageInfo(_Base):
    """Token counts of one request (tokens)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(_Base):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenfab"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Base):
    """``GET /v1/models``: the served model as OpenAI's list object (``object: "list"``, ``data``: model cards)."""
    object: Literal["list"] = "list"
    data: list[ModelCard]
