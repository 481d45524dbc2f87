"""The one set of request checks every entry point runs, so that nothing invalid reaches an engine step.

Offline, :class:`~tokenfab.sampling_params.SamplingParams` runs :func:`check_sampling_params` when it is built and
:meth:`~tokenfab.sampling_params.SamplingParams.validate` (:func:`check_sampling_params_for_model`) when
``LLMEngine.add_request`` accepts it, which also checks the prompt with :func:`check_prompt_text` and
:func:`check_token_ids`. The HTTP server's protocol models check JSON types (strict integers for token ids, finite
numbers, :func:`find_lone_surrogate` on every string) and then build the same SamplingParams and call the same
functions, so a field is checked by the same code with the same message whichever way it arrives. The
logits-processor fields (penalties, min_p, logit_bias, allowed_token_ids, bad_words) are checked here too
(:func:`check_processor_params`, :func:`check_processor_params_for_model`, :func:`bad_words_token_ids`), below the
engine and the sampler that apply them (``tokenfab/engine/logits_processors.py``).

Every failure raises :class:`~tokenfab.errors.InvalidRequestError` (a ValueError) whose ``param`` names the field
and whose message says what is allowed; the server returns it as a 400 in OpenAI's error JSON.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

from tokenfab.errors import InvalidRequestError

MAX_TEMPERATURE = 2.0 ** 16  # larger values make every token equally likely already; float32 keeps them finite
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1  # what torch.Generator.manual_seed accepts


def is_int(v: Any) -> bool:
    """True for an integer that is not a bool (Python ints, numpy integers)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_int(field: str, v: Any, lo: int | None = None, hi: int | None = None, what: str | None = None) -> int:
    """``v`` as a Python int when it is an integer (not a bool) in [lo, hi] (None: unbounded).

    Raises:
        InvalidRequestError: naming ``field`` and the allowed range (``what`` overrides the range's wording).
    """
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        if what is None:
            what = ("an integer" + (f" >= {lo}" if lo is not None and hi is None else "")
                    + (f" <= {hi}" if hi is not None and lo is None else "")
                    + (f" in [{lo}, {hi}]" if lo is not None and hi is not None else ""))
        raise InvalidRequestError(f"{field} must be {what}, got {v!r}.", field)
    return int(v)


def check_float(field: str, v: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    """``v`` as a float when it is a finite real number (not a bool) in [lo, hi] (``(lo, hi]`` with ``lo_open``).

    Raises:
        InvalidRequestError: naming ``field``; NaN and infinities are refused as not finite.
    """
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        raise InvalidRequestError(f"{field} must be a number in {interval}, got {v!r}.", field)
    f = float(v)
    if not math.isfinite(f):
        raise InvalidRequestError(f"{field} must be a finite number in {interval}; NaN and infinity are not "
                                  f"allowed (got {f}).", field)
    if f > hi or f < lo or (lo_open and f == lo):
        raise InvalidRequestError(f"{field} must be in {interval}, got {v}.", field)
    return f


def find_lone_surrogate(v: Any) -> str | None:
    """The first string inside ``v`` (a str, or lists / tuples / dicts of them, keys included) holding a lone UTF-16
    surrogate (U+D800..U+DFFF, which JSON's ``\\ud800`` escape can produce and UTF-8 cannot encode), or None.
    Lists whose first element is an int are skipped (token id lists, checked by their own type)."""
    if isinstance(v, str):
        if v.isascii():
            return None
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return v
        return None
    if isinstance(v, (list, tuple)):
        if v and is_int(v[0]):
            return None
        for x in v:
            bad = find_lone_surrogate(x)
            if bad is not None:
                return bad
    elif isinstance(v, dict):
        for k, x in v.items():
            bad = find_lone_surrogate(k)
            if bad is None:
                bad = find_lone_surrogate(x)
            if bad is not None:
                return bad
    return None


def surrogate_message(field: str) -> str:
    """The message for a lone surrogate found in ``field``."""
    return (f"{field} contains a lone UTF-16 surrogate (U+D800..U+DFFF, e.g. the JSON escape \\ud800 without its "
            "pair), which is not valid Unicode text; send UTF-8 text or a complete surrogate pair.")


def check_prompt_text(field: str, text: Any) -> str:
    """``text`` when it is a str that UTF-8 can encode.

    Raises:
        InvalidRequestError: not a string, or a lone surrogate inside.
    """
    if not isinstance(text, str):
        raise InvalidRequestError(f"{field} must be a string, got {type(text).__name__}.", field)
    if find_lone_surrogate(text) is not None:
        raise InvalidRequestError(surrogate_message(field), field)
    return text


def check_token_ids(field: str, ids: Any, vocab_size: int, allow_empty: bool = False) -> list[int]:
    """``ids`` (a list / tuple of ints, a numpy array or tensor) as a list of Python ints in [0, vocab_size).

    Bools, floats and strings are refused (``[True]`` is not token 1). Runs once per request, in O(len(ids)).

    Raises:
        InvalidRequestError: naming ``field``: not a list of integers, empty (unless ``allow_empty``), or an id
            outside the vocabulary.
    """
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError(f"{field} must be a list of token ids (integers), got {type(ids).__name__}.",
                                  field)
    if not all(type(t) is int for t in ids):  # the common case (Python ints) takes one pass; bools never do
        for t in ids:
            if not is_int(t):
                raise InvalidRequestError(f"{field} must hold integer token ids only, got {t!r} "
                                          f"({type(t).__name__}).", field)
        ids = [int(t) for t in ids]
    if not ids:
        if allow_empty:
            return list(ids)
        raise InvalidRequestError(f"{field} is empty: give at least one token.", field)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise InvalidRequestError(f"{field}: token ids must be in [0, {vocab_size}) (vocab_size); got {lo}..{hi}.",
                                  field)
    return list(ids)


def check_sampling_params(p) -> None:
    """The checks that need no model: types, ranges, finiteness of every SamplingParams field.

    Raises:
        InvalidRequestError: the first field at fault, by name.
    """
    n = check_int("n", p.n, lo=1)
    check_float("temperature", p.temperature, 0.0, MAX_TEMPERATURE)
    check_float("top_p", p.top_p, 0.0, 1.0, lo_open=True)
    if not is_int(p.top_k) or p.top_k < -1 or p.top_k == 0:
        raise InvalidRequestError(f"top_k must be -1 (disabled) or an integer >= 1, got {p.top_k!r}.", "top_k")
    if p.max_tokens is not None:
        check_int("max_tokens", p.max_tokens, lo=1)
    check_int("min_tokens", p.min_tokens, lo=0)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise InvalidRequestError(f"min_tokens must be in [0, max_tokens] (max_tokens = {p.max_tokens}), "
                                  f"got {p.min_tokens}.", "min_tokens")
    if p.seed is not None:
        check_int("seed", p.seed, what=f"an integer in [-2**63, 2**64 - n] (n = {n}; sequence i uses seed + i)",
                  lo=SEED_MIN, hi=SEED_MAX - (n - 1))
    if not isinstance(p.stop, list) or not all(isinstance(s, str) for s in p.stop):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {p.stop!r}.", "stop")
    if not isinstance(p.stop_token_ids, list):
        raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {p.stop_token_ids!r}.",
                                  "stop_token_ids")
    for t in p.stop_token_ids:
        check_int("stop_token_ids", t, lo=0, what="a list of token ids >= 0")
    for field in ("logprobs", "prompt_logprobs"):
        v = getattr(p, field)
        if v is not None:
            check_int(field, v, lo=0)


def check_sampling_params_for_model(p, vocab_size: int) -> None:
    """Every check of :func:`check_sampling_params` again (a SamplingParams may be changed after it was built),
    then the ones that need the model: stop token ids inside the vocabulary, logprob counts at most vocab_size.

    Raises:
        InvalidRequestError: the first field at fault, by name.
    """
    check_sampling_params(p)
    for t in p.stop_token_ids:
        if t >= vocab_size:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size}) (vocab_size), got {t}.",
                                      "stop_token_ids")
    for field in ("logprobs", "prompt_logprobs"):
        v = getattr(p, field)
        if v is not None and v > vocab_size:
            raise InvalidRequestError(f"{field} must be at most the vocabulary size ({vocab_size}), got {v}.",
                                      field)


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """Token id sequences to forbid for ``bad_words``, vLLM's way: each word (leading spaces stripped) is encoded
    without special tokens as is, and again after one leading space; the spaced form is kept only when it starts
    with a different token and has the same length (a word-initial variant, e.g. "Ġword").

    Raises:
        InvalidRequestError (a ValueError): a word encodes to no tokens, or there is no tokenizer.
    """
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs a tokenizer; this engine has none (use allowed_token_ids or "
                                  "logit_bias).", "bad_words")
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidRequestError(f"bad_words: {word!r} encodes to no tokens; remove it.", "bad_words")
        out.append([int(t) for t in plain])
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append([int(t) for t in spaced])
    return out


def check_processor_params(p) -> None:
    """Check (and normalize) the logits-processor fields of a SamplingParams ``p``; no model needed. Ranges are
    vLLM's / OpenAI's: presence and frequency penalties in [-2, 2], repetition_penalty > 0, min_p in [0, 1],
    logit_bias values in [-100, 100] keyed by integer token ids, allowed_token_ids a non-empty list of ids,
    bad_words a list of strings (one string becomes a list of one).

    Raises:
        InvalidRequestError (a ValueError): the field at fault, by name.
    """
    check_float("presence_penalty", p.presence_penalty, -2.0, 2.0)
    check_float("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    check_float("repetition_penalty", p.repetition_penalty, 0.0, math.inf, lo_open=True)
    check_float("min_p", p.min_p, 0.0, 1.0)
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            raise InvalidRequestError(f"logit_bias must be a dict of token id -> bias, got {p.logit_bias!r}.",
                                      "logit_bias")
        for t, v in p.logit_bias.items():
            check_int("logit_bias", t, lo=0, what="keyed by token ids (integers >= 0)")
            check_float("logit_bias", v, -100.0, 100.0)
    if p.allowed_token_ids is not None:
        if isinstance(p.allowed_token_ids, tuple):
            p.allowed_token_ids = list(p.allowed_token_ids)
        if not isinstance(p.allowed_token_ids, list) or not p.allowed_token_ids:
            raise InvalidRequestError(f"allowed_token_ids must be a non-empty list of token ids (or None), got "
                                      f"{p.allowed_token_ids!r}.", "allowed_token_ids")
        for t in p.allowed_token_ids:
            check_int("allowed_token_ids", t, lo=0, what="a list of token ids >= 0")
    if isinstance(p.bad_words, str):
        p.bad_words = [p.bad_words]
    if p.bad_words is not None and (not isinstance(p.bad_words, (list, tuple))
                                    or not all(isinstance(w, str) and w.strip() for w in p.bad_words)):
        raise InvalidRequestError(f"bad_words must be a list of non-blank strings, got {p.bad_words!r}.",
                                  "bad_words")


def check_processor_params_for_model(p, vocab_size: int, bad_words_ids: list[list[int]] = ()) -> None:
    """Check the token ids of ``p`` (``logit_bias`` keys, ``allowed_token_ids``) and of its encoded bad words
    (:func:`bad_words_token_ids`) against [0, vocab_size).

    Raises:
        InvalidRequestError (a ValueError): naming the field and the vocabulary size.
    """
    for field, ids in (("logit_bias", list(p.logit_bias or {})),
                       ("allowed_token_ids", list(p.allowed_token_ids or [])),
                       ("bad_words", [t for w in bad_words_ids for t in w])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"{field}: token ids must be in [0, {vocab_size}) (vocab_size); got "
                                      f"{bad[:5]}.", field)
