"""The structured-output fields of an OpenAI request, mapped onto one StructuredOutputsParams.

Accepted, on /v1/completions and /v1/chat/completions alike (one of them per request):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (JSON valid against ``schema``);
- vLLM's ``structured_outputs`` object (v0.11 on): ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...,
  "disable_any_whitespace": ...}``;
- vLLM's older extra fields (removed in v0.12, still what many clients send): ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar`` (with ``guided_whitespace_pattern``; ``guided_decoding_backend`` may name
  "xgrammar" or "auto", the only backend here).

Errors are OpenAI 400s whose ``param`` names the field (a schema that does not compile is found when the server
compiles it, before the request streams: ``OpenAIServing.sampling_params``).
"""
from __future__ import annotations

from tokenfab.errors import InvalidRequestError
from tokenfab.structured_output.params import StructuredOutputsParams, as_structured_outputs

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def response_format_params(rf: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as a constraint (None for ``text`` or no field).

    Raises:
        InvalidRequestError: an unknown type, or json_schema without a ``schema`` object (param "response_format").
    """
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
            raise InvalidRequestError('response_format json_schema needs "json_schema": {"name": ..., "schema": '
                                      '{...JSON schema...}}.', "response_format")
        return StructuredOutputsParams(json=js["schema"], source="response_format")
    raise InvalidRequestError(f"response_format type must be \"text\", \"json_object\" or \"json_schema\", got "
                              f"{kind!r}.", "response_format")


def request_structured_outputs(req) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for through any of the fields above, or None.

    Raises:
        InvalidRequestError: two of the fields at once, or a bad value, naming the field.
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = response_format_params(getattr(req, "response_format", None))
    if rf is not None:
        found.append(("response_format", rf))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        found.append(("structured_outputs", as_structured_outputs(so, "structured_outputs")))
    guided = {f: getattr(req, f, None) for f in GUIDED_FIELDS if getattr(req, f, None) is not None}
    if len(guided) > 1:
        raise InvalidRequestError(f"give one of {', '.join(GUIDED_FIELDS)}, got {', '.join(guided)}.",
                                  next(iter(guided)))
    wsp = getattr(req, "guided_whitespace_pattern", None)
    for f, v in guided.items():
        found.append((f, StructuredOutputsParams(**{GUIDED_FIELDS[f]: v}, whitespace_pattern=wsp, source=f)))
    backend = getattr(req, "guided_decoding_backend", None)
    if backend is not None and backend.split(":")[0] not in ("xgrammar", "auto"):
        raise InvalidRequestError(f"guided_decoding_backend {backend!r}: this server's structured outputs run on "
                                  "xgrammar; send \"xgrammar\" or leave the field out.", "guided_decoding_backend")
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise InvalidRequestError(f"{names}: give one output constraint per request, not several.", found[0][0])
    return found[0][1] if found else None
