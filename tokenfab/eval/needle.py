"""Planted-code (needle-in-a-haystack) recall, against the offline engine or an OpenAI-compatible server.

For every (length, depth) cell one haystack is built: filler sentences (no digits) up to the length budget, with a
block of K needle sentences ``"The access code for room RRRR is CCCCC."`` (distinct rooms, random 5-digit codes)
inserted at the sentence boundary nearest ``depth x filler tokens`` (depth 0 = the start of the context, 1 = right
before the question). Each of the K codes is then asked for in its own prompt (the other K-1 needles act as
distractors) and scored on the first number of the greedy answer:

* exact: that number equals the code (the recall reported per length and depth);
* partial: the fraction of the code's digit positions that match (left-aligned), for diagnosis.

Prompts are built as token ids (exact needle positions) for the offline engine; a server gets the same text. Lengths
are counted in tokens of the model's tokenizer ("4k" = 4096). Random-weight models score ~0: expected.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tokenfab.eval import usage_error

FILLER_SENTENCES = (
    "The river bends twice before it reaches the old stone bridge.",
    "Morning fog settled over the valley and hid the farmhouses from view.",
    "A quiet library keeps its oldest maps in a cool room below the stairs.",
    "Travelers often stop at the market to buy bread, cheese and dried fruit.",
    "The lighthouse keeper wrote a short note in the log every evening.",
    "Wind from the north carried the smell of pine across the meadow.",
    "Children chased each other around the fountain in the square.",
    "The baker opened the shop early, long before the sun rose.",
    "Clouds gathered over the hills, but the rain never came.",
    "An old clock in the hallway chimed softly on the hour.",
    "The ferry crossed the lake slowly, carrying carts and bicycles.",
    "Gardeners planted rows of tulips along the path to the museum.",
    "A narrow road climbs through the forest toward the mountain pass.",
    "The teacher read a story aloud while the class listened closely.",
    "Fishermen mended their nets on the dock in the late afternoon.",
    "Snow covered the rooftops and muffled the sounds of the town.",
    "The painter mixed blue and yellow to find the color of the sea.",
    "Owls called to each other from the tall trees beyond the field.",
    "The train station was crowded with people returning from the coast.",
    "A small cafe on the corner served tea in heavy white cups.",
    "Bees moved from flower to flower in the warm summer light.",
    "The museum guard walked the long gallery one last time each night.",
    "Leaves turned red and gold as the days grew shorter.",
    "A merchant counted coins carefully behind the wooden counter.",
)
NEEDLE_TEMPLATE = "The access code for room {room} is {code}."
QUESTION_TEMPLATE = "\n\nQuestion: What is the access code for room {room}?\nAnswer: The access code for room {room} is"


@dataclass
class Needle:
    """One planted code; ``token_start`` / ``token_end`` are [start, end) offsets in the haystack's token ids."""

    room: int
    code: str
    token_start: int = -1
    token_end: int = -1


@dataclass
class Haystack:
    """Filler + needle block as token ids (``token_ids``, no special tokens) and text (``text``).

    ``depth`` is the requested fraction; ``needle_start`` the block's first token offset; ``filler_tokens`` the
    number of filler tokens (the block sits after ``round(depth x filler_tokens)`` of them, snapped to a sentence).
    """

    token_ids: list[int]
    text: str
    needles: list[Needle]
    depth: float
    needle_start: int
    filler_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


# ---- parsing ---------------------------------------------------------------------------------------------------
def parse_lengths(spec: str | Sequence[int], flag: str = "--lengths") -> list[int]:
    """'4k,16k,32k' -> [4096, 16384, 32768] ('k' = 1024, 'm' = 1024^2, plain integers as tokens)."""
    if not isinstance(spec, str):
        return [int(x) for x in spec]
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", part)
        if not m:
            raise usage_error(f"{flag}: cannot read '{part}'; use e.g. 4k,16k,32k or 2048.")
        n = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]
        if n < 16:
            raise usage_error(f"{flag}: length {part} is too short (at least 16 tokens).")
        out.append(int(n))
    return out


def parse_depths(spec: str | Sequence[float], flag: str = "--depths") -> list[float]:
    """'0,0.25,0.5' -> [0.0, 0.25, 0.5]; each must be in [0, 1]."""
    try:
        vals = [float(x) for x in spec.split(",")] if isinstance(spec, str) else [float(x) for x in spec]
    except ValueError:
        raise usage_error(f"{flag}: cannot read '{spec}'; use fractions such as 0,0.25,0.5,0.75,1.0.") from None
    for d in vals:
        if not 0.0 <= d <= 1.0 or math.isnan(d):
            raise usage_error(f"{flag}: depth {d} is outside [0, 1].")
    if not vals:
        raise usage_error(f"{flag}: give at least one depth.")
    return vals


# ---- haystack ----------------------------------------------------------------------------------------------------
def make_needles(k: int, rng: random.Random) -> list[Needle]:
    """K needles with distinct 4-digit rooms and random 5-digit codes (leading digit non-zero)."""
    if k < 1:
        raise usage_error(f"--needles must be >= 1, got {k}.")
    rooms = rng.sample(range(1000, 10000), k)
    return [Needle(room=r, code=str(rng.randint(10000, 99999))) for r in rooms]


def build_haystack(tokenize: Callable[[str], list[int]], num_tokens: int, depth: float, needles: Sequence[Needle],
                   seed: int = 0) -> Haystack:
    """Fill ``num_tokens`` tokens (at most) with filler sentences and the needle block at ``depth``.

    Args:
        tokenize: text -> token ids without special tokens; each sentence is tokenized on its own with a leading
            space, so the haystack's token ids are the concatenation and needle offsets are exact.
        num_tokens: budget for filler + needles (tokens).
        depth: fraction in [0, 1] of the filler placed before the needle block.

    Raises:
        ValueError: the needles alone do not fit in ``num_tokens``.
    """
    rng = random.Random(seed)
    needle_toks = [tokenize(" " + NEEDLE_TEMPLATE.format(room=n.room, code=n.code)) for n in needles]
    block = sum(len(t) for t in needle_toks)
    if block > num_tokens:
        raise usage_error(f"{len(needles)} needles need {block} tokens, more than the {num_tokens}-token haystack; "
                         f"lower --needles or raise --lengths.")
    sent_toks = {s: tokenize(" " + s) for s in FILLER_SENTENCES}
    order: list[str] = []
    filler: list[list[int]] = []
    used, budget = 0, num_tokens - block
    pool: list[str] = []
    while True:
        if not pool:
            pool = list(FILLER_SENTENCES)
            rng.shuffle(pool)
        s = pool.pop()
        if used + len(sent_toks[s]) > budget:
            break
        order.append(s)
        filler.append(sent_toks[s])
        used += len(sent_toks[s])
    # the sentence boundary nearest depth x filler tokens
    bounds = [0]
    for t in filler:
        bounds.append(bounds[-1] + len(t))
    target = depth * used
    cut = min(range(len(bounds)), key=lambda i: (abs(bounds[i] - target), i))
    ids: list[int] = [x for t in filler[:cut] for x in t]
    start = len(ids)
    placed = []
    for n, t in zip(needles, needle_toks):
        placed.append(Needle(n.room, n.code, len(ids), len(ids) + len(t)))
        ids.extend(t)
    for t in filler[cut:]:
        ids.extend(t)
    needle_text = [NEEDLE_TEMPLATE.format(room=n.room, code=n.code) for n in needles]
    text = " ".join(order[:cut] + needle_text + order[cut:])
    return Haystack(ids, text, placed, depth, start, used)


def question(room: int) -> str:
    """The question appended after the haystack, ending where the code should follow."""
    return QUESTION_TEMPLATE.format(room=room)


# ---- scoring -----------------------------------------------------------------------------------------------------
def score_answer(answer: str, code: str) -> dict:
    """Score one answer: {"predicted": first number in ``answer`` or None, "exact": bool, "partial": float}.

    ``partial`` = matching digit positions (left-aligned, up to len(code)) / len(code); 0.0 without a number.
    """
    m = re.search(r"\d+", answer or "")
    pred = m.group(0) if m else None
    if pred is None:
        return {"predicted": None, "exact": False, "partial": 0.0}
    hits = sum(1 for a, b in zip(pred, code) if a == b)
    return {"predicted": pred, "exact": pred == code, "partial": hits / len(code)}


def aggregate(records: Sequence[dict]) -> dict:
    """records with "length", "depth", "exact", "partial" -> {"cells": [...], "by_length": {...}, "overall": ...}.

    Recall values are fractions in [0, 1] of exact answers; ``n`` counts questions.
    """
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["length"], r["depth"]), []).append(r)
    out_cells = []
    for (length, depth), rs in sorted(cells.items()):
        out_cells.append({"length": length, "depth": depth, "n": len(rs),
                          "exact_recall": sum(r["exact"] for r in rs) / len(rs),
                          "partial": sum(r["partial"] for r in rs) / len(rs)})
    by_length = {}
    for length in sorted({r["length"] for r in records}):
        rs = [r for r in records if r["length"] == length]
        by_length[str(length)] = {"n": len(rs), "exact_recall": sum(r["exact"] for r in rs) / len(rs)}
    overall = (sum(r["exact"] for r in records) / len(records)) if records else None
    return {"cells": out_cells, "by_length": by_length, "overall_exact_recall": overall}


def _server_error(message: str) -> RuntimeError:
    e = RuntimeError(message)
    e.user_error = True  # reported by the CLI as one line
    return e


# ---- backends ----------------------------------------------------------------------------------------------------
class EngineBackend:
    """The offline engine (``tokenfab.LLM``); prompts go in as token ids."""

    def __init__(self, model: str | None, dtype: str = "auto", tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, seed: int = 0, llm=None):
        if llm is None:
            from tokenfab.entrypoints.llm import LLM
            kw = dict(dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size)
            if max_model_len is not None:
                kw["max_model_len"] = max_model_len
            llm = LLM(model, progress=False, **kw)
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.llm_engine.max_model_len
        self.name = llm.engine_config.model

    def complete(self, prompts: list[dict], max_tokens: int) -> list[str]:
        """prompts: [{"prompt_token_ids": [...], "prompt": text}] -> greedy completions (text)."""
        from tokenfab.sampling_params import SamplingParams
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outs = self.llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].text for o in outs]


class HttpBackend:
    """An OpenAI-compatible server: POST ``{base_url}/v1/completions`` with the prompt text, temperature 0."""

    def __init__(self, base_url: str, model: str | None = None, tokenizer_path: str | None = None,
                 max_model_len: int | None = None, api_key: str | None = None, timeout: float = 600.0):
        import httpx
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        info = {}
        try:
            r = self.client.get(f"{self.base_url}/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
            info = data[0] if data else {}
        except Exception as e:  # noqa: BLE001 - a server without /v1/models still works with --max-model-len
            if model is None:
                raise _server_error(f"--base-url {base_url}: GET /v1/models failed ({e}); is the server up?") from e
        self.name = model or info.get("id")
        self.max_model_len = max_model_len or info.get("max_model_len")
        path = tokenizer_path
        if path is None and isinstance(info.get("root"), str) and os.path.isdir(info["root"]):
            path = info["root"]
        if path is None:
            from tokenfab.default_model import default_model_path
            path = default_model_path(quiet=True)
            print(f"[needle] counting tokens with {path}'s tokenizer (pass --tokenizer for the served model's)")
        from tokenfab.engine.model_loader import load_tokenizer
        self.tokenizer = load_tokenizer(path)
        if self.tokenizer is None:
            raise ValueError(f"--tokenizer {path}: no tokenizer files there (tokenizer.json, tokenizer_config.json, "
                             "tokenizer.model or tiktoken.model); pass the served model's folder.")

    def complete(self, prompts: list[dict], max_tokens: int) -> list[str]:
        out = []
        for p in prompts:
            body = {"model": self.name, "prompt": p["prompt"], "max_tokens": max_tokens, "temperature": 0.0}
            r = self.client.post(f"{self.base_url}/v1/completions", json=body)
            if r.status_code != 200:
                raise _server_error(f"--base-url: POST /v1/completions returned {r.status_code}: {r.text[:300]}")
            out.append(r.json()["choices"][0]["text"])
        return out


# ---- runner ------------------------------------------------------------------------------------------------------
def run_needle(model: str | None = None, *, base_url: str | None = None, lengths: str | Sequence[int] = "4k,16k,32k",
               needles: int = 4, depths: str | Sequence[float] = "0,0.25,0.5,0.75,1.0", seed: int = 0,
               max_tokens: int = 8, dtype: str = "auto", tensor_parallel_size: int = 1,
               max_model_len: int | None = None, tokenizer: str | None = None, served_model_name: str | None = None,
               api_key: str | None = None, out_dir: str | None = None, progress: bool = True, backend=None,
               log: Callable[[str], None] = print, command: str | None = None) -> dict:
    """Run the needle test over lengths x depths; returns a JSON-ready dict (records, cells, skipped lengths).

    ``backend``: an object with ``complete(prompts, max_tokens)``, ``tokenizer``, ``max_model_len``, ``name``
    (tests); otherwise the engine (MODEL) or a server (``base_url``) is used.
    """
    from tqdm import tqdm

    lens = parse_lengths(lengths)
    deps = parse_depths(depths)
    if max_tokens < 1:
        raise usage_error(f"--max-tokens must be >= 1, got {max_tokens}.")
    if backend is None:
        if base_url:
            backend = HttpBackend(base_url, served_model_name, tokenizer or model, max_model_len, api_key)
        else:
            from tokenfab.default_model import resolve_model
            model = resolve_model(model)  # None: the default model (SmolLM2 when installed); *.gguf: its folder
            backend = EngineBackend(model, dtype, tensor_parallel_size, max_model_len, seed)
    tok = backend.tokenizer

    def tokenize(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    prefix = list(tok("", add_special_tokens=True)["input_ids"])  # BOS if the tokenizer adds one
    mml = backend.max_model_len
    records, skipped = [], []
    run_lens = []
    for L in lens:
        if mml is not None and L + max_tokens > mml:
            msg = f"length {L} skipped: {L} + {max_tokens} answer tokens exceed max_model_len {mml}"
            log(f"[needle] {msg}")
            skipped.append({"length": L, "reason": msg})
        else:
            run_lens.append(L)
    q_max = max(len(tokenize(question(r))) for r in (1000, 9999))
    bar = tqdm(total=len(run_lens) * len(deps) * needles, desc="eval needle", unit="q", disable=not progress)
    t0 = time.perf_counter()
    for li, L in enumerate(run_lens):
        for di, d in enumerate(deps):
            cell_seed = seed * 1_000_003 + li * 1009 + di
            rng = random.Random(cell_seed)
            ns = make_needles(needles, rng)
            hay = build_haystack(tokenize, L - len(prefix) - q_max, d, ns, seed=cell_seed)
            prompts = []
            for n in hay.needles:
                qt = question(n.room)
                prompts.append({"prompt_token_ids": prefix + hay.token_ids + tokenize(qt),
                                "prompt": hay.text + qt})
            answers = backend.complete(prompts, max_tokens)
            for n, p, a in zip(hay.needles, prompts, answers):
                s = score_answer(a, n.code)
                records.append({"length": L, "depth": d, "room": n.room, "code": n.code, "answer": a,
                                "prompt_tokens": len(p["prompt_token_ids"]),
                                "needle_token_start": len(prefix) + n.token_start,
                                "actual_depth": n.token_start / max(hay.num_tokens, 1), **s})
            bar.update(len(prompts))
    bar.close()
    result = {"command": command, "model": getattr(backend, "name", model), "base_url": base_url,
              "lengths": lens, "run_lengths": run_lens, "skipped": skipped, "depths": deps, "needles": needles,
              "seed": seed, "max_tokens": max_tokens, "max_model_len": mml,
              "elapsed_s": time.perf_counter() - t0, **aggregate(records), "records": records}
    if out_dir:
        write_needle_outputs(result, out_dir)
    return result


# ---- rendering ---------------------------------------------------------------------------------------------------
def recall_matrix(result: dict) -> tuple[list[float], list[int], list[list[float | None]]]:
    """(depths, lengths, matrix[depth][length] of exact recall or None)."""
    deps, lens = result["depths"], result["run_lengths"]
    look = {(c["length"], c["depth"]): c["exact_recall"] for c in result["cells"]}
    return deps, lens, [[look.get((L, d)) for L in lens] for d in deps]


def render_markdown(result: dict) -> str:
    """Markdown: settings, a depth x length recall table, skipped lengths."""
    deps, lens, mat = recall_matrix(result)
    lines = ["# tokenfab eval needle", "",
             f"- model: `{result['model']}`" + (f" via {result['base_url']}" if result["base_url"] else " (offline engine)"),
             f"- {result['needles']} needles per haystack, seed {result['seed']}, greedy, {result['max_tokens']} "
             f"answer tokens; exact recall (first number of the answer == planted code)",
             f"- overall exact recall: {_pct(result['overall_exact_recall'])}"]
    if result.get("command"):
        lines.append(f"- command: `{result['command']}`")
    lines += ["", "| depth \\ length | " + " | ".join(str(L) for L in lens) + " |", "|---|" + "---|" * len(lens)]
    for d, row in zip(deps, mat):
        lines.append(f"| {d:g} | " + " | ".join(_pct(v) for v in row) + " |")
    for s in result["skipped"]:
        lines.append(f"\n- {s['reason']}")
    return "\n".join(lines) + "\n"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def print_table(result: dict) -> None:
    """Print the depth x length recall table with rich."""
    from rich.console import Console
    from rich.table import Table
    deps, lens, mat = recall_matrix(result)
    tab = Table(title=f"needle exact recall ({result['needles']} needles per haystack)")
    tab.add_column("depth \\ length")
    for L in lens:
        tab.add_column(str(L), justify="right")
    for d, row in zip(deps, mat):
        tab.add_row(f"{d:g}", *[_pct(v) for v in row])
    Console(width=None if sys.stdout.isatty() else 120).print(tab)  # no squeezing when piped


def write_heatmap(result: dict, path: str) -> str:
    """A depth x length heat map of exact recall (matplotlib, Agg backend) saved as PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    deps, lens, mat = recall_matrix(result)
    arr = np.array([[np.nan if v is None else v for v in row] for row in mat], dtype=float).reshape(len(deps),
                                                                                                   len(lens))
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 + 1.2 * len(lens)), 1.6 + 0.6 * len(deps)))
    im = ax.imshow(arr, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lens)), [str(L) for L in lens])
    ax.set_yticks(range(len(deps)), [f"{d:g}" for d in deps])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(deps)):
        for j in range(len(lens)):
            if not np.isnan(arr[i, j]):
                ax.text(j, i, f"{100 * arr[i, j]:.0f}%", ha="center", va="center", fontsize=8)
    ax.set_title(f"needle exact recall\n{os.path.basename(str(result['model']))}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_needle_outputs(result: dict, out_dir: str) -> dict:
    """Write needle.json, needle.md and needle_heatmap.png into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "needle.json"), "markdown": os.path.join(out_dir, "needle.md"),
             "heatmap": os.path.join(out_dir, "needle_heatmap.png")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths["markdown"], "w") as f:
        f.write(render_markdown(result))
    if result["run_lengths"]:
        write_heatmap(result, paths["heatmap"])
    else:
        paths.pop("heatmap")
    return paths


# ---- side by side -------------------------------------------------------------------------------------------------
def _label(result: dict) -> str:
    return os.path.basename(str(result["model"]).rstrip("/")) or str(result["model"])


def comparison_rows(results: Sequence[dict]) -> list[dict]:
    """One row per (length, depth) present in any run: {"length", "depth", "recall": [per run or None]}, then one
    row per length with depth "all" (recall over that length's questions)."""
    keys = sorted({(c["length"], c["depth"]) for r in results for c in r["cells"]})
    looks = [{(c["length"], c["depth"]): c["exact_recall"] for c in r["cells"]} for r in results]
    rows = [{"length": L, "depth": d, "recall": [lk.get((L, d)) for lk in looks]} for L, d in keys]
    for L in sorted({L for L, _ in keys}):
        rows.append({"length": L, "depth": "all",
                     "recall": [(r["by_length"].get(str(L)) or {}).get("exact_recall") for r in results]})
    return rows


def render_comparison_markdown(results: Sequence[dict]) -> str:
    """Markdown: recall of each run per length and depth side by side (the first run is the baseline)."""
    labels = [_label(r) for r in results]
    lines = ["# tokenfab eval needle: side by side", ""]
    for lab, r in zip(labels, results):
        lines.append(f"- `{lab}`: `{r['model']}`" + (f" via {r['base_url']}" if r.get("base_url") else "")
                     + f", overall exact recall {_pct(r['overall_exact_recall'])}")
    if results and results[0].get("command"):
        lines.append(f"- command: `{results[0]['command']}`")
    lines += ["", "| length | depth | " + " | ".join(f"`{x}`" for x in labels) + " |",
              "|---:|---:|" + "---:|" * len(labels)]
    for row in comparison_rows(results):
        d = row["depth"] if isinstance(row["depth"], str) else f"{row['depth']:g}"
        lines.append(f"| {row['length']} | {d} | " + " | ".join(_pct(v) for v in row["recall"]) + " |")
    return "\n".join(lines) + "\n"


def print_comparison(results: Sequence[dict]) -> None:
    """Print the side-by-side recall table (rows: length x depth, then per-length totals) with rich."""
    from rich.console import Console
    from rich.table import Table
    tab = Table(title="needle exact recall, side by side")
    tab.add_column("length", justify="right")
    tab.add_column("depth", justify="right")
    for lab in (_label(r) for r in results):
        tab.add_column(lab, justify="right")
    for row in comparison_rows(results):
        d = row["depth"] if isinstance(row["depth"], str) else f"{row['depth']:g}"
        tab.add_row(str(row["length"]), d, *[_pct(v) for v in row["recall"]])
    Console(width=None if sys.stdout.isatty() else 120).print(tab)


def write_comparison_outputs(results: Sequence[dict], out_dir: str) -> dict:
    """Each run's outputs in ``out_dir/run<i>-<model>/`` and the side-by-side needle_compare.md /
    needle_compare.json (rows of :func:`comparison_rows`) in ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for i, r in enumerate(results):
        for k, v in write_needle_outputs(r, os.path.join(out_dir, f"run{i}-{_label(r)}")).items():
            paths[f"run{i}_{k}"] = v
    paths["compare_markdown"] = os.path.join(out_dir, "needle_compare.md")
    paths["compare_json"] = os.path.join(out_dir, "needle_compare.json")
    with open(paths["compare_markdown"], "w") as f:
        f.write(render_comparison_markdown(results))
    with open(paths["compare_json"], "w") as f:
        json.dump({"models": [r["model"] for r in results], "rows": comparison_rows(results)}, f, indent=2)
    return paths


def write_config_variant(src: str, dst: str, changes: dict) -> str:
    """A copy of checkpoint folder ``src`` at ``dst`` whose config.json has ``changes`` applied (the other files
    are symlinked, so no weights are copied). Keys are config.json fields; ``rope_theta`` is written where the
    config keeps it (top level and/or ``rope_parameters`` / ``rope_scaling``). This is how a misread attention
    parameter is reproduced: e.g. ``{"rope_theta": 10000.0}`` for a model trained with 100000.

    Raises:
        FileNotFoundError: ``src`` has no config.json.
        ValueError: a key of ``changes`` is not in the config (a typo would otherwise change nothing).
    """
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{src}: no config.json; give a checkpoint folder.")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        placed = False
        if key in cfg:
            cfg[key], placed = value, True
        for sub in ("rope_parameters", "rope_scaling"):
            if isinstance(cfg.get(sub), dict) and key in cfg[sub]:
                cfg[sub][key], placed = value, True
        if not placed:
            raise ValueError(f"config field '{key}' is not in {cfg_path}; name a field the config has.")
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        target = os.path.join(dst, name)
        if name == "config.json" or os.path.lexists(target):
            continue
        os.symlink(os.path.abspath(os.path.join(src, name)), target)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def config_rope_theta(path: str) -> float | None:
    """rope_theta of a checkpoint's config.json (top level, ``rope_parameters`` or ``rope_scaling``), or None."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for d in (cfg, cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}):
        if isinstance(d, dict) and "rope_theta" in d:
            return float(d["rope_theta"])
    return None


__all__ = ["Needle", "Haystack", "build_haystack", "make_needles", "score_answer", "aggregate", "run_needle",
           "parse_lengths", "parse_depths", "write_needle_outputs", "comparison_rows", "render_comparison_markdown",
           "print_comparison", "write_comparison_outputs", "write_config_variant", "config_rope_theta"]
