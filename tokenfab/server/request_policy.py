"""What ``tokenfab serve`` applies to every completion / chat request from its engine settings, as vLLM does:
default sampling fields from the model's generation config (for fields the request leaves unset), the
``max_logprobs`` limit, and the one-line request log (``--disable-log-requests`` turns it off)."""
from __future__ import annotations

import logging

from tokenfab.server.protocol import OpenAIError

request_logger = logging.getLogger("tokenfab.requests")

_PLAIN_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class RequestPolicy:
    """Per-server request rules.

    Args:
        defaults: SamplingParams field -> value from ``EngineConfig.generation_defaults()`` (temperature, top_p,
            top_k, min_p, repetition_penalty, max_tokens).
        max_logprobs: most logprobs a request may ask for; -1: no limit.
        max_model_len: context length (tokens), caps a default max_tokens.
        log_requests: log one INFO line per request on the ``tokenfab.requests`` logger.
        max_log_len: characters of prompt (and entries of prompt token ids) kept in that line; None: all.
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
        the request when logging is on."""
        cap = self.max_logprobs
        k = getattr(params, "logprobs", None)
        if cap >= 0 and k is not None and k > cap:
            raise OpenAIError(400, f"{logprobs_field}={k} is more than this server's max_logprobs ({cap}); ask "
                                   f"for at most {cap} (the server sets it with --max-logprobs).",
                              param=logprobs_field)
        if self.log_requests and request_logger.isEnabledFor(logging.INFO):
            n = self.max_log_len
            text = prompt if prompt is None or n is None else prompt[:n]
            ids = prompt_token_ids if n is None else prompt_token_ids[:n]
            request_logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id,
                                text, params, ids)
