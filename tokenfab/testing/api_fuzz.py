"""Hypothesis strategies for fuzzing the OpenAI server, built from its protocol models (tokenfab/server/protocol.py),
and the checks each answer must pass. Used by tests/test_fuzz_api.py (bounded, in CI) and benchmarks/fuzz_api.py
(longer, with statistics). Needs ``hypothesis`` (the ``dev`` extra).

A :class:`FuzzCase` is one raw HTTP request (method, path, body bytes, content type) with its ``kind`` and what must
come back: ``"4xx"`` (a client error in OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}`` with
``code`` equal to the status) or ``"not5xx"`` (a valid answer or a 4xx; for values that may be legal, e.g. a huge
seed). Kinds: malformed_json, not_an_object, deep_nesting, wrong_type, huge_number, nan_inf, surrogate,
nested_garbage, missing_field, extra_fields, bad_content_type, huge_string, bad_route.
"""
from __future__ import annotations

import json
import typing
from dataclasses import dataclass

from hypothesis import strategies as st
from pydantic import BaseModel

from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


@dataclass
class FuzzCase:
    """One generated request. ``expect``: "4xx" or "not5xx" (see the module docstring)."""

    kind: str
    method: str
    path: str
    body: bytes | None
    content_type: str | None = "application/json"
    expect: str = "4xx"
    field: str | None = None

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        b = self.body if self.body is None or len(self.body) < 400 else self.body[:400] + b"..."
        return f"FuzzCase({self.kind}, {self.method} {self.path}, field={self.field}, body={b!r})"


def base_bodies(vocab_size: int) -> dict[str, tuple[type[BaseModel], dict]]:
    """path -> (protocol model, a small valid body) for the POST endpoints (2 tokens at most, greedy)."""
    return {
        "/v1/completions": (CompletionRequest, {"prompt": "Hello there", "max_tokens": 2, "temperature": 0}),
        "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 2, "temperature": 0}),
        "/tokenize": (TokenizeRequest, {"prompt": "Hello there"}),
        "/detokenize": (DetokenizeRequest, {"tokens": [5, 6, min(7, vocab_size - 1)]}),
    }


# ------------------------------------------------------------------------------------------- annotations
def accepted_kinds(annotation) -> set[str]:
    """The JSON kinds a pydantic annotation accepts: string, integer, number, boolean, array, object, null, any."""
    if annotation is typing.Any:
        return {"any"}
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) in ("types.UnionType", "<class 'types.UnionType'>"):
        out: set[str] = set()
        for a in typing.get_args(annotation):
            out |= accepted_kinds(a)
        return out
    if origin is typing.Annotated:
        return accepted_kinds(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return {"string"}
    if origin in (list, tuple, set):
        return {"array"}
    if origin is dict:
        return {"object"}
    if annotation is type(None):
        return {"null"}
    if isinstance(annotation, type):
        if issubclass(annotation, bool):
            return {"boolean"}
        if issubclass(annotation, int):
            return {"integer"}
        if issubclass(annotation, float):
            return {"number", "integer"}
        if issubclass(annotation, str):
            return {"string"}
        if issubclass(annotation, BaseModel):
            return {"object"}
    return {"any"}


def _fields(model: type[BaseModel]) -> list[tuple[str, set[str], bool]]:
    """(name, accepted kinds, required) of a model's fields."""
    return [(n, accepted_kinds(f.annotation), f.is_required()) for n, f in model.model_fields.items()]


_words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8).map(lambda s: "x" + s)
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6), st.floats(allow_nan=False,
                     allow_infinity=False), _words)


def _wrong_values(kinds: set[str]):
    """Values of a JSON kind that ``kinds`` does not take (an integer is a valid number). The server refuses
    pydantic's lax conversions too, so numeric strings, booleans for numbers, 2.0 for integers and 0 / 1 for
    booleans are wrong types here."""
    opts = []
    if "string" not in kinds:
        opts.append(st.one_of(_words, st.sampled_from(["5", "0.5", "true", "1e3", ""])))
    if "boolean" not in kinds:
        opts.append(st.booleans())
    if not kinds & {"integer", "number"}:
        opts.append(st.integers(-10 ** 6, 10 ** 6))
    if "number" not in kinds:
        opts.append(st.sampled_from([2.5, -3.75, 0.125, 2.0, 0.0]))
    if "array" not in kinds:
        opts.append(st.lists(_scalars, max_size=3))
    if "object" not in kinds:
        opts.append(st.dictionaries(_words, _scalars, max_size=3))
    if "null" not in kinds:
        opts.append(st.none())
    return st.one_of(*opts) if opts else st.nothing()


# ------------------------------------------------------------------------------------------------ kinds
HUGE_INTS = [2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 63) - 1, -(2 ** 70), 10 ** 30, 10 ** 400]
HUGE_FLOATS = [1e308, -1e308, 1.7976931348623157e308, 5e-324, -5e-324, 1e-300, 1e-45, -0.0, 1e20]


def _dumps(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def _field_case(draw, vocab_size: int):
    """A base body with one field replaced (wrong type, huge number, NaN / inf, surrogate, nested garbage)."""
    bodies = base_bodies(vocab_size)
    path = draw(st.sampled_from(sorted(bodies)))
    model, base = bodies[path]
    body = json.loads(json.dumps(base))
    fields = _fields(model)
    kind = draw(st.sampled_from(["wrong_type", "huge_number", "nan_inf", "surrogate", "nested_garbage"]))
    if kind == "wrong_type":
        name, kinds, _ = draw(st.sampled_from([f for f in fields if "any" not in f[1]]))
        body[name] = draw(_wrong_values(kinds))
        return FuzzCase(kind, "POST", path, _dumps(body), field=name)
    if kind in ("huge_number", "nan_inf"):
        num = [f for f in fields if f[1] & {"integer", "number"}]
        if not num:  # /tokenize, /detokenize: the number goes where a token id would
            path = "/detokenize"
            model, base = bodies[path]
            body = json.loads(json.dumps(base))
            num = [("tokens", {"integer"}, True)]
        name, kinds, _ = draw(st.sampled_from(num))
        if kind == "nan_inf":
            lit = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
            body[name] = "@@NUM@@" if name != "tokens" else [5, "@@NUM@@"]
            raw = _dumps(body).replace(b'"@@NUM@@"', lit.encode())
            return FuzzCase(kind, "POST", path, raw, field=name)
        pool = HUGE_INTS + (HUGE_FLOATS if "number" in kinds else [])
        v = draw(st.sampled_from(pool))
        body[name] = v if name != "tokens" else [5, v]
        return FuzzCase(kind, "POST", path, _dumps(body), expect="not5xx", field=name)
    if kind == "surrogate":
        targets = [f[0] for f in fields if f[1] & {"string", "array", "object"} and f[0] != "tokens"]
        if path == "/v1/chat/completions":
            targets += ["messages.content", "messages.role", "messages.name"]
        name = draw(st.sampled_from(sorted(targets)))
        bad = draw(st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d"]))  # lone halves of a pair
        val = draw(st.sampled_from(["plain", "list", "key"]))
        if name.startswith("messages."):
            body["messages"][0][name.split(".")[1]] = bad
        elif val == "list":
            body[name] = [bad]
        elif val == "key":
            body[name] = {bad: 1}
        else:
            body[name] = bad
        raw = json.dumps(body, ensure_ascii=True).encode()  # the surrogate travels as a \\udXXX escape
        return FuzzCase(kind, "POST", path, raw, field=name)
    # nested garbage: a deep mixture of lists and objects where a field goes
    name, kinds, _ = draw(st.sampled_from(fields))
    garbage = draw(st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                  st.dictionaries(_words, inner, max_size=3)),
                                max_leaves=12).filter(lambda v: isinstance(v, (list, dict))))
    body[name] = garbage
    return FuzzCase(kind, "POST", path, _dumps(body), expect="not5xx", field=name)


@st.composite
def _body_case(draw, vocab_size: int):
    """Whole-body faults: malformed JSON, not an object, deep nesting, missing fields, extra fields, content
    type, huge strings."""
    bodies = base_bodies(vocab_size)
    path = draw(st.sampled_from(sorted(bodies)))
    model, base = bodies[path]
    good = _dumps(base)
    kind = draw(st.sampled_from(["malformed_json", "not_an_object", "deep_nesting", "missing_field", "extra_fields",
                                 "bad_content_type", "huge_string"]))
    if kind == "malformed_json":
        how = draw(st.sampled_from(["truncate", "garbage", "bytes", "empty"]))
        if how == "truncate":
            raw = good[:draw(st.integers(1, len(good) - 1))]
        elif how == "garbage":
            i = draw(st.integers(0, len(good)))
            raw = good[:i] + draw(st.sampled_from([b"}", b"{", b",,", b"'", b"\x00", b"\\", b"]"])) + good[i:]
            try:
                json.loads(raw)
                raw = raw + b"}"  # still valid: break it
            except ValueError:
                pass
        elif how == "bytes":
            raw = b"{" + draw(st.binary(min_size=1, max_size=64))
        else:
            raw = b""
        return FuzzCase(kind, "POST", path, raw)
    if kind == "not_an_object":
        raw = _dumps(draw(st.one_of(st.lists(_scalars, max_size=3), st.integers(), _words, st.none(), st.booleans())))
        return FuzzCase(kind, "POST", path, raw)
    if kind == "deep_nesting":
        depth = draw(st.sampled_from([100, 1000, 10_000, 100_000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        field = draw(st.sampled_from([f[0] for f in _fields(model)]))
        raw = good[:-1] + b', "' + field.encode() + b'": ' + opener * depth + b"1" + closer * depth + b"}"
        return FuzzCase(kind, "POST", path, raw, expect="not5xx", field=field)
    if kind == "missing_field":
        need = {"/tokenize": {"prompt", "messages"}}.get(path, set())  # one of them is needed
        body = {k: v for k, v in base.items() if not model.model_fields[k].is_required() and k not in need}
        return FuzzCase(kind, "POST", path, _dumps(body))
    if kind == "extra_fields":
        body = dict(base, **draw(st.dictionaries(_words, _scalars, min_size=1, max_size=4)))
        return FuzzCase(kind, "POST", path, _dumps(body), expect="not5xx")
    if kind == "bad_content_type":
        ctype = draw(st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                      "application/json; charset=latin-1"]))
        return FuzzCase(kind, "POST", path, good, content_type=ctype, expect="not5xx")
    # huge string in a text field
    texts = {"/v1/completions": "prompt", "/tokenize": "prompt", "/v1/chat/completions": "messages",
             "/detokenize": "model"}
    n = draw(st.sampled_from([10_000, 200_000]))
    body = json.loads(good)
    big = "word " * (n // 5)
    if texts[path] == "messages":
        body["messages"][0]["content"] = big
    else:
        body[texts[path]] = big
    return FuzzCase(kind, "POST", path, _dumps(body), expect="not5xx", field=texts[path])


@st.composite
def _route_case(draw):
    """Unknown paths, wrong methods, /v1/models with garbage query strings."""
    how = draw(st.sampled_from(["unknown_path", "wrong_method", "models_query"]))
    if how == "unknown_path":
        return FuzzCase("bad_route", "POST", "/v1/" + draw(_words), b"{}")
    if how == "wrong_method":
        method, path = draw(st.sampled_from([("POST", "/v1/models"), ("DELETE", "/v1/completions"),
                                             ("GET", "/v1/chat/completions"), ("PUT", "/tokenize"),
                                             ("GET", "/detokenize")]))
        return FuzzCase("bad_route", method, path, b"{}" if method != "GET" else None)
    q = draw(st.text(alphabet="abc=&%?/\\x0123456789", max_size=30))
    return FuzzCase("models_query", "GET", "/v1/models?" + q, None, content_type=None, expect="not5xx")


def fuzz_cases(vocab_size: int):
    """Every kind of generated bad (or borderline) request."""
    return st.one_of(_field_case(vocab_size), _body_case(vocab_size), _route_case())


# ------------------------------------------------------------------------------------------------ checks
def check_answer(case: FuzzCase, status: int, body: bytes) -> str | None:
    """Why the answer to ``case`` is wrong, or None: 5xx never; 4xx must be OpenAI's error JSON with ``code`` ==
    status; ``expect == "4xx"`` must get a 4xx; a 200 to a POST must be JSON (a stream: SSE ending in [DONE]
    without an error event)."""
    if status >= 500:
        return f"status {status}: {body[:300]!r}"
    if 400 <= status < 500:
        try:
            err = json.loads(body)["error"]
            ok = (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
                  and err["code"] == status)
        except (ValueError, KeyError, TypeError):
            ok = False
        return None if ok else f"status {status} without OpenAI's error JSON: {body[:300]!r}"
    if case.expect == "4xx":
        return f"status {status} where a 4xx was due: {body[:300]!r}"
    if status != 200:
        return f"status {status}: {body[:300]!r}"
    if body.startswith(b"data: "):
        events = [ln[6:] for ln in body.split(b"\n") if ln.startswith(b"data: ")]
        if events[-1] != b"[DONE]":
            return "stream without [DONE]"
        if any(b'"error"' in e[:12] for e in events[:-1]):
            return f"error event in a 200 stream: {events[-2][:300]!r}"
        return None
    try:
        json.loads(body)
    except ValueError:
        return f"200 with a body that is not JSON: {body[:300]!r}"
    return None
