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


def test_sigterm_stops_cleanly(tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.cli", "serve", tiny_model("llama"), "--port", str(port),
                             "--max-model-len", "64", "--num-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise AssertionError("server did not come up")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    assert "[tokenfab] server stopped" in out
