"""API-key check for ``tokenfab serve --api-key`` (vLLM's behaviour): requests under ``/v1`` need the header
``Authorization: Bearer KEY``; others (``/health``, ``/metrics``, ``/version``, ``/tokenize`` ...) stay open, and
CORS preflight (``OPTIONS``) passes. A missing or wrong key gets HTTP 401 in OpenAI's error JSON."""
from __future__ import annotations

import hmac
import json
import os

from tokenfab.server.protocol import error_body

API_KEY_ENV = ("VLLM_API_KEY", "TOKENFAB_API_KEY")  # read when --api-key is not given, in this order


def resolve_api_key(flag: str | None) -> str | None:
    """The key to require: ``--api-key`` when given, else ``$VLLM_API_KEY`` (as vLLM reads it), else
    ``$TOKENFAB_API_KEY``; None (no check) when none is set or the value is empty."""
    if flag:
        return flag
    for name in API_KEY_ENV:
        value = os.environ.get(name)
        if value:
            return value
    return None


class APIKeyMiddleware:
    """Pure ASGI middleware (streams pass through untouched) that answers 401 to ``/v1/*`` HTTP requests whose
    ``Authorization`` header is not ``Bearer <key>`` (compared in constant time)."""

    def __init__(self, app, api_key: str, prefix: str = "/v1"):
        if not api_key:
            raise ValueError("--api-key: the key is empty.")
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.prefix = prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not self._guarded(scope.get("path", "")):
            return await self.app(scope, receive, send)
        got = b""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                got = value
                break
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        msg = ("Incorrect API key provided: send the header 'Authorization: Bearer <key>' with the key given to "
               "tokenfab serve --api-key (or $VLLM_API_KEY)." if got else
               "You didn't provide an API key: send the header 'Authorization: Bearer <key>' (the key given to "
               "tokenfab serve --api-key or $VLLM_API_KEY).")
        body = json.dumps(error_body(401, msg, "AuthenticationError")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _guarded(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/")


def add_api_key(app, api_key: str | None) -> None:
    """Require ``api_key`` on ``app``'s ``/v1`` routes (no-op for None)."""
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
