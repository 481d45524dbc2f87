"""`tokenfab serve` stops cleanly on SIGTERM: the engine is shut down and the exit status is 0 (uvicorn re-raises
SIGTERM after its graceful shutdown, which with the default handler killed the process before the cleanup)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _serve(model: str, max_model_len: int, env: dict) -> tuple[subprocess.Popen, int]:
    """`tokenfab serve` in a subprocess on a free port, returned once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.cli", "serve", model, "--port", str(port),
                             "--max-model-len", str(max_model_len), "--num-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("server did not come up")


def test_sigterm_stops_cleanly(tiny_model):
    proc, _ = _serve(tiny_model("llama"), 64, dict(os.environ))
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    assert "[tokenfab] server stopped" in out


def test_sigterm_mid_stream_ends_the_stream_cleanly(tiny_model):
    """SIGTERM while a long streamed completion runs: after the drain period (0 s here) the stream ends with an
    OpenAI error event and [DONE] instead of running to max_tokens, the server exits 0, and its log has no
    traceback."""
    import json
    proc, port = _serve(tiny_model("llama"), 512, dict(os.environ, TOKENFAB_DRAIN_SECONDS="0"))
    lines = []
    try:
        body = {"model": tiny_model("llama"), "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])
    assert "shutting down" in err["error"]["message"]
    assert len(lines) < 400  # ended early, not run to max_tokens
    assert proc.returncode == 0, out[-2000:]
    assert "Traceback" not in out and "Exception in ASGI" not in out, out[-3000:]
    assert "[tokenfab] server stopped" in out
