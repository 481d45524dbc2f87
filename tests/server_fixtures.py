"""Fixtures for the server tests: tiny checkpoints (written once per session) and an in-process live server.

Import the fixtures into a test module with ``from server_fixtures import *``. Everything binds 127.0.0.1 only.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

SERVED_NAME = "tiny-llama"


def _root(tmp_path_factory) -> str:
    path = os.path.join(str(tmp_path_factory.getbasetemp()), "tokenfab_server_models")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory) -> str:
    """A tiny Llama checkpoint (vocab 512, float32) with a ChatML tokenizer."""
    from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(os.path.join(_root(tmp_path_factory), "llama"), "llama", vocab_size=512)


@pytest.fixture(scope="session")
def no_template_model_dir(tmp_path_factory, server_model_dir) -> str:
    """The same checkpoint with the chat template removed from its tokenizer files."""
    dst = os.path.join(_root(tmp_path_factory), "llama-no-template")
    if not os.path.isfile(os.path.join(dst, "config.json")):
        tmp = dst + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(server_model_dir, tmp)
        for name in ("chat_template.jinja", "chat_template.json"):
            if os.path.exists(os.path.join(tmp, name)):
                os.remove(os.path.join(tmp, name))
        cfg_path = os.path.join(tmp, "tokenizer_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.pop("chat_template", None)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        os.rename(tmp, dst)
    return dst


def start_test_server(model_dir: str, name: str = SERVED_NAME, **engine_kw):
    """Load ``model_dir`` (float32, CPU) and serve it on a free 127.0.0.1 port; returns a ServerHandle."""
    import torch

    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.server.api_server import build_app
    from tokenfab.server.launch import ServerHandle
    from tokenfab.server.async_engine import AsyncLLM

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    kw = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8)
    kw.update(engine_kw)
    llm = AsyncLLM.from_config(EngineConfig(model=model_dir, **kw))
    llm.start()
    app = build_app(llm, name, model_dir)
    return ServerHandle(app, llm)


@contextlib.contextmanager
def serve_subprocess(args: list[str], log_path, env: dict):
    """``python -m tokenfab.cli serve ARGS --port PORT`` on a free 127.0.0.1 port in its own process (stdout and
    stderr to ``log_path``); yields the base URL once /health answers 200 (the log in the assertion message if the
    process exits or 180 s pass first), and terminates the process afterwards."""
    import httpx
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.cli", "serve", *args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, open(log_path).read()
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def metric_value(text: str, name: str) -> float:
    """The value of the first sample of ``name`` (any labels) in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def server(server_model_dir):  # noqa: F811
    """A test server on the default tiny model for the test module (stopped after it)."""
    h = start_test_server(server_model_dir)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def http(server):  # noqa: F811
    """An httpx client on :func:`server` (no proxies from the environment)."""
    import httpx
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as c:
        yield c
