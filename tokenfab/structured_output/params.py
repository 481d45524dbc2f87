"""What a request constrains its output to: vLLM's ``StructuredOutputsParams`` (and its older name).

vLLM (since v0.11) takes ``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`` offline and
``"structured_outputs": {"json": ...}`` in an OpenAI request; before that the same fields were
``SamplingParams(guided_decoding=GuidedDecodingParams(...))`` and ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` in requests (removed in vLLM v0.12). tokenfab accepts both spellings:
:data:`GuidedDecodingParams` is this class, ``SamplingParams(guided_decoding=...)`` is folded into
``structured_outputs``, and the server maps every request form onto one instance (server/structured_request.py).

Exactly one constraint per request:

- ``json``: a JSON schema (dict or JSON text); the output is one JSON value that validates against it.
- ``json_object``: True for any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
- ``regex``: the whole output matches the regular expression.
- ``choice``: the output is exactly one of these strings.
- ``grammar``: an EBNF grammar (GBNF, llama.cpp's dialect, with a ``root`` rule), as vLLM's xgrammar backend takes.

Options: ``disable_any_whitespace`` (JSON without optional whitespace: compact output).
``disable_additional_properties`` and ``disable_fallback`` are accepted and change nothing: every schema compiles
in xgrammar's strict mode (no property the schema does not name, unless it allows them) and there is no other
backend to fall back to.
``whitespace_pattern`` and ``structural_tag`` are refused by name (xgrammar here does not take them).
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

from tokenfab.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint (see the module docstring). Checked when built.

    Attributes:
        source: the request field it came from, named in error messages ("structured_outputs" offline; the
            server sets "response_format", "guided_json", ...). Not one of vLLM's fields.

    Raises:
        InvalidRequestError (a ValueError): no constraint or more than one, a field of the wrong type, JSON text
            that does not parse, an empty choice list, an unsupported option; ``param`` is ``source``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    source: str = field(default="structured_outputs", compare=False, repr=False)

    def __post_init__(self) -> None:
        self.check()

    def _fail(self, msg: str) -> InvalidRequestError:
        return InvalidRequestError(f"{self.source}: {msg}", self.source)

    def check(self) -> None:
        """Check the fields (see the class docstring); parses ``json`` given as text into a dict."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise self._fail(f"give exactly one of json, regex, choice, grammar, json_object; got "
                             f"{', '.join(given) if given else 'none'}.")
        if self.structural_tag is not None:
            raise self._fail("structural_tag is not supported; use json, regex, choice or grammar.")
        if self.whitespace_pattern is not None:
            raise self._fail("whitespace_pattern is not supported (xgrammar has no whitespace pattern); use "
                             "disable_any_whitespace=True for compact JSON, or leave it unset.")
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise self._fail(f"the JSON schema is not valid JSON ({e}).") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise self._fail(f"a JSON schema must be a JSON object, got {type(self.json).__name__}.")
        if self.json_object not in (None, True, False):
            raise self._fail(f"json_object must be true or false, got {self.json_object!r}.")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise self._fail(f"regex must be a non-empty string, got {self.regex!r}.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise self._fail(f"grammar must be a non-empty EBNF string, got {self.grammar!r}.")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise self._fail(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}.")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """A string that is equal for constraints that compile to the same grammar."""
        value: Any = getattr(self, self.kind)
        return _json.dumps([self.kind, value, self.disable_any_whitespace, self.disable_additional_properties],
                           sort_keys=True, default=str)


GuidedDecodingParams = StructuredOutputsParams  # vLLM <= 0.10's name for the same fields


def as_structured_outputs(value: Any, source: str = "structured_outputs") -> StructuredOutputsParams | None:
    """``value`` (None, a StructuredOutputsParams or a dict of its fields, as JSON sends it) as a checked
    StructuredOutputsParams whose errors name ``source``.

    Raises:
        InvalidRequestError: an unknown key (named, with the known ones), or a bad field (see the class).
    """
    if value is None or isinstance(value, StructuredOutputsParams):
        if value is not None:
            value.source = source
            value.check()
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{source} must be an object with one of json, regex, choice, grammar, "
                                  f"json_object; got {type(value).__name__}.", source)
    known = {f for f in StructuredOutputsParams.__dataclass_fields__ if f != "source"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(f"{source}: unknown field(s) {unknown}; known: {sorted(known)}.", source)
    return StructuredOutputsParams(**value, source=source)
