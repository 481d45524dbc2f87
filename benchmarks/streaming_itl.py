"""Streaming smoothness: median ITL against median TPOT of `tokenfab serve` at a fixed concurrency.

A streamed request whose server sends one SSE chunk per engine step has ITL ~ TPOT; a server that falls behind its
engine merges several steps' tokens into one chunk and ITL grows to (tokens per chunk) x TPOT (issue 33: 99.7 ms
against 6.7 ms on an H200 at concurrency 16). Per variant (``--stream-interval`` values) this starts `tokenfab serve`
on a free loopback port as a subprocess, sends one untimed warm-up request, runs `tokenfab bench serve` against it
(a second subprocess, vLLM's metric definitions) and reads its result JSON; then it prints and writes a JSON + a
Markdown table under benchmarks/results/ with both commands, the machine and the load.

    .venv/bin/python benchmarks/streaming_itl.py --max-concurrency 16 --num-prompts 32 --input-len 256 \\
        --output-len 64 --stream-interval 1,4 --label smollm2

It also times the API server's own per-token work in this process (``--no-micro`` skips it): the engine's
incremental detokenization of one token, building and JSON-encoding one chat chunk and the SSE framing, and the
whole server's CPU time per streamed chunk (HTTP, asyncio, hand-over from the engine thread) with a scripted engine
(tokenfab/testing/scripted_engine.py) that costs nothing, so the table says what each streamed token costs the server
beside the engine step.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_file import write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (bound once and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll /health until 200; raise when the server exits or ``timeout`` seconds pass."""
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """Terminate a server subprocess; kill it if it has not exited after ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one_run(a, interval: int | None, out_dir: str) -> dict:
    """Serve, warm up, bench, stop; returns the bench result dict plus the two commands."""
    import httpx
    host = "127.0.0.1"
    port = free_port(host)
    base_url = f"http://{host}:{port}"
    serve_cmd = [sys.executable, "-m", "tokenfab.cli", "serve", *([a.model] if a.model else []), "--host", host,
                 "--port", str(port), "--max-model-len", str(a.max_model_len), "--max-num-seqs",
                 str(a.max_concurrency), *(["--stream-interval", str(interval)] if interval is not None else []),
                 *shlex.split(a.server_args)]
    log_path = os.path.join(out_dir, f"server-{interval}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(base_url, proc, a.server_timeout)
        httpx.post(base_url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4, "ignore_eos": True},
                   timeout=300.0, trust_env=False)
        name = f"result-{interval}.json"
        bench_cmd = [sys.executable, "-m", "tokenfab.cli", "bench", "serve", "--backend", a.backend, "--base-url",
                     base_url, "--dataset-name", "random", "--random-input-len", str(a.input_len),
                     "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
                     "--max-concurrency", str(a.max_concurrency), "--ignore-eos", "--temperature", "0",
                     "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
                     "50,90,99", "--save-result", "--result-dir", out_dir, "--result-filename", name,
                     "--save-detailed", "--disable-tqdm"]
        load_before = os.getloadavg()[0]
        subprocess.run(bench_cmd, check=True)
        load_after = os.getloadavg()[0]
        with open(os.path.join(out_dir, name)) as f:
            res = json.load(f)
    finally:
        stop_server(proc)
    res["serve_command"] = shlex.join(serve_cmd).replace(f"--port {port}", "--port PORT")
    res["bench_command"] = shlex.join(bench_cmd).replace(base_url, "http://127.0.0.1:PORT").replace(out_dir, "DIR")
    res["load"] = [load_before, load_after]
    return res


def tokens_per_chunk(res: dict) -> float | None:
    """Output tokens per streamed text chunk over the successful requests (1.0: one chunk per engine step at
    stream interval 1); None without the per-request lists (``--save-detailed``)."""
    itls, lens = res.get("itls"), res.get("output_lens")
    if not itls or not lens:
        return None
    chunks = sum(len(x) + 1 for x, n in zip(itls, lens) if n)
    return sum(n for n in lens if n) / max(1, chunks)


def micro_costs(rounds: int = 512) -> dict:
    """Microseconds per streamed token of the server's own work on SmolLM2's tokenizer (or the test tokenizer when
    the default model is not installed): incremental detokenization (engine thread), the chat chunk's dict +
    ``json.dumps`` + SSE framing (event loop)."""
    from tokenfab.engine.detokenizer import IncrementalDetokenizer
    from tokenfab.server.api_server import _sse
    tok = None
    try:
        from transformers import AutoTokenizer

        from tokenfab.default_model import resolve_model
        tok = AutoTokenizer.from_pretrained(resolve_model(None))
    except Exception as e:  # pragma: no cover - no default model: say so
        print(f"micro: no tokenizer ({type(e).__name__}: {e}); skipped")
        return {}
    ids = tok("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)["input_ids"][:rounds]
    d = IncrementalDetokenizer(tok, True, None)
    t0 = time.perf_counter()
    for i in range(1, len(ids) + 1):
        d.update(ids[:i])
    detok = (time.perf_counter() - t0) / len(ids)
    t0 = time.perf_counter()
    for i in range(len(ids)):
        _sse({"id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion.chunk",
              "created": 1700000000, "model": "SmolLM2-135M-Instruct",
              "choices": [{"index": 0, "delta": {"content": " fox"}, "logprobs": None, "finish_reason": None,
                           "stop_reason": None}]}).encode()
    chunk = (time.perf_counter() - t0) / len(ids)
    return {"detokenize_us_per_token": detok * 1e6, "chunk_json_sse_us_per_token": chunk * 1e6,
            "tokens": len(ids), "server_cpu_us_per_chunk": server_cpu_per_chunk()}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


CLIENT = """
import asyncio, json, sys
import httpx
base, streams, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
async def one(c):
    async with c.stream("POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": tokens,
                                                          "stream": True}) as r:
        async for line in r.aiter_lines():
            pass
async def main():
    async with httpx.AsyncClient(base_url=base, timeout=300, trust_env=False) as c:
        await asyncio.gather(*(one(c) for _ in range(streams)))
asyncio.run(main())
"""


SCRIPTED_CLIENT = """
import asyncio, json, statistics, sys, time
import httpx
base, streams, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
async def one(c):
    times, sizes = [], []
    async with c.stream("POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": tokens,
                                                          "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0]["text"]:
                    times.append(time.perf_counter())
                    sizes.append(len(ch[0]["text"]))
    return times, sizes
async def main():
    async with httpx.AsyncClient(base_url=base, timeout=300, trust_env=False) as c:
        res = await asyncio.gather(*(one(c) for _ in range(streams)))
    itl = [b - a for t, _ in res for a, b in zip(t, t[1:])]
    tpot = [(t[-1] - t[0]) / (tokens - 1) for t, _ in res]
    print(json.dumps({"median_itl_ms": statistics.median(itl) * 1e3, "median_tpot_ms": statistics.median(tpot) * 1e3,
                      "tokens_per_chunk": tokens * streams / sum(len(s) for _, s in res),
                      "largest_chunk": max(max(s) for _, s in res)}))
asyncio.run(main())
"""


def scripted_run(step_ms: float, streams: int = 16, tokens: int = 64) -> dict:
    """Stream ``tokens`` tokens to ``streams`` clients (another process) from a scripted engine whose steps take
    ``step_ms`` without holding the GIL (tokenfab/testing/scripted_engine.py): an engine faster than the event
    loop's work for 16 chunks, where a server that falls behind merges steps into chunks. Returns the client's
    median ITL and TPOT (ms), tokens per chunk and the largest chunk."""
    from tokenfab.server.api_server import build_app
    from tokenfab.server.async_engine import AsyncLLM
    from tokenfab.server.launch import ServerHandle
    from tokenfab.testing.scripted_engine import ScriptedEngine
    llm = AsyncLLM(ScriptedEngine(step_s=step_ms / 1e3))
    llm.start()
    srv = ServerHandle(build_app(llm, "scripted"), llm)
    try:
        subprocess.run([sys.executable, "-c", CLIENT, srv.base_url, "2", "4"], check=True)  # warm-up
        out = subprocess.run([sys.executable, "-c", SCRIPTED_CLIENT, srv.base_url, str(streams), str(tokens)],
                             check=True, capture_output=True, text=True).stdout
        res = json.loads(out.strip().splitlines()[-1])
    finally:
        srv.stop()
    res.update(step_ms=step_ms, streams=streams, tokens=tokens, itl_over_tpot=res["median_itl_ms"] /
               res["median_tpot_ms"], load=os.getloadavg()[0])
    return res


def server_cpu_per_chunk(streams: int = 16, tokens: int = 64, step_s: float = 0.02) -> float:
    """Microseconds of this process's CPU time per streamed chunk when ``streams`` clients (another process) stream
    ``tokens`` tokens each from a scripted engine whose steps cost no CPU (a ``step_s`` sleep)."""
    from tokenfab.server.api_server import build_app
    from tokenfab.server.async_engine import AsyncLLM
    from tokenfab.server.launch import ServerHandle
    from tokenfab.testing.scripted_engine import ScriptedEngine
    llm = AsyncLLM(ScriptedEngine(step_s=step_s))
    llm.start()
    srv = ServerHandle(build_app(llm, "scripted"), llm)
    try:
        subprocess.run([sys.executable, "-c", CLIENT, srv.base_url, "2", "4"], check=True)  # warm-up
        c0 = time.process_time()
        subprocess.run([sys.executable, "-c", CLIENT, srv.base_url, str(streams), str(tokens)], check=True)
        return (time.process_time() - c0) / (streams * tokens) * 1e6
    finally:
        srv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="MODEL for tokenfab serve. Default: the default model (SmolLM2).")
    p.add_argument("--backend", default="openai-chat")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--stream-interval", default="default",
                   help="Comma-separated --stream-interval values to run, one server each; 'default' runs the "
                        "server without the flag (for a server that does not have it). Default: default.")
    p.add_argument("--server-args", default="", help="More tokenfab serve flags, one string.")
    p.add_argument("--server-timeout", type=float, default=1800.0)
    p.add_argument("--label", default="smollm2")
    p.add_argument("--note", default="", help="A sentence added under the title (e.g. which code the server ran).")
    p.add_argument("--no-micro", action="store_true", help="Skip the per-token cost timings.")
    p.add_argument("--scripted-step-ms", default="0.2,2",
                   help="Comma-separated step times (ms) of scripted-engine runs (16 streams x 64 tokens, no model, "
                        "in this process); empty: none. Default 0.2,2.")
    p.add_argument("--skip-model", action="store_true", help="Only the scripted-engine runs and the timings.")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args()
    intervals = [] if a.skip_model else [None if x.strip() == "default" else int(x)
                                         for x in a.stream_interval.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="streaming-itl-") as tmp:
        for iv in intervals:
            res = one_run(a, iv, tmp)
            row = {"stream_interval": iv if iv is not None else "default",
                   "median_itl_ms": res["median_itl_ms"], "median_tpot_ms": res["median_tpot_ms"],
                   "itl_over_tpot": res["median_itl_ms"] / res["median_tpot_ms"],
                   "p99_itl_ms": res.get("p99_itl_ms"), "median_ttft_ms": res["median_ttft_ms"],
                   "output_throughput": res["output_throughput"], "completed": res["completed"],
                   "tokens_per_chunk": tokens_per_chunk(res),
                   "load": res["load"], "serve_command": res["serve_command"], "bench_command": res["bench_command"]}
            rows.append(row)
            print(f"stream_interval {row['stream_interval']}: median ITL {row['median_itl_ms']:.2f} ms, median TPOT "
                  f"{row['median_tpot_ms']:.2f} ms, ITL/TPOT {row['itl_over_tpot']:.2f}, tokens per chunk {_fmt(row['tokens_per_chunk'])}", flush=True)
    scripted = [scripted_run(float(x)) for x in a.scripted_step_ms.split(",") if x.strip()]
    for r in scripted:
        print(f"scripted engine, step {r['step_ms']:g} ms: median ITL {r['median_itl_ms']:.2f} ms, median TPOT "
              f"{r['median_tpot_ms']:.2f} ms, tokens per chunk {r['tokens_per_chunk']:.2f}, largest chunk "
              f"{r['largest_chunk']}", flush=True)
    micro = {} if a.no_micro else micro_costs()
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    today = dt.date.today().isoformat()
    lines = [f"# Streaming ITL vs TPOT, {a.label} ({today})", "",
             f"`tokenfab serve` + `tokenfab bench serve --backend {a.backend}`: {a.num_prompts} prompts, "
             f"{a.input_len} in / {a.output_len} out, max concurrency {a.max_concurrency}, temperature 0, "
             f"ignore_eos. Commit {commit}, {platform.machine()} {os.cpu_count()} CPUs, "
             f"python {platform.python_version()}." + (f" {a.note}" if a.note else ""), "",
             "| stream interval | median ITL ms | median TPOT ms | ITL / TPOT | tokens per chunk | p99 ITL ms | "
             "median TTFT ms | output tok/s | load (before, after) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stream_interval']} | {r['median_itl_ms']:.2f} | {r['median_tpot_ms']:.2f} | "
                     f"{r['itl_over_tpot']:.2f} | {_fmt(r['tokens_per_chunk'])} | {r['p99_itl_ms']:.2f} | {r['median_ttft_ms']:.1f} | "
                     f"{r['output_throughput']:.1f} | {r['load'][0]:.1f}, {r['load'][1]:.1f} |")
    if scripted:
        lines += ["", "Scripted engine (no model; steps sleep without the GIL; 16 streams x 64 tokens through "
                      "/v1/completions; the client in another process):", "",
                  "| step ms | median ITL ms | median TPOT ms | ITL / TPOT | tokens per chunk | largest chunk | load |",
                  "|---|---|---|---|---|---|---|"]
        for r in scripted:
            lines.append(f"| {r['step_ms']:g} | {r['median_itl_ms']:.2f} | {r['median_tpot_ms']:.2f} | "
                         f"{r['itl_over_tpot']:.2f} | {r['tokens_per_chunk']:.2f} | {r['largest_chunk']} | "
                         f"{r['load']:.1f} |")
    if micro:
        lines += ["", f"Server per-token work on SmolLM2's tokenizer ({micro['tokens']} tokens): incremental "
                      f"detokenization {micro['detokenize_us_per_token']:.1f} µs (engine thread), chat chunk dict + "
                      f"JSON + SSE {micro['chunk_json_sse_us_per_token']:.1f} µs (event loop); the whole server's CPU "
                      f"per streamed chunk (16 streams from a scripted engine: HTTP, asyncio, hand-over) "
                      f"{micro['server_cpu_us_per_chunk']:.0f} µs."]
    lines += ["", "Commands (PORT: a free loopback port; DIR: a temporary folder):", ""]
    for r in rows:
        lines += [f"- `{r['serve_command']}`", f"  `{r['bench_command']}`"]
    lines += ["", f"Reproduce: `{shlex.join(['python', 'benchmarks/streaming_itl.py', *sys.argv[1:]])}`"]
    write_results(a.out, f"{today}-streaming-itl-{a.label}", {"rows": rows, "scripted": scripted, "micro": micro,
                                                              "commit": commit,
                                                              "argv": sys.argv[1:]}, lines)


if __name__ == "__main__":
    main()
