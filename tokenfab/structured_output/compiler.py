"""Grammars compiled for one model's tokenizer with xgrammar (Apache-2.0; vLLM's default structured-output backend).

:class:`GrammarCompiler` turns a :class:`~tokenfab.structured_output.params.StructuredOutputsParams` into an
``xgrammar.CompiledGrammar`` (a pushdown automaton whose token masks are precomputed per state against the
vocabulary), caching results by constraint so that n > 1, repeated schemas and the server's early check compile
once. The mapping follows vLLM's xgrammar backend: ``json`` -> ``compile_json_schema`` (strict mode: no properties
the schema does not name; ``any_whitespace`` unless ``disable_any_whitespace``), ``json_object`` -> the schema
``{"type": "object"}``, ``regex`` -> ``compile_regex``, ``choice`` -> an EBNF alternation of the quoted strings,
``grammar`` -> ``compile_grammar`` (EBNF / GBNF).

xgrammar is imported on first use (its import takes seconds), so engines that never see a constraint never load it;
``tokenfab serve`` starts that import on a background thread at startup (:meth:`GrammarCompiler.warm_up_in_background`).
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict

from tokenfab.errors import InvalidRequestError
from tokenfab.structured_output.params import StructuredOutputsParams

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")  # "[18:10:52] /project/cpp/x.cc:94: " in xgrammar errors


def import_xgrammar():
    """The ``xgrammar`` module, or InvalidRequestError saying how to install it."""
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise InvalidRequestError(f"structured outputs need the xgrammar package ({e}); pip install xgrammar.",
                                  "structured_outputs") from None
    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``: ``root ::= "a" | "b"``, each string quoted with
    JSON's escapes (which xgrammar's EBNF string literals read)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles output constraints against one tokenizer (thread-safe: the server checks requests on its event
    loop while the engine thread compiles the same ones, from the cache).

    Args:
        tokenizer: the model's Hugging Face tokenizer (None: every compile raises InvalidRequestError).
        vocab_size: the model's logits width V (>= the tokenizer's size; ids past the tokenizer are never allowed).
        stop_token_ids: the model's EOS ids: the only tokens a finished grammar allows, and only then.
        cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.cache_size = cache_size
        self._compiler = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _xgr_compiler(self):
        if self._compiler is None:
            xgr = import_xgrammar()
            if self.tokenizer is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer and this model has none "
                                          "(no tokenizer files in its folder).", "structured_outputs")
            try:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
            except Exception as e:
                raise InvalidRequestError(f"structured outputs: xgrammar cannot read this model's tokenizer "
                                          f"({type(e).__name__}: {e}).", "structured_outputs") from None
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def warm_up_in_background(self) -> threading.Thread:
        """Import xgrammar and build its tokenizer info on a low-priority daemon thread, so the first constrained
        request does not wait seconds for them (a request arriving meanwhile waits on the lock, never works twice).
        Failures are left for that request to report. Returns the thread."""
        def run():
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # Linux: this thread only
            except (AttributeError, OSError):
                pass
            try:
                with self._lock:
                    self._xgr_compiler()
            except Exception:  # the first structured request raises it again, as a 400 naming the field
                pass
        t = threading.Thread(target=run, name="tokenfab-xgrammar-warmup", daemon=True)
        t.start()
        return t

    def compile(self, p: StructuredOutputsParams):
        """The ``xgrammar.CompiledGrammar`` for ``p`` (cached).

        Raises:
            InvalidRequestError (a ValueError): a schema, regex or grammar xgrammar cannot compile (its message,
                with the field named by ``p.source``), or a model without tokenizer.
        """
        key = p.cache_key()
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                return g
            c = self._xgr_compiler()
            try:
                g = self._compile(c, p)
            except InvalidRequestError:
                raise
            except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
                what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                        "choice": "choice", "grammar": "EBNF grammar"}[p.kind]
                msg = _XGR_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__
                raise InvalidRequestError(f"{p.source}: the {what} cannot be compiled: {msg}", p.source) from None
            self._cache[key] = g
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return g

    @staticmethod
    def _compile(c, p: StructuredOutputsParams):
        ws = not p.disable_any_whitespace
        if p.kind == "json":
            schema = p.json
            if schema is True:
                schema = {}
            if schema is False:
                raise InvalidRequestError(f"{p.source}: the JSON schema false accepts nothing.", p.source)
            return c.compile_json_schema(json.dumps(schema), any_whitespace=ws, strict_mode=True)
        if p.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=ws, strict_mode=False)
        if p.kind == "regex":
            return c.compile_regex(p.regex)
        if p.kind == "choice":
            return c.compile_grammar(choice_ebnf(p.choice))
        return c.compile_grammar(p.grammar)
