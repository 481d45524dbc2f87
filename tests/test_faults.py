"""Faults: SIGTERM drains a running server, a dead tensor-parallel worker stops it, and broken checkpoints (a truncated
file, a wrong dtype, a shape that disagrees with config.json, a missing shard) are one-line errors naming the file
and the tensor, from `tokenfab generate` and `tokenfab serve` alike. (The busy-port check is tested in
test_vllm_surface.py, a worker killed under the offline LLM in test_tp_launch_errors.py.)"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenfab.cli import main


# ------------------------------------------------------------------------------------------------ checkpoints
def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _one_line_error(argv: list[str], capsys) -> str:
    """Run the CLI in-process; assert exit status 2 and a one-line error without a traceback; return the line."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("tokenfab ")]
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"tokenfab {argv[0]}: error: "), err[-2000:]
    return lines[0]


def _cli_cases(path: str) -> list[list[str]]:
    return [["generate", path, "--prompt", "hi", "--max-tokens", "2"], ["serve", path, "--port", "0"]]


def test_truncated_safetensors_names_file_and_tensors(tiny_model, tmp_path, capsys):
    """The last 1,000 bytes cut off: the file and the tensors whose bytes lie past its end are named."""
    path = _copy(tiny_model("llama"), tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    header_len = int.from_bytes(open(f, "rb").read(8), "little")
    header = json.loads(open(f, "rb").read(8 + header_len)[8:])
    header.pop("__metadata__", None)
    data = os.path.getsize(f) - 8 - header_len - 1000
    cut = sorted(n for n, i in header.items() if i["data_offsets"][1] > data)  # computed from the spec, independently
    assert cut
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 1000)
    for argv in _cli_cases(path):
        line = _one_line_error(argv, capsys)
        assert f"{f}: truncated" in line and cut[0] in line, line


def test_truncated_header_names_the_file(tiny_model, tmp_path, capsys):
    path = _copy(tiny_model("llama"), tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(100)  # inside the JSON header
    line = _one_line_error(_cli_cases(path)[0], capsys)
    assert f in line and "truncated" in line, line


def test_wrong_dtype_is_refused_not_cast(tiny_model, tmp_path, capsys):
    """An int32 tensor where the model has a float weight was silently cast before: now refused by name."""
    path = _copy(tiny_model("llama"), tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    name = "model.layers.0.self_attn.q_proj.weight"
    sd[name] = (sd[name] * 100).to(torch.int32)
    save_file(sd, f, metadata={"format": "pt"})
    for argv in _cli_cases(path):
        line = _one_line_error(argv, capsys)
        assert f"{name} (in model.safetensors): checkpoint dtype int32" in line, line


def test_shape_that_disagrees_with_config_json(tiny_model, tmp_path, capsys):
    """config.json's intermediate_size raised by 8: each MLP weight is named once, with its file and both shapes."""
    path = _copy(tiny_model("llama"), tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    cfg["intermediate_size"] = i + 8
    json.dump(cfg, open(cfg_path, "w"))
    for argv in _cli_cases(path):
        line = _one_line_error(argv, capsys)
        assert "config.json" in line and "missing weights" not in line, line  # mismatched, not also "missing"
        assert (f"model.layers.0.mlp.gate_proj.weight (in model.safetensors): checkpoint ({i}, {h}) vs model "
                f"({i + 8}, {h})") in line, line


def test_missing_shard_names_file_and_its_tensors(tiny_model, tmp_path, capsys):
    path = _copy(tiny_model("llama", max_shard_size="20KB"), tmp_path / "m")
    weight_map = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    gone = sorted(set(weight_map.values()))[-1]
    held = [n for n, f in weight_map.items() if f == gone]
    os.remove(os.path.join(path, gone))
    for argv in _cli_cases(path):
        line = _one_line_error(argv, capsys)
        assert f"shard {gone} is missing" in line and held[0] in line, line


# ---------------------------------------------------------------------------------------------- live server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, extra: list[str], env: dict) -> tuple[subprocess.Popen, int]:
    """`tokenfab serve` in a subprocess on a free port, returned once /health answers 200."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.cli", "serve", model, "--port", str(port),
                             "--num-threads", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("server did not come up:\n" + (proc.communicate()[0] or "")[-3000:])


DRAIN_S = 60.0


def test_sigterm_drains_in_flight_and_refuses_new_with_503(tiny_model):
    """SIGTERM while a streamed completion runs: the stream still runs to its max_tokens (usage counts them all),
    a request sent during the drain gets 503 in OpenAI's error JSON, and the process exits 0 soon after the
    stream ends (well inside the drain bound)."""
    path = tiny_model("llama")
    proc, port = _serve(path, ["--max-model-len", "512"], dict(os.environ, TOKENFAB_DRAIN_SECONDS=str(DRAIN_S)))
    base = f"http://127.0.0.1:{port}"
    n_tokens = 480
    lines: list[str] = []
    got = {}
    try:
        with httpx.Client(base_url=base, timeout=120, trust_env=False) as c:
            body = {"prompt": [5, 6, 7], "max_tokens": n_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line:
                        continue
                    lines.append(line)
                    if len(lines) == 3:
                        t_sig = time.monotonic()
                        proc.send_signal(signal.SIGTERM)

                        def late() -> None:  # a new request once the server drains (/health says 503)
                            with httpx.Client(base_url=base, timeout=30, trust_env=False) as c2:
                                while c2.get("/health").status_code == 200:
                                    time.sleep(0.02)
                                got["late"] = c2.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})

                        th = threading.Thread(target=late)
                        th.start()
            th.join(30)
        out, _ = proc.communicate(timeout=DRAIN_S + 30)
        t_exit = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert not any("error" in e for e in events), lines[-3:]
    assert events[-1]["usage"]["completion_tokens"] == n_tokens
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    late = got["late"]
    assert late.status_code == 503 and late.json()["error"]["code"] == 503
    assert "shutting down" in late.json()["error"]["message"]
    assert proc.returncode == 0, out[-2000:]
    assert t_exit - t_sig < DRAIN_S, (t_exit - t_sig, out[-2000:])  # it did not wait out the whole drain bound
    assert "Traceback" not in out, out[-3000:]
    assert "[tokenfab] server stopped" in out


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to find the worker process")
def test_dead_tensor_parallel_worker_fails_health_and_exits(tiny_model):
    """SIGKILL on rank 1's worker of an idle 2-rank server: /health answers 503 naming the rank (every 503 until the
    process is gone), and the server exits with status 1 instead of serving on (or hanging) without a rank."""
    proc, port = _serve(tiny_model("llama"), ["--max-model-len", "64", "--tensor-parallel-size", "2"],
                        dict(os.environ, TOKENFAB_TP_TIMEOUT="60"))
    try:
        kids = _children(proc.pid)
        workers = [k for k in kids if "tokenfab.parallel.worker" in open(f"/proc/{k}/cmdline").read()]
        assert len(workers) == 1, kids
        os.kill(workers[0], signal.SIGKILL)
        health = []
        while proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                health.append((r.status_code, r.text))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
            if len(health) > 1200:
                break
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    bad = [t for s, t in health if s == 503]
    # every 503 names the dead rank, up to the exit (the reason comes before "not running" while it exits)
    assert bad and all("the engine cannot serve" in t and "rank 1" in t for t in bad), health[:3]
    assert "the engine cannot serve" in out and "rank 1" in out, out[-2000:]
