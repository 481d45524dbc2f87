"""Routed experts kept packed (INT4 group-32, MXFP4: kernels/cpu/csrc/packed_experts.cpp; FP8 block-scaled as DeepSeek-V3
publishes them: fp8_linear.cpp's fp8_experts_linear) against tokenfab's bf16 routed experts (VNNI-packed,
cpu_moe.moe_experts_packed) on DeepSeek-V3-like expert shapes, side by side; and the
resident memory of a small Kimi K3 checkpoint with MXFP4 experts loaded packed vs the same weights dequantized.

    .venv/bin/python benchmarks/packed_experts.py [--experts 4] [--tokens 1,8,64] [--reps 7] [--mb 900] [--threads N]
        [--no-rss] [--formats bf16,int4_group,mxfp4,fp8_block] [--tag NAME]

Part 1: one MoE layer's routed experts (hidden 7168, intermediate 2048, ``--experts`` experts, every token routed
to all of them, so each expert gets 1, 8 or 64 tokens: decode GEMVs, and the prefill path at 64), computed by RoutedExperts.forward for each format. Every
format gets enough layers of its own (``--mb`` MB of its bytes, above the L3 cache) that a pass streams them from
memory as a decode step does; formats run the same input, alternated pass by pass, best pass of ``--reps``.
Reported: ms per layer, GB/s of the format's resident bytes read, and the time relative to bf16.
Part 2: process RSS after ``LLM(...)`` of a K3-shaped checkpoint (latent 1024, intermediate 512, 32 experts, 4
layers) with MXFP4 routed experts (kept packed) and of the same weights with the experts stored dequantized
(bf16 in memory), each in a fresh process; the packed expert bytes are reported beside them.
Writes <out>/<date>-packed-experts[-<tag>].{json,md} (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.results_file import unused_stem, write_lines  # noqa: E402

H, I = 7168, 2048
FORMATS = ("bf16", "int4_group", "mxfp4", "fp8_block")


def make_layer(fmt: str, E: int, g: torch.Generator):
    """A RoutedExperts of E experts [2I, H] / [H, I] in ``fmt`` with random weights, prepared (fuse())."""
    from tokenfab.layers.moe import RoutedExperts
    with torch.device("cpu"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            m = RoutedExperts(E, H, I)
        finally:
            torch.set_default_dtype(prev)
    if fmt == "bf16":
        m.w13.data.normal_(0, 0.02, generator=g)
        m.w2.data.normal_(0, 0.02, generator=g)
        m.fuse()
        nbytes = sum(t.numel() * t.element_size() for t in m._p13 + m._p2)
    else:
        m.use_packed(fmt)
        for q in (m.q13, m.q2):
            if fmt == "int4_group":
                q.packed.random_(-2**31, 2**31 - 1, generator=g)
                q.scale.fill_(0.01)
            elif fmt == "fp8_block":  # positive finite e4m3 codes (0x00-0x7D), block scales
                q.packed.random_(0, 0x7E, generator=g)
                q.scale.fill_(1e-3)
            else:
                q.packed.random_(0, 256, generator=g)
                q.scale.fill_(120)
        m.fuse()
        nbytes = m.q13.nbytes + m.q2.nbytes
    return m, nbytes


def bench_experts(E: int, token_counts: list[int], reps: int, mb: float, formats=FORMATS) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    layers, nbytes = {}, {}
    FORMATS = formats  # noqa: N806  (the formats run, "bf16" first: the ratios are to it)
    for fmt in FORMATS:
        one, nb = make_layer(fmt, E, g)
        count = max(2, int(mb * 1e6 // nb))
        layers[fmt] = [one] + [make_layer(fmt, E, g)[0] for _ in range(count - 1)]
        nbytes[fmt] = nb
        print(f"{fmt}: {count} layers of {nb / 1e6:.0f} MB", flush=True)
    rows = []
    for T in token_counts:
        x = torch.randn(T, H, generator=g).bfloat16()
        ids = torch.arange(E).repeat(T, 1)
        w = torch.full((T, E), 1.0 / E)
        best = {f: float("inf") for f in FORMATS}
        with torch.no_grad():
            for f in FORMATS:  # warm-up
                layers[f][0](x, w, ids)
            for _ in range(reps):
                for f in FORMATS:
                    t0 = time.perf_counter()
                    for m in layers[f]:
                        m(x, w, ids)
                    best[f] = min(best[f], (time.perf_counter() - t0) / len(layers[f]))
        for f in FORMATS:
            rows.append({"tokens_per_expert": T, "experts": E, "format": f, "bytes_per_layer": nbytes[f],
                         "ms": best[f] * 1e3, "gb_s": nbytes[f] / best[f] / 1e9,
                         "time_vs_bf16": best[f] / best["bf16"]})
            print(f"T={T} {f:10s} {best[f] * 1e3:8.2f} ms  {nbytes[f] / best[f] / 1e9:6.1f} GB/s  "
                  f"x{best[f] / best['bf16']:.2f} of bf16", flush=True)
    return rows


# ---- RSS of a K3-shaped checkpoint -------------------------------------------------------------------------------
K3_TEXT_OVERRIDES = dict(routed_expert_hidden_size=1024, moe_intermediate_size=512, num_experts=32,
                         hidden_size=256, intermediate_size=512)


def write_k3_pair(root: str) -> tuple[str, str]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import test_kimi_k3  # the K3 test checkpoint writer (published layout)
    from test_kimi_k3 import P, TEXT, k3_tensors, write_k3

    from tokenfab.layers.mxfp4 import dequantize_mxfp4
    # its float64 reference decoder loops in Python (fine for test sizes); the benchmark needs no reference
    test_kimi_k3.naive_mxfp4 = lambda pk, sc: dequantize_mxfp4(pk, sc, torch.float64)
    from tokenfab.testing.tokenizer_builder import build_tokenizer
    text = dict(TEXT, **K3_TEXT_OVERRIDES)
    tok = build_tokenizer(os.path.join(root, "tok"), vocab_size=512)
    stored, _ = k3_tensors(text)
    stored = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in stored.items()}
    deq = {}
    for k, v in stored.items():
        if k.endswith("_packed"):
            base = k[: -len("_packed")]
            deq[base] = dequantize_mxfp4(v, stored[base + "_scale"], torch.bfloat16)
        elif not (k.startswith(P) and ".experts." in k and k.endswith(("_scale", "_shape"))):
            deq[k] = v
    return (write_k3(os.path.join(root, "mxfp4"), tok, text=text, tensors=stored),
            write_k3(os.path.join(root, "dequantized"), tok, text=text, tensors=deq, quant=None))


_RSS_CHILD = r"""
import json, os, sys, torch
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
from tokenfab import LLM
from tokenfab.layers.moe import RoutedExperts
base = rss()
llm = LLM(sys.argv[1], dtype='bfloat16', device='cpu', progress=False, kv_cache_memory=16 << 20)
import gc; gc.collect()
after = rss()
m = llm.llm_engine.runner.model
ex = [x for x in m.modules() if isinstance(x, RoutedExperts)]
packed = sum(x.q13.nbytes + x.q2.nbytes for x in ex if x.q13 is not None)
dense = sum(t.numel() * t.element_size() for x in ex for t in (x._p13 or []) + (x._p2 or [])
            + [w for w in (x.w13, x.w2) if w is not None])
params = sum(p.numel() * p.element_size() for p in m.parameters()) + sum(b.numel() * b.element_size() for b in m.buffers())
print(json.dumps({"rss_before": base, "rss_after": after, "packed_expert_bytes": packed,
                  "bf16_expert_bytes": dense, "model_bytes": params}))
"""


def bench_rss(root: str) -> list[dict]:
    q_dir, d_dir = write_k3_pair(root)
    rows = []
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."))
    for name, path in (("mxfp4 packed", q_dir), ("dequantized bf16", d_dir)):
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, path], capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["variant"] = name
        r["rss_delta"] = r["rss_after"] - r["rss_before"]
        rows.append(r)
        print(f"{name:18s} RSS +{r['rss_delta'] / 2**20:7.1f} MiB  experts packed {r['packed_expert_bytes'] / 2**20:.1f}"
              f" MiB / bf16 {r['bf16_expert_bytes'] / 2**20:.1f} MiB  (model tensors {r['model_bytes'] / 2**20:.1f}"
              " MiB)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mb", type=float, default=900.0)
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="formats run side by side (bf16 always included)")
    ap.add_argument("--tag", default="", help="suffix of the result files' name")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    formats = ("bf16",) + tuple(f for f in a.formats.split(",") if f and f != "bf16")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        sys.exit(f"--formats: unknown {', '.join(bad)} (known: {', '.join(FORMATS)})")
    if a.threads:
        torch.set_num_threads(a.threads)
    from tokenfab.kernels.cpu import build as cpu_build
    from tokenfab.kernels.cpu.ops import fp8_linear as cpu_fp8
    from tokenfab.kernels.cpu.ops import packed_experts as cpu_packed_experts
    if not cpu_packed_experts.packed_experts_applies():
        sys.exit(f"packed expert kernels not available here ({cpu_build.load_error() or 'no AVX512-BF16'})")
    if "fp8_block" in formats and not cpu_fp8.fp8_experts_applies():
        sys.exit("FP8 expert kernels not available here (fp8_experts_linear)")
    rows = bench_experts(a.experts, [int(t) for t in a.tokens.split(",")], a.reps, a.mb, formats)
    rss = []
    if not a.no_rss:
        import tempfile
        with tempfile.TemporaryDirectory() as root:
            rss = bench_rss(root)
    cmd = "python benchmarks/packed_experts.py " + " ".join(sys.argv[1:])
    os.makedirs(a.out, exist_ok=True)
    stem = unused_stem(os.path.join(a.out, f"{dt.date.today().isoformat()}-packed-experts"
                                           + (f"-{a.tag}" if a.tag else "")))
    meta = {"command": cmd.strip(), "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "hidden": H, "intermediate": I}
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "experts": rows, "rss": rss}, f, indent=1)
    lines = [f"# Packed routed experts vs bf16 ({dt.date.today().isoformat()})", "", f"Command: `{meta['command']}`",
             f"({meta['threads']} threads on a shared machine: absolute times are noise, the ratios within a row "
             "were measured side by side, alternated pass by pass, best of the reps.)", "",
             f"## One MoE layer's routed experts: hidden {H}, intermediate {I}, {a.experts} experts", "",
             "| tokens / expert | format | MB / layer | ms / layer | GB/s | time vs bf16 |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens_per_expert']} | {r['format']} | {r['bytes_per_layer'] / 1e6:.0f} | {r['ms']:.2f} "
                     f"| {r['gb_s']:.1f} | {r['time_vs_bf16']:.2f} |")
    if rss:
        lines += ["", "## Resident memory after LLM(): K3-shaped checkpoint, MXFP4 experts packed vs dequantized", "",
                  "| variant | RSS delta MiB | packed expert MiB | bf16 expert MiB | all model tensors MiB |",
                  "|---|---|---|---|---|"]
        for r in rss:
            lines.append(f"| {r['variant']} | {r['rss_delta'] / 2**20:.1f} | {r['packed_expert_bytes'] / 2**20:.1f} | "
                         f"{r['bf16_expert_bytes'] / 2**20:.1f} | {r['model_bytes'] / 2**20:.1f} |")
    write_lines(stem + ".md", lines)
    print("wrote", stem + ".md")


if __name__ == "__main__":
    main()
