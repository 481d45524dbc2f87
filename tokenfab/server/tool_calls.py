"""Tool calling on /v1/chat/completions: ``tools`` to the chat template, ``tool_choice`` enforced, ``tool_calls`` out.

As vLLM does it:

- ``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters"}}]``) go to the
  chat template (transformers' ``apply_chat_template(tools=...)``), which decides how the model sees them.
- ``tool_choice`` a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained
  to a JSON object valid against that function's ``parameters`` schema (structured outputs), returned as one tool
  call whose ``arguments`` is that text.
- ``tool_choice: "required"``: the output is constrained to a JSON array of one or more ``{"name", "parameters"}``
  objects, each naming one of the tools with arguments valid against its schema (:func:`required_schema`); each
  item becomes a tool call.
- ``tool_choice: "auto"`` (OpenAI's default when tools are given): the model decides; its text is parsed by a
  tool-call parser chosen at launch (``--enable-auto-tool-choice --tool-call-parser hermes``); without those flags
  the request is refused by name. :func:`parse_hermes` reads Hermes / Qwen-style ``<tool_call>{json}</tool_call>``.
- ``tool_choice: "none"``: plain text (the tools still reach the template, as vLLM's default).

Responses follow OpenAI: ``message.tool_calls = [{"id", "type": "function", "function": {"name", "arguments"}}]``
(``arguments`` a JSON string) and ``finish_reason: "tool_calls"`` when the constrained output was completed.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tokenfab.errors import InvalidRequestError
from tokenfab.structured_output.params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def tool_call_id() -> str:
    """A fresh tool-call id in vLLM's form (``chatcmpl-tool-<32 hex>``)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def check_tools(tools) -> list[dict]:
    """``tools`` checked: a list of ``{"type": "function", "function": {"name": str, "parameters": object}}``
    (``parameters`` defaults to an object with no properties). Returns the list with defaults filled.

    Raises:
        InvalidRequestError: naming ``tools[i]`` and what is wrong.
    """
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}}.", "tools")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                      f"\"parameters\": {{...}}}}}}.", f"tools[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string.", f"tools[{i}]")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object.", f"tools[{i}]")
        out.append({"type": "function", "function": {**f, "parameters": params}})
    return out


@dataclass
class ToolChoice:
    """A request's resolved ``tool_choice``: ``mode`` is "none", "auto", "required" or "named" (``name`` set)."""

    mode: str
    name: str | None = None


def resolve_tool_choice(tools: list[dict] | None, tool_choice, auto_parser: str | None) -> ToolChoice:
    """The request's tool choice (OpenAI's defaults: "auto" with tools, "none" without).

    Args:
        auto_parser: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on, else None.
    Raises:
        InvalidRequestError: an unknown value, a named function not in ``tools``, tool_choice without tools, or
            "auto" on a server started without ``--enable-auto-tool-choice`` (param "tool_choice").
    """
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoice("none")
    if not tools:
        raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools.", "tool_choice")
    if tool_choice == "auto":
        if auto_parser is None:
            raise InvalidRequestError('tool_choice "auto" (the default when tools are given) needs a server started '
                                      'with --enable-auto-tool-choice --tool-call-parser hermes; or send tool_choice '
                                      '"required", a named function, or "none".', "tool_choice")
        return ToolChoice("auto")
    if tool_choice == "required":
        return ToolChoice("required")
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools ({names}).",
                                      "tool_choice")
        return ToolChoice("named", name)
    raise InvalidRequestError(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                              f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}.", "tool_choice")


def required_schema(tools: list[dict]) -> dict:
    """JSON schema of a "required" reply: an array of at least one ``{"name": <a tool>, "parameters": <its
    arguments>}`` (vLLM's form), each item one of the tools."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"]["parameters"]},
              "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": items}}


def tool_constraint(tools: list[dict], choice: ToolChoice) -> StructuredOutputsParams | None:
    """The output constraint that enforces ``choice`` (None for "none" and "auto")."""
    if choice.mode == "named":
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == choice.name)
        return StructuredOutputsParams(json=schema, source="tool_choice")
    if choice.mode == "required":
        return StructuredOutputsParams(json=required_schema(tools), source="tool_choice")
    return None


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """Hermes-format tool calls in ``text``: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    block (the last may be unterminated) becomes a tool call. Returns (content before the first block, stripped,
    or None when empty; the calls). Blocks that are not such JSON objects leave ``text`` as plain content."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for m in _HERMES.finditer(text, start):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    content = text[:start].strip()
    return content or None, calls


def output_tool_calls(text: str, choice: ToolChoice, finish_reason: str | None) -> tuple[str | None, list[dict]]:
    """(message content, tool calls) of a finished reply under ``choice``. A constrained reply that did not end
    by completing its grammar (``finish_reason`` "length") is returned as plain content, without tool calls."""
    if choice.mode == "named":
        if finish_reason != "stop":
            return text, []
        return "", [_call(choice.name, text.strip())]
    if choice.mode == "required":
        try:
            items = json.loads(text) if finish_reason == "stop" else None
        except ValueError:
            items = None
        if not isinstance(items, list):
            return text, []
        return "", [_call(it["name"], it["parameters"]) for it in items]
    if choice.mode == "auto":
        return parse_hermes(text)
    return text, []


class ToolCallStream:
    """Streamed deltas of one choice's tool calls.

    Named: the first delta carries the call's id, type and name with the first piece of ``arguments``; later
    deltas carry the next pieces (vLLM's shape). "required" and "auto": the text is held until the choice
    finishes, then the parsed calls go out in one delta (or the text as content when it holds none).
    """

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.id = tool_call_id()
        self.started = False
        self.text = ""

    def delta(self, piece: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the chunk's ``delta``, its finish_reason) for new text ``piece`` (``finish_reason`` set on the last)."""
        self.text += piece
        if self.choice.mode == "named":
            d = {}
            if piece or (finish_reason is not None and not self.started):
                fn = {"arguments": piece}
                call = {"index": 0, "function": fn}
                if not self.started:
                    call.update(id=self.id, type="function")
                    fn.update(name=self.choice.name)
                    fn["arguments"] = piece.lstrip()
                    self.started = True
                d = {"tool_calls": [call]}
            return d, ("tool_calls" if finish_reason == "stop" else finish_reason)
        if finish_reason is None:
            return {}, None
        content, calls = output_tool_calls(self.text, self.choice, finish_reason)
        if not calls:
            return ({"content": content} if content else {}), finish_reason
        d = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        if content:
            d["content"] = content
        return d, "tool_calls"


def message_tool_fields(message) -> dict:
    """The tool fields of a chat message (a ChatMessage, whose extra fields pydantic keeps) for the chat template:
    ``tool_calls`` (each call's ``function.arguments`` JSON string parsed into an object where it parses, as HF
    templates iterate over arguments) and ``tool_call_id``; {} when it has none."""
    extra = getattr(message, "model_extra", None) or {}
    out = {}
    calls = extra.get("tool_calls")
    if isinstance(calls, list) and calls:
        fixed = []
        for c in calls:
            if isinstance(c, dict) and isinstance(c.get("function"), dict):
                f = dict(c["function"])
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except ValueError:
                        pass
                c = {**c, "function": f}
            fixed.append(c)
        out["tool_calls"] = fixed
    if extra.get("tool_call_id") is not None:
        out["tool_call_id"] = extra["tool_call_id"]
    return out
