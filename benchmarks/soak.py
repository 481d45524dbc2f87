"""Soak test of the OpenAI server: many concurrent streaming clients for a fixed time, then leak checks.

This process serves the model in-process (the same engine, FastAPI app and uvicorn ``tokenfab serve`` runs), with a
small KV pool so that load bursts run past it (preemption by recompute), and runs the client load in a child process
(``--client-of URL``) so that the server's RSS is its own. The load, for ``--duration`` seconds:

- ``--clients`` (64) streaming clients, each sending one request after another: completions or chat, prompt lengths
  from a few to a few hundred tokens, ``max_tokens`` 1..128, mixed sampling (greedy, temperature, top_p, top_k, seed,
  stop strings, min_tokens, logprobs, penalties, n = 2), and a random disconnect mid-stream in ~10% of them;
- every ``--burst-every`` seconds a burst of ``--burst-size`` extra streams with long prompts at once (past the pool);
- every ``--bad-every`` seconds a bad request (malformed JSON, NaN, a lone surrogate, a wrong type, a token id
  outside the vocabulary, a prompt longer than the context ...), which must get a 400 in OpenAI's error JSON.

Every request ends in exactly one outcome: ``complete`` (a stream with finish_reason for each choice, usage that
matches max_tokens / min_tokens, and ``[DONE]``), ``disconnect`` (the client left on purpose), a clean error (an HTTP
status with OpenAI's error JSON, or an error event and ``[DONE]`` in the stream) counted by kind, or ``lost`` (a
dropped connection, a stream without ``[DONE]``, a timeout, a body that is not OpenAI's shape). Response ids must
be unique (none duplicated). After the load: the server must come back to 0 running and 0 waiting (``/metrics`` and
the engine), the block manager's invariants must hold with every block free (free + used = total, no block or batch
row leaked), the server's finished-request counter must equal the choices the clients started, and RSS growth is
reported.

    .venv/bin/python benchmarks/soak.py --duration 600            # the report (default real model)
    .venv/bin/python benchmarks/soak.py --duration 60 --model tiny  # a smoke run on the embedded tiny model

Writes ``benchmarks/results/<date>-soak.{md,json}`` (``--out`` changes the stem). Exit status 0 when every check
passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

WORDS = ("the of and to in is was for on that with as by at from his her an which be this are or had not but "
         "what all were when we there can been one do more if will out so up said about into them some could time "
         "these two may then first any like now my other over such our man me even most made after also did many "
         "before must through back years where much your way well down should because each just those people how "
         "too little state good very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since against go came right used "
         "take three river mountain library garden window engine ocean forest").split()


# ---------------------------------------------------------------------------------------------------- clients
def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "."


def _sampling(rng: random.Random) -> dict:
    """Mixed sampling settings (fields of both endpoints)."""
    body: dict = {}
    kind = rng.random()
    if kind < 0.35:
        body["temperature"] = 0.0
    else:
        body["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        if rng.random() < 0.5:
            body["top_p"] = rng.choice([0.8, 0.95])
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([5, 40])
        if rng.random() < 0.4:
            body["seed"] = rng.randrange(2 ** 31)
        if rng.random() < 0.15:
            body["min_p"] = 0.05
    if rng.random() < 0.2:
        body["stop"] = rng.choice([["."], ["\n\n"], ["the", "and"]])
    if rng.random() < 0.2:
        body["presence_penalty"] = rng.choice([0.5, -0.5])
    if rng.random() < 0.1:
        body["repetition_penalty"] = 1.2
    if rng.random() < 0.1 and body["temperature"] > 0:
        body["n"] = 2
    return body


def _request(rng: random.Random, long: bool = False, cap: int = 128) -> tuple[str, dict]:
    """(path, body) of one streaming request (``max_tokens`` at most ``cap``)."""
    n_words = rng.randint(150, 300) if long else rng.choice([rng.randint(1, 12), rng.randint(12, 60),
                                                             rng.randint(60, 200)])
    max_tokens = rng.randint(32, 96) if long else rng.choice([1, rng.randint(2, 16), rng.randint(16, 64),
                                                              rng.randint(64, 128)])
    max_tokens = min(max_tokens, cap)
    body = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, **_sampling(rng)}
    if rng.random() < 0.2:
        body["min_tokens"] = min(max_tokens, rng.randint(1, 8))
    if rng.random() < 0.5:
        body["prompt"] = _text(rng, n_words)
        if rng.random() < 0.2:
            body["logprobs"] = 2
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": _text(rng, n_words)}]
    if rng.random() < 0.2:
        body["logprobs"], body["top_logprobs"] = True, 2
    return "/v1/chat/completions", body


def bad_requests(vocab_size: int, max_model_len: int) -> list[tuple[str, str, bytes]]:
    """(kind, path, raw body) of requests that must get a 400."""
    j = lambda o: json.dumps(o).encode()  # noqa: E731
    return [
        ("malformed_json", "/v1/completions", b'{"prompt": "hi", "max_tokens": '),
        ("nan", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}'),
        ("infinity", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'),
        ("lone_surrogate", "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 4}'),
        ("lone_surrogate", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
        ("wrong_type", "/v1/completions", j({"prompt": "hi", "max_tokens": "many"})),
        ("wrong_type", "/v1/chat/completions", j({"messages": "hello"})),
        ("missing_field", "/v1/completions", j({"max_tokens": 4})),
        ("token_outside_vocab", "/v1/completions", j({"prompt": [1, vocab_size + 5], "max_tokens": 4})),
        ("stop_token_outside_vocab", "/v1/completions",
         j({"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [vocab_size]})),
        ("huge_number", "/v1/completions", j({"prompt": "hi", "max_tokens": 4, "stop_token_ids": [2 ** 70]})),
        ("huge_number", "/v1/completions", j({"prompt": "hi", "max_tokens": 2 ** 40})),
        ("prompt_too_long", "/v1/completions", j({"prompt": [5] * (max_model_len + 1), "max_tokens": 1})),
        ("bad_range", "/v1/completions", j({"prompt": "hi", "max_tokens": 4, "top_p": 0})),
        ("nested_garbage", "/v1/chat/completions", b'{"messages": [[[[[{"role": [{"x": [null]}]}]]]]]}'),
    ]


def _kind(path: str) -> str:
    return "chat" if "chat" in path else "completion"


def _is_openai_error(obj) -> bool:
    e = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) and "type" in e and "code" in e


async def _stream_one(client, path: str, body: dict, disconnect_after: int | None, rec: dict) -> None:
    """Send one streaming request and fill ``rec`` with its outcome (see the module docstring)."""
    import httpx
    n = body.get("n", 1)
    finish: dict[int, str] = {}
    usage = None
    ids = set()
    events = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = None
                rec["outcome"] = (f"error_{r.status_code}" if _is_openai_error(obj)
                                  else f"lost_bad_error_body_{r.status_code}")
                if _is_openai_error(obj):
                    rec["error_type"] = obj["error"]["type"]
                return
            done = False
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    rec["outcome"] = "lost_not_sse"
                    return
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["outcome"] = "stream_error" if _is_openai_error(obj) else "lost_bad_error_event"
                    rec["error_message"] = str(obj.get("error"))[:200]
                    rec["error_type"] = obj["error"].get("type") if isinstance(obj["error"], dict) else None
                    continue
                ids.add(obj.get("id"))
                for ch in obj.get("choices") or []:
                    if ch.get("finish_reason") is not None:
                        if ch["index"] in finish:
                            rec["outcome"] = "duplicate_finish"
                            return
                        finish[ch["index"]] = ch["finish_reason"]
                if obj.get("usage"):
                    usage = obj["usage"]
                events += 1
                if disconnect_after is not None and events >= disconnect_after:
                    rec["outcome"] = "disconnect"
                    rec["choices_started"] = n
                    rec["id"] = next(iter(ids), None)
                    return  # leaving the context manager closes the connection mid-stream
            rec["id"] = next(iter(ids), None)
            rec["choices_started"] = n
            if len(ids) != 1:
                rec["outcome"] = "lost_ids"
                rec["ids"] = sorted(map(str, ids))
                return
            if not done:
                rec["outcome"] = "lost_no_done"
                return
            if rec.get("outcome") == "stream_error":
                return
            if len(finish) != n or usage is None:
                rec["outcome"] = "lost_incomplete"
                return
            toks = usage["completion_tokens"]
            rec["completion_tokens"] = toks
            mt, mn = body["max_tokens"], body.get("min_tokens", 0)
            lengths_ok = (mn * n <= toks <= mt * n) and (
                toks == mt * n if all(f == "length" for f in finish.values()) else True)
            rec["outcome"] = "complete" if lengths_ok else "lost_bad_usage"
            rec["finish"] = sorted(finish.values())
    except (httpx.TimeoutException,) as e:
        rec["outcome"] = "lost_timeout"
        rec["exc"] = type(e).__name__
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        rec["outcome"] = "lost_" + type(e).__name__
        rec["exc"] = str(e)[:200]


async def client_load(base_url: str, duration: float, clients: int, burst_every: float, burst_size: int,
                      bad_every: float, vocab_size: int, max_model_len: int, seed: int, cap: int = 128) -> dict:
    """Run the load against ``base_url`` for ``duration`` seconds; returns every request's record."""
    import httpx
    records: list[dict] = []
    t_end = time.monotonic() + duration
    limits = httpx.Limits(max_connections=clients + burst_size + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0, connect=30.0), limits=limits,
                                 trust_env=False) as client:
        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < t_end:
                path, body = _request(rng, cap=cap)
                cut = rng.randint(1, 8) if rng.random() < 0.1 else None
                rec = {"client": i, "kind": _kind(path) + ("_disconnect" if cut else ""),
                       "req": uuid.uuid4().hex, "t0": time.monotonic()}
                records.append(rec)
                await _stream_one(client, path, body, cut, rec)
                rec["t1"] = time.monotonic()

        async def bursts() -> None:
            rng = random.Random(seed + 7)
            k = 0
            while True:  # a burst is never cut short: the load waits for it (cancelling would abort its streams)
                await asyncio.sleep(max(0.0, min(burst_every, t_end - time.monotonic())))
                if time.monotonic() >= t_end - 1:
                    return
                k += 1
                jobs = []
                for _ in range(burst_size):
                    path, body = _request(rng, long=True, cap=cap)
                    rec = {"client": "burst", "kind": "burst_" + _kind(path), "burst": k,
                           "req": uuid.uuid4().hex, "t0": time.monotonic()}
                    records.append(rec)
                    jobs.append(_stream_one(client, path, body, None, rec))
                await asyncio.gather(*jobs)

        async def bad() -> None:
            rng = random.Random(seed + 11)
            cases = bad_requests(vocab_size, max_model_len)
            while time.monotonic() < t_end:
                await asyncio.sleep(bad_every * (0.5 + rng.random()))
                kind, path, raw = rng.choice(cases)
                rec = {"client": "bad", "kind": "bad_" + kind, "req": uuid.uuid4().hex, "t0": time.monotonic()}
                records.append(rec)
                try:
                    r = await client.post(path, content=raw, headers={"content-type": "application/json"})
                    rec["status"] = r.status_code
                    ok = r.status_code == 400 and _is_openai_error(r.json())
                    rec["outcome"] = "refused_400" if ok else f"wrong_answer_{r.status_code}"
                except (httpx.HTTPError, ValueError) as e:
                    rec["outcome"] = "lost_" + type(e).__name__
                rec["t1"] = time.monotonic()

        tasks = [asyncio.create_task(worker(i)) for i in range(clients)]
        side = [asyncio.create_task(bursts()), asyncio.create_task(bad())]
        await asyncio.gather(*tasks, *side)
    for r in records:
        r.setdefault("outcome", "lost_unfinished")
    return {"records": records}


# ----------------------------------------------------------------------------------------------------- server
def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _metric(text: str, name: str, label: str | None = None) -> float:
    """Sum of the samples of ``name`` (optionally only those whose labels contain ``label``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if label is None or label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def engine_leaks(async_llm) -> dict:
    """The engine's bookkeeping once idle: block-manager invariants with no sequence holding blocks, free rows,
    queues, the server's in-flight streams. Call only while no request runs."""
    eng = async_llm.engine
    bm, sched = eng.block_manager, eng.scheduler
    out = {"num_blocks": bm.num_blocks, "free_blocks": bm.num_free_blocks,
           "used_blocks": bm.num_blocks - bm.num_free_blocks,
           "free_rows": len(sched.free_rows), "rows": int(bm.block_tables.shape[0]),
           "running": len(sched.running), "waiting": len(sched.waiting),
           "streams_open": len(async_llm._streams), "in_flight": async_llm.num_in_flight}
    try:
        bm.check_invariants(list(sched.running) + list(sched.waiting))
        out["invariants"] = "hold"
    except AssertionError as e:
        out["invariants"] = f"broken: {e}"
    return out


def serve_in_process(model: str, args) -> tuple:
    """(ServerHandle, AsyncLLM) for ``model`` with a small KV pool, on a free 127.0.0.1 port."""
    import torch

    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.server.api_server import build_app
    from tokenfab.server.async_engine import AsyncLLM
    from tokenfab.server.launch import ServerHandle
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    cfg = EngineConfig(model=model, dtype=args.dtype, device="cpu", max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, num_kv_blocks=args.num_kv_blocks)
    llm = AsyncLLM.from_config(cfg)
    llm.start()
    app = build_app(llm, "soak-model", model)
    return ServerHandle(app, llm), llm


def resolve(model: str | None, tiny_dir: str) -> str:
    if model == "tiny":
        from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
        return make_tiny_checkpoint(tiny_dir, "llama", vocab_size=512, max_position_embeddings=2048)
    from tokenfab.default_model import resolve_model
    return resolve_model(model)


def summarize(records: list[dict]) -> dict:
    by_kind: dict[str, Counter] = {}
    for r in records:
        by_kind.setdefault(r["kind"], Counter())[r["outcome"]] += 1
    outcomes = Counter(r["outcome"] for r in records)
    statuses = Counter(str(r.get("status", "none")) for r in records)
    ids = [r["id"] for r in records if r.get("id")]
    dup = [i for i, c in Counter(ids).items() if c > 1]
    lost = [r for r in records if r["outcome"].startswith(("lost", "wrong_answer", "duplicate"))]
    entered = sum(r.get("choices_started", 0) for r in records)
    return {"requests": len(records), "outcomes": dict(outcomes), "http_status": dict(statuses),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}, "duplicate_ids": dup,
            "lost": len(lost), "lost_examples": lost[:10], "choices_started": entered,
            "error_types": dict(Counter(r.get("error_type") for r in records if r.get("error_type")))}


def run(args) -> dict:
    """Serve, run the client child for ``args.duration`` seconds, check leaks; returns the report dict."""
    import httpx
    model = resolve(args.model, os.path.join(args.workdir, "tiny-llama"))
    t_load = time.monotonic()
    handle, llm = serve_in_process(model, args)
    load_s = time.monotonic() - t_load
    vocab = int(llm.model_config.vocab_size)
    rss = [(0.0, _rss_mib())]
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.wait(args.rss_every):
            rss.append((time.monotonic() - t0, _rss_mib()))

    threading.Thread(target=sample, daemon=True).start()
    out_path = os.path.join(args.workdir, f"soak-clients-{os.getpid()}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--client-of", handle.base_url, "--duration", str(args.duration),
           "--clients", str(args.clients), "--burst-every", str(args.burst_every), "--burst-size",
           str(args.burst_size), "--bad-every", str(args.bad_every), "--vocab-size", str(vocab), "--max-model-len",
           str(args.max_model_len), "--seed", str(args.seed), "--max-tokens", str(args.max_tokens), "--client-out",
           out_path]
    child = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    load_wall = time.monotonic() - t0
    if child.returncode != 0:
        raise RuntimeError(f"the client process failed:\n{child.stderr[-3000:]}")
    with open(out_path) as f:
        records = json.load(f)["records"]
    os.remove(out_path)
    # back to idle: /metrics and the engine
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=handle.base_url, trust_env=False, timeout=30) as c:
        while True:
            text = c.get("/metrics").text
            busy = _metric(text, "vllm:num_requests_running") + _metric(text, "vllm:num_requests_waiting")
            if busy == 0 and llm.num_in_flight == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(1.0)
        text = c.get("/metrics").text
        health = c.get("/health").status_code
    stop.set()
    rss.append((time.monotonic() - t0, _rss_mib()))
    leaks = engine_leaks(llm)
    metrics = {"num_requests_running": _metric(text, "vllm:num_requests_running"),
               "num_requests_waiting": _metric(text, "vllm:num_requests_waiting"),
               "kv_cache_usage_perc": _metric(text, "vllm:kv_cache_usage_perc"),
               "num_preemptions_total": _metric(text, "vllm:num_preemptions_total"),
               "request_success_total": {r: _metric(text, "vllm:request_success_total", f'finished_reason="{r}"')
                                         for r in ("stop", "length", "abort", "error")}}
    handle.stop()
    summary = summarize(records)
    finished_total = sum(metrics["request_success_total"].values())
    warm = [m for t, m in rss if t >= 0.1 * load_wall] or [rss[-1][1]]
    rss_rep = {"at_start_mib": round(rss[0][1], 1), "after_10pct_mib": round(warm[0], 1),
               "peak_mib": round(max(m for _, m in rss), 1), "at_end_mib": round(rss[-1][1], 1),
               "growth_after_10pct_mib": round(rss[-1][1] - warm[0], 1), "samples": len(rss)}
    checks = {
        "zero_lost": summary["lost"] == 0,
        "zero_duplicate_ids": not summary["duplicate_ids"],
        "every_bad_request_400": all(r["outcome"] == "refused_400" for r in records if r["kind"].startswith("bad_")),
        "no_5xx": not any(str(s).startswith("5") for s in summary["http_status"]),
        "metrics_idle": metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0
        and metrics["kv_cache_usage_perc"] == 0,
        "blocks_all_free": leaks["free_blocks"] == leaks["num_blocks"] and leaks["invariants"] == "hold",
        "rows_all_free": leaks["free_rows"] == leaks["rows"] and leaks["running"] == 0 and leaks["waiting"] == 0
        and leaks["streams_open"] == 0 and leaks["in_flight"] == 0,
        "finished_equals_started": finished_total == summary["choices_started"],
        "health_200": health == 200,
        "rss_growth_bounded": rss_rep["growth_after_10pct_mib"] <= args.rss_bound_mib,
    }
    return {"model": model if args.model != "tiny" else "tiny llama (2 layers, hidden 64, vocab 512)",
            "dtype": args.dtype,
            "duration_s": args.duration, "load_wall_s": round(load_wall, 1), "engine_load_s": round(load_s, 1),
            "clients": args.clients, "burst_every_s": args.burst_every, "burst_size": args.burst_size,
            "bad_every_s": args.bad_every, "max_num_seqs": args.max_num_seqs, "num_kv_blocks": args.num_kv_blocks,
            "max_model_len": args.max_model_len, "seed": args.seed, "summary": summary, "metrics_after": metrics,
            "server_finished_choices": finished_total, "engine_after": leaks, "rss": rss_rep,
            "rss_trace_mib": [(round(t, 1), round(m, 1)) for t, m in rss], "checks": checks,
            "passed": all(checks.values())}


def write_report(rep: dict, stem: str, command: str) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(dict(rep, command=command), f, indent=1, default=str)
    s = rep["summary"]
    lines = [f"# Soak: {rep['clients']} streaming clients for {rep['duration_s']:g} s", "",
             f"Command: `{command}`", "",
             f"Model {rep['model']} ({rep['dtype']}), max_num_seqs {rep['max_num_seqs']}, KV pool "
             f"{rep['num_kv_blocks']} blocks of 16 tokens, max_model_len {rep['max_model_len']}; bursts of "
             f"{rep['burst_size']} long streams every {rep['burst_every_s']:g} s, a bad request every ~"
             f"{rep['bad_every_s']:g} s; ~10% of streams disconnect mid-stream. CPU shared with other jobs.", "",
             f"**{'PASS' if rep['passed'] else 'FAIL'}**: {s['requests']} requests, {s['lost']} lost, "
             f"{len(s['duplicate_ids'])} duplicated ids, {rep['metrics_after']['num_preemptions_total']:g} "
             "preemptions.", "", "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'ok' if v else 'FAILED'} |" for k, v in rep["checks"].items()]
    lines += ["", "## Outcomes", "", "| outcome | requests |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(s["outcomes"].items(), key=lambda kv: -kv[1])]
    lines += ["", "HTTP status: " + ", ".join(f"{k}: {v}" for k, v in sorted(s["http_status"].items())), ""]
    if s["error_types"]:
        lines += ["Error types: " + ", ".join(f"{k}: {v}" for k, v in s["error_types"].items()), ""]
    lines += ["## By kind", "", "| kind | outcomes |", "|---|---|"]
    lines += [f"| {k} | {', '.join(f'{o} {n}' for o, n in sorted(v.items()))} |" for k, v in s["by_kind"].items()]
    m, e, r = rep["metrics_after"], rep["engine_after"], rep["rss"]
    lines += ["", "## After the load", "",
              f"- /metrics: num_requests_running {m['num_requests_running']:g}, num_requests_waiting "
              f"{m['num_requests_waiting']:g}, kv_cache_usage_perc {m['kv_cache_usage_perc']:g}; "
              f"request_success_total {m['request_success_total']} = {rep['server_finished_choices']:g} choices, "
              f"clients started {s['choices_started']} choices",
              f"- engine: {e['free_blocks']} of {e['num_blocks']} blocks free (used {e['used_blocks']}), block-manager "
              f"invariants {e['invariants']}; {e['free_rows']} of {e['rows']} batch rows free; running {e['running']}, "
              f"waiting {e['waiting']}, open streams {e['streams_open']}, in flight {e['in_flight']}",
              f"- server RSS: {r['at_start_mib']} MiB at start, {r['after_10pct_mib']} MiB after 10% of the run, peak "
              f"{r['peak_mib']} MiB, {r['at_end_mib']} MiB at the end: growth after warm-up "
              f"{r['growth_after_10pct_mib']} MiB ({r['samples']} samples)", ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default=None, help="checkpoint folder, 'tiny' (embedded tiny llama), default: the "
                    "default real model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--burst-every", type=float, default=45.0)
    ap.add_argument("--burst-size", type=int, default=32)
    ap.add_argument("--bad-every", type=float, default=3.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="small on purpose: bursts run past it")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rss-every", type=float, default=5.0)
    ap.add_argument("--rss-bound-mib", type=float, default=200.0, help="largest RSS growth after warm-up that passes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=128, help="largest max_tokens a request asks for")
    ap.add_argument("--workdir", default="/tmp/tokenfab-soak")
    ap.add_argument("--out", default=None, help="result stem (default benchmarks/results/<date>-soak)")
    ap.add_argument("--client-of", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--client-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vocab-size", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_of:
        res = asyncio.run(client_load(args.client_of, args.duration, args.clients, args.burst_every,
                                      args.burst_size, args.bad_every, args.vocab_size, args.max_model_len, args.seed,
                                      args.max_tokens))
        with open(args.client_out, "w") as f:
            json.dump(res, f)
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    if args.model == "tiny" and args.dtype == "bfloat16":
        args.dtype = "float32"
    rep = run(args)
    stem = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    time.strftime("%Y-%m-%d") + "-soak")
    env = " ".join(f"{k}={os.environ[k]}" for k in ("TOKENFAB_CPU_KERNELS",) if k in os.environ)
    command = (env + " " if env else "") + "python benchmarks/soak.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    write_report(rep, stem, command)
    print(open(stem + ".md").read())
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
