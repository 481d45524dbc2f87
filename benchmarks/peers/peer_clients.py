"""The benchmark clients of the side-by-side peer run (run_peers.py): each cell's dataset seed, the command lines of
``tokenfab bench serve`` and ``vllm bench serve`` against one server, and running one of them to its result JSON."""
from __future__ import annotations

import contextlib
import json
import os
import shlex

from peer_prepare import REPO, Paths, run_logged
from peer_servers import SERVED_NAME, Server


def cell_seed(workload_index: int, conc: int) -> int:
    """Dataset seed of one (workload, concurrency) cell: the same for every engine, different between cells, so no
    server can answer a measured prompt from a prefix cache filled by an earlier cell (llama-server caches prompts
    by default, vLLM enables prefix caching for non-MLA models)."""
    return 1000 * (workload_index + 1) + conc


WARMUP_SEED = 7
DRIFT_SEED_OFFSET = 500  # the drift re-measurement's prompts: the first cell's shape, never its prompts


def _bench_flags(server: Server, model_path: str, inp: int, out: int, n: int, conc: int, result_dir: str,
                 result_file: str, seed: int) -> list[str]:
    """The flags ``tokenfab bench serve`` and ``vllm bench serve`` share: one cell's random dataset, greedy, EOS
    ignored, the percentiles reported, the result saved; then the server's extra headers."""
    cmd = ["--base-url", server.base_url, "--model", model_path, "--served-model-name", SERVED_NAME,
           "--dataset-name", "random", "--random-input-len", str(inp), "--random-output-len", str(out),
           "--num-prompts", str(n), "--max-concurrency", str(conc), "--ignore-eos", "--temperature", "0",
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--disable-tqdm", "--save-result", "--result-dir", result_dir, "--result-filename", result_file]
    for h in server.headers:
        cmd += ["--header", h]
    return cmd


def tokenfab_client_cmd(server: Server, model_path: str, inp: int, out: int, n: int, conc: int,
                        result_dir: str, result_file: str, seed: int) -> list[str]:
    """``tokenfab bench serve`` for one cell against ``server``."""
    exe = os.path.join(REPO, ".venv", "bin", "tokenfab")
    return [exe if os.path.isfile(exe) else "tokenfab", "bench", "serve",
            *_bench_flags(server, model_path, inp, out, n, conc, result_dir, result_file, seed)]


def vllm_client_cmd(p: Paths, server: Server, model_path: str, inp: int, out: int, n: int, conc: int,
                    result_dir: str, result_file: str, seed: int) -> list[str]:
    """``vllm bench serve`` (vLLM's venv) for one cell against ``server``, on its completions endpoint."""
    return [p.vllm_bin, "bench", "serve", "--backend", "vllm", "--endpoint", "/v1/completions",
            *_bench_flags(server, model_path, inp, out, n, conc, result_dir, result_file, seed)]


def run_client(cmd: list[str], env: dict, result_path: str, logfile: str, timeout: float) -> dict:
    """Run a client command line and read its result JSON.

    ``tokenfab bench serve`` runs in this process (``run_bench_serve(make_args(...))`` from the same flags: no
    interpreter start-up per cell); ``vllm bench serve`` runs as a subprocess in vLLM's venv.
    """
    if os.path.exists(result_path):
        os.unlink(result_path)
    if cmd[1:3] == ["bench", "serve"] and os.path.basename(cmd[0]) == "tokenfab":
        from tokenfab.bench.serve import build_parser, run_bench_serve

        args = build_parser().parse_args(cmd[3:])
        args.request_timeout = timeout
        args.command_line = shlex.join(cmd)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        with open(logfile, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            f.write(f"\n$ {shlex.join(cmd)}\n")
            run_bench_serve(args)
    else:
        run_logged(cmd, logfile, env=env, timeout=timeout, cwd=REPO)
    with open(result_path) as f:
        return json.load(f)
