"""What ``tokenfab serve`` applies to every completion / chat request from its engine settings, as vLLM does:
default sampling fields from the model's generation config (for fields the request leaves unset), the
``max_logprobs`` limit, and the request log.

Request log (vLLM's): nothing per request unless ``--enable-log-requests``; then one INFO line per request with its
id, the prompt's length and a summary of the sampling parameters that differ from the defaults, every field cut to
``--max-log-len`` characters (:data:`DEFAULT_FIELD_LOG_LEN` without it; a collection shows its size first). The
prompt text and token ids go to a second line at DEBUG only (``TOKENFAB_LOGGING_LEVEL=DEBUG``), cut to
``--max-log-len``. No prompt text is ever logged at INFO."""
from __future__ import annotations

import dataclasses
import logging

from tokenfab.server.protocol import OpenAIError

request_logger = logging.getLogger("tokenfab.requests")

_PLAIN_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

DEFAULT_FIELD_LOG_LEN = 100  # characters of one sampling-parameter value in a request log line without --max-log-len


def _cut(text: str, n: int | None) -> str:
    return text if n is None or len(text) <= n else text[:n] + f"...(+{len(text) - n} chars)"


def _head_repr(value, n: int) -> str:
    """repr of a collection's first entries, stopping once ``n`` characters are reached (a 49,152-entry
    logit_bias is not rendered whole to be cut)."""
    items = value.items() if isinstance(value, dict) else value
    out, size = [], 0
    for x in items:
        piece = f"{x[0]!r}: {x[1]!r}" if isinstance(value, dict) else repr(x)
        out.append(piece)
        size += len(piece) + 2
        if size > n:
            break
    o, c = {dict: "{}", list: "[]", tuple: "()", set: "{}"}.get(type(value), "[]")
    return o + ", ".join(out) + (", ..." if len(out) < len(value) else "") + c


def params_summary(params, max_len: int | None = None) -> str:
    """The sampling parameters of ``params`` that differ from ``SamplingParams()``'s defaults, as ``name=value``
    pairs, each value's repr cut to ``max_len`` characters (default :data:`DEFAULT_FIELD_LOG_LEN`); a dict, list,
    tuple or set value starts with its size (``logit_bias=<49152 entries> {0: 1.0, ...``)."""
    from tokenfab.sampling_params import SamplingParams
    n = DEFAULT_FIELD_LOG_LEN if max_len is None else max_len
    if not dataclasses.is_dataclass(params):
        return _cut(repr(params), n)
    default = SamplingParams()
    parts = []
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if value == getattr(default, f.name, None):
            continue
        if isinstance(value, (dict, list, tuple, set)):
            text = f"<{len(value)} entries> " + _head_repr(value, n)
        else:
            text = repr(value)
        parts.append(f"{f.name}={_cut(text, n)}")
    return ", ".join(parts)


class RequestPolicy:
    """Per-server request rules.

    Args:
        defaults: SamplingParams field -> value from ``EngineConfig.generation_defaults()`` (temperature, top_p,
            top_k, min_p, repetition_penalty, max_tokens).
        max_logprobs: most logprobs a request may ask for; -1: no limit.
        max_model_len: context length (tokens), caps a default max_tokens.
        log_requests: log each request on the ``tokenfab.requests`` logger (module docstring): id, lengths and
            a bounded parameter summary at INFO, the prompt at DEBUG.
        max_log_len: characters (token ids) kept of every logged field; None: the prompt whole (DEBUG) and
            :data:`DEFAULT_FIELD_LOG_LEN` characters per parameter.
    """

    def __init__(self, defaults: dict | None = None, max_logprobs: int = 20, max_model_len: int | None = None,
                 log_requests: bool = False, max_log_len: int | None = None):
        self.defaults = dict(defaults or {})
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.log_requests = log_requests
        self.max_log_len = max_log_len

    @classmethod
    def from_async_llm(cls, async_llm, log_requests: bool = False, max_log_len: int | None = None) -> "RequestPolicy":
        """The policy an engine's EngineConfig implies (no defaults and vLLM's limit 20 without one)."""
        cfg = getattr(getattr(async_llm, "engine", None), "config", None)
        if cfg is None or not hasattr(cfg, "generation_defaults"):
            return cls(max_model_len=getattr(async_llm, "max_model_len", None), log_requests=log_requests,
                       max_log_len=max_log_len)
        return cls(cfg.generation_defaults(), cfg.max_logprobs, async_llm.max_model_len, log_requests, max_log_len)

    def fill_defaults(self, req, prompt_len: int) -> None:
        """Set the generation-config defaults on the request fields the client did not send (pydantic's
        ``model_fields_set``). A default max_tokens is capped to the context left after the prompt (as vLLM's
        ``get_max_tokens`` does); a client's own max_tokens is never changed."""
        if not self.defaults:
            return
        sent = req.model_fields_set
        for name in _PLAIN_FIELDS:
            if name in self.defaults and name not in sent and hasattr(req, name):
                setattr(req, name, self.defaults[name])
        if "max_tokens" in self.defaults and not ({"max_tokens", "max_completion_tokens"} & sent):
            cap = self.defaults["max_tokens"]
            if self.max_model_len is not None:
                cap = max(1, min(cap, self.max_model_len - prompt_len))
            req.max_tokens = cap

    def admit(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params,
              logprobs_field: str = "logprobs") -> None:
        """Refuse logprobs above max_logprobs (HTTP 400 naming ``logprobs_field`` and max_logprobs), then log
        the request when logging is on (:meth:`log_request`)."""
        cap = self.max_logprobs
        k = getattr(params, "logprobs", None)
        if cap >= 0 and k is not None and k > cap:
            raise OpenAIError(400, f"{logprobs_field}={k} is more than this server's max_logprobs ({cap}); ask "
                                   f"for at most {cap} (the server sets it with --max-logprobs).",
                              param=logprobs_field)
        if self.log_requests:
            self.log_request(request_id, prompt, prompt_token_ids, params)

    def log_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params) -> None:
        """Log one request (module docstring): INFO ``Received request ID: prompt_tokens N, prompt_chars M,
        params: ...`` with every field bounded; DEBUG ``Request ID prompt: ..., prompt_token_ids: ...`` cut to
        ``max_log_len``."""
        n = self.max_log_len
        if request_logger.isEnabledFor(logging.INFO):
            chars = "" if prompt is None else f", prompt_chars {len(prompt)}"
            request_logger.info("Received request %s: prompt_tokens %d%s, params: %s", _cut(request_id, n),
                                len(prompt_token_ids), chars, params_summary(params, n))
        if request_logger.isEnabledFor(logging.DEBUG):
            ids = prompt_token_ids if n is None else prompt_token_ids[:n]
            more = "" if len(ids) == len(prompt_token_ids) else f"...(+{len(prompt_token_ids) - len(ids)} ids)"
            request_logger.debug("Request %s prompt: %r, prompt_token_ids: %s%s", _cut(request_id, n),
                                 None if prompt is None else _cut(prompt, n), ids, more)
