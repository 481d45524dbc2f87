"""``tokenfab eval tasks``: run GSM8K / HumanEval / MMLU-Pro against one backend and render the results.

Offline (MODEL, no ``--base-url``) the engine runs in-process (:class:`tokenfab.eval.tasks.client.EngineClient`):
each task's prompts go to the engine in one batched ``LLM.generate`` call. With ``--base-url`` any
OpenAI-compatible server is used (``tokenfab serve``, vLLM, ...). Decoding is greedy (temperature 0).

Output: a rich table (task, metric, value, n), ``tasks.json`` (settings, metrics and per-item records of each
task) and ``tasks.md``.
"""
from __future__ import annotations

import json
import os
import sys
import time

from tokenfab.eval import usage_error
from tokenfab.eval.tasks import TASK_NAMES

DEFAULT_MAX_TOKENS = {"gsm8k": 256, "humaneval": 512, "mmlu_pro": 256}


def parse_tasks(spec: str) -> list[str]:
    """'gsm8k,humaneval' -> ['gsm8k', 'humaneval']; unknown names are refused with the known ones listed."""
    names = [t.strip().lower().replace("-", "_") for t in spec.split(",") if t.strip()]
    bad = [t for t in names if t not in TASK_NAMES]
    if bad or not names:
        raise usage_error(f"--tasks: unknown task(s) {bad or spec!r}; choose from {', '.join(TASK_NAMES)}.")
    return list(dict.fromkeys(names))


def run_tasks(tasks: str | list[str], model: str | None = None, *, base_url: str | None = None,
              served_model_name: str | None = None, api_key: str | None = None, limit: int | None = None,
              num_fewshot: int | None = None, mode: str = "completion", max_tokens: int | None = None,
              data_dir: str | None = None, gsm8k_file: str | None = None, gsm8k_fewshot_file: str | None = None,
              mmlu_pro_file: str | None = None, mmlu_pro_fewshot_file: str | None = None,
              mmlu_pro_format: str = "cot", humaneval_file: str | None = None, humaneval_timeout: float = 10.0,
              dtype: str = "auto", max_model_len: int | None = None, batch_size: int = 8, concurrency: int = 8,
              client=None, progress: bool = True, command: str | None = None,
              data_label: str | None = None) -> dict:
    """Run ``tasks``; returns a JSON-ready dict {"tasks": {name: result}, "model", "base_url", ...}.

    Every file and setting error is raised (ValueError naming the flag) before any model is loaded.
    ``client``: any object with ``generate(requests, progress)``, ``name``, ``base_url`` (tests).
    """
    from tqdm import tqdm

    from tokenfab.eval.tasks import gsm8k, humaneval, mmlu_pro

    names = parse_tasks(tasks) if isinstance(tasks, str) else list(tasks)
    if mode not in ("completion", "chat"):
        raise usage_error(f"--mode must be completion or chat, got {mode!r}.")
    if mmlu_pro_format not in ("cot", "direct"):
        raise usage_error(f"--mmlu-pro-format must be cot or direct, got {mmlu_pro_format!r}.")
    for flag, v in (("--limit", limit), ("--num-fewshot", num_fewshot), ("--max-tokens", max_tokens)):
        if v is not None and v < (1 if flag != "--num-fewshot" else 0):
            raise usage_error(f"{flag} must be >= {1 if flag != '--num-fewshot' else 0}, got {v}.")
    data = {}  # load (and check) all data first: a bad file fails before the model loads
    if "gsm8k" in names:
        data["gsm8k"] = gsm8k.load(gsm8k_file, gsm8k_fewshot_file, data_dir)
    if "humaneval" in names:
        data["humaneval"] = humaneval.load(humaneval_file)
    if "mmlu_pro" in names:
        data["mmlu_pro"] = mmlu_pro.load(mmlu_pro_file, mmlu_pro_fewshot_file, data_dir)
    if client is None:
        from tokenfab.eval.tasks.client import EngineClient, HttpClient
        client = (HttpClient(base_url, served_model_name, api_key, batch_size, concurrency) if base_url else
                  EngineClient(model, dtype=dtype, max_model_len=max_model_len))
    results = {}
    t_all = time.perf_counter()
    for name in names:
        mt = max_tokens or DEFAULT_MAX_TOKENS[name]
        t0 = time.perf_counter()
        if name == "gsm8k":
            rows, shots, path = data[name]
            total = min(len(rows) - (0 if shots else (num_fewshot if num_fewshot is not None else 5)),
                        limit or len(rows))
        elif name == "humaneval":
            rows, path = data[name]
            total = min(len(rows), limit or len(rows))
        else:
            rows, shots, path = data[name]
            total = min(len(rows), limit or len(rows))
        bar = tqdm(total=max(total, 0), desc=f"eval {name}", unit="item", disable=not progress)
        if name == "gsm8k":
            res = gsm8k.evaluate(client, rows, shots, num_fewshot=num_fewshot, limit=limit, mode=mode,
                                 max_tokens=mt, progress=bar.update)
        elif name == "humaneval":
            res = humaneval.evaluate(client, rows, limit=limit, mode=mode, max_tokens=mt,
                                     timeout_s=humaneval_timeout, progress=bar.update)
        else:
            res = mmlu_pro.evaluate(client, rows, shots, num_fewshot=num_fewshot, limit=limit, mode=mode,
                                    max_tokens=mt, fmt=mmlu_pro_format, progress=bar.update)
        bar.close()
        res["data"] = path
        res["elapsed_s"] = time.perf_counter() - t0
        results[name] = res
    return {"command": command, "model": getattr(client, "name", model), "base_url": getattr(client, "base_url",
                                                                                             base_url),
            "limit": limit, "mode": mode, "greedy": True, "data_label": data_label,
            "elapsed_s": time.perf_counter() - t_all, "tasks": results}


def summary_rows(result: dict) -> list[tuple[str, str, float | None, int]]:
    """(task, metric, value in [0, 1] or None, n) for every metric of every task."""
    rows = []
    for name, r in result["tasks"].items():
        for metric, v in r["metrics"].items():
            rows.append((name, metric, v, r["n"]))
    return rows


def _fmt(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def print_table(result: dict) -> None:
    """The task x metric table with rich."""
    from rich.console import Console
    from rich.table import Table
    where = result["base_url"] or "offline engine"
    tab = Table(title=f"eval tasks: {os.path.basename(str(result['model']).rstrip('/'))} ({where}, {result['mode']} "
                      f"mode, greedy" + (f", --limit {result['limit']}" if result["limit"] else "") + ")")
    for col in ("task", "metric", "value", "n", "few-shot", "data"):
        tab.add_column(col, justify="right" if col in ("value", "n", "few-shot") else "left")
    for name, metric, v, n in summary_rows(result):
        r = result["tasks"][name]
        tab.add_row(name, metric, _fmt(v), str(n), str(r["settings"].get("num_fewshot", "-")),
                    os.path.basename(r["data"]))
    Console(width=None if sys.stdout.isatty() else 140).print(tab)


def render_markdown(result: dict) -> str:
    """Markdown summary (settings and the table; per-item records stay in tasks.json)."""
    lines = ["# tokenfab eval tasks", "",
             f"- model: `{result['model']}`" + (f" via {result['base_url']}" if result["base_url"] else
                                                " (offline engine, in-process)"),
             f"- mode: {result['mode']}, greedy; --limit {result['limit']}"]
    if result.get("data_label"):
        lines.append(f"- data: {result['data_label']}")
    if result.get("command"):
        lines.append(f"- command: `{result['command']}`")
    lines += ["", "| task | metric | value | n | few-shot | data file |", "|---|---|---:|---:|---:|---|"]
    for name, metric, v, n in summary_rows(result):
        r = result["tasks"][name]
        lines.append(f"| {name} | {metric} | {_fmt(v)} | {n} | {r['settings'].get('num_fewshot', '-')} | "
                     f"`{os.path.basename(r['data'])}` |")
    for name, r in result["tasks"].items():
        if r["settings"].get("note"):
            lines.append(f"\n- {name}: {r['settings']['note']}")
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out_dir: str) -> dict:
    """tasks.json (everything, per-item records included) and tasks.md in ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "tasks.json"), "markdown": os.path.join(out_dir, "tasks.md")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths["markdown"], "w") as f:
        f.write(render_markdown(result))
    return paths
