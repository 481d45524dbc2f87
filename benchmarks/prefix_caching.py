"""Prefix caching on a shared-prefix workload: `tokenfab bench serve --dataset-name prefix_repetition` against
`tokenfab serve` with and without `--enable-prefix-caching`, side by side (interleaved, repeated), on the embedded
random DeepSeek-V3 default MoE and on a tiny Kimi Linear (hybrid KDA + MLA) model.

Per run: the prefix-cache hit rate (hits / queries in tokens, from the engine's counters, which /metrics exports as
vllm:prefix_cache_hits / vllm:prefix_cache_queries), median and p99 TTFT, total token throughput (vLLM's
definitions). Each server runs in this process on a free loopback port; each (model, variant) pair gets a fresh
server (empty cache) per repetition, and the order of the two variants alternates between repetitions.

    .venv/bin/python benchmarks/prefix_caching.py --reps 2 --num-prompts 32 --prefix-len 512 --suffix-len 64 \\
        --num-prefixes 4 --output-len 16 --max-concurrency 8 --workloads shared,unique
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_file import unused_stem, write_markdown  # noqa: E402


def make_kimi_linear(out_dir: str) -> str:
    """A random tiny Kimi Linear checkpoint (4 KDA + 2 MLA layers, 8 experts top-2) saved by transformers, with
    tokenfab's offline test tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, KimiLinearConfig

    from tokenfab.testing.tiny_checkpoints import perturb_random_model
    from tokenfab.testing.tokenizer_builder import build_tokenizer

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    cfg = KimiLinearConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=48, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, routed_scaling_factor=2.446, linear_num_heads=4, linear_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        initializer_range=0.05, rms_norm_eps=1e-5,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        mlp_layer_types=["dense"] + ["sparse"] * 5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    perturb_random_model(model)
    model.save_pretrained(out_dir)
    tok = build_tokenizer(os.path.join(out_dir, ".tok"), vocab_size=2048)
    for f in os.listdir(tok):
        shutil.copy(os.path.join(tok, f), out_dir)
    return out_dir


def one_run(model: str, caching: bool, a, num_prefixes: int) -> dict:
    """Serve ``model`` (prefix caching on or off), run the benchmark against it with ``num_prefixes`` groups,
    return its figures."""
    from tokenfab.bench.serve import make_args, run_bench_serve
    from tokenfab.engine.engine_config import EngineConfig
    from tokenfab.server.api_server import build_app
    from tokenfab.server.async_engine import AsyncLLM
    from tokenfab.server.launch import ServerHandle

    cfg = EngineConfig(model=model, device="cpu", max_model_len=a.max_model_len, max_num_seqs=a.max_concurrency,
                       max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=caching,
                       kv_cache_memory=a.kv_cache_memory)
    llm = AsyncLLM.from_config(cfg)
    llm.start()
    handle = ServerHandle(build_app(llm, "bench-model", model), llm)
    try:
        args = make_args(backend="vllm", base_url=handle.base_url, dataset_name="prefix_repetition",
                         num_prompts=a.num_prompts, prefix_repetition_prefix_len=a.prefix_len,
                         prefix_repetition_suffix_len=a.suffix_len, prefix_repetition_num_prefixes=num_prefixes,
                         prefix_repetition_output_len=a.output_len, max_concurrency=a.max_concurrency,
                         ignore_eos=True, seed=a.seed, disable_tqdm=True, metric_percentiles="50,99")
        res = run_bench_serve(args)
        st = llm.get_stats()
    finally:
        handle.stop()
    del llm, handle
    import gc
    gc.collect()  # the next run's server gets this run's KV pool memory back
    q, h = st.get("prefix_cache_queries", 0), st.get("prefix_cache_hits", 0)
    return {"caching": caching, "hit_rate": h / q if q else 0.0, "queries": q, "hits": h,
            "median_ttft_ms": res["median_ttft_ms"], "p99_ttft_ms": res["p99_ttft_ms"],
            "total_token_throughput": res["total_token_throughput"], "completed": res["completed"],
            "total_input_tokens": res["total_input_tokens"], "duration_s": res["duration"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="default,kimi_linear", help="default (embedded DeepSeek-V3) and/or kimi_linear.")
    p.add_argument("--workloads", default="shared,unique",
                   help="shared (prefix_repetition groups) and/or unique (same lengths, one prompt per prefix).")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokenfab serve's CPU default.")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args()

    from tokenfab.cache_paths import cache_dir
    from tokenfab.default_model import ensure_default_model
    paths = {"default": ensure_default_model(quiet=True),
             "kimi_linear": make_kimi_linear(os.path.join(cache_dir(), "models", "bench-kimi-linear-tiny"))}
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    # shared: the prefix_repetition groups; unique: the same lengths with one prompt per prefix (no sharing), the
    # cost of prefix caching when nothing hits
    workloads = {"shared": a.num_prefixes, "unique": a.num_prompts}
    wl = [w.strip() for w in a.workloads.split(",") if w.strip()]
    keys = [(m, w) for m in models for w in wl]
    runs: dict[str, list[dict]] = {f"{m}/{w}": [] for m, w in keys}
    for rep in range(a.reps):
        for m, w in keys:
            order = (False, True) if rep % 2 == 0 else (True, False)
            for caching in order:
                r = one_run(paths[m], caching, a, workloads[w])
                r["rep"] = rep
                runs[f"{m}/{w}"].append(r)
                print(f"[{m}/{w} rep {rep}] caching={caching}: hit rate {r['hit_rate']:.3f}, median TTFT "
                      f"{r['median_ttft_ms']:.0f} ms, p99 {r['p99_ttft_ms']:.0f} ms, "
                      f"{r['total_token_throughput']:.0f} tok/s", flush=True)
    models = list(runs)

    def med(rs, k):
        return statistics.median(r[k] for r in rs)

    summary = {}
    for m in models:
        off = [r for r in runs[m] if not r["caching"]]
        on = [r for r in runs[m] if r["caching"]]
        summary[m] = {v: {k: med(rs, k) for k in ("hit_rate", "median_ttft_ms", "p99_ttft_ms",
                                                   "total_token_throughput")}
                      for v, rs in (("off", off), ("on", on))}
        s = summary[m]
        s["ratios_on_over_off"] = {k: s["on"][k] / s["off"][k] for k in ("median_ttft_ms", "p99_ttft_ms",
                                                                      "total_token_throughput")}
    cmd = "python benchmarks/prefix_caching.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    date = dt.date.today().isoformat()
    os.makedirs(a.out, exist_ok=True)
    stem = unused_stem(os.path.join(a.out, f"{date}-prefix-caching"))
    with open(stem + ".json", "w") as f:
        json.dump({"command": cmd, "settings": vars(a), "models": paths, "runs": runs, "summary": summary}, f,
                  indent=2)
    lines = [f"# Prefix caching, shared-prefix workload ({date})", "",
             f"Command: `{cmd}`", "",
             f"Workload: vLLM's `prefix_repetition` dataset through `tokenfab bench serve` (backend vllm): "
             f"{a.num_prefixes} random prefixes of {a.prefix_len} tokens, {a.num_prompts // a.num_prefixes} prompts "
             f"each with its own {a.suffix_len}-token suffix, {a.output_len} output tokens (ignore_eos), all sent at "
             f"once under --max-concurrency {a.max_concurrency}; `tokenfab serve` settings: max_num_seqs "
             f"{a.max_concurrency}, max_num_batched_tokens {a.max_num_batched_tokens}, bf16, CPU. A fresh server "
             f"(empty cache) per run; {a.reps} repetitions, variants alternated; medians over repetitions. Hit rate "
             "= prefix-cache hits / queries (tokens). `unique` runs the same lengths with one prompt per prefix "
             "(nothing shared): the cost of prefix caching when nothing hits. 2 CPU cores shared with other jobs: "
             "read the ratios, not absolute times.", "",
             "| model, workload | prefix caching | hit rate | median TTFT (ms) | p99 TTFT (ms) | total tok/s |",
             "|---|---|---|---|---|---|"]
    names = {k: k.replace("default/", "embedded DeepSeek-V3 MoE (default), ").replace(
        "kimi_linear/", "tiny Kimi Linear (KDA + MLA), ") + " prompts" for k in models}
    for m in models:
        for v in ("off", "on"):
            s = summary[m][v]
            lines.append(f"| {names[m]} | {v} | {s['hit_rate']:.1%} | {s['median_ttft_ms']:.0f} | "
                         f"{s['p99_ttft_ms']:.0f} | {s['total_token_throughput']:.0f} |")
    lines += ["", "Ratios on / off (medians):", ""]
    for m in models:
        r = summary[m]["ratios_on_over_off"]
        lines.append(f"- {names[m]}: median TTFT {r['median_ttft_ms']:.2f}x, p99 TTFT {r['p99_ttft_ms']:.2f}x, "
                     f"total tok/s {r['total_token_throughput']:.2f}x")
    lines += ["", "Per run:", "", "| model / workload | rep | caching | hit rate | median TTFT (ms) | p99 TTFT (ms) | total tok/s |",
              "|---|---|---|---|---|---|---|"]
    for m in models:
        for r in runs[m]:
            lines.append(f"| {m} | {r['rep']} | {'on' if r['caching'] else 'off'} | {r['hit_rate']:.1%} | "
                         f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['total_token_throughput']:.0f} |")
    write_markdown(a.out, os.path.basename(stem) + ".md", lines)
    print(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
