"""Waiting for a server started in a subprocess (``tokenfab serve``, a peer engine) to answer over HTTP."""
from __future__ import annotations

import time
from collections.abc import Callable


def wait_until_ready(proc, base_url: str, timeout: float, *, exited: Callable[[], BaseException],
                     not_ready: Callable[[], BaseException], paths: tuple[str, ...] = ("/health",),
                     request_timeout: float = 2.0, poll_s: float = 0.25) -> None:
    """Poll ``GET base_url + path`` for each of ``paths`` every ``poll_s`` seconds until all answer 200.

    Raises:
        ``exited()``: the subprocess ``proc`` (a Popen) ended first (checked before each poll).
        ``not_ready()``: ``timeout`` seconds passed.
    """
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise exited()
        try:
            codes = [httpx.get(base_url + p, timeout=request_timeout, trust_env=False).status_code for p in paths]
            if all(c == 200 for c in codes):
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise not_ready()
