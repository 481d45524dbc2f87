"""The full stack on one model: `tokenfab serve` started once per variant, `tokenfab bench serve` cells against it.

    python benchmarks/serve_check.py --model FOLDER --label k3 [--server-args "--load-format dummy ..."] \\
        [--variant plain=] [--spec-variant 'dspark={"method": "dspark", "model": ..., ...}'] \\
        [--cells 1024/128x1,1024/128x16] [--prompts-per-concurrency 2] [--out DIR]

Per variant (``--variant NAME=EXTRA SERVE FLAGS``, ``--spec-variant NAME=JSON`` for ``--speculative-config JSON``;
default one plain variant) it starts the server on a free loopback port (a
subprocess; its log beside the results), sends one untimed warm-up request, then runs each cell ``IN/OUTxC`` (random
prompts of IN tokens, OUT tokens each with ignore_eos, temperature 0, C concurrent requests, C x
``--prompts-per-concurrency`` prompts at least 4) with `tokenfab bench serve` (vLLM's metric definitions; ``--power
auto`` samples the GPU's power where NVML / amdsmi exist) and reads its result JSON: total and output tok/s, median
TTFT / TPOT / ITL, and for speculative variants the acceptance rate and length from the server's ``/metrics``, which
also gives the steps the decode-graph buffers served during the cell (``tokenfab:graph_steps_total``: decode,
verification steps of hybrid models, and DSpark drafter passes from the drafter's buffers).
Writes ``<out>/<date>-<label>-serve-check.{json,md}`` after every cell (a run stopped by a timeout keeps its rows).
GPU use: benchmarks/gpu_serve_check.sh (Kimi K3 with MXFP4 experts and a DSpark drafter, DeepSeek-V3 FP8, random
weights at real shapes). On CPU, a dry run of the wiring (times meaningless)::

    .venv/bin/python benchmarks/serve_check.py --model <tiny folder> --label dry --server-args "--device cpu" \\
        --cells 32/8x1,32/8x2 --max-model-len 128

Exit status 1 when a server or a cell failed (the rest still run; the failure is in the table).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchmarks.streaming_itl import free_port, stop_server, wait_ready  # noqa: E402


def parse_cells(text: str) -> list[tuple[int, int, int]]:
    """``"1024/128x1,1024/128x16"`` -> [(1024, 128, 1), (1024, 128, 16)].

    Raises:
        ValueError: a cell not of the form IN/OUTxC with positive integers (naming it).
    """
    cells = []
    for c in (x.strip() for x in text.split(",") if x.strip()):
        try:
            io, conc = c.split("x")
            i, o = io.split("/")
            cell = (int(i), int(o), int(conc))
        except ValueError:
            raise ValueError(f"cell {c!r} is not IN/OUTxCONCURRENCY (e.g. 1024/128x16)") from None
        if min(cell) <= 0:
            raise ValueError(f"cell {c!r}: lengths and concurrency must be positive")
        cells.append(cell)
    return cells


def parse_variant(text: str, spec: bool = False) -> tuple[str, list[str]]:
    """``"NAME=FLAGS"`` -> (NAME, the flags split as a shell would); with ``spec``, ``"NAME=JSON"`` -> (NAME,
    ["--speculative-config", JSON]) (the JSON kept whole). A bare NAME has no extra flags.

    Raises:
        ValueError: an empty name, or an empty JSON with ``spec``.
    """
    name, _, rest = text.partition("=")
    if not name.strip():
        raise ValueError(f"variant {text!r} has no name (NAME={'JSON' if spec else 'EXTRA SERVE FLAGS'})")
    if spec:
        if not rest.strip():
            raise ValueError(f"--spec-variant {text!r} has no speculative_config JSON after '='")
        return name.strip(), ["--speculative-config", rest.strip()]
    return name.strip(), shlex.split(rest)


def graph_steps(base_url: str) -> dict[str, float] | None:
    """{"decode": n, "verify": n} from the server's ``tokenfab:graph_steps_total{kind}`` counters, or None when
    /metrics is unreachable or has none (graphs off)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5.0) as r:
            text = r.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 (no /metrics: no column)
        return None
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "tokenfab:graph_steps_total" and "kind" in smp.labels:
                out[smp.labels["kind"]] = out.get(smp.labels["kind"], 0.0) + smp.value
    return out or None


def row_of(variant: str, cell: tuple[int, int, int], res: dict) -> dict:
    """The table's numbers from a `tokenfab bench serve` result dict."""
    i, o, c = cell
    whole = ((res.get("power") or {}).get("whole_run") or {}) if (res.get("power") or {}).get("measured") else {}
    watts = whole.get("avg_w_per_device")
    return {"variant": variant, "input_len": i, "output_len": o, "concurrency": c,
            "completed": res.get("completed"), "failed": res.get("failed", 0),
            "total_tok_s": res.get("total_token_throughput"), "output_tok_s": res.get("output_throughput"),
            "median_ttft_ms": res.get("median_ttft_ms"), "median_tpot_ms": res.get("median_tpot_ms"),
            "median_itl_ms": res.get("median_itl_ms"),
            "acceptance_rate": res.get("spec_decode_acceptance_rate"),  # percent, vLLM's key
            "acceptance_length": res.get("spec_decode_acceptance_length"),
            "avg_w": sum(watts) if watts else None, "tokens_per_j": whole.get("total_tokens_per_j")}


def _f(x, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    """The result table: one line per variant and cell (failures with their error)."""
    lines = [f"# Serve check, {meta['label']} ({meta['date']})", "",
             f"Model `{meta['model']}`; serve `{meta['serve_command']}` (+ each variant's flags); bench `tokenfab bench "
             f"serve --dataset-name random --ignore-eos --temperature 0 --power auto`; commit {meta['commit']}.", "",
             "| variant | in / out | conc. | done | total tok/s | output tok/s | TTFT ms | TPOT ms | ITL ms | "
             "acceptance % / length | graph steps decode / verify / draft | W (devices) | tokens / J |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        head = f"| {r['variant']} | {r['input_len']} / {r['output_len']} | {r['concurrency']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} | | | | | | | | | |")
            continue
        acc = ("—" if r["acceptance_rate"] is None else
               f"{r['acceptance_rate']:.1f} / {_f(r['acceptance_length'], '{:.2f}')}")
        gs = r.get("graph_steps")
        graphs = "—" if not gs else f"{gs.get('decode', 0):.0f} / {gs.get('verify', 0):.0f} / {gs.get('draft', 0):.0f}"
        lines.append(f"{head} {r['completed']} | {_f(r['total_tok_s'])} | {_f(r['output_tok_s'])} | "
                     f"{_f(r['median_ttft_ms'])} | {_f(r['median_tpot_ms'], '{:.2f}')} | "
                     f"{_f(r['median_itl_ms'], '{:.2f}')} | {acc} | {graphs} | {_f(r['avg_w'], '{:.0f}')} | "
                     f"{_f(r['tokens_per_j'], '{:.2f}')} |")
    return lines


def run_variant(a, name: str, flags: list[str], cells, out_dir: str, emit) -> bool:
    """Serve with ``flags``, warm up, run every cell through ``emit(row)``; False when anything failed."""
    import httpx
    host = "127.0.0.1"
    port = free_port(host)
    base_url = f"http://{host}:{port}"
    max_conc = max(c for _, _, c in cells)
    serve_cmd = [sys.executable, "-m", "tokenfab.cli", "serve", a.model, "--host", host, "--port", str(port),
                 "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(max_conc),
                 *shlex.split(a.server_args), *flags]
    log = open(os.path.join(out_dir, f"{a.label}-{name}-server.log"), "w")
    proc = subprocess.Popen(serve_cmd, stdout=log, stderr=subprocess.STDOUT)
    ok = True
    try:
        try:
            wait_ready(base_url, proc, a.server_timeout)
            httpx.post(base_url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4, "ignore_eos": True},
                       timeout=600.0, trust_env=False)
        except Exception as e:  # noqa: BLE001 (reported in the table; the next variant still runs)
            for cell in cells:
                emit({"variant": name, "input_len": cell[0], "output_len": cell[1], "concurrency": cell[2],
                      "error": f"server: {e}"})
            return False
        for cell in cells:
            i, o, c = cell
            fname = f"{a.label}-{name}-{i}-{o}-c{c}.json"
            bench = [sys.executable, "-m", "tokenfab.cli", "bench", "serve", "--backend", "openai", "--base-url",
                     base_url, "--dataset-name", "random", "--random-input-len", str(i), "--random-output-len",
                     str(o), "--num-prompts", str(max(4, c * a.prompts_per_concurrency)), "--max-concurrency",
                     str(c), "--ignore-eos", "--temperature", "0", "--seed", str(c), "--power", "auto",
                     "--save-result", "--result-dir", out_dir, "--result-filename", fname, "--disable-tqdm"]
            t0 = time.monotonic()
            steps0 = graph_steps(base_url)
            done = subprocess.run(bench, capture_output=True, text=True)
            if done.returncode != 0:
                ok = False
                emit({"variant": name, "input_len": i, "output_len": o, "concurrency": c,
                      "error": f"bench exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"})
                continue
            with open(os.path.join(out_dir, fname)) as f:
                row = row_of(name, cell, json.load(f))
            row["seconds"] = time.monotonic() - t0
            steps1 = graph_steps(base_url)
            if steps0 is not None and steps1 is not None:
                row["graph_steps"] = {k: steps1[k] - steps0.get(k, 0.0) for k in steps1}
            emit(row)
    finally:
        stop_server(proc)
        log.close()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (or GGUF file) for tokenfab serve")
    ap.add_argument("--label", required=True, help="the result files' name")
    ap.add_argument("--server-args", default="", help="tokenfab serve flags every variant gets, one string")
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME=EXTRA SERVE FLAGS, repeatable (default, without any --spec-variant: plain=)")
    ap.add_argument("--spec-variant", action="append", default=[],
                    help="NAME=speculative_config JSON, repeatable (a variant served with --speculative-config)")
    ap.add_argument("--cells", default="1024/128x1,1024/128x16", help="IN/OUTxCONCURRENCY, comma-separated")
    ap.add_argument("--prompts-per-concurrency", type=int, default=2, help="prompts per cell = C x this (>= 4)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds for the server to become ready")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="output folder")
    a = ap.parse_args()
    try:
        cells = parse_cells(a.cells)
        variants = ([parse_variant(v) for v in (a.variant or ([] if a.spec_variant else ["plain="]))]
                    + [parse_variant(v, spec=True) for v in a.spec_variant])
    except ValueError as e:
        ap.error(str(e))
    if max(i + o for i, o, _ in cells) > a.max_model_len:
        ap.error(f"--max-model-len {a.max_model_len} is below the longest cell's IN + OUT")
    os.makedirs(a.out, exist_ok=True)
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    meta = {"label": a.label, "date": dt.date.today().isoformat(), "model": a.model, "commit": commit,
            "serve_command": f"tokenfab serve MODEL --max-model-len {a.max_model_len} {a.server_args}".strip(),
            "command": " ".join(["benchmarks/serve_check.py"] + [shlex.quote(x) for x in sys.argv[1:]])}
    rows: list[dict] = []
    stem = os.path.join(a.out, f"{meta['date']}-{a.label}-serve-check")

    def emit(row: dict) -> None:
        rows.append(row)
        print(markdown(meta, [row])[-1], flush=True)
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write("\n".join(markdown(meta, rows)) + "\n")

    ok = True
    for name, flags in variants:
        ok &= run_variant(a, name, flags, cells, a.out, emit)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
